//! The verbs backend's events: the listener and handshakes, the peers' TCP links (their end
//! is a peer's end), the device's asynchronous events, and receives held while a peer was
//! paused.

use rdma_sys as ffi;

use super::{RdmaBackend, ASYNC, CHANNEL, HANDSHAKE, LISTENER, TIMER};
use crate::{Completion, PeerId, TransportError};

impl RdmaBackend {
    /// Readiness of the listener, handshakes, the completion channel, device events and the
    /// peers' TCP links (whose end is the peer's end).
    pub(super) fn poll_events(
        &mut self,
        on: &mut dyn FnMut(Completion<'_>),
        n: &mut usize,
    ) -> Result<(), TransportError> {
        match self
            .poll
            .poll(&mut self.events, Some(std::time::Duration::ZERO))
        {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
        let ready: Vec<usize> = self.events.iter().map(|e| e.token().0).collect();
        if self.accept_retry.due() {
            self.accept_all()?;
        }
        for t in ready {
            match mio::Token(t) {
                LISTENER => self.accept_all()?,
                CHANNEL => self.cq.drain_events(),
                ASYNC => self.async_events(),
                TIMER => {
                    // Its count of expirations: only the wake-up mattered.
                    let _ = rustix::io::read(&self.timer, &mut [0u8; 8]);
                }
                _ if t >= HANDSHAKE => {
                    if let Some(peer) = self.handshake(t) {
                        on(Completion::Connected { peer });
                        *n += 1;
                        // What it sent while the handshake ended.
                        for w in self.early.take() {
                            self.on_wc(&w.0, on, n);
                        }
                    }
                }
                _ => self.check_link(t as u32),
            }
        }
        self.expire_handshakes();
        // Events are asked for again before each sleep; a wake-up may also have been spent.
        Ok(())
    }

    /// Wakes a sleep on the backend's descriptor after `after`, once.
    pub(super) fn wake_after(&self, after: std::time::Duration) -> Result<(), TransportError> {
        use rustix::time::{timerfd_settime, Itimerspec, TimerfdTimerFlags, Timespec};
        let spec = Itimerspec {
            it_interval: Timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: Timespec {
                tv_sec: after.as_secs() as i64,
                tv_nsec: after.subsec_nanos() as i64,
            },
        };
        timerfd_settime(&self.timer, TimerfdTimerFlags::empty(), &spec)
            .map_err(std::io::Error::from)?;
        Ok(())
    }

    /// The peer's TCP link is readable: it closed (the peer is gone), or sent what it never
    /// should.
    fn check_link(&mut self, id: u32) {
        use std::io::Read;
        let Some(p) = self.peers.get_mut(&id) else {
            return;
        };
        let Some(s) = &mut p.sock else { return };
        let mut b = [0u8; 16];
        match s.read(&mut b) {
            // Its last messages may be in the completion queue: they go first (`progress`).
            Ok(0) => self.ended.push(id),
            Ok(_) => self.lose(
                PeerId(id),
                TransportError::Refused("bytes on the RDMA link's TCP side".into()),
            ),
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => self.lose(PeerId(id), e.into()),
        }
    }

    /// Device events: a fatal error of a queue pair loses its peer; a port that goes down, or
    /// a device, completion queue or shared receive queue that fails, loses every peer.
    fn async_events(&mut self) {
        use ffi::ibv_event_type as t;
        while let Some((kind, qpn)) = self.ctx.next_async_event() {
            match (kind, qpn) {
                (
                    t::IBV_EVENT_QP_FATAL | t::IBV_EVENT_QP_REQ_ERR | t::IBV_EVENT_QP_ACCESS_ERR,
                    Some(q),
                ) => {
                    if let Some(&id) = self.by_qpn.get(&q) {
                        self.lose(
                            PeerId(id),
                            TransportError::Rdma(format!("queue pair {q} failed ({kind:?})")),
                        );
                    }
                }
                // A lost peer's queue pair will take no more receives from the shared queue:
                // once the completion queue is polled dry, it can go.
                (t::IBV_EVENT_QP_LAST_WQE_REACHED, Some(q)) => {
                    for d in self.draining.iter_mut().filter(|d| d.qp.num == q) {
                        d.last_wqe = true;
                    }
                }
                // The port, the device, the completion queue or the shared receive queue
                // every peer uses: no peer can be served any more.
                (
                    t::IBV_EVENT_PORT_ERR
                    | t::IBV_EVENT_DEVICE_FATAL
                    | t::IBV_EVENT_CQ_ERR
                    | t::IBV_EVENT_SRQ_ERR,
                    _,
                ) => {
                    let what = match kind {
                        t::IBV_EVENT_PORT_ERR => "went down",
                        _ => "failed",
                    };
                    let ids: Vec<u32> = self.peers.keys().copied().collect();
                    for id in ids {
                        self.lose(
                            PeerId(id),
                            TransportError::Rdma(format!(
                                "{} port {} {what} ({kind:?})",
                                self.ctx.name, self.cfg.port
                            )),
                        );
                    }
                }
                _ => {}
            }
        }
    }

    /// Destroys the lost peers' queue pairs whose receives are all accounted for: those the
    /// device said took their last receive (the completion queue was polled dry since, by
    /// the caller), and those lost longer ago than [`DRAIN_MAX`] (a device that never says).
    pub(super) fn reap_drained(&mut self) {
        if !self.draining.is_empty() {
            self.draining
                .retain(|d| !d.last_wqe && d.since.elapsed() < DRAIN_MAX);
        }
    }

    /// Receives held while their peer was paused, taken in order once it is resumed.
    pub(super) fn resume_held(&mut self, on: &mut dyn FnMut(Completion<'_>), n: &mut usize) {
        let ids: Vec<u32> = self
            .peers
            .iter()
            .filter(|(_, p)| !p.paused && !p.held.is_empty())
            .map(|(k, _)| *k)
            .collect();
        for id in ids {
            while let Some(a) = self
                .peers
                .get_mut(&id)
                .filter(|p| !p.paused)
                .and_then(|p| p.held.pop_front())
            {
                if let Err(e) = self.on_recv(id, a, on, n) {
                    let _ = self.rx.post(a.buf);
                    self.lose(PeerId(id), e);
                    break;
                }
            }
        }
    }
}

/// How long a lost peer's queue pair waits for the device's word that it took its last
/// receive.
const DRAIN_MAX: std::time::Duration = std::time::Duration::from_secs(2);

/// A lost peer's queue pair, in error, waiting to be destroyed.
pub(super) struct Draining {
    pub(super) qp: super::queues::Qp,
    since: std::time::Instant,
    last_wqe: bool,
}

impl Draining {
    pub(super) fn new(qp: super::queues::Qp) -> Draining {
        Draining {
            qp,
            since: std::time::Instant::now(),
            last_wqe: false,
        }
    }
}
