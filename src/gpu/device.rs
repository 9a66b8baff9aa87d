//! GPU memory (feature `cuda`): one context and one non-blocking stream per device, made on
//! first use, and device buffers with a host mirror.
//!
//! A device buffer is the array's storage. Host views of it (everything that reads or writes
//! an array's bytes on the CPU: printing, comparisons, the local store's host sums, the
//! transports) go through its mirror, which is brought up to date from the device when a view
//! is asked for and the device holds newer bytes, and written back before the device is next
//! used when a mutable view changed it. So every host path is right for GPU arrays by
//! construction (staged through host memory), and GPU paths use the device memory directly.
//!
//! Every copy between host memory and a device is waited for before it returns: cudarc's
//! copies of host slices are queued on the stream and rely on the driver copying pageable
//! memory before it returns, which it does not do for page-locked memory (the mirrors are).

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};

use crate::storage::{AlignedBuf, Storage};
use crate::{KvError, Result};

/// A device's context and its stream (non-blocking: it does not wait for the legacy default
/// stream, and cudarc orders work on the buffers it touches by events).
pub(crate) struct Gpu {
    pub(crate) ordinal: u32,
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
}

fn cuda(ordinal: u32, what: &str, e: impl std::fmt::Display) -> KvError {
    KvError::Device(format!("gpu({ordinal}): {what}: {e}"))
}

/// The value `make` gives for device `ordinal`, made once per process and device (a failure
/// is not kept: the next call tries again).
pub(crate) fn per_device<T: Clone>(
    registry: &Mutex<Vec<Option<T>>>,
    ordinal: u32,
    make: impl FnOnce() -> Result<T>,
) -> Result<T> {
    let mut made = registry.lock().unwrap_or_else(|p| p.into_inner());
    let i = ordinal as usize;
    if made.len() <= i {
        made.resize(i + 1, None);
    }
    if let Some(v) = &made[i] {
        return Ok(v.clone());
    }
    let v = make()?;
    made[i] = Some(v.clone());
    Ok(v)
}

/// Device `ordinal`'s context and stream, made once (the caller checked the ordinal).
pub(crate) fn gpu(ordinal: u32) -> Result<Arc<Gpu>> {
    static GPUS: Mutex<Vec<Option<Arc<Gpu>>>> = Mutex::new(Vec::new());
    per_device(&GPUS, ordinal, || {
        let ctx = CudaContext::new(ordinal as usize).map_err(|e| cuda(ordinal, "context", e))?;
        let stream = ctx.new_stream().map_err(|e| cuda(ordinal, "stream", e))?;
        Ok(Arc::new(Gpu {
            ordinal,
            ctx,
            stream,
        }))
    })
}

/// Page-locks the `len` bytes at `ptr` for every CUDA context (`cuMemHostRegister`,
/// portable), so that copies between them and a GPU go by DMA with no bounce buffer: `false`,
/// with nothing done, where there is no GPU or CUDA refuses (the memory then stays plain).
/// The caller owns the range, which no other registration covers (whole pages), and calls
/// [`unpin`] before freeing it.
pub(crate) fn pin(ptr: *mut u8, len: usize) -> bool {
    if super::gpu_count() == 0 {
        return false;
    }
    let Ok(g) = gpu(0) else {
        return false;
    };
    if !make_current(&g) {
        return false;
    }
    // SAFETY: `ptr` addresses `len` bytes the caller owns and keeps allocated until `unpin`;
    // registering only page-locks them (no byte changes).
    let r = unsafe {
        cudarc::driver::sys::cuMemHostRegister_v2(
            ptr.cast(),
            len,
            cudarc::driver::sys::CU_MEMHOSTREGISTER_PORTABLE,
        )
    };
    r == cudarc::driver::sys::CUresult::CUDA_SUCCESS
}

/// Makes `g`'s context the thread's: directly, not through cudarc's `bind_to_thread`, which
/// first takes (and so hides from its owner) an error cudarc recorded earlier, a failed free
/// or event say, and then fails: `unpin` would leave freed memory registered.
fn make_current(g: &Gpu) -> bool {
    // SAFETY: `g.ctx` is a live context (the registry holds it for the process's life).
    unsafe { cudarc::driver::result::ctx::set_current(g.ctx.cu_ctx()) }.is_ok()
}

/// Undoes [`pin`] for the range starting at `ptr`, before it is freed.
pub(crate) fn unpin(ptr: *mut u8) {
    if let Ok(g) = gpu(0) {
        if make_current(&g) {
            // SAFETY: `ptr` starts a range that `pin` registered and that is still allocated;
            // unregistering only unlocks its pages. A failure leaves them locked until exit.
            unsafe { cudarc::driver::sys::cuMemHostUnregister(ptr.cast()) };
        }
    }
}

