//! Arrays over memory their caller lends: made once ([`NDArray::from_raw_parts`]) and, for a
//! binding that lends memory to one call at a time, pointed at the next call's memory with no
//! allocation ([`NDArray::repoint`]).

use std::ptr::NonNull;
use std::sync::atomic::{fence, AtomicPtr, AtomicUsize, Ordering};
use std::sync::Arc;

use super::{checked_bytes, NDArray};
use crate::storage::{External, Storage};
use crate::{DType, Device, KvError, Result};

// `lent_ptr` checks alignment by a mask: every dtype's size is a power of two.
const _: () = {
    let mut i = 0;
    while i < DType::ALL.len() {
        assert!(DType::ALL[i].size().is_power_of_two());
        i += 1;
    }
};

/// `ptr` as the start of `bytes` bytes of `dtype`: aligned for it, and non-null unless empty.
fn lent_ptr(ptr: *mut u8, bytes: usize, dtype: DType) -> Result<NonNull<u8>> {
    match NonNull::new(ptr) {
        // A dtype's size is a power of two: a mask, not a division.
        Some(p) if (p.as_ptr() as usize) & (dtype.size() - 1) == 0 => Ok(p),
        _ if bytes == 0 => Ok(NonNull::<u64>::dangling().cast()),
        _ => Err(misaligned(ptr, dtype)),
    }
}

#[cold]
#[inline(never)]
fn misaligned(ptr: *mut u8, dtype: DType) -> KvError {
    KvError::Incompatible(format!("memory at {ptr:p} is not aligned for {dtype}"))
}

impl NDArray {
    /// An array over memory its caller owns, with no copy: pushes read it and pulls write it
    /// in place (a pull into it while a clone of it lives is refused: the clone's storage
    /// would be copied on write, and the pull would land in the copy). `owner` is dropped with the last clone of the array (or of a copy a failed
    /// call kept); it keeps the memory valid until then. A peer never writes this memory
    /// directly: what a pull brings is copied into it by this process, which stops once a call
    /// has failed, so after any call returns nothing else writes it. (Over RDMA a pull lands
    /// in the store's memory and is copied in.)
    ///
    /// # Safety
    /// `ptr` addresses `shape`'s size times `dtype`'s size bytes, aligned for `dtype`, that stay
    /// valid for reads and writes until `owner` is dropped, and that nothing else reads or
    /// writes while the array, a clone of it, or a call using it is live.
    pub unsafe fn from_raw_parts(
        ptr: *mut u8,
        shape: &[usize],
        dtype: DType,
        owner: Box<dyn std::any::Any + Send + Sync>,
    ) -> Result<NDArray> {
        let bytes = checked_bytes(shape, dtype)?;
        let ptr = lent_ptr(ptr, bytes, dtype)?;
        Ok(NDArray {
            shape: super::Shape::from_slice(shape),
            dtype,
            device: Device::default(),
            buf: Arc::new(Storage::External(External {
                ptr: AtomicPtr::new(ptr.as_ptr()),
                len: AtomicUsize::new(bytes),
                _owner: owner,
            })),
        })
    }

