//! RDMA verbs as a [`Backend`] (the `rdma` feature): reliable-connected queue pairs, set up over
//! a TCP connection that then stays open to tell when the peer is gone.
//!
//! - **Messages** are SENDs from the backend's registered send buffers into the peer's receive
//!   buffers, a 48-byte header first. The receiver gives credits back (the count of buffers it
//!   posted again) in every header it sends and, when enough are owed, by an RDMA WRITE of the
//!   count into a word the sender registered for it: a sender never sends into a buffer that
//!   is not posted, so there is no receiver-not-ready retry in steady state, and a full link
//!   answers "would block". Data that fits goes in the buffer after the body; larger data is
//!   read by the receiver (RDMA READ) from the sender's registered memory, and the receiver's
//!   RELEASE is the sender's completion.
//! - **Puts** are RDMA WRITEs (split at the device's largest message) into the range the peer
//!   granted, followed on the same queue pair by a SEND that names the grant, offset, length
//!   and the caller's 32-bit immediate; RC ordering places the data before the notice. (A
//!   WRITE_WITH_IMM's 32 bits cannot carry both the grant and the caller's immediate.)
//! - **Grants** register the granted range on its own, with remote write access: nothing else
//!   is ever remotely writable. A revoke asks the peer, whose answer comes after every write it
//!   posted before (RC order); a lost peer's queue pair is moved to the error state first. Then
//!   the registration goes, and only then does the revoke complete.
//! - **Registration** of memory for sends and puts is cached by storage identity (the `Arc`
//!   the region holds, checked alive through a weak reference), never by address alone.
//! - **Completions**: one completion queue on a channel whose descriptor, with the listener's
//!   and the peers' sockets and the device's asynchronous events, is what a loop sleeps on.

mod complete;
mod ops;
mod setup;
mod verbs;

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::ops::Range;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use mio::net::TcpListener;
use mio::unix::SourceFd;
use mio::{Events, Interest, Poll};
use rdma_sys as ffi;
use rustc_hash::{FxHashMap, FxHashSet};

use crate::backend::{fresh_id, Place};
use crate::{Access, Mem, PeerId, Region, RemoteRegion, Storage, Token, TransportError};
pub use setup::RdmaConfig;
use setup::{Hello, HEAD, HELLO_LEN};
use verbs::{Channel, Context, Cq, Mr, Pd, Qp, LOCAL, REMOTE_READ, REMOTE_WRITE};

/// The [`RemoteRegion`] kind of a grant of this backend.
const KIND_RDMA: u32 = 3;
const LISTENER: mio::Token = mio::Token(usize::MAX);
const CHANNEL: mio::Token = mio::Token(usize::MAX - 1);
const ASYNC: mio::Token = mio::Token(usize::MAX - 2);
/// Tokens of connections still in their handshake start here.
const HANDSHAKE: usize = 1 << 40;

/// What a device and port offer, read once.
#[derive(Clone, Copy, Debug)]
struct Limits {
    max_msg: usize,
    max_qp_wr: usize,
    max_cqe: usize,
    link_layer: u8,
    lid: u16,
    mtu: u32,
}

/// A handshake of an accepted connection: the peer's hello is read without blocking the loop.
struct Handshake {
    sock: mio::net::TcpStream,
    got: Vec<u8>,
    deadline: Instant,
    /// After our hello went: the peer's "ready" byte is awaited.
    made: Option<Box<Peer>>,
}

/// One posted send work request, in posting order.
struct Posted {
    seq: u64,
    /// A send buffer to free when it completes.
    slot: Option<u32>,
    token: Option<Token>,
    /// An RDMA READ of a message's data: its inbox entry.
    read: Option<u64>,
}

/// A message or put received and not yet handed over (paused peer, or data still being read).
enum Inbound {
    Msg {
        body: Vec<u8>,
        data: Option<Arc<Mem>>,
        /// Reads of the data still in flight.
        reads: usize,
        tag: u64,
        /// The sender's number for data it lent (its RELEASE is due when this is delivered).
        release: Option<u64>,
        /// The registration the data is read into.
        mr: Option<Mr>,
    },
    Put {
        grant: u64,
        offset: usize,
        len: usize,
        imm: u32,
    },
}

