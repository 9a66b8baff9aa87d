//! Owning wrappers of the verbs queues: the shared receive queue and the reliable-connected
//! queue pair, each holding what it was made from alive and freeing itself in `Drop`; posting
//! is an `unsafe fn` whose contract says what the caller keeps alive.

use std::sync::Arc;

use rdma_sys as ffi;

use super::verbs::{os_err, ret_err, Cq, Pd, LOCAL, REMOTE_READ, REMOTE_WRITE};
use crate::TransportError;

/// A shared receive queue: the receive buffers of every queue pair of a backend, in one pool.
pub(crate) struct Srq {
    ptr: *mut ffi::ibv_srq,
    _pd: Arc<Pd>,
    /// The receives it holds at most (as the device granted).
    pub(crate) depth: u32,
}

// SAFETY: as for `Context`.
unsafe impl Send for Srq {}
// SAFETY: as for `Context`: posting to a shared receive queue is thread-safe in libibverbs.
unsafe impl Sync for Srq {}

impl Srq {
    pub(crate) fn new(pd: &Arc<Pd>, depth: u32) -> Result<Arc<Srq>, TransportError> {
        // SAFETY: a plain C struct, all zeroes valid.
        let mut init: ffi::ibv_srq_init_attr = unsafe { std::mem::zeroed() };
        init.attr.max_wr = depth;
        init.attr.max_sge = 1;
        // SAFETY: a live PD; `init` is valid and receives the granted depth.
        let ptr = unsafe { ffi::ibv_create_srq(pd.ptr, &mut init) };
        if ptr.is_null() {
            return Err(os_err("ibv_create_srq"));
        }
        Ok(Arc::new(Srq {
            ptr,
            _pd: pd.clone(),
            depth: init.attr.max_wr,
        }))
    }

    /// Posts a chain of receive work requests.
    ///
    /// # Safety
    /// Each buffer named stays registered and alive, and unread by anything else, until its
    /// request completes (or the queue is destroyed).
    pub(crate) unsafe fn post_recv(&self, wr: *mut ffi::ibv_recv_wr) -> Result<(), TransportError> {
        let mut bad = std::ptr::null_mut();
        // SAFETY: a live SRQ; the buffers' validity is the caller's contract.
        let rc = unsafe { ffi::ibv_post_srq_recv(self.ptr, wr, &mut bad) };
        if rc != 0 {
            return Err(ret_err("ibv_post_srq_recv", rc));
        }
        Ok(())
    }
}

impl Drop for Srq {
    fn drop(&mut self) {
        // SAFETY: destroyed once, after every queue pair using it (each holds it alive); the
        // backend drops the buffers it names after it.
        unsafe { ffi::ibv_destroy_srq(self.ptr) };
    }
}

/// A reliable-connected queue pair.
pub(crate) struct Qp {
    ptr: *mut ffi::ibv_qp,
    _pd: Arc<Pd>,
    /// Where its receives come from, held alive while the queue pair uses it.
    _srq: Arc<Srq>,
    pub(crate) num: u32,
    /// The capabilities the device granted (read back after creation).
    pub(crate) cap: ffi::ibv_qp_cap,
}

// SAFETY: as for `Context`.
unsafe impl Send for Qp {}

/// The QP's path, as both ends exchanged it.
pub(crate) struct Path {
    pub(crate) port: u8,
    pub(crate) remote_qpn: u32,
    pub(crate) remote_psn: u32,
    pub(crate) local_psn: u32,
    pub(crate) mtu: u32,
    pub(crate) remote_gid: [u8; 16],
    pub(crate) remote_lid: u16,
    pub(crate) gid_index: u32,
    pub(crate) global: bool,
    pub(crate) sl: u8,
    pub(crate) traffic_class: u8,
    pub(crate) timeout: u8,
    pub(crate) retry: u8,
    pub(crate) rnr_retry: u8,
    /// Whether the peer may READ and WRITE (the registrations' keys it holds): not before it
    /// proved itself ([`Qp::allow_remote`]).
    pub(crate) remote: bool,
}

impl Qp {
    /// A queue pair whose receives come from `srq`.
    pub(crate) fn new(
        pd: &Arc<Pd>,
        cq: &Cq,
        srq: &Arc<Srq>,
        cap: ffi::ibv_qp_cap,
    ) -> Result<Qp, TransportError> {
        // SAFETY: a plain C struct, all zeroes valid.
        let mut init: ffi::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = cq.ptr;
        init.recv_cq = cq.ptr;
        init.srq = srq.ptr;
        init.cap = cap;
        init.qp_type = ffi::ibv_qp_type::IBV_QPT_RC;
        // SAFETY: a live PD and CQ; `init` is valid and receives the granted capabilities.
        let ptr = unsafe { ffi::ibv_create_qp(pd.ptr, &mut init) };
        if ptr.is_null() {
            return Err(os_err("ibv_create_qp"));
        }
        // SAFETY: a live QP.
        let num = unsafe { (*ptr).qp_num };
        Ok(Qp {
            ptr,
            _pd: pd.clone(),
            _srq: srq.clone(),
            num,
            cap: init.cap,
        })
    }

