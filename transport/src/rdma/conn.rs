//! Connection setup of the verbs backend: listening, connecting, and the handshake of an
//! accepted connection (the peer's queue-pair address read without blocking the loop, ours
//! sent once our queue pair is ready, then the peer's "ready" byte awaited).

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mio::net::TcpListener;
use mio::Interest;
use rdma_sys as ffi;
use rustc_hash::{FxHashMap, FxHashSet};

use super::setup::{self, Hello, HEAD, HELLO_LEN};
use super::verbs::{self, Mr, Qp, LOCAL, REMOTE_WRITE};
use super::{wire, Handshake, Peer, RdmaBackend, HANDSHAKE, LISTENER};
use crate::{Mem, PeerId, Storage, TransportError};
use std::collections::VecDeque;

impl RdmaBackend {
    /// Listens on `addr` (TCP, for the queue-pair exchange); peers that connect are reported
    /// as [`crate::Completion::Connected`].
    pub fn listen(&mut self, addr: SocketAddr) -> Result<SocketAddr, TransportError> {
        let mut l = TcpListener::bind(addr)?;
        self.poll
            .registry()
            .register(&mut l, LISTENER, Interest::READABLE)?;
        let at = l.local_addr()?;
        self.listener = Some(l);
        Ok(at)
    }

    /// Peers that connect to this backend's listener may send messages of at most `max` bytes
    /// of data, and their queue pairs take no READ or WRITE (whatever key they name), until
    /// [`crate::Backend::trust`] (after their hello). Their few messages before it carry the
    /// credits they give back: with at least 8 receives a peer, none is owed by a WRITE.
    pub fn set_accepted_max_payload(&mut self, max: u64) {
        self.accepted_max = Some(max.min(self.cfg.max_message));
    }

    /// The queue pairs of peers this backend connects to from now on take no READ or WRITE
    /// until [`crate::Backend::trust`] (after the peer proved itself): what this side grants or
    /// lends is out of reach of a process that took the peer's address.
    pub fn set_connected_untrusted(&mut self) {
        self.connected_untrusted = true;
    }

    /// Connects to a listening backend at `addr`, retrying until `timeout`; the queue pair is
    /// ready to use when this returns.
    pub fn connect(
        &mut self,
        addr: SocketAddr,
        timeout: Duration,
    ) -> Result<PeerId, TransportError> {
        let mut s = crate::tcp::connect_retry(addr, timeout)?;
        s.set_nodelay(true)?;
        // The link's end is the peer's end: the kernel probes it, as a TCP backend's links,
        // so a host that dies while nothing is in flight is seen.
        crate::tcp::liveness(&s)?;
        let mut peer = self.new_peer(false)?;
        let mut setup = || -> Result<(), TransportError> {
            let ours = self.hello(&mut peer, s.local_addr()?.ip())?;
            let theirs = setup::exchange(&mut s, &ours, timeout)?;
            self.start_peer(&mut peer, &ours, &theirs)?;
            s.write_all(&[1])?;
            s.set_nonblocking(true)?;
            Ok(())
        };
        if let Err(e) = setup() {
            self.abandon(peer);
            return Err(e);
        }
        peer.sock = Some(mio::net::TcpStream::from_std(s));
        self.add_peer(peer)
    }

    /// Forgets a peer that never became one (its setup failed). Its queue pair may be up
    /// already, with the shared queue's receives in its reach: it goes to the error state and
    /// waits to be destroyed as a lost peer's does (see `lose`), not destroyed at once.
    fn abandon(&mut self, p: Peer) {
        self.starting.remove(&p.id);
        self.by_qpn.remove(&p.qp.num);
        self.retire(p.qp);
    }

