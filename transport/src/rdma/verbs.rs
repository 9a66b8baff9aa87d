//! Owning wrappers of the verbs objects, in the manner of rust-ibverbs: each one holds its
//! parent alive (an `Arc`) and frees itself in `Drop`, so no object outlives what it was made
//! from, and a memory region holds its storage alive. All of the backend's `unsafe` calls into
//! libibverbs are here and in `queues.rs` (the receive queue and the queue pairs); posting work
//! requests is an `unsafe fn` whose contract says what the caller keeps alive.

use std::ffi::CStr;
use std::sync::Arc;

use rdma_sys as ffi;

use crate::{Storage, TransportError};

pub(crate) use super::queues::{Path, Qp, Srq};

/// An error of a verbs call, with errno's words.
pub(crate) fn os_err(what: &str) -> TransportError {
    let e = std::io::Error::last_os_error();
    TransportError::Rdma(format!("{what}: {e}"))
}

pub(super) fn ret_err(what: &str, rc: i32) -> TransportError {
    // Verbs calls return the errno itself (or -1 with errno set).
    let e = if rc > 0 {
        std::io::Error::from_raw_os_error(rc)
    } else {
        std::io::Error::last_os_error()
    };
    TransportError::Rdma(format!("{what}: {e}"))
}

/// The InfiniBand link layer (LIDs); RoCE is Ethernet.
pub(crate) const LINK_LAYER_IB: u8 = 1;

/// An open RDMA device.
pub(crate) struct Context {
    ptr: *mut ffi::ibv_context,
    pub(crate) name: String,
}

// SAFETY: libibverbs objects may be used from any thread; the wrappers add no thread-bound state.
unsafe impl Send for Context {}
// SAFETY: as above; calls on a context are thread-safe in libibverbs.
unsafe impl Sync for Context {}

/// Runs `f` over this host's devices (each with its name) while the device list is held; an
/// error says why there are none.
fn with_devices<R>(
    f: impl FnOnce(&[(*mut ffi::ibv_device, String)]) -> R,
) -> Result<R, TransportError> {
    let mut n = 0;
    // SAFETY: `n` is a valid out-pointer; the list is freed below.
    let list = unsafe { ffi::ibv_get_device_list(&mut n) };
    if list.is_null() {
        return Err(os_err("no RDMA devices (ibv_get_device_list)"));
    }
    let devs: Vec<_> = (0..n.max(0) as usize)
        .map(|i| {
            // SAFETY: `list` holds `n` valid device pointers until it is freed.
            let dev = unsafe { *list.add(i) };
            // SAFETY: a valid device of the list.
            let name = unsafe { CStr::from_ptr(ffi::ibv_get_device_name(dev)) };
            (dev, name.to_string_lossy().into_owned())
        })
        .collect();
    let r = f(&devs);
    // SAFETY: freed once, after its last use; opened contexts do not depend on it.
    unsafe { ffi::ibv_free_device_list(list) };
    Ok(r)
}

/// The names of the RDMA devices of this host; an error says why there are none.
pub(crate) fn device_names() -> Result<Vec<String>, TransportError> {
    with_devices(|d| d.iter().map(|(_, n)| n.clone()).collect())
}