    fn modify(
        &self,
        a: &mut ffi::ibv_qp_attr,
        mask: u32,
        what: &str,
    ) -> Result<(), TransportError> {
        // SAFETY: a live QP; `a` is valid for the attributes `mask` names.
        let rc = unsafe { ffi::ibv_modify_qp(self.ptr, a, mask as i32) };
        if rc != 0 {
            return Err(ret_err(&format!("ibv_modify_qp to {what}"), rc));
        }
        Ok(())
    }

    /// RESET → INIT → RTR → RTS along `p`. Remote access, where `p.remote`: writes (grants)
    /// and reads (data of messages sent by reference); which memory is reachable is each MR's
    /// own access. Without it the peer's SENDs alone are taken: a READ or WRITE it tries, with
    /// whatever key, is refused by the device and fails its queue pair.
    pub(crate) fn connect(&self, p: &Path) -> Result<(), TransportError> {
        use ffi::ibv_qp_attr_mask as m;
        // SAFETY: a plain C struct, all zeroes valid.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_INIT;
        a.port_num = p.port;
        a.pkey_index = 0;
        a.qp_access_flags = if p.remote {
            REMOTE_WRITE | REMOTE_READ | LOCAL
        } else {
            LOCAL
        };
        let mask = m::IBV_QP_STATE | m::IBV_QP_PKEY_INDEX | m::IBV_QP_PORT | m::IBV_QP_ACCESS_FLAGS;
        self.modify(&mut a, mask.0, "INIT")?;

        // SAFETY: as above.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_RTR;
        a.path_mtu = p.mtu;
        a.dest_qp_num = p.remote_qpn;
        a.rq_psn = p.remote_psn;
        a.max_dest_rd_atomic = 1;
        a.min_rnr_timer = 12;
        a.ah_attr.is_global = p.global as u8;
        a.ah_attr.dlid = p.remote_lid;
        a.ah_attr.sl = p.sl;
        a.ah_attr.port_num = p.port;
        if p.global {
            a.ah_attr.grh.dgid.raw = p.remote_gid;
            a.ah_attr.grh.sgid_index = p.gid_index as u8;
            a.ah_attr.grh.hop_limit = 64;
            a.ah_attr.grh.traffic_class = p.traffic_class;
        }
        let mask = m::IBV_QP_STATE
            | m::IBV_QP_AV
            | m::IBV_QP_PATH_MTU
            | m::IBV_QP_DEST_QPN
            | m::IBV_QP_RQ_PSN
            | m::IBV_QP_MAX_DEST_RD_ATOMIC
            | m::IBV_QP_MIN_RNR_TIMER;
        self.modify(&mut a, mask.0, "RTR")?;

        // SAFETY: as above.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_RTS;
        a.sq_psn = p.local_psn;
        a.timeout = p.timeout;
        a.retry_cnt = p.retry;
        a.rnr_retry = p.rnr_retry;
        a.max_rd_atomic = 1;
        let mask = m::IBV_QP_STATE
            | m::IBV_QP_SQ_PSN
            | m::IBV_QP_TIMEOUT
            | m::IBV_QP_RETRY_CNT
            | m::IBV_QP_RNR_RETRY
            | m::IBV_QP_MAX_QP_RD_ATOMIC;
        self.modify(&mut a, mask.0, "RTS")
    }

    /// Lets the peer READ and WRITE from now on (RTS → RTS, which may change the access).
    pub(crate) fn allow_remote(&self) -> Result<(), TransportError> {
        use ffi::ibv_qp_attr_mask as m;
        // SAFETY: a plain C struct, all zeroes valid.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_RTS;
        a.qp_access_flags = REMOTE_WRITE | REMOTE_READ | LOCAL;
        let mask = m::IBV_QP_STATE | m::IBV_QP_ACCESS_FLAGS;
        self.modify(&mut a, mask.0, "RTS with remote access")
    }

    /// Moves the QP to the error state: nothing more is sent or received on it, and what was
    /// posted completes with a flush error.
    pub(crate) fn to_error(&self) -> Result<(), TransportError> {
        // SAFETY: a plain C struct, all zeroes valid.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_ERR;
        self.modify(&mut a, ffi::ibv_qp_attr_mask::IBV_QP_STATE.0, "ERR")
    }

    /// Posts a chain of send work requests; on failure also the first request not posted
    /// (those before it were, and complete as usual).
    ///
    /// # Safety
    /// Every request of the chain is valid, and each memory range its gather lists name stays
    /// registered, alive and unwritten until the request completes (or the QP is destroyed).
    pub(crate) unsafe fn post_send(
        &self,
        wr: *mut ffi::ibv_send_wr,
    ) -> Result<(), (TransportError, *mut ffi::ibv_send_wr)> {
        let mut bad = std::ptr::null_mut();
        // SAFETY: a live QP; the chain's validity is the caller's contract.
        let rc = unsafe { ffi::ibv_post_send(self.ptr, wr, &mut bad) };
        if rc != 0 {
            return Err((ret_err("ibv_post_send", rc), bad));
        }
        Ok(())
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: destroyed once; the memory its requests named is held by the backend until
        // after this (the peer's buffers are dropped after the QP).
        unsafe { ffi::ibv_destroy_qp(self.ptr) };
    }
}