pub(crate) struct Peer {
    /// Its number (in the work request ids of its receives).
    id: u32,
    // Dropped first: the queue pair goes before the memory its requests named.
    qp: Qp,
    recv_mr: Mr,
    credit_mr: Mr,
    _recv: Arc<Mem>,
    _credit: Arc<Mem>,
    /// The TCP link of the setup, kept open: its end is the peer's end.
    sock: Option<mio::net::TcpStream>,
    /// The peer's receive buffers and their size, and its credit word.
    their_receives: u32,
    their_buffer: usize,
    their_credit: (u64, u32),
    /// Buffers this side used, and the peer's count of buffers it posted again (cumulative).
    sent: u64,
    returned: u64,
    /// Buffers posted again and the count last told to the peer.
    reposted: u64,
    told: u64,
    posted: VecDeque<Posted>,
    next_seq: u64,
    inbox: VecDeque<Inbound>,
    next_tag: u64,
    paused: bool,
    /// Grants the peer revoked: never put into again.
    revoked: FxHashSet<u64>,
    /// Receives taken while paused: handled, in order, once resumed (their buffers are not
    /// posted again meanwhile, so the peer runs out of credits: backpressure).
    held: VecDeque<(u32, usize)>,
    /// Sources of puts, held alive and registered until the put's last request completes.
    holds: VecDeque<(u64, Region, Arc<Mr>)>,
    /// Control messages waiting for a credit or room.
    unsent: VecDeque<[u8; HEAD]>,
    /// Our messages whose data the peer reads: completed by its RELEASE.
    lent: FxHashMap<u64, (Token, Region)>,
    next_lent: u64,
    max_inline: usize,
    /// The local GID's index, chosen for the address the TCP link uses.
    gid_index: u32,
}

/// A registration in the cache: the storage it was made for (alive or not), and it.
type Cached = (Weak<dyn Storage>, Arc<Mr>);

struct Grant {
    peer: PeerId,
    len: usize,
    _mr: Mr,
    /// The region granted, held alive with the registration.
    _region: Region,
    revoking: Option<Token>,
}

/// RDMA verbs as a [`crate::Backend`]. See the module documentation.
pub struct RdmaBackend {
    id: u64,
    cfg: RdmaConfig,
    lim: Limits,
    // Peers (their queue pairs) go before the completion queue, the PD and the context.
    peers: FxHashMap<u32, Peer>,
    handshakes: FxHashMap<usize, Handshake>,
    by_qpn: FxHashMap<u32, u32>,
    grants: FxHashMap<u64, Grant>,
    cache: FxHashMap<(usize, usize), Cached>,
    send_mr: Mr,
    send_mem: Arc<Mem>,
    free_sends: Vec<u32>,
    cq: Cq,
    pd: Arc<Pd>,
    ctx: Arc<Context>,
    poll: Poll,
    events: Events,
    listener: Option<TcpListener>,
    next_peer: u32,
    next_handshake: usize,
    next_grant: u64,
    done: VecDeque<(Token, Option<TransportError>)>,
    lost: VecDeque<(PeerId, TransportError)>,
    armed: bool,
    registrations: u64,
    /// Progress calls: the event descriptors are looked at on some of them.
    calls: u32,
    /// Work completions found by the look after arming, or of peers still starting.
    early: Vec<ops::OwnedWc>,
    /// Peers whose queue pair is up but whose handshake has not ended.
    starting: FxHashSet<u32>,
}

fn set_nonblocking(fd: i32) -> Result<(), TransportError> {
    // SAFETY: fcntl on a descriptor the context owns, which outlives the call.
    let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    if fl < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK) } < 0 {
        return Err(verbs::os_err("fcntl O_NONBLOCK"));
    }
    Ok(())
}

/// The names of this host's RDMA devices, or why there are none (no device, no driver).
pub fn devices() -> Result<Vec<String>, TransportError> {
    verbs::device_names()
}