/// Which copy of a device buffer's bytes is the newer.
const DEVICE_NEWER: u8 = 0;
const SYNCED: u8 = 1;
const HOST_NEWER: u8 = 2;

/// A mirror of `len` bytes of its own: zeroed memory, page-locked where CUDA can.
fn own_mirror(len: usize) -> Box<Storage> {
    Box::new(Storage::Heap(AlignedBuf::zeroed_pinned(len)))
}

/// An array's bytes on a GPU, with a host mirror made on the first host view.
pub(crate) struct DeviceBuf {
    gpu: Arc<Gpu>,
    mem: CudaSlice<u8>,
    len: usize,
    /// The host copy: page-locked memory of its own (made on the first host view), or the
    /// transport's pages (`KVStore::alloc_on`), which a transport sends in place and lands
    /// pulls in, page-locked too where CUDA can. Written only while `state` is `DEVICE_NEWER`
    /// (under `sync`, or through `&mut self`), when no host view of it can be live: a view is
    /// handed out only once the state has left `DEVICE_NEWER`, and the state returns there
    /// only through `&mut self`.
    mirror: UnsafeCell<Option<Box<Storage>>>,
    state: AtomicU8,
    sync: Mutex<()>,
}

// SAFETY: the mirror is written only as its field says (under the lock or with `&mut self`);
// the device memory is reached through cudarc's stream, which orders its users.
unsafe impl Sync for DeviceBuf {}

impl DeviceBuf {
    /// `len` zero bytes on device `ordinal`.
    pub(crate) fn zeroed(ordinal: u32, len: usize) -> Result<DeviceBuf> {
        let gpu = gpu(ordinal)?;
        let mem = gpu
            .stream
            .alloc_zeros::<u8>(len.max(1))
            .map_err(|e| cuda(ordinal, "allocating device memory", e))?;
        Ok(DeviceBuf::over(gpu, mem, len))
    }

    /// A copy of `bytes` on device `ordinal`.
    pub(crate) fn from_host(ordinal: u32, bytes: &[u8]) -> Result<DeviceBuf> {
        let mut d = DeviceBuf::zeroed(ordinal, bytes.len())?;
        d.write_from_host(bytes)?;
        Ok(d)
    }

    /// Zero bytes on device `ordinal`, as many as `mirror` holds, with `mirror` (zeros: the
    /// transport's zeroed pages, or zeroed memory, page-locked where CUDA can) as the host
    /// mirror from the start (`KVStore::alloc_on`).
    pub(crate) fn with_mirror(ordinal: u32, mirror: Storage) -> Result<DeviceBuf> {
        let mut d = DeviceBuf::zeroed(ordinal, mirror.bytes().len())?;
        *d.mirror.get_mut() = Some(Box::new(mirror));
        // Both copies are zeros.
        *d.state.get_mut() = SYNCED;
        Ok(d)
    }

    /// The transport's pages that are the host mirror, if they are (`over_region`), brought up
    /// to date first, for a transport to send in place or land a pull in; `None` otherwise or
    /// where the device cannot be read (the caller then registers the storage, whose host
    /// view reports the failure).
    pub(crate) fn region(&self) -> Option<&kvstore_transport::Region> {
        self.host().ok()?;
        // SAFETY: `host` left the state SYNCED or HOST_NEWER: the mirror exists and is not
        // replaced while `&self` lives.
        match unsafe { &*self.mirror.get() } {
            Some(m) => match &**m {
                Storage::Region { region, .. } => Some(region),
                _ => None,
            },
            None => None,
        }
    }

    /// Whether the host mirror is a transport's pages (`over_region`).
    pub(crate) fn has_shared_mirror(&self) -> bool {
        let _g = self.sync.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: the lock is held, so no other thread replaces the mirror; only its kind is
        // read.
        unsafe { &*self.mirror.get() }
            .as_deref()
            .is_some_and(|m| matches!(m, Storage::Region { .. }))
    }

    /// Readies the host mirror to be overwritten whole (a pull's destination): made if
    /// absent, never filled from the device first, and newer than the device afterwards.
    pub(crate) fn prepare_overwrite(&mut self) {
        let len = self.len;
        let mirror = self.mirror.get_mut();
        if mirror.as_deref().is_none_or(Storage::pages_held) {
            *mirror = Some(own_mirror(len));
        }
        *self.state.get_mut() = HOST_NEWER;
    }

    fn over(gpu: Arc<Gpu>, mem: CudaSlice<u8>, len: usize) -> DeviceBuf {
        DeviceBuf {
            gpu,
            mem,
            len,
            mirror: UnsafeCell::new(None),
            state: AtomicU8::new(DEVICE_NEWER),
            sync: Mutex::new(()),
        }
    }

