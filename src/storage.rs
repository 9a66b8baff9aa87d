//! Where an array's bytes live: process memory the store allocated, or memory a transport
//! allocated (`KVStore::alloc`). Both can be registered with a transport, which may write them
//! through their address while no Rust reference to them is live.

use std::sync::Arc;

/// Where an array's bytes are.
pub(crate) enum Storage {
    /// Process memory.
    Heap(AlignedBuf),
    /// Memory a transport allocated (`KVStore::alloc`, a server's stored values): over shared
    /// memory, send-pool pages that peers read in place and can never write (they map them
    /// read-only; the kernel refuses more). Only a cross-memory write by the kernel, into a
    /// range granted for a pull while the call holds the array mutably, writes them from
    /// outside; a call that fails with the answer outstanding takes them out of the caller's
    /// array. Page-locked for GPUs' copies where `pin` says so (`KVStore::alloc_on`), and
    /// unlocked before the pages go back to the transport.
    Region {
        pin: Option<Pin>,
        region: kvstore_transport::Region,
    },
    /// Memory the caller owns (a Python buffer, say), lent to the array and held alive by its
    /// owner. The store cannot keep it from the caller after a failed call, so no peer is ever
    /// granted it to write directly ([`kvstore_transport::Storage::peer_may_write`]): what
    /// lands in it is copied there by this process, which stops when a grant is revoked.
    External(External),
    /// Memory on a GPU (feature `cuda`), read and written on the host through a mirror that
    /// follows the device ([`crate::gpu::device::DeviceBuf`]).
    #[cfg(feature = "cuda")]
    Device(crate::gpu::device::DeviceBuf),
}

/// A GPU that fails under a host view (which cannot return an error): the bytes cannot be
/// trusted, so the process stops here rather than compute with them.
#[cfg(feature = "cuda")]
fn gpu_failed(e: crate::KvError) -> ! {
    panic!("a GPU failed while its array was read or written on the host: {e}")
}

/// Memory lent by its owner: `len` bytes at `ptr`, valid while `_owner` lives. Atomic (and
/// read and written with relaxed ordering, as plain fields cost) so that
/// [`crate::NDArray::repoint`] can point an array that shares its storage with nothing at
/// other memory without `Arc::get_mut`'s locked instruction.
pub(crate) struct External {
    pub(crate) ptr: std::sync::atomic::AtomicPtr<u8>,
    pub(crate) len: std::sync::atomic::AtomicUsize,
    pub(crate) _owner: Box<dyn std::any::Any + Send + Sync>,
}

impl External {
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub(crate) fn len(&self) -> usize {
        self.len.load(std::sync::atomic::Ordering::Relaxed)
    }
}

// SAFETY: the owner is Send and Sync and keeps the memory valid; `NDArray::from_raw_parts`'s
// contract makes the array the memory's only user while it lives.
unsafe impl Send for External {}
// SAFETY: as above; shared access only reads.
unsafe impl Sync for External {}

impl Clone for Storage {
    /// A copy in process memory (a clone of a transport's memory does not share it).
    fn clone(&self) -> Storage {
        match self {
            Storage::Heap(b) => Storage::Heap(b.clone()),
            Storage::Region { .. } | Storage::External(_) => {
                // A copy of page-locked memory is page-locked too.
                let mut b = match self.is_pinned() {
                    true => AlignedBuf::zeroed_pinned(self.bytes().len()),
                    false => AlignedBuf::zeroed(self.bytes().len()),
                };
                kvstore_transport::copy::copy(b.bytes_mut(), self.bytes());
                Storage::Heap(b)
            }
            // A copy on the same device.
            #[cfg(feature = "cuda")]
            Storage::Device(d) => {
                Storage::Device(d.copy_to(d.ordinal()).unwrap_or_else(|e| gpu_failed(e)))
            }
        }
    }
}