    /// An error where this array is over lent memory that a clone shares: a write in place
    /// (a pull into it) would go to a copy of its own, as a clone's storage is copied on
    /// write, and not to the memory lent. Asked once per call, where the store's calls take
    /// their outputs ([`crate::KVStore`]), and by an optimizer's update.
    pub(crate) fn check_in_place(&self) -> Result<()> {
        if matches!(*self.buf, Storage::External(_)) && Arc::strong_count(&self.buf) > 1 {
            return Err(KvError::Unsupported(
                "an output over lent memory (NDArray::from_raw_parts) that a clone shares: \
                 a pull would write a copy of its own, not that memory (drop the clone first)"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Points an array over lent memory (one [`NDArray::from_raw_parts`] made) at other
    /// memory, keeping its owner and its allocations: a binding that lends its caller's memory
    /// to one call at a time (the Python package) allocates nothing per call. Fails, changing
    /// nothing, where the array is not over lent memory or shares its storage with a clone
    /// (a call that kept one): the memory it names may still be in use.
    ///
    /// ```
    /// use kvstore::{DType, NDArray};
    /// let (mut a, mut b) = ([1.0f32, 2.0], [3.0f32; 3]);
    /// // SAFETY: `a` and `b` outlive the array, which is their only user.
    /// let mut v = unsafe {
    ///     NDArray::from_raw_parts(a.as_mut_ptr().cast(), &[2], DType::F32, Box::new(()))
    /// }
    /// .unwrap();
    /// assert_eq!(v.to_vec::<f32>().unwrap(), [1.0, 2.0]);
    /// // SAFETY: as above.
    /// unsafe { v.repoint(b.as_mut_ptr().cast(), &[3], DType::F32) }.unwrap();
    /// assert_eq!(v.to_vec::<f32>().unwrap(), [3.0; 3]);
    /// // A clone (as a failed call may keep) pins the array to its memory.
    /// let kept = v.clone();
    /// // SAFETY: as above.
    /// assert!(unsafe { v.repoint(a.as_mut_ptr().cast(), &[2], DType::F32) }.is_err());
    /// # drop(kept);
    /// ```
    ///
    /// # Safety
    /// As for [`NDArray::from_raw_parts`], for the new memory: `ptr` addresses `shape`'s size
    /// times `dtype`'s size bytes, aligned for `dtype`, valid for reads and writes until the
    /// owner is dropped or the array is pointed elsewhere again, and used by nothing else while
    /// the array, a clone of it, or a call using it is live.
    // Inlined: a binding calls it twice a call (to lend an array, then to name no memory),
    // and the second's constant arguments fold away.
    #[inline(always)]
    pub unsafe fn repoint(&mut self, ptr: *mut u8, shape: &[usize], dtype: DType) -> Result<()> {
        let bytes = checked_bytes(shape, dtype)?;
        let p = lent_ptr(ptr, bytes, dtype)?;
        let Storage::External(e) = &*self.buf else {
            return Err(not_repointable(
                "only an array over lent memory can be pointed elsewhere",
            ));
        };
        // No other `Arc` (a clone) and no `Weak` (a transport's cache) names the storage, and
        // `&mut self` holds the only one: nothing else can read the fields now, nor reach
        // them until this returns. (The fence orders this after a clone's last use, which
        // dropping it published.)
        if Arc::strong_count(&self.buf) != 1 || Arc::weak_count(&self.buf) != 0 {
            return Err(not_repointable(
                "an array whose storage a clone shares cannot be pointed elsewhere",
            ));
        }
        fence(Ordering::Acquire);
        e.ptr.store(p.as_ptr(), Ordering::Relaxed);
        e.len.store(bytes, Ordering::Relaxed);
        // In place where the number of dimensions stays (a binding's calls, mostly), element
        // by element otherwise: an array has a few, fewer than a memcpy call costs.
        if self.shape.len() == shape.len() {
            for (d, &n) in self.shape.iter_mut().zip(shape) {
                *d = n;
            }
        } else {
            self.shape.clear();
            for &n in shape {
                self.shape.push(n);
            }
        }
        self.dtype = dtype;
        self.device = Device::default();
        Ok(())
    }
}

/// Why an array cannot be pointed elsewhere (out of line: `repoint` is inlined into its
/// callers, and this is their rare case).
#[cold]
#[inline(never)]
fn not_repointable(why: &str) -> KvError {
    KvError::Unsupported(why.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lent(mem: &mut [u64]) -> NDArray {
        // SAFETY: `mem` outlives every array made from it in these tests.
        unsafe {
            NDArray::from_raw_parts(
                mem.as_mut_ptr().cast(),
                &[mem.len()],
                DType::I64,
                Box::new(()),
            )
        }
        .unwrap()
    }

    #[test]
    fn repoint_moves_an_array_and_refuses_what_it_cannot_make_safe() {
        let (mut a, mut b) = ([1u64, 2], [7u64; 4]);
        let mut v = lent(&mut a);
        // SAFETY: `b` outlives `v`.
        unsafe { v.repoint(b.as_mut_ptr().cast(), &[2, 2], DType::I64) }.unwrap();
        assert_eq!((v.shape(), v.nbytes()), (&[2usize, 2][..], 32));
        assert_eq!(v.to_vec::<i64>().unwrap(), [7; 4]);
        // Misaligned memory, a size that overflows, and a shared storage are refused, and
        // the array stays as it was.
        let odd = b.as_mut_ptr().cast::<u8>().wrapping_add(1);
        // SAFETY: refused before any use.
        assert!(unsafe { v.repoint(odd, &[1], DType::I64) }.is_err());
        // SAFETY: as above.
        let huge = unsafe { v.repoint(b.as_mut_ptr().cast(), &[usize::MAX, 2], DType::I64) };
        assert!(matches!(huge, Err(KvError::TooLarge { .. })));
        let clone = v.clone();
        // SAFETY: as above.
        assert!(unsafe { v.repoint(a.as_mut_ptr().cast(), &[2], DType::I64) }.is_err());
        drop(clone);
        assert_eq!(v.to_vec::<i64>().unwrap(), [7; 4]);
        // Once alone again it moves, to nothing as well.
        // SAFETY: an empty array names no memory.
        unsafe { v.repoint(std::ptr::null_mut(), &[0], DType::U8) }.unwrap();
        assert_eq!(v.nbytes(), 0);
        // An array over the store's own memory is never pointed elsewhere.
        let mut own = NDArray::zeros(&[2]);
        // SAFETY: refused before any use.
        assert!(unsafe { own.repoint(a.as_mut_ptr().cast(), &[2], DType::I64) }.is_err());
    }

    #[test]
    fn a_pull_into_lent_memory_a_clone_shares_is_refused_not_written_elsewhere() {
        // (Before, the pull wrote a copy the clone made, and the lent memory kept its bytes
        // without a word.)
        let mut kv = crate::create("local").unwrap();
        kv.init(3, &NDArray::full_dtype(&[2], 5.0, DType::I64))
            .unwrap();
        let mut mem = [0u64; 2];
        let mut v = lent(&mut mem);
        let kept = v.clone();
        assert!(matches!(kv.pull(3, &mut v), Err(KvError::Unsupported(_))));
        drop(kept);
        kv.pull(3, &mut v).unwrap();
        drop(v);
        assert_eq!(mem, [5, 5]);
        // An optimizer's update of such a weight, the same.
        let mut w = [1.0f32; 2];
        // SAFETY: `w` outlives the array.
        let mut v = unsafe {
            NDArray::from_raw_parts(w.as_mut_ptr().cast(), &[2], DType::F32, Box::new(()))
        }
        .unwrap();
        let mut u = crate::OptimizerUpdater::new(crate::Optimizer::sgd(0.5));
        let (k, g) = (crate::Key::Int(0), NDArray::ones(&[2]));
        let kept = v.clone();
        assert!(matches!(
            u.update(&k, &g, &mut v),
            Err(KvError::Unsupported(_))
        ));
        drop(kept);
        u.update(&k, &g, &mut v).unwrap();
        drop(v);
        assert_eq!(w, [0.5; 2]);
    }
}
