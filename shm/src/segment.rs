//! The mapping. All reads and writes of shared memory go through here.

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use memmap2::{MmapOptions, MmapRaw};
use rustix::fs::{MemfdFlags, SealFlags};

use crate::ShmError;

/// An anonymous shared memory segment, mapped read-write, or read-only where the creator sealed
/// it against writable mappings by others ([`Segment::create_read_only_for_peers`]).
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
    writable: bool,
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

    /// Creates a segment that this process maps read-write and every other process only
    /// read-only: after this mapping is made the memfd is sealed with `F_SEAL_FUTURE_WRITE`, so
    /// the kernel refuses any later writable mapping, `mprotect` to writable, or `write(2)`,
    /// whoever holds the descriptor. Peers map it with [`Segment::from_fd_read_only`].
    pub fn create_read_only_for_peers(name: &str, len: usize) -> Result<Segment, ShmError> {
        let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
        rustix::fs::ftruncate(&fd, len as u64)?;
        let file = File::from(fd);
        let map = MmapOptions::new().len(len).map_raw(&file)?;
        rustix::fs::fcntl_add_seals(
            &file,
            SealFlags::SHRINK | SealFlags::GROW | SealFlags::FUTURE_WRITE | SealFlags::SEAL,
        )?;
        Ok(Segment {
            map,
            file,
            writable: true,
        })
    }

    /// Maps a segment received from another process. It must be sealed against shrinking, so
    /// the peer cannot make this process's accesses fault.
    pub fn from_fd(fd: OwnedFd) -> Result<Segment, ShmError> {
        Self::map(fd, true)
    }

    /// Maps a segment received from another process for reading only (one it sealed against
    /// writable mappings, or any other). Every write through it is refused.
    pub fn from_fd_read_only(fd: OwnedFd) -> Result<Segment, ShmError> {
        Self::map(fd, false)
    }

    fn map(fd: OwnedFd, writable: bool) -> Result<Segment, ShmError> {
        let file = Self::sealed_file(fd)?;
        let mut opts = MmapOptions::new();
        opts.len(file.metadata()?.len() as usize);
        let map = if writable {
            opts.map_raw(&file)?
        } else {
            opts.map_raw_read_only(&file)?
        };
        Ok(Segment {
            map,
            file,
            writable,
        })
    }

    fn sealed_file(fd: OwnedFd) -> Result<File, ShmError> {
        let seals = rustix::fs::fcntl_get_seals(&fd)?;
        if !seals.contains(SealFlags::SHRINK) {
            return Err(ShmError::Corrupt(
                "segment is not sealed against shrinking".into(),
            ));
        }
        let file = File::from(fd);
        if file.metadata()?.len() == 0 {
            return Err(ShmError::Corrupt("empty segment".into()));
        }
        Ok(file)
    }

    /// Whether this process may write the segment (its own, or a peer's writable one).
    pub fn is_writable(&self) -> bool {
        self.writable
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

    fn check_write(&self, off: usize, len: usize, align: usize) -> Result<(), ShmError> {
        if !self.writable {
            return Err(ShmError::ReadOnly);
        }
        self.check(off, len, align)
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

    /// The `AtomicU64` at `off` (8-aligned, inside the segment; a writable mapping).
    pub fn atomic_u64(&self, off: usize) -> Result<&AtomicU64, ShmError> {
        self.check_write(off, 8, 8)?;
        // SAFETY: the range is inside the mapping and 8-aligned (the mapping is page-aligned);
        // the mapping lives as long as `self`, which the reference borrows; atomics are valid
        // for any bit pattern and may be shared between processes.
        Ok(unsafe { &*(self.map.as_mut_ptr().add(off) as *const AtomicU64) })
    }

    /// The `AtomicU32` at `off` (4-aligned, inside the segment; a writable mapping).
    pub fn atomic_u32(&self, off: usize) -> Result<&AtomicU32, ShmError> {
        self.check_write(off, 4, 4)?;
        // SAFETY: as for `atomic_u64`, with 4-byte alignment.
        Ok(unsafe { &*(self.map.as_mut_ptr().add(off) as *const AtomicU32) })
    }

    /// An atomic load of the `u64` at `off` (8-aligned, inside the segment), with `order`;
    /// works on read-only mappings too.
    pub fn load_u64(&self, off: usize, order: Ordering) -> Result<u64, ShmError> {
        self.check(off, 8, 8)?;
        // SAFETY: in bounds and 8-aligned (checked; the mapping is page-aligned); a load never
        // writes, so a read-only mapping serves; the reference does not outlive this call.
        let a = unsafe { &*(self.map.as_ptr().add(off) as *const AtomicU64) };
        Ok(a.load(order))
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

    /// The address of `off..off+len` for a writer (checked to lie inside a writable mapping):
    /// a peer's landing pages that it granted.
    pub fn ptr_mut(&self, off: usize, len: usize) -> Result<*mut u8, ShmError> {
        self.check_write(off, len, 1)?;
        // SAFETY: `off` is inside the mapping (checked), so the offset pointer stays in bounds.
        Ok(unsafe { self.map.as_mut_ptr().add(off) })
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
        self.check_write(off, len, 1)?;
        // SAFETY: in bounds (checked); exclusivity is the caller's promise.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.map.as_mut_ptr().add(off), len) })
    }

    /// Copies `src` into the segment at `off`.
    pub fn write(&self, off: usize, src: &[u8]) -> Result<(), ShmError> {
        self.check_write(off, src.len(), 1)?;
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
        self.check_write(dst, len, 1)?;
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
    fn a_segment_read_only_for_peers_cannot_be_written_through_its_descriptor() {
        let a = Segment::create_read_only_for_peers("ro", 8192).unwrap();
        a.write(100, b"owner").unwrap();
        let fd = || a.fd().try_clone_to_owned().unwrap();
        // The kernel refuses a writable mapping, and a write(2), to whoever holds the descriptor.
        assert!(Segment::from_fd(fd()).is_err());
        assert!(rustix::io::write(fd(), b"x").is_err());
        let b = Segment::from_fd_read_only(fd()).unwrap();
        assert!(!b.is_writable());
        let mut out = [0u8; 5];
        b.read(100, &mut out).unwrap();
        assert_eq!(&out, b"owner");
        assert!(matches!(b.write(0, b"x"), Err(ShmError::ReadOnly)));
        assert!(b.atomic_u64(0).is_err());
        assert!(b.ptr_mut(0, 1).is_err());
        let word = u64::from_le_bytes(*b"\0\0\0\0owne");
        assert_eq!(b.load_u64(96, Ordering::SeqCst).unwrap(), word);
        // Nor can the read-only mapping be made writable.
        let addr = b.ptr(0, 1).unwrap() as *mut std::ffi::c_void;
        // SAFETY: the range is this test's own mapping of `b`, which outlives the call; asking
        // for more rights changes no memory.
        let up = unsafe {
            rustix::mm::mprotect(
                addr,
                4096,
                rustix::mm::MprotectFlags::READ | rustix::mm::MprotectFlags::WRITE,
            )
        };
        assert!(up.is_err(), "mprotect to writable must fail");
        // The owner still writes, and the reader sees it.
        a.write(100, b"later").unwrap();
        b.read(100, &mut out).unwrap();
        assert_eq!(&out, b"later");
    }

    #[test]
    fn an_unsealed_descriptor_is_refused() {
        let fd = rustix::fs::memfd_create("x", MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&fd, 4096).unwrap();
        assert!(matches!(Segment::from_fd(fd), Err(ShmError::Corrupt(_))));
    }
}