impl Context {
    /// Opens the device called `name`, or the first one.
    pub(crate) fn open(name: Option<&str>) -> Result<Arc<Context>, TransportError> {
        with_devices(|devs| {
            let found = devs.iter().find(|(_, dn)| name.is_none_or(|w| w == dn));
            match found {
                // SAFETY: a valid device of the list, opened while the list is held.
                Some((dev, dn)) => match unsafe { ffi::ibv_open_device(*dev) } {
                    p if p.is_null() => Err(os_err(&format!("cannot open RDMA device {dn}"))),
                    p => Ok(Arc::new(Context {
                        ptr: p,
                        name: dn.clone(),
                    })),
                },
                None if devs.is_empty() => Err(TransportError::Rdma("no RDMA device".into())),
                None => Err(TransportError::Rdma(format!(
                    "no RDMA device {:?} (this host has {})",
                    name.unwrap_or_default(),
                    devs.iter()
                        .map(|(_, n)| n.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ))),
            }
        })?
    }

    pub(crate) fn query_device(&self) -> Result<ffi::ibv_device_attr, TransportError> {
        // SAFETY: a plain C struct, all zeroes valid; filled by the call.
        let mut a: ffi::ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: a live context and a valid out-pointer.
        let rc = unsafe { ffi::ibv_query_device(self.ptr, &mut a) };
        if rc != 0 {
            return Err(ret_err("ibv_query_device", rc));
        }
        Ok(a)
    }

    pub(crate) fn query_port(&self, port: u8) -> Result<ffi::ibv_port_attr, TransportError> {
        // SAFETY: a plain C struct, all zeroes valid; filled by the call.
        let mut a: ffi::ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: a live context and a valid out-pointer of the type the call expects.
        let rc = unsafe { ffi::___ibv_query_port(self.ptr, port, &mut a) };
        if rc != 0 {
            return Err(ret_err(&format!("ibv_query_port {port}"), rc));
        }
        Ok(a)
    }

    pub(crate) fn query_gid(&self, port: u8, index: u32) -> Result<[u8; 16], TransportError> {
        // SAFETY: a plain C union, all zeroes valid; filled by the call.
        let mut g: ffi::ibv_gid = unsafe { std::mem::zeroed() };
        // SAFETY: a live context and a valid out-pointer.
        let rc = unsafe { ffi::ibv_query_gid(self.ptr, port, index as i32, &mut g) };
        if rc != 0 {
            return Err(ret_err(&format!("ibv_query_gid {port}/{index}"), rc));
        }
        // SAFETY: every bit pattern is a valid `raw`.
        Ok(unsafe { g.raw })
    }

    /// The descriptor of asynchronous events (port changes, fatal QP errors).
    pub(crate) fn async_fd(&self) -> i32 {
        // SAFETY: a live context; the field is set once when it is opened.
        unsafe { (*self.ptr).async_fd }
    }

    /// Takes one asynchronous event if one is waiting (the descriptor is non-blocking):
    /// its type, and the QP number it names (for QP events).
    pub(crate) fn next_async_event(&self) -> Option<(ffi::ibv_event_type, Option<u32>)> {
        // SAFETY: a plain C struct, filled by the call.
        let mut ev: ffi::ibv_async_event = unsafe { std::mem::zeroed() };
        // SAFETY: a live context and a valid out-pointer; the descriptor is non-blocking.
        if unsafe { ffi::ibv_get_async_event(self.ptr, &mut ev) } != 0 {
            return None;
        }
        use ffi::ibv_event_type as t;
        let kind = ev.event_type;
        let qp = match kind {
            t::IBV_EVENT_QP_FATAL
            | t::IBV_EVENT_QP_REQ_ERR
            | t::IBV_EVENT_QP_ACCESS_ERR
            | t::IBV_EVENT_COMM_EST
            | t::IBV_EVENT_SQ_DRAINED
            | t::IBV_EVENT_PATH_MIG
            | t::IBV_EVENT_PATH_MIG_ERR
            | t::IBV_EVENT_QP_LAST_WQE_REACHED => {
                // SAFETY: for QP events the union holds the QP, alive until acknowledged.
                Some(unsafe { (*ev.element.qp).qp_num })
            }
            _ => None,
        };
        // SAFETY: the event taken above, acknowledged once.
        unsafe { ffi::ibv_ack_async_event(&mut ev) };
        Some((kind, qp))
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: every child holds this context alive, so none is left; closed once.
        unsafe { ffi::ibv_close_device(self.ptr) };
    }
}

/// A protection domain.
pub(crate) struct Pd {
    pub(super) ptr: *mut ffi::ibv_pd,
    _ctx: Arc<Context>,
}

// SAFETY: as for `Context`.
unsafe impl Send for Pd {}
// SAFETY: as for `Context`.
unsafe impl Sync for Pd {}

impl Pd {
    pub(crate) fn new(ctx: &Arc<Context>) -> Result<Arc<Pd>, TransportError> {
        // SAFETY: a live context.
        let ptr = unsafe { ffi::ibv_alloc_pd(ctx.ptr) };
        if ptr.is_null() {
            return Err(os_err("ibv_alloc_pd"));
        }
        Ok(Arc::new(Pd {
            ptr,
            _ctx: ctx.clone(),
        }))
    }
}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: every MR and QP holds this PD alive, so none is left; freed once.
        unsafe { ffi::ibv_dealloc_pd(self.ptr) };
    }
}

