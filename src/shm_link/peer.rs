//! The other process of a shared-memory channel: who it is ([`PeerProcess`], from the kernel,
//! held by a pidfd) and its pages, which are read only by copy or in-place sum, never as a
//! slice.

use std::sync::Arc;

use kvstore_shm::Segment;

use crate::shm_link::shm;
use crate::{DType, Element, KvError, NDArray, Result};

pub(crate) use kvstore_transport::PeerProcess;

/// A payload in a peer's pool pages. The peer can write those pages at any time (it should not
/// while it waits for the answer, but nothing here can enforce that), so they are never viewed
/// as a slice: they are read once, element by element, into this process's own memory.
pub struct PeerPages {
    pub(crate) seg: Arc<Segment>,
    pub(crate) offset: usize,
    /// Elements of `dtype`.
    pub(crate) len: usize,
    pub(crate) dtype: DType,
}

impl PeerPages {
    fn nbytes(&self) -> usize {
        self.len * self.dtype.size()
    }

    /// The bytes, copied (control payloads: names, optimizer parameters).
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let mut v = vec![0u8; self.nbytes()];
        self.seg.read(self.offset, &mut v).map_err(shm)?;
        Ok(v)
    }

    /// Copies the elements into `dst` (same length and dtype).
    pub fn copy_into(&self, dst: &mut NDArray) -> Result<()> {
        self.check_like(dst)?;
        self.seg.read(self.offset, dst.as_bytes_mut()).map_err(shm)
    }

    /// The elements in a new array of this process.
    pub fn to_array(&self) -> Result<NDArray> {
        let mut a = NDArray::zeros_dtype(&[self.len], self.dtype);
        self.copy_into(&mut a)?;
        Ok(a)
    }

    /// `dst += self`, reading each element once where it lies (no copy).
    pub fn add_into(&self, dst: &mut NDArray) -> Result<()> {
        self.check_like(dst)?;
        let p = self.seg.ptr(self.offset, self.nbytes()).map_err(shm)?;
        crate::dtype::with_dtype!(self.dtype, T => add_peer::<T>(dst, p))
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

fn add_peer<T: Element>(dst: &mut NDArray, p: *const u8) -> Result<()> {
    if (p as usize) % std::mem::align_of::<T>() != 0 {
        return Err(KvError::Protocol("a misaligned payload region".into()));
    }
    let d: &mut [T] = bytemuck::cast_slice_mut(dst.as_bytes_mut());
    // SAFETY: `p` addresses `d.len()` elements inside the peer's mapped pool (checked by
    // `Segment::ptr` against the mapping, and by the pool against its pages), is aligned for
    // `T` (checked above), and cannot overlap `d`, which is this process's own heap memory
    // (a merge buffer). The mapping lives while `self.seg` does, which outlives the call.
    unsafe { crate::ops::add_from_raw(d, p as *const T) };
    Ok(())
}
