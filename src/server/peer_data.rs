//! A request's tensor data as a backend lends it: possibly in a peer's pages, which that peer
//! could write at any time, so it is read only by copy or by an in-place sum, element by
//! element, never viewed as a slice.

use std::marker::PhantomData;

use crate::{DType, Element, KvError, NDArray, Result};

/// `len` elements of `dtype`, lent for the lifetime `'a`.
pub struct PeerData<'a> {
    ptr: *const u8,
    len: usize,
    dtype: DType,
    /// The backend's loan it is, where the data may be held past the message.
    lent: Option<&'a kvstore_transport::Lent<'a>>,
    _lent: PhantomData<&'a [u8]>,
}

impl<'a> PeerData<'a> {
    /// # Safety
    /// `ptr` is valid for reads of `len * dtype.size()` bytes for `'a`.
    pub unsafe fn new(ptr: *const u8, len: usize, dtype: DType) -> PeerData<'a> {
        PeerData {
            ptr,
            len,
            dtype,
            lent: None,
            _lent: PhantomData,
        }
    }

    /// The same data, which is all of what `lent` lends: it may be held past the message
    /// ([`PeerData::hold`]).
    pub(crate) fn of_whole(self, lent: &'a kvstore_transport::Lent<'a>) -> PeerData<'a> {
        PeerData {
            lent: Some(lent),
            ..self
        }
    }

    /// Keeps the data past the message, where its backend can
    /// ([`kvstore_transport::Lent::hold`]).
    pub(crate) fn hold(&self) -> Option<kvstore_transport::Held> {
        self.lent?.hold()
    }

    /// The elements.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    fn nbytes(&self) -> usize {
        self.len * self.dtype.size()
    }

    /// The bytes, copied.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.nbytes()];
        // SAFETY: valid for `nbytes` reads (the constructor's contract); `v` is our own.
        unsafe { kvstore_transport::copy::copy_nonoverlapping(self.ptr, v.as_mut_ptr(), v.len()) };
        v
    }

    /// The bytes, copied to the end of `v`.
    pub(crate) fn append_to(&self, v: &mut Vec<u8>) {
        let n = self.nbytes();
        v.reserve(n);
        // SAFETY: valid for `nbytes` reads (the constructor's contract); `v` is our own, with
        // room for `n` more bytes past its length, which are set before it is extended.
        unsafe {
            kvstore_transport::copy::copy_nonoverlapping(self.ptr, v.as_mut_ptr().add(v.len()), n);
            v.set_len(v.len() + n);
        }
    }

    /// Copies the elements into `dst` (same length and dtype).
    pub fn copy_into(&self, dst: &mut NDArray) -> Result<()> {
        self.check_like(dst)?;
        let d = dst.as_bytes_mut();
        // SAFETY: valid for `nbytes` reads, which is `d.len()` (checked); `d` is this process's
        // own memory, so the two cannot overlap.
        unsafe { kvstore_transport::copy::copy_nonoverlapping(self.ptr, d.as_mut_ptr(), d.len()) };
        Ok(())
    }

    /// The elements in a new array of this process.
    pub fn to_array(&self) -> Result<NDArray> {
        let mut a = NDArray::zeros_dtype(&[self.len], self.dtype);
        self.copy_into(&mut a)?;
        Ok(a)
    }

    /// `dst += self`, reading each element once where it lies (a copy first only if the data
    /// is not aligned for its type).
    pub fn add_into(&self, dst: &mut NDArray) -> Result<()> {
        self.check_like(dst)?;
        if (self.ptr as usize) % self.dtype.size() != 0 {
            return dst.add_assign(&self.to_array()?);
        }
        crate::dtype::with_dtype!(self.dtype, T => add_lent::<T>(dst, self.ptr))
    }

    /// `dst = self + other` in one pass (the order of the additions is the round's: `self`
    /// came first). Unaligned data is summed by a copy and an add instead.
    pub fn sum_with(&self, other: &PeerData<'_>, dst: &mut NDArray) -> Result<()> {
        self.check_like(dst)?;
        other.check_like(dst)?;
        let size = self.dtype.size();
        if (self.ptr as usize) % size != 0 || (other.ptr as usize) % size != 0 {
            self.copy_into(dst)?;
            return other.add_into(dst);
        }
        crate::dtype::with_dtype!(self.dtype, T => {
            let d: &mut [T] = bytemuck::cast_slice_mut(dst.as_bytes_mut());
            // SAFETY: both address `d.len()` elements (checked against the array), aligned
            // for `T` (checked above), and cannot overlap `d`, this process's own memory.
            unsafe { crate::ops::sum2_from_raw(d, self.ptr as *const T, other.ptr as *const T) };
        });
        Ok(())
    }

    /// The raw parts, for a state machine that keeps the data where it lies.
    pub(crate) fn raw(&self) -> (*const u8, usize, DType) {
        (self.ptr, self.len, self.dtype)
    }

    fn check_like(&self, dst: &NDArray) -> Result<()> {
        if dst.dtype() != self.dtype || dst.size() != self.len {
            return Err(KvError::Protocol(format!(
                "{} {} elements do not fit {} {} elements",
                self.len,
                self.dtype,
                dst.size(),
                dst.dtype()
            )));
        }
        Ok(())
    }
}

fn add_lent<T: Element>(dst: &mut NDArray, p: *const u8) -> Result<()> {
    let d: &mut [T] = bytemuck::cast_slice_mut(dst.as_bytes_mut());
    // SAFETY: `p` addresses `d.len()` elements (checked against the array), is aligned for `T`
    // (checked by the caller), and cannot overlap `d`, which is this process's own memory.
    unsafe { crate::ops::add_from_raw(d, p as *const T) };
    Ok(())
}