/// A memory region: `len` bytes at `at` of `mem`, registered; holds `mem` alive.
pub(crate) struct Mr {
    ptr: *mut ffi::ibv_mr,
    /// The storage, held alive; `None` for registrations that only the caller's regions
    /// hold alive (the cache's, never remotely writable).
    _mem: Option<Arc<dyn Storage>>,
    _pd: Arc<Pd>,
    pub(crate) addr: u64,
    pub(crate) lkey: u32,
    pub(crate) rkey: u32,
    /// Whether the registration is of the storage's dma-buf (the device memory), not its
    /// host bytes.
    pub(crate) on_device: bool,
    /// Why the device refused the storage's dma-buf, where it named one.
    pub(crate) dmabuf_refused: Option<String>,
}

// SAFETY: as for `Context`; the storage is `Send + Sync`.
unsafe impl Send for Mr {}
// SAFETY: as above.
unsafe impl Sync for Mr {}

/// Access flags of a region.
pub(crate) const LOCAL: u32 = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
pub(crate) const REMOTE_READ: u32 = ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
pub(crate) const REMOTE_WRITE: u32 = ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;

impl Mr {
    /// Registers `len` bytes at `at` of `mem` with `access`; the registration holds `mem`.
    pub(crate) fn new(
        pd: &Arc<Pd>,
        mem: &Arc<dyn Storage>,
        at: usize,
        len: usize,
        access: u32,
    ) -> Result<Mr, TransportError> {
        let mut mr = Mr::new_unheld(pd, mem, at, len, access)?;
        mr._mem = Some(mem.clone());
        Ok(mr)
    }

    /// Registers like [`Mr::new`] without holding `mem`: for local access and remote reads
    /// only, used while a region holds `mem` alive. Pages stay pinned until it is dropped.
    pub(crate) fn new_unheld(
        pd: &Arc<Pd>,
        mem: &Arc<dyn Storage>,
        at: usize,
        len: usize,
        access: u32,
    ) -> Result<Mr, TransportError> {
        if at.checked_add(len).is_none_or(|e| e > mem.len()) {
            return Err(TransportError::Refused(format!(
                "{len} bytes at {at} of a region of {}",
                mem.len()
            )));
        }
        // SAFETY: in bounds (checked); the storage lives as long as the MR (held below).
        let addr = unsafe { mem.ptr().add(at) };
        let made = |ptr: *mut ffi::ibv_mr, on_device: bool, dmabuf_refused: Option<String>| {
            // SAFETY: a live MR a registration call returned.
            let (lkey, rkey) = unsafe { ((*ptr).lkey, (*ptr).rkey) };
            Mr {
                ptr,
                _mem: None,
                _pd: pd.clone(),
                addr: addr as u64,
                lkey,
                rkey,
                on_device,
                dmabuf_refused,
            }
        };
        let mut refused = None;
        if let Some(d) = mem.dmabuf() {
            // The device memory, at the host bytes' address as its I/O address (so that work
            // requests name the same addresses either way); the host bytes where the device
            // refuses (rxe does, and so does a NIC without dma-buf support).
            // SAFETY: a live PD; the storage holds the descriptor open and `at..at + len` of
            // its bytes lie at `offset + at` in the dma-buf (its contract).
            let ptr = unsafe {
                ffi::ibv_reg_dmabuf_mr(
                    pd.ptr,
                    d.offset + at as u64,
                    len.max(1),
                    addr as u64,
                    d.fd,
                    access as i32,
                )
            };
            if !ptr.is_null() {
                return Ok(made(ptr, true, None));
            }
            refused = Some(format!(
                "ibv_reg_dmabuf_mr: {}",
                std::io::Error::last_os_error()
            ));
        }
        // SAFETY: a live PD; `addr..addr+len` is valid memory of `mem` (its contract).
        let ptr = unsafe { ffi::ibv_reg_mr(pd.ptr, addr.cast(), len.max(1), access as i32) };
        if ptr.is_null() {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENOMEM) || e.raw_os_error() == Some(libc::EPERM) {
                return Err(TransportError::Rdma(super::setup::memlock_advice(len)));
            }
            return Err(TransportError::Rdma(format!(
                "ibv_reg_mr of {len} bytes: {e}"
            )));
        }
        Ok(made(ptr, false, refused))
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: registered once, deregistered once; the storage is still held.
        let rc = unsafe { ffi::ibv_dereg_mr(self.ptr) };
        if rc != 0 {
            // The registration may still stand, and a peer may still write through it: its
            // memory (where this registration holds it) and its protection domain are kept
            // for the life of the process rather than freed under it.
            if let Some(m) = self._mem.take() {
                std::mem::forget(m);
            }
            std::mem::forget(self._pd.clone());
        }
    }
}