    /// The device it lives on.
    pub(crate) fn ordinal(&self) -> u32 {
        self.gpu.ordinal
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// A copy on device `ordinal` (this one, or another: a peer-to-peer copy where the
    /// devices allow it, else through the host by the driver).
    pub(crate) fn copy_to(&self, ordinal: u32) -> Result<DeviceBuf> {
        let mut d = DeviceBuf::zeroed(ordinal, self.len)?;
        if self.len > 0 {
            d.copy_from(self)?;
        }
        Ok(d)
    }

    /// After a copy between this buffer and one on device `ordinal`, on that device's
    /// `stream`: waits for it when the devices differ, as cudarc orders such a copy against
    /// the source's own stream only (a later write or free there must not overtake it).
    fn cross_device_done(&self, stream: &CudaStream, ordinal: u32) -> Result<()> {
        if ordinal == self.gpu.ordinal {
            return Ok(());
        }
        stream
            .synchronize()
            .map_err(|e| cuda(ordinal, "copying between devices", e))
    }

    /// The bytes, read on the host: the mirror, brought up to date first if the device has
    /// newer bytes.
    pub(crate) fn host(&self) -> Result<&[u8]> {
        if self.state.load(Ordering::Acquire) == DEVICE_NEWER {
            let _g = self.sync.lock().unwrap_or_else(|p| p.into_inner());
            if self.state.load(Ordering::Acquire) == DEVICE_NEWER {
                // SAFETY: the state is DEVICE_NEWER and the lock is held: no host view of
                // the mirror is live (see the field) and no other thread writes it.
                let mirror = unsafe { &mut *self.mirror.get() };
                self.download(mirror)?;
                self.state.store(SYNCED, Ordering::Release);
            }
        }
        // SAFETY: the state is SYNCED or HOST_NEWER, so the mirror exists and is not written
        // while `&self` lives (writes need `&mut self`, or the state DEVICE_NEWER).
        let mirror = unsafe { &*self.mirror.get() };
        Ok(mirror.as_deref().map_or(&[][..], Storage::bytes))
    }

    /// The bytes, written on the host: the mirror (up to date), whose changes go to the
    /// device before the device is next used.
    pub(crate) fn host_mut(&mut self) -> Result<&mut [u8]> {
        if *self.state.get_mut() == DEVICE_NEWER {
            let mirror = self.mirror.get_mut();
            let mut m = mirror.take();
            let r = self.download(&mut m);
            *self.mirror.get_mut() = m;
            r?;
        }
        *self.state.get_mut() = HOST_NEWER;
        Ok(self
            .mirror
            .get_mut()
            .as_mut()
            .map_or(&mut [][..], |m| m.bytes_mut()))
    }

    /// Copies the device bytes into `mirror` (made if absent, and made anew where a transport
    /// still reads the pages it was).
    fn download(&self, mirror: &mut Option<Box<Storage>>) -> Result<()> {
        if mirror.as_deref().is_some_and(Storage::pages_held) {
            *mirror = None;
        }
        let m = mirror.get_or_insert_with(|| own_mirror(self.len));
        self.copy_out(m.bytes_mut())
    }

    /// Copies the device's first `out.len()` bytes into `out`, and waits for the copy.
    fn copy_out(&self, out: &mut [u8]) -> Result<()> {
        if out.is_empty() {
            return Ok(());
        }
        let src = self.mem.slice(..out.len());
        self.gpu
            .stream
            .memcpy_dtoh(&src, out)
            .and_then(|()| self.gpu.stream.synchronize())
            .map_err(|e| cuda(self.gpu.ordinal, "copying to the host", e))
    }

    /// Sends the mirror's changes to the device, if a host write made them.
    fn upload_if_stale(&self) -> Result<()> {
        if self.state.load(Ordering::Acquire) != HOST_NEWER {
            return Ok(());
        }
        let _g = self.sync.lock().unwrap_or_else(|p| p.into_inner());
        if self.state.load(Ordering::Acquire) != HOST_NEWER {
            return Ok(());
        }
        // SAFETY: the state is HOST_NEWER: the mirror exists and only `&mut self` writes it.
        let mirror = unsafe { &*self.mirror.get() };
        self.gpu
            .ctx
            .bind_to_thread()
            .map_err(|e| cuda(self.gpu.ordinal, "copying to the device", e))?;
        if let Some(m) = mirror {
            // The device memory is written through a raw copy: `&self` holds no Rust view of
            // it, and every device reader comes through here first.
            let (dst, _sync) = self.mem.device_ptr(&self.gpu.stream);
            let bytes = m.bytes();
            // SAFETY: `dst` addresses `len` bytes of this buffer's device memory and `bytes`
            // is `len` readable host bytes; the copy is ordered on the buffer's stream, and
            // `_sync` records it for later users.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(dst, bytes, self.gpu.stream.cu_stream())
            }
            .map_err(|e| cuda(self.gpu.ordinal, "copying to the device", e))?;
            self.gpu
                .stream
                .synchronize()
                .map_err(|e| cuda(self.gpu.ordinal, "copying to the device", e))?;
        }
        self.state.store(SYNCED, Ordering::Release);
        Ok(())
    }