impl RdmaBackend {
    /// Opens the device `cfg` names (or the first), checks its port is active, and registers
    /// the send buffers. Fails cleanly on a host without RDMA.
    pub fn new(cfg: RdmaConfig) -> Result<RdmaBackend, TransportError> {
        let ctx = Context::open(cfg.device.as_deref())?;
        let dev = ctx.query_device()?;
        let port = ctx.query_port(cfg.port)?;
        if port.state != ffi::ibv_port_state::IBV_PORT_ACTIVE {
            return Err(TransportError::Rdma(format!(
                "{} port {} is not active (state {})",
                ctx.name, cfg.port, port.state
            )));
        }
        let lim = Limits {
            max_msg: port.max_msg_sz.max(4096) as usize,
            max_qp_wr: dev.max_qp_wr.max(16) as usize,
            max_cqe: dev.max_cqe.max(64) as usize,
            link_layer: port.link_layer,
            lid: port.lid,
            mtu: port.active_mtu,
        };
        let mut cfg = cfg;
        cfg.send_depth = cfg.send_depth.clamp(16, lim.max_qp_wr);
        cfg.receives = cfg.receives.clamp(8, lim.max_qp_wr.min(4096));
        cfg.buffer = cfg.buffer.clamp(HEAD + 256, lim.max_msg);
        let per_peer = cfg.send_depth + cfg.receives;
        cfg.max_peers = cfg.max_peers.clamp(1, (lim.max_cqe / per_peer).max(1));
        setup::check_memlock(cfg.sends * cfg.buffer + cfg.receives * cfg.buffer)?;
        let pd = Pd::new(&ctx)?;
        let chan = Channel::new(&ctx)?;
        set_nonblocking(chan.fd())?;
        set_nonblocking(ctx.async_fd())?;
        let cq = Cq::new(&ctx, &chan, (cfg.max_peers * per_peer) as i32)?;
        let send_mem = Mem::zeroed(cfg.sends * cfg.buffer);
        let as_storage: Arc<dyn Storage> = send_mem.clone();
        let send_mr = Mr::new(&pd, &as_storage, 0, send_mem.len(), LOCAL)?;
        let poll = Poll::new()?;
        poll.registry()
            .register(&mut SourceFd(&chan.fd()), CHANNEL, Interest::READABLE)?;
        poll.registry()
            .register(&mut SourceFd(&ctx.async_fd()), ASYNC, Interest::READABLE)?;
        let mut b = RdmaBackend {
            id: fresh_id(),
            free_sends: (0..cfg.sends as u32).rev().collect(),
            cfg,
            lim,
            peers: FxHashMap::default(),
            handshakes: FxHashMap::default(),
            by_qpn: FxHashMap::default(),
            grants: FxHashMap::default(),
            cache: FxHashMap::default(),
            send_mr,
            send_mem,
            cq,
            pd,
            ctx,
            poll,
            events: Events::with_capacity(64),
            listener: None,
            next_peer: 0,
            next_handshake: 0,
            next_grant: 1,
            done: VecDeque::new(),
            lost: VecDeque::new(),
            armed: false,
            registrations: 0,
            calls: 0,
            early: Vec::new(),
            starting: FxHashSet::default(),
        };
        b.cq.arm()?;
        Ok(b)
    }

    /// The device in use.
    pub fn device(&self) -> &str {
        &self.ctx.name
    }

    /// The addresses this device's port answers on (its RoCE v2 GIDs): listen and connect
    /// on one of them so the TCP link and the queue pair take the same path.
    pub fn addresses(&self) -> Vec<std::net::IpAddr> {
        setup::addresses(&self.ctx, self.cfg.port)
    }

    /// The largest message the device takes (puts and reads are split at it).
    pub fn max_message(&self) -> usize {
        self.lim.max_msg
    }

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

    /// Connects to a listening backend at `addr`, retrying until `timeout`; the queue pair is
    /// ready to use when this returns.
    pub fn connect(
        &mut self,
        addr: SocketAddr,
        timeout: Duration,
    ) -> Result<PeerId, TransportError> {
        let mut s = crate::tcp::connect_retry(addr, timeout)?;
        s.set_nodelay(true)?;
        let mut peer = self.new_peer()?;
        let ours = self.hello(&mut peer, s.local_addr()?.ip())?;
        let theirs = setup::exchange(&mut s, &ours, timeout)?;
        self.start_peer(&mut peer, &ours, &theirs)?;
        s.write_all(&[1])?;
        s.set_nonblocking(true)?;
        peer.sock = Some(mio::net::TcpStream::from_std(s));
        self.add_peer(peer)
    }