impl Storage {
    /// A copy, as `clone` makes one, where a GPU that cannot give the memory is an error.
    pub(crate) fn try_clone(&self) -> crate::Result<Storage> {
        match self {
            #[cfg(feature = "cuda")]
            Storage::Device(d) => Ok(Storage::Device(d.copy_to(d.ordinal())?)),
            other => Ok(other.clone()),
        }
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        match self {
            Storage::Heap(b) => b.bytes(),
            // SAFETY: the region's storage is valid for its length while the region lives (it
            // holds it). No peer can write it (its mapping there is read-only); the kernel
            // writes it for a peer only into a range granted for a pull into this array, which
            // happens while a call holds the array's `&mut`, and a call that fails with the
            // answer outstanding takes the storage out of the caller's array, so no `&` to it
            // is live then.
            Storage::Region { region: r, .. } => unsafe {
                std::slice::from_raw_parts(kvstore_transport::Storage::ptr(&**r.storage()), r.len())
            },
            // SAFETY: `NDArray::from_raw_parts`'s contract: valid for `len` bytes while the
            // owner lives, and used by no one else meanwhile; peers never write it.
            Storage::External(e) => unsafe { std::slice::from_raw_parts(e.ptr(), e.len()) },
            #[cfg(feature = "cuda")]
            Storage::Device(d) => d.host().unwrap_or_else(|e| gpu_failed(e)),
        }
    }

    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Storage::Heap(b) => b.bytes_mut(),
            // SAFETY: as in `bytes`; `&mut self` makes this the only access in this process.
            Storage::Region { region: r, .. } => unsafe {
                std::slice::from_raw_parts_mut(
                    kvstore_transport::Storage::ptr(&**r.storage()),
                    r.len(),
                )
            },
            // SAFETY: as in `bytes`; `&mut self` makes this the only access in this process.
            Storage::External(e) => unsafe { std::slice::from_raw_parts_mut(e.ptr(), e.len()) },
            #[cfg(feature = "cuda")]
            Storage::Device(d) => d.host_mut().unwrap_or_else(|e| gpu_failed(e)),
        }
    }

    /// The transport's pages `region`, page-locked for GPUs' copies where CUDA can.
    pub(crate) fn pinned_region(region: kvstore_transport::Region) -> Storage {
        let pin = Pin::new(
            kvstore_transport::Storage::ptr(&**region.storage()),
            region.len(),
        );
        Storage::Region { pin, region }
    }

    /// Whether the bytes are page-locked for GPUs' copies (a GPU array: its host mirror).
    pub(crate) fn is_pinned(&self) -> bool {
        match self {
            Storage::Heap(b) => b.is_pinned(),
            Storage::Region { pin, .. } => pin.is_some(),
            Storage::External(_) => false,
            #[cfg(feature = "cuda")]
            Storage::Device(d) => d.mirror_is_pinned(),
        }
    }

    /// Whether a transport still holds the pages (a send by reference being read): they must
    /// not be written in place then.
    pub(crate) fn pages_held(&self) -> bool {
        match self {
            Storage::Region { region, .. } => Arc::strong_count(region.storage()) > 1,
            _ => false,
        }
    }

    /// New zeroed storage of `len` bytes where this lives: on its GPU for device memory, else
    /// in process memory.
    pub(crate) fn fresh(&self, len: usize) -> Storage {
        match self {
            #[cfg(feature = "cuda")]
            Storage::Device(d) => Storage::Device(
                crate::gpu::device::DeviceBuf::zeroed(d.ordinal(), len)
                    .unwrap_or_else(|e| gpu_failed(e)),
            ),
            _ => Storage::Heap(AlignedBuf::zeroed(len)),
        }
    }

    pub(crate) fn set_len(&mut self, len: usize) {
        match self {
            Storage::Heap(b) => b.set_len(len),
            Storage::Region { .. } | Storage::External(_) => {
                *self = Storage::Heap(AlignedBuf::zeroed(len))
            }
            #[cfg(feature = "cuda")]
            Storage::Device(d) if d.len() == len => {}
            #[cfg(feature = "cuda")]
            Storage::Device(d) => {
                let d = crate::gpu::device::DeviceBuf::zeroed(d.ordinal(), len);
                *self = Storage::Device(d.unwrap_or_else(|e| gpu_failed(e)));
            }
        }
    }
}