    /// The device memory, for reading on the device (up to date with host writes).
    pub(crate) fn device(&self) -> Result<&CudaSlice<u8>> {
        self.upload_if_stale()?;
        Ok(&self.mem)
    }

    /// The device memory, for writing on the device: host views are stale afterwards.
    pub(crate) fn device_mut(&mut self) -> Result<&mut CudaSlice<u8>> {
        self.upload_if_stale()?;
        *self.state.get_mut() = DEVICE_NEWER;
        Ok(&mut self.mem)
    }

    /// The device's stream.
    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.gpu.stream
    }

    /// Waits for the work queued on this buffer's device stream.
    pub(crate) fn synchronize(&self) -> Result<()> {
        let ordinal = self.gpu.ordinal;
        self.gpu
            .stream
            .synchronize()
            .map_err(|e| cuda(ordinal, "waiting for its stream", e))
    }

    /// Copies `src` (of the same length, on any device) into this buffer on the device.
    pub(crate) fn copy_from(&mut self, src: &DeviceBuf) -> Result<()> {
        let ordinal = self.gpu.ordinal;
        let stream = self.gpu.stream.clone();
        let n = self.len.min(src.len);
        let from = src.device()?.slice(..n);
        let mut to = self.device_mut()?.slice_mut(..n);
        stream
            .memcpy_dtod(&from, &mut to)
            .map_err(|e| cuda(ordinal, "copying between devices", e))?;
        src.cross_device_done(&stream, ordinal)
    }

    /// Whether the host mirror exists and is page-locked (it is made on the first host view,
    /// pinned where CUDA can).
    pub(crate) fn mirror_is_pinned(&self) -> bool {
        let _g = self.sync.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: the lock is held, so no other thread replaces the mirror; only a flag of it
        // is read.
        unsafe { &*self.mirror.get() }
            .as_deref()
            .is_some_and(Storage::is_pinned)
    }

    /// Writes `bytes` (the buffer's length) to the device, straight from host memory: the
    /// mirror, if any, is stale afterwards and is not read or written.
    pub(crate) fn write_from_host(&mut self, bytes: &[u8]) -> Result<()> {
        let ordinal = self.gpu.ordinal;
        let n = self.len.min(bytes.len());
        let stream = self.gpu.stream.clone();
        if n > 0 {
            let mut dst = self.mem.slice_mut(..n);
            let copied = stream
                .memcpy_htod(&bytes[..n], &mut dst)
                .and_then(|()| stream.synchronize());
            if let Err(e) = copied {
                // The device's bytes may be partly overwritten: a mirror that was up to date
                // is the array's value again, sent back before the device's next use.
                let state = self.state.get_mut();
                if *state == SYNCED {
                    *state = HOST_NEWER;
                }
                return Err(cuda(ordinal, "copying to the device", e));
            }
        }
        *self.state.get_mut() = DEVICE_NEWER;
        Ok(())
    }

    /// Copies the bytes into `out` (the buffer's length) on the host: from the mirror where
    /// it is up to date, else straight from the device, the mirror left as it is.
    pub(crate) fn read_to_host(&self, out: &mut [u8]) -> Result<()> {
        let n = self.len.min(out.len());
        if self.state.load(Ordering::Acquire) != DEVICE_NEWER {
            out[..n].copy_from_slice(&self.host()?[..n]);
            return Ok(());
        }
        self.copy_out(&mut out[..n])
    }

    /// The mirror's address, for a transport that reads it (a push) or writes it (a pull's
    /// destination, after a host write view set the state: the changes go to the device
    /// before its next use). No reference to the mirror is made here.
    pub(crate) fn mirror_ptr(&self) -> Result<*mut u8> {
        self.host()?;
        // SAFETY: `host` left the state SYNCED or HOST_NEWER, so the mirror exists and is not
        // replaced while `self` lives; only its address is taken.
        let mirror = unsafe { &*self.mirror.get() };
        Ok(mirror.as_deref().map_or(
            std::ptr::NonNull::dangling().as_ptr(),
            kvstore_transport::Storage::ptr,
        ))
    }
}
