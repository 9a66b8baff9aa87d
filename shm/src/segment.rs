//! The mapping. All reads and writes of shared memory go through here.

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64};

use memmap2::{MmapOptions, MmapRaw};
use rustix::fs::{MemfdFlags, SealFlags};

use crate::ShmError;

/// An anonymous shared memory segment, mapped read-write.
///
/// ```
/// use kvstore_shm::Segment;
/// let seg = Segment::create("doc", 4096).unwrap();
/// seg.write(100, b"hello").unwrap();
/// let mut out = [0u8; 5];
/// seg.read(100, &mut out).unwrap();
/// assert_eq!(&out, b"hello");
/// assert!(seg.write(4094, b"toolong").is_err());
/// ```
pub struct Segment {
    map: MmapRaw,
    file: File,
}

impl Segment {
    /// Creates a segment of `len` bytes (zeroed), named `name` for diagnostics only
    /// (`/proc/PID/fd` shows `memfd:NAME`).
    pub fn create(name: &str, len: usize) -> Result<Segment, ShmError> {
        let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
        rustix::fs::ftruncate(&fd, len as u64)?;
        // Nobody may shrink it under a mapping (which would turn accesses into SIGBUS).
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)?;
        Segment::from_fd(fd)
    }

    /// Maps a segment received from another process. It must be sealed against shrinking, so
    /// the peer cannot make this process's accesses fault.
    pub fn from_fd(fd: OwnedFd) -> Result<Segment, ShmError> {
        let seals = rustix::fs::fcntl_get_seals(&fd)?;
        if !seals.contains(SealFlags::SHRINK) {
            return Err(ShmError::Corrupt(
                "segment is not sealed against shrinking".into(),
            ));
        }
        let file = File::from(fd);
        let len = file.metadata()?.len() as usize;
        if len == 0 {
            return Err(ShmError::Corrupt("empty segment".into()));
        }
        let map = MmapOptions::new().len(len).map_raw(&file)?;
        Ok(Segment { map, file })
    }

    /// The segment's descriptor (to pass to another process).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether the segment is empty (never: creation refuses it).
    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }

    fn check(&self, off: usize, len: usize, align: usize) -> Result<(), ShmError> {
        match off.checked_add(len) {
            Some(end) if end <= self.len() && off % align == 0 => Ok(()),
            _ => Err(ShmError::OutOfBounds(format!(
                "{off}+{len} (align {align}) in a segment of {}",
                self.len()
            ))),
        }
    }

    /// The `AtomicU64` at `off` (8-aligned, inside the segment).
    pub fn atomic_u64(&self, off: usize) -> Result<&AtomicU64, ShmError> {
        self.check(off, 8, 8)?;
        // SAFETY: the range is inside the mapping and 8-aligned (the mapping is page-aligned);
        // the mapping lives as long as `self`, which the reference borrows; atomics are valid
        // for any bit pattern and may be shared between processes.
        Ok(unsafe { &*(self.map.as_mut_ptr().add(off) as *const AtomicU64) })
    }

    /// The `AtomicU32` at `off` (4-aligned, inside the segment).
    pub fn atomic_u32(&self, off: usize) -> Result<&AtomicU32, ShmError> {
        self.check(off, 4, 4)?;
        // SAFETY: as for `atomic_u64`, with 4-byte alignment.
        Ok(unsafe { &*(self.map.as_mut_ptr().add(off) as *const AtomicU32) })
    }

    /// The bytes at `off..off+len` as a slice.
    ///
    /// # Safety
    /// No process may write the range while the slice lives: it must be a region this process
    /// owns under the protocol (one it allocated and has not handed to a peer for writing), or
    /// the compiler's assumption that the bytes do not change is broken.
    pub unsafe fn bytes(&self, off: usize, len: usize) -> Result<&[u8], ShmError> {
        self.check(off, len, 1)?;
        // SAFETY: in bounds (checked), inside a mapping that lives as long as `self`; u8 has
        // no invalid bit patterns; that nobody writes it meanwhile is the caller's promise.
        Ok(unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(off), len) })
    }

    /// The address of `off..off+len` (checked to lie inside the mapping), for readers that
    /// must not form a slice over bytes a peer may write: they read each element once through
    /// the pointer, which stays valid while `self` lives.
    pub fn ptr(&self, off: usize, len: usize) -> Result<*const u8, ShmError> {
        self.check(off, len, 1)?;
        // SAFETY: `off` is inside the mapping (checked), so the offset pointer stays in bounds.
        Ok(unsafe { self.map.as_ptr().add(off) })
    }

    /// The bytes at `off..off+len` as a mutable slice.
    ///
    /// # Safety
    /// The caller must have exclusive use of the range for the slice's lifetime: no other slice
    /// of it in this process, and no other process writing or reading it (a region this process
    /// allocated and has not handed out).
    // A mutable slice from `&self` is the point: the mapping is shared memory whose ownership
    // the protocol assigns, not Rust's borrows; the caller's promise above stands in for them.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut(&self, off: usize, len: usize) -> Result<&mut [u8], ShmError> {
        self.check(off, len, 1)?;
        // SAFETY: in bounds (checked); exclusivity is the caller's promise.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.map.as_mut_ptr().add(off), len) })
    }

    /// Copies `src` into the segment at `off`.
    pub fn write(&self, off: usize, src: &[u8]) -> Result<(), ShmError> {
        self.check(off, src.len(), 1)?;
        // SAFETY: the destination range is inside the mapping; `src` is ordinary memory of this
        // process, so the ranges cannot overlap. Concurrent writers to the same bytes are a
        // protocol error of the users (ownership passes through the rings), never unsoundness
        // of this process's own memory: the mapping is only accessed through raw copies.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.map.as_mut_ptr().add(off), src.len())
        };
        Ok(())
    }

    /// Copies bytes at `off` out of the segment into `dst`.
    pub fn read(&self, off: usize, dst: &mut [u8]) -> Result<(), ShmError> {
        self.check(off, dst.len(), 1)?;
        // SAFETY: the source range is inside the mapping, `dst` is this process's memory.
        unsafe {
            std::ptr::copy_nonoverlapping(self.map.as_ptr().add(off), dst.as_mut_ptr(), dst.len())
        };
        Ok(())
    }

    /// Copies `len` bytes within the segment from `src` to `dst` (ranges may not overlap).
    pub fn copy_within(&self, src: usize, dst: usize, len: usize) -> Result<(), ShmError> {
        self.check(src, len, 1)?;
        self.check(dst, len, 1)?;
        if src < dst + len && dst < src + len {
            return Err(ShmError::OutOfBounds("overlapping copy".into()));
        }
        // SAFETY: both ranges are inside the mapping and do not overlap (checked above).
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.map.as_ptr().add(src),
                self.map.as_mut_ptr().add(dst),
                len,
            )
        };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_mapping_of_the_descriptor_sees_the_same_bytes() {
        let a = Segment::create("t", 8192).unwrap();
        let fd = a.fd().try_clone_to_owned().unwrap();
        let b = Segment::from_fd(fd).unwrap();
        a.write(4000, b"shared").unwrap();
        let mut out = [0u8; 6];
        b.read(4000, &mut out).unwrap();
        assert_eq!(&out, b"shared");
        a.atomic_u64(64)
            .unwrap()
            .store(7, std::sync::atomic::Ordering::SeqCst);
        assert_eq!(
            b.atomic_u64(64)
                .unwrap()
                .load(std::sync::atomic::Ordering::SeqCst),
            7
        );
    }

    #[test]
    fn bounds_and_alignment_are_checked() {
        let s = Segment::create("t", 4096).unwrap();
        assert!(s.atomic_u64(4092).is_err());
        assert!(s.atomic_u64(3).is_err());
        assert!(s.atomic_u32(4096).is_err());
        assert!(s.read(usize::MAX, &mut [0u8; 2]).is_err());
        assert!(s.copy_within(0, 10, 20).is_err(), "overlap");
        assert!(s.copy_within(0, 100, 20).is_ok());
    }

    #[test]
    fn an_unsealed_descriptor_is_refused() {
        let fd = rustix::fs::memfd_create("x", MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&fd, 4096).unwrap();
        assert!(matches!(Segment::from_fd(fd), Err(ShmError::Corrupt(_))));
    }
}