// SAFETY: `ptr` addresses `len` bytes that live, at the same address, as long as the value: a
// heap buffer is never reallocated through `&self`, and a region holds its storage alive. A
// transport writes them only where the store granted them, while the store holds the array
// mutably or has taken the storage out of the caller's array (see `Storage::bytes`).
unsafe impl kvstore_transport::Storage for Storage {
    fn ptr(&self) -> *mut u8 {
        match self {
            Storage::Heap(b) => b.as_mut_ptr(),
            Storage::Region { region: r, .. } => r.storage().ptr(),
            Storage::External(e) => e.ptr(),
            // The host mirror: a transport moves GPU arrays through it.
            #[cfg(feature = "cuda")]
            Storage::Device(d) => d.mirror_ptr().unwrap_or_else(|e| gpu_failed(e)),
        }
    }
    fn len(&self) -> usize {
        match self {
            Storage::Heap(b) => b.len,
            Storage::Region { region: r, .. } => r.len(),
            Storage::External(e) => e.len(),
            #[cfg(feature = "cuda")]
            Storage::Device(d) => d.len(),
        }
    }
    fn peer_may_write(&self) -> bool {
        !matches!(self, Storage::External(_))
    }
}

/// A range of host memory page-locked for GPUs' copies (`cuMemHostRegister`: copies between
/// it and a GPU go by DMA, with no bounce buffer), unlocked when dropped.
pub(crate) struct Pin {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    ptr: *mut u8,
}

// SAFETY: only the range's address is kept, to unlock it; nothing is read or written through it.
unsafe impl Send for Pin {}
// SAFETY: as above.
unsafe impl Sync for Pin {}

impl Pin {
    /// Page-locks the `len` bytes at `ptr`, whole pages that no other pin covers and that the
    /// caller keeps allocated while the pin lives: `None`, with nothing done, where there is
    /// no GPU or CUDA refuses.
    pub(crate) fn new(ptr: *mut u8, len: usize) -> Option<Pin> {
        #[cfg(feature = "cuda")]
        if len > 0 && crate::gpu::device::pin(ptr, len) {
            return Some(Pin { ptr });
        }
        let _ = (ptr, len);
        None
    }
}

impl Drop for Pin {
    fn drop(&mut self) {
        #[cfg(feature = "cuda")]
        crate::gpu::device::unpin(self.ptr);
    }
}

/// Byte storage aligned to 8 bytes, so it can be viewed as a slice of any element type. It is a
/// raw allocation (not a `Vec`), so that a transport may write it through its address while
/// no reference to it is live. [`AlignedBuf::zeroed_pinned`] makes one page-aligned and
/// page-locked for GPUs' copies (a GPU array's host mirror, a host copy of a GPU array).
pub(crate) struct AlignedBuf {
    ptr: std::ptr::NonNull<u64>,
    words: usize,
    len: usize,
    /// The allocation's alignment: 8, or a page for pinned buffers.
    align: usize,
    /// Page-locked for GPUs' copies, and unlocked before it is freed.
    pin: Option<Pin>,
}

// SAFETY: the buffer owns its allocation; shared access only reads it.
unsafe impl Send for AlignedBuf {}
// SAFETY: as above.
unsafe impl Sync for AlignedBuf {}

/// The alignment of pinned buffers: a page of this machine (64 KiB on some ARM servers), so
/// that no two registered ranges share one.
fn page() -> usize {
    static PAGE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *PAGE.get_or_init(|| rustix::param::page_size().max(4096))
}

impl AlignedBuf {
    pub(crate) fn zeroed(len: usize) -> Self {
        AlignedBuf::zeroed_aligned(len, 8)
    }