    /// A queue pair and buffers for a new peer (not yet connected).
    fn new_peer(&mut self) -> Result<Peer, TransportError> {
        if self.peers.len() + self.handshakes.len() >= self.cfg.max_peers {
            return Err(TransportError::Refused(format!(
                "more than {} RDMA peers (the completion queue is sized for them)",
                self.cfg.max_peers
            )));
        }
        let cap = ffi::ibv_qp_cap {
            max_send_wr: self.cfg.send_depth as u32,
            max_recv_wr: self.cfg.receives as u32,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: HEAD as u32,
        };
        let qp = Qp::new(&self.pd, &self.cq, cap)?;
        let recv = Mem::zeroed(self.cfg.receives * self.cfg.buffer);
        let recv_s: Arc<dyn Storage> = recv.clone();
        let recv_mr = Mr::new(&self.pd, &recv_s, 0, recv.len(), LOCAL)?;
        let credit = Mem::zeroed(8);
        let credit_s: Arc<dyn Storage> = credit.clone();
        let credit_mr = Mr::new(&self.pd, &credit_s, 0, 8, LOCAL | REMOTE_WRITE)?;
        let max_inline = qp.cap.max_inline_data as usize;
        let id = self.next_peer;
        self.next_peer += 1;
        self.starting.insert(id);
        Ok(Peer {
            id,
            qp,
            recv_mr,
            credit_mr,
            _recv: recv,
            _credit: credit,
            sock: None,
            their_receives: 0,
            their_buffer: 0,
            their_credit: (0, 0),
            sent: 0,
            returned: 0,
            reposted: 0,
            told: 0,
            posted: VecDeque::new(),
            next_seq: 1,
            inbox: VecDeque::new(),
            held: VecDeque::new(),
            holds: VecDeque::new(),
            next_tag: 1,
            paused: false,
            revoked: FxHashSet::default(),
            unsent: VecDeque::new(),
            lent: FxHashMap::default(),
            next_lent: 1,
            max_inline,
            gid_index: 0,
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

    /// Moves the queue pair to RTS towards `theirs` and posts every receive buffer.
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
        })?;
        p.their_receives = theirs.receives;
        p.their_buffer = theirs.buffer as usize;
        p.their_credit = (theirs.credit_addr, theirs.credit_key);
        for i in 0..self.cfg.receives {
            ops::post_receive(p, i as u32, self.cfg.buffer)?;
        }
        Ok(())
    }

    fn add_peer(&mut self, mut p: Peer) -> Result<PeerId, TransportError> {
        let id = p.id;
        self.starting.remove(&id);
        if let Some(s) = &mut p.sock {
            self.poll
                .registry()
                .register(s, mio::Token(id as usize), Interest::READABLE)?;
        }
        self.by_qpn.insert(p.qp.num, id);
        self.peers.insert(id, p);
        Ok(PeerId(id))
    }

    /// The registration of `r`'s storage: cached by the storage's identity (a live `Arc`
    /// with the same address and length), registered anew when the cached one is stale.
    fn mr_of(&mut self, r: &Region) -> Result<Arc<Mr>, TransportError> {
        r.check_owner(self.id)?;
        let key = (r.mem.ptr() as usize, r.len());
        if let Some((w, mr)) = self.cache.get(&key) {
            if w.upgrade()
                .is_some_and(|m| Arc::as_ptr(&m).cast::<u8>() == Arc::as_ptr(&r.mem).cast::<u8>())
            {
                return Ok(mr.clone());
            }
        }
        self.registrations += 1;
        if self.registrations % 64 == 0 {
            // Registrations of storage that is gone are dropped now and then.
            self.cache.retain(|_, (w, _)| w.strong_count() > 0);
        }
        let mr = Arc::new(Mr::new_unheld(
            &self.pd,
            &r.mem,
            0,
            r.len(),
            LOCAL | REMOTE_READ,
        )?);
        self.cache.insert(key, (Arc::downgrade(&r.mem), mr.clone()));
        Ok(mr)
    }

    /// Registrations made so far (a cache hit makes none): for tests of the cache.
    pub fn registrations(&self) -> u64 {
        self.registrations
    }

    fn peer(&mut self, peer: PeerId) -> Result<&mut Peer, TransportError> {
        self.peers
            .get_mut(&peer.0)
            .ok_or_else(|| TransportError::PeerLost(format!("{peer} is not connected")))
    }

