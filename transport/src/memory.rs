//! Memory a backend may read and write on the caller's behalf: the [`Storage`] contract that
//! a [`crate::Region`] holds alive, and [`Mem`], plain heap memory that meets it.

use std::sync::Arc;

/// Memory a backend may read and write on the caller's behalf.
///
/// # Safety
/// [`Storage::ptr`] addresses [`Storage::len`] bytes that stay valid for reads and writes, at the
/// same address, for as long as the value lives, and that no Rust reference covers while a
/// backend reads or writes them (the caller's side of [`crate::Backend::grant`],
/// [`crate::Backend::send`] and [`crate::Backend::put`]).
pub unsafe trait Storage: Send + Sync + 'static {
    /// The first byte.
    fn ptr(&self) -> *mut u8;
    /// The length in bytes.
    fn len(&self) -> usize;
    /// Whether the length is zero.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Whether a peer may be granted this memory to write it directly (a cross-memory write,
    /// an RDMA write), which only the peer's answer or exit can stop. False for memory the
    /// caller takes back after a failed call whatever a peer still does (memory the store
    /// does not own): a backend then lands puts elsewhere and copies them into place itself,
    /// which a revoke stops at once, or refuses the grant.
    fn peer_may_write(&self) -> bool {
        true
    }
    /// Where the bytes also live in device memory that a dma-buf exports (a GPU's): the RDMA
    /// backend registers that (`ibv_reg_dmabuf_mr`, the NIC reading and writing the device
    /// memory itself) where the device takes it, and the host bytes at [`Storage::ptr`]
    /// otherwise. `None`, the default: host memory only. A storage that names one holds the
    /// descriptor open while it lives, and keeps both copies in step around a backend's use.
    fn dmabuf(&self) -> Option<DmaBuf> {
        None
    }
}

/// Device memory exported as a dma-buf: its descriptor, and where a storage's bytes start in
/// it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DmaBuf {
    /// The dma-buf's file descriptor.
    pub fd: std::os::fd::RawFd,
    /// The offset of the storage's first byte in it.
    pub offset: u64,
}

/// Plain heap memory, 64-byte aligned and zeroed, for a backend to read and write. It hands
/// out no slices (a peer may be writing it); bytes go in and out by copy.
pub struct Mem {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

const MEM_ALIGN: usize = 64;

impl Mem {
    /// `len` zeroed bytes.
    pub fn zeroed(len: usize) -> Arc<Mem> {
        let layout = std::alloc::Layout::from_size_align(len.max(1), MEM_ALIGN)
            .expect("a length that fits a layout");
        match Mem::try_zeroed(len) {
            Some(m) => m,
            None => std::alloc::handle_alloc_error(layout),
        }
    }

    /// `len` zeroed bytes, or `None` where they cannot be had (a length a peer named).
    pub fn try_zeroed(len: usize) -> Option<Arc<Mem>> {
        let layout = std::alloc::Layout::from_size_align(len.max(1), MEM_ALIGN).ok()?;
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = std::ptr::NonNull::new(p)?;
        Some(Arc::new(Mem { ptr, len }))
    }

    /// `len` zeroed bytes, or an error where they cannot be had (memory a transport allocates
    /// for a length a caller or a peer chose).
    pub fn zeroed_or_refused(len: usize) -> Result<Arc<Mem>, crate::TransportError> {
        Mem::try_zeroed(len)
            .ok_or_else(|| crate::TransportError::Refused(format!("no memory for {len} bytes")))
    }

    /// `data`, copied into new memory.
    pub fn from_bytes(data: &[u8]) -> Arc<Mem> {
        let m = Mem::zeroed(data.len());
        m.write(0, data);
        m
    }

    /// Copies `src` in at `off` (panics out of bounds).
    pub fn write(&self, off: usize, src: &[u8]) {
        assert!(off.checked_add(src.len()).is_some_and(|e| e <= self.len));
        // SAFETY: in bounds (checked); `src` is the caller's own memory, which cannot overlap
        // this allocation while `self` is borrowed; no reference to these bytes exists.
        unsafe { crate::copy::copy_any(src.as_ptr(), self.ptr.as_ptr().add(off), src.len()) }
    }

    /// Copies bytes out from `off` (panics out of bounds).
    pub fn read(&self, off: usize, dst: &mut [u8]) {
        assert!(off.checked_add(dst.len()).is_some_and(|e| e <= self.len));
        // SAFETY: as in `write`, in the other direction.
        unsafe { crate::copy::copy_any(self.ptr.as_ptr().add(off), dst.as_mut_ptr(), dst.len()) }
    }

    /// All the bytes, copied.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len];
        self.read(0, &mut v);
        v
    }
}

impl Drop for Mem {
    fn drop(&mut self) {
        let layout = std::alloc::Layout::from_size_align(self.len.max(1), MEM_ALIGN)
            .expect("the layout it was made with");
        // SAFETY: allocated in `zeroed` with this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) }
    }
}

// SAFETY: `Mem` owns its allocation, which does not move and lives until `drop`; it hands out
// no references, so the bytes are reached only through `ptr` and copies.
unsafe impl Storage for Mem {
    fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    fn len(&self) -> usize {
        self.len
    }
}

// SAFETY: the allocation is owned and reached only through raw copies (see `Storage`).
unsafe impl Send for Mem {}
// SAFETY: as above; `&Mem` gives no references into the bytes.
unsafe impl Sync for Mem {}