    /// `len` zero bytes, page-locked for the GPUs' copies where CUDA can do it (copies to and
    /// from a GPU then go by DMA, with no bounce buffer), else plain memory.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn zeroed_pinned(len: usize) -> Self {
        let mut b = AlignedBuf::zeroed_aligned(len, page());
        b.pin = Pin::new(b.as_mut_ptr(), b.words * 8);
        b
    }

    /// Whether the buffer is page-locked for GPUs' copies.
    pub(crate) fn is_pinned(&self) -> bool {
        self.pin.is_some()
    }

    fn zeroed_aligned(len: usize, align: usize) -> Self {
        match AlignedBuf::try_zeroed_aligned(len, align) {
            Ok(b) => b,
            // As `vec!` does.
            Err(None) => panic!("capacity overflow: {len} bytes"),
            Err(Some(layout)) => std::alloc::handle_alloc_error(layout),
        }
    }

    /// `len` zero bytes at `align`, or why not: a size no layout has (`None`), or memory the
    /// allocator did not give (the layout asked for).
    fn try_zeroed_aligned(len: usize, align: usize) -> Result<Self, Option<std::alloc::Layout>> {
        let words = len.div_ceil(8);
        let size = words.checked_mul(8).ok_or(None)?;
        let layout = std::alloc::Layout::from_size_align(size, align).map_err(|_| None)?;
        let ptr = if words > 0 {
            // SAFETY: the layout has a non-zero size.
            let p = unsafe { std::alloc::alloc_zeroed(layout) };
            std::ptr::NonNull::new(p.cast::<u64>()).ok_or(Some(layout))?
        } else {
            std::ptr::NonNull::dangling()
        };
        Ok(AlignedBuf {
            ptr,
            words,
            len,
            align,
            pin: None,
        })
    }

    /// `len` zero bytes, or `None` where the size has no layout or the allocator gives none:
    /// for the fallible constructors, which answer [`crate::KvError::TooLarge`] then.
    pub(crate) fn try_zeroed(len: usize) -> Option<Self> {
        AlignedBuf::try_zeroed_aligned(len, 8).ok()
    }

    /// [`AlignedBuf::zeroed_pinned`], or `None` as [`AlignedBuf::try_zeroed`].
    pub(crate) fn try_zeroed_pinned(len: usize) -> Option<Self> {
        let mut b = AlignedBuf::try_zeroed_aligned(len, page()).ok()?;
        b.pin = Pin::new(b.as_mut_ptr(), b.words * 8);
        Some(b)
    }

    /// Makes the buffer `len` bytes long, keeping its allocation when it is big enough.
    pub(crate) fn set_len(&mut self, len: usize) {
        if len.div_ceil(8) > self.words {
            *self = if self.align == page() {
                AlignedBuf::zeroed_pinned(len)
            } else {
                AlignedBuf::zeroed(len)
            };
        } else {
            self.len = len;
        }
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: the allocation holds at least `len` initialised bytes (zeroed at first) and
        // lives as long as `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().cast(), self.len) }
    }

    /// The allocation's address (valid for `len` bytes while the buffer lives).
    pub(crate) fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr().cast()
    }

    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, and `&mut self` is the only access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().cast(), self.len) }
    }
}

impl Clone for AlignedBuf {
    /// A copy, page-locked where this one is (a copy made on write keeps the DMA path).
    fn clone(&self) -> Self {
        let mut b = match self.is_pinned() {
            true => AlignedBuf::zeroed_pinned(self.len),
            false => AlignedBuf::zeroed(self.len),
        };
        kvstore_transport::copy::copy(b.bytes_mut(), self.bytes());
        b
    }
}

impl Default for AlignedBuf {
    fn default() -> Self {
        AlignedBuf::zeroed(0)
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // Unlocked before it is freed.
        self.pin = None;
        if let Ok(layout) = std::alloc::Layout::from_size_align(self.words * 8, self.align) {
            if self.words > 0 {
                // SAFETY: allocated in `zeroed` with this very layout.
                unsafe { std::alloc::dealloc(self.ptr.as_ptr().cast(), layout) };
            }
        }
    }
}