    /// A queue pair and buffers for a new peer (not yet connected), one this side `accepted`
    /// or connected to, limited as the owner asked until trusted.
    fn new_peer(&mut self, accepted: bool) -> Result<Peer, TransportError> {
        if self.peers.len() + self.handshakes.len() >= self.cfg.max_peers {
            return Err(TransportError::Refused(format!(
                "more than {} RDMA peers (the completion queue is sized for them)",
                self.cfg.max_peers
            )));
        }
        // The shared queue gets this peer's share of buffers first.
        let want = self.cfg.receives * (self.peers.len() + self.starting.len() + 1);
        if want > self.rx.count() {
            setup::check_memlock(
                self.cfg.sends * self.cfg.buffer
                    + self.rx.bytes()
                    + self.cfg.receives * self.cfg.buffer,
            )?;
            self.rx.grow(&self.pd, want)?;
        }
        let cap = |inline: usize| ffi::ibv_qp_cap {
            max_send_wr: self.cfg.send_depth as u32,
            max_recv_wr: 0,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: inline as u32,
        };
        // As much inline data as the device allows, up to INLINE; read back below.
        let srq = &self.rx.srq;
        let qp = match Qp::new(&self.pd, &self.cq, srq, cap(wire::INLINE)) {
            Ok(qp) => qp,
            Err(_) => Qp::new(&self.pd, &self.cq, srq, cap(HEAD))?,
        };
        let credit = Mem::zeroed(8);
        let credit_s: Arc<dyn Storage> = credit.clone();
        let credit_mr = Mr::new(&self.pd, &credit_s, 0, 8, LOCAL | REMOTE_WRITE)?;
        let max_inline = (qp.cap.max_inline_data as usize).min(wire::INLINE);
        // Limited as the owner asked until trusted ([`crate::Backend::trust`]).
        let (max_data, remote) = match (accepted, self.accepted_max) {
            (true, Some(max)) => (max, false),
            (true, None) => (self.cfg.max_message, true),
            (false, _) => (self.cfg.max_message, !self.connected_untrusted),
        };
        let id = self.next_peer;
        self.next_peer += 1;
        self.starting.insert(id);
        // Its receives arrive on its queue pair's number (even before it is added).
        self.by_qpn.insert(qp.num, id);
        Ok(Peer {
            id,
            qp,
            credit_mr,
            _credit: credit,
            sock: None,
            their_receives: 0,
            their_buffer: 0,
            their_credit: (0, 0),
            sent: 0,
            returned: 0,
            reposted: 0,
            told: 0,
            note_owed: None,
            starved: 0,
            arrived: 0,
            posted: VecDeque::new(),
            next_seq: 1,
            inbox: VecDeque::new(),
            unread: VecDeque::new(),
            held: VecDeque::new(),
            holds: VecDeque::new(),
            next_tag: 1,
            paused: false,
            revoked: FxHashSet::default(),
            unsent: VecDeque::new(),
            lent: FxHashMap::default(),
            next_lent: 1,
            max_inline,
            max_data,
            remote,
            gid_index: 0,
            slots: FxHashMap::default(),
            free_slots: Vec::new(),
            next_slot: 1,
        })
    }

    /// Our address for `peer`, on the GID of the address the TCP link uses.
    fn hello(&self, peer: &mut Peer, local: std::net::IpAddr) -> Result<Hello, TransportError> {
        let (index, gid) = setup::choose_gid(
            &self.ctx,
            self.cfg.port,
            self.lim.link_layer,
            self.cfg.gid_index,
            local,
        )?;
        peer.gid_index = index;
        Ok(Hello {
            qpn: peer.qp.num,
            psn: setup::random_psn(),
            lid: self.lim.lid,
            mtu: self.lim.mtu,
            gid,
            receives: self.cfg.receives as u32,
            buffer: self.cfg.buffer as u32,
            credit_addr: peer.credit_mr.addr,
            credit_key: peer.credit_mr.rkey,
        })
    }

    /// Moves the queue pair to RTS towards `theirs` (its receive buffers are in the shared
    /// queue already).
    fn start_peer(
        &mut self,
        p: &mut Peer,
        ours: &Hello,
        theirs: &Hello,
    ) -> Result<(), TransportError> {
        let global = self.lim.link_layer != verbs::LINK_LAYER_IB;
        let gid_index = p.gid_index;
        p.qp.connect(&verbs::Path {
            port: self.cfg.port,
            remote_qpn: theirs.qpn,
            remote_psn: theirs.psn,
            local_psn: ours.psn,
            mtu: ours.mtu.min(theirs.mtu),
            remote_gid: theirs.gid,
            remote_lid: theirs.lid,
            gid_index,
            global,
            sl: self.cfg.service_level,
            traffic_class: self.cfg.traffic_class,
            timeout: self.cfg.timeout,
            retry: self.cfg.retry_count.min(7),
            rnr_retry: self.cfg.rnr_retry.min(6),
            remote: p.remote,
        })?;
        p.their_receives = theirs.receives;
        p.their_buffer = theirs.buffer as usize;
        p.their_credit = (theirs.credit_addr, theirs.credit_key);
        Ok(())
    }

    fn add_peer(&mut self, mut p: Peer) -> Result<PeerId, TransportError> {
        let id = p.id;
        if let Some(s) = &mut p.sock {
            let r = self.poll.registry();
            if let Err(e) = r.register(s, mio::Token(id as usize), Interest::READABLE) {
                self.abandon(p);
                return Err(e.into());
            }
        }
        self.starting.remove(&id);
        self.by_qpn.insert(p.qp.num, id);
        self.peers.insert(p);
        Ok(PeerId(id))
    }