    /// Drops a peer: its queue pair moves to the error state (no write of it can land after
    /// this), its operations fail, its grants are fenced.
    fn lose(&mut self, peer: PeerId, error: TransportError) {
        let Some(p) = self.peers.remove(&peer.0) else {
            return;
        };
        let _ = p.qp.to_error();
        self.by_qpn.remove(&p.qp.num);
        if let Some(mut s) = p.sock {
            let _ = self.poll.registry().deregister(&mut s);
        }
        for w in p.posted {
            if let Some(s) = w.slot {
                self.free_sends.push(s);
            }
            if let Some(t) = w.token {
                self.done
                    .push_back((t, Some(TransportError::PeerLost(error.to_string()))));
            }
        }
        for (_, (t, _)) in p.lent {
            self.done
                .push_back((t, Some(TransportError::PeerLost(error.to_string()))));
        }
        // The queue pair is in error: the peer can write none of its grants any more.
        let gone: Vec<u64> = self
            .grants
            .iter()
            .filter(|(_, g)| g.peer == peer)
            .map(|(k, _)| *k)
            .collect();
        for k in gone {
            if let Some(g) = self.grants.remove(&k) {
                if let Some(t) = g.revoking {
                    self.done.push_back((t, None));
                }
            }
        }
        self.lost.push_back((peer, error));
    }

    fn accept_all(&mut self) -> Result<(), TransportError> {
        let Some(l) = &self.listener else {
            return Ok(());
        };
        loop {
            match l.accept() {
                Ok((mut sock, _)) => {
                    let t = HANDSHAKE + self.next_handshake;
                    self.next_handshake += 1;
                    sock.set_nodelay(true)?;
                    self.poll
                        .registry()
                        .register(&mut sock, mio::Token(t), Interest::READABLE)?;
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
                // A refused accept (out of descriptors) is tried again at the next readiness.
                Err(_) => return Ok(()),
            }
        }
    }

    /// Advances the handshake `t`: reads the peer's hello, answers with ours once our queue
    /// pair is ready, then waits for the peer's "ready". Returns a connected peer.
    fn handshake(&mut self, t: usize) -> Option<PeerId> {
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
                if let Some(p) = &h.made {
                    self.starting.remove(&p.id);
                }
                let _ = self.poll.registry().deregister(&mut h.sock);
                None
            }
        }
    }

    fn advance(&mut self, h: &mut Handshake) -> Result<bool, TransportError> {
        // Our hello, then the peer's one "ready" byte: no more is ever read here.
        let mut buf = [0u8; HELLO_LEN + 1];
        loop {
            match h
                .sock
                .read(&mut buf[..HELLO_LEN + 1 - h.got.len().min(HELLO_LEN)])
            {
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
            let mut p = self.new_peer()?;
            let ours = self.hello(&mut p, h.sock.local_addr()?.ip())?;
            self.start_peer(&mut p, &ours, &theirs)?;
            // A new connection's buffer takes these few bytes at once.
            h.sock.write_all(&ours.encode())?;
            h.made = Some(Box::new(p));
            h.got.drain(..HELLO_LEN);
        }
        Ok(h.made.is_some() && !h.got.is_empty())
    }

    fn expire_handshakes(&mut self) {
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
            }
        }
    }

    fn fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the epoll descriptor lives as long as `self.poll`, which outlives the borrow.
        unsafe { BorrowedFd::borrow_raw(self.poll.as_raw_fd()) }
    }
}

impl Drop for RdmaBackend {
    fn drop(&mut self) {
        // Queue pairs go to the error state first, so no peer writes anything while the
        // registrations are dropped.
        for p in self.peers.values() {
            let _ = p.qp.to_error();
        }
        self.peers.clear();
        self.grants.clear();
    }
}

impl RdmaBackend {
    fn place(&self) -> Place {
        Place::Local
    }

    /// New memory registered with this backend.
    fn alloc_mem(&mut self, len: usize, _access: Access) -> Result<Region, TransportError> {
        let r = Region::new(self.id, Mem::zeroed(len), self.place());
        self.mr_of(&r)?;
        Ok(r)
    }

    #[allow(clippy::too_many_arguments)]
    fn grant_range(
        &mut self,
        peer: PeerId,
        r: &Region,
        range: Range<usize>,
    ) -> Result<RemoteRegion, TransportError> {
        r.check_owner(self.id)?;
        r.check_range(&range)?;
        self.peer(peer)?;
        let mr = Mr::new(
            &self.pd,
            &r.mem,
            range.start,
            range.len(),
            LOCAL | REMOTE_WRITE,
        )?;
        let id = self.next_grant;
        self.next_grant += 1;
        let rr = RemoteRegion {
            kind: KIND_RDMA,
            key: mr.rkey,
            id,
            addr: mr.addr,
            len: range.len() as u64,
        };
        self.grants.insert(
            id,
            Grant {
                peer,
                len: range.len(),
                _mr: mr,
                _region: r.clone(),
                revoking: None,
            },
        );
        Ok(rr)
    }
}