/// A completion channel: the descriptor a sleeping loop waits on.
pub(crate) struct Channel {
    ptr: *mut ffi::ibv_comp_channel,
    _ctx: Arc<Context>,
}

// SAFETY: as for `Context`.
unsafe impl Send for Channel {}
// SAFETY: as for `Context`.
unsafe impl Sync for Channel {}

impl Channel {
    pub(crate) fn new(ctx: &Arc<Context>) -> Result<Arc<Channel>, TransportError> {
        // SAFETY: a live context.
        let ptr = unsafe { ffi::ibv_create_comp_channel(ctx.ptr) };
        if ptr.is_null() {
            return Err(os_err("ibv_create_comp_channel"));
        }
        Ok(Arc::new(Channel {
            ptr,
            _ctx: ctx.clone(),
        }))
    }

    pub(crate) fn fd(&self) -> i32 {
        // SAFETY: a live channel; the field is set at creation.
        unsafe { (*self.ptr).fd }
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        // SAFETY: every CQ on it holds it alive, so none is left; destroyed once.
        unsafe { ffi::ibv_destroy_comp_channel(self.ptr) };
    }
}

/// A completion queue on a channel.
pub(crate) struct Cq {
    pub(super) ptr: *mut ffi::ibv_cq,
    chan: Arc<Channel>,
    /// Events taken from the channel and not yet acknowledged.
    unacked: u32,
}

// SAFETY: as for `Context`.
unsafe impl Send for Cq {}

impl Cq {
    pub(crate) fn new(
        ctx: &Arc<Context>,
        chan: &Arc<Channel>,
        cqe: i32,
    ) -> Result<Cq, TransportError> {
        // SAFETY: a live context and channel.
        let ptr = unsafe { ffi::ibv_create_cq(ctx.ptr, cqe, std::ptr::null_mut(), chan.ptr, 0) };
        if ptr.is_null() {
            return Err(os_err(&format!("ibv_create_cq of {cqe} entries")));
        }
        Ok(Cq {
            ptr,
            chan: chan.clone(),
            unacked: 0,
        })
    }

    /// Takes up to `wc.len()` completions.
    pub(crate) fn poll(&mut self, wc: &mut [ffi::ibv_wc]) -> Result<usize, TransportError> {
        // SAFETY: a live CQ; `wc` has room for `wc.len()` entries.
        let n = unsafe { ffi::ibv_poll_cq(self.ptr, wc.len() as i32, wc.as_mut_ptr()) };
        if n < 0 {
            return Err(ret_err("ibv_poll_cq", n));
        }
        Ok(n as usize)
    }

    /// Asks for an event on the channel at the next completion.
    pub(crate) fn arm(&mut self) -> Result<(), TransportError> {
        // SAFETY: a live CQ.
        let rc = unsafe { ffi::ibv_req_notify_cq(self.ptr, 0) };
        if rc != 0 {
            return Err(ret_err("ibv_req_notify_cq", rc));
        }
        Ok(())
    }

    /// Takes the events waiting on the (non-blocking) channel.
    pub(crate) fn drain_events(&mut self) {
        loop {
            let mut cq = std::ptr::null_mut();
            let mut cq_ctx = std::ptr::null_mut();
            // SAFETY: a live channel and valid out-pointers; the descriptor is non-blocking.
            if unsafe { ffi::ibv_get_cq_event(self.chan.ptr, &mut cq, &mut cq_ctx) } != 0 {
                break;
            }
            self.unacked += 1;
        }
        if self.unacked >= 64 {
            // SAFETY: acknowledges events taken above from this CQ.
            unsafe { ffi::ibv_ack_cq_events(self.ptr, self.unacked) };
            self.unacked = 0;
        }
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: every event taken is acknowledged before the CQ is destroyed, once; the QPs
        // that used it were destroyed first (the backend drops its peers before the CQ).
        unsafe {
            ffi::ibv_ack_cq_events(self.ptr, self.unacked);
            ffi::ibv_destroy_cq(self.ptr);
        }
    }
}