    pub(super) fn accept_all(&mut self) -> Result<(), TransportError> {
        let Some(l) = &self.listener else {
            return Ok(());
        };
        loop {
            match l.accept() {
                Ok((mut sock, _)) => {
                    // Beyond the handshakes already waiting, or not set up: dropped at once.
                    if self.handshakes.len() >= crate::backend::MAX_PENDING
                        || sock.set_nodelay(true).is_err()
                        || crate::tcp::liveness(&sock).is_err()
                    {
                        continue;
                    }
                    let t = HANDSHAKE + self.next_handshake;
                    self.next_handshake += 1;
                    if self
                        .poll
                        .registry()
                        .register(&mut sock, mio::Token(t), Interest::READABLE)
                        .is_err()
                    {
                        continue;
                    }
                    self.handshakes.insert(
                        t,
                        Handshake {
                            sock,
                            got: Vec::new(),
                            deadline: Instant::now() + self.cfg.handshake_timeout,
                            made: None,
                        },
                    );
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionAborted => {}
                // Out of descriptors or memory: tried again shortly.
                Err(_) => {
                    self.accept_retry.failed();
                    return Ok(());
                }
            }
        }
    }

    /// Advances the handshake `t`: reads the peer's hello, answers with ours once our queue
    /// pair is ready, then waits for the peer's "ready". Returns a connected peer.
    pub(super) fn handshake(&mut self, t: usize) -> Option<PeerId> {
        let mut h = self.handshakes.remove(&t)?;
        let r = self.advance(&mut h);
        match r {
            Ok(true) => {
                let _ = self.poll.registry().deregister(&mut h.sock);
                let mut p = *h.made.take()?;
                p.sock = Some(h.sock);
                self.add_peer(p).ok()
            }
            Ok(false) if Instant::now() < h.deadline => {
                self.handshakes.insert(t, h);
                None
            }
            // Failed or too slow: the connection is dropped, and costs nothing more.
            _ => {
                if let Some(p) = h.made.take() {
                    self.abandon(*p);
                }
                let _ = self.poll.registry().deregister(&mut h.sock);
                None
            }
        }
    }

    /// Ends the handshake of starting peer `peer` (it broke the protocol), if it has one.
    pub(super) fn drop_handshake_of(&mut self, peer: u32) {
        let t = self
            .handshakes
            .iter()
            .find_map(|(t, h)| h.made.as_ref().is_some_and(|p| p.id == peer).then_some(*t));
        if let Some(mut h) = t.and_then(|t| self.handshakes.remove(&t)) {
            let _ = self.poll.registry().deregister(&mut h.sock);
            if let Some(p) = h.made.take() {
                self.abandon(*p);
            }
        }
    }

    fn advance(&mut self, h: &mut Handshake) -> Result<bool, TransportError> {
        // The peer's hello, then (after ours went) its one "ready" byte: no more is ever read
        // here, however much it sends (the rest is for the deadline to end).
        let mut buf = [0u8; HELLO_LEN];
        loop {
            let want = match h.made {
                None => HELLO_LEN.saturating_sub(h.got.len()),
                Some(_) => 1usize.saturating_sub(h.got.len()),
            };
            if want == 0 {
                break;
            }
            match h.sock.read(&mut buf[..want]) {
                Ok(0) => return Err(TransportError::Closed),
                Ok(n) => h.got.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
        if h.made.is_none() && h.got.len() >= HELLO_LEN {
            let theirs = Hello::decode(h.got[..HELLO_LEN].try_into().unwrap_or(&[0; HELLO_LEN]))?;
            // Our queue pair is ready before our address goes out.
            let mut p = self.new_peer(true)?;
            let mut setup = || -> Result<(), TransportError> {
                let ours = self.hello(&mut p, h.sock.local_addr()?.ip())?;
                self.start_peer(&mut p, &ours, &theirs)?;
                // A new connection's buffer takes these few bytes at once.
                h.sock.write_all(&ours.encode())?;
                Ok(())
            };
            if let Err(e) = setup() {
                self.abandon(p);
                return Err(e);
            }
            h.made = Some(Box::new(p));
            h.got.drain(..HELLO_LEN);
        }
        Ok(h.made.is_some() && !h.got.is_empty())
    }

    pub(super) fn expire_handshakes(&mut self) {
        let now = Instant::now();
        let old: Vec<usize> = self
            .handshakes
            .iter()
            .filter(|(_, h)| h.deadline <= now)
            .map(|(t, _)| *t)
            .collect();
        for t in old {
            if let Some(mut h) = self.handshakes.remove(&t) {
                let _ = self.poll.registry().deregister(&mut h.sock);
                if let Some(p) = h.made.take() {
                    self.abandon(*p);
                }
            }
        }
    }
}
