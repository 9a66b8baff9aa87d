//! RDMA verbs as a [`crate::Backend`] (the `rdma` feature): reliable-connected queue pairs, set up over
//! a TCP connection that then stays open to tell when the peer is gone.
//!
//! - **Messages** are SENDs from the backend's registered send buffers into receive buffers
//!   of the peer, a 48-byte header first. Receive buffers are one pool per backend, posted to a
//!   shared receive queue (a chunk of buffers for each peer's credits, made as peers come); a
//!   buffer goes back to the queue as soon as what arrived in it was handled. The receiver gives
//!   credits back (the count of buffers it posted again for that peer) in every header it sends
//!   and, when enough are owed, by an RDMA WRITE of the count into a word the sender registered
//!   for it: a sender never uses more buffers than it was credited, and the queue always holds
//!   at least as many as all peers were credited, so there is no receiver-not-ready NAK in
//!   steady state, and a full link answers "would block". Data that fits goes in the buffer
//!   after the body; larger data is read by the receiver (RDMA READ) from the sender's
//!   registered memory, and the receiver's RELEASE is the sender's completion.
//! - **Puts.** A put that fills its grant (how the store puts: a push into its receive slot, a
//!   pull's answer into its output) is one RDMA WRITE_WITH_IMM, split at the device's largest
//!   message with the last piece carrying the immediate: its high bits are the grant's slot
//!   (a number per peer, in the grant's handle), its low [`crate::IMM_BITS`] the caller's. It
//!   takes a receive (a credit) at the target, like a SEND. Other puts are RDMA WRITEs and a
//!   SEND naming the grant, offset, length and immediate (RC ordering places the data before
//!   the notice), or, when small, one SEND carrying the data.
//! - **Grants** register the granted range on its own, with remote write access: nothing else
//!   is ever remotely writable but each peer's credit word. A revoke asks the peer, whose
//!   answer comes after every write it posted before (RC order); a lost peer's queue pair is
//!   moved to the error state first. Then the registration goes, and only then does the
//!   revoke complete. Where the owner asks it
//!   (`set_accepted_max_payload`, `set_connected_untrusted`), a peer's queue pair takes no
//!   READ or WRITE at all until the owner trusts it: every registration shares one protection
//!   domain, and a peer that has not proved itself must not reach one by a guessed key.
//! - **Registration** of memory for sends and puts is cached by storage identity (the `Arc`
//!   the region holds, checked alive through a weak reference), never by address alone.
//!   Storage that names a dma-buf (device memory) is registered through it where the device
//!   takes it (`ibv_reg_dmabuf_mr`), and by its host bytes otherwise.
//! - **Completions**: one completion queue on a channel whose descriptor, with the listener's
//!   and the peers' sockets and the device's asynchronous events, is what a loop sleeps on.

mod complete;
mod conn;
mod events;
mod ops;
mod post;
mod queues;
mod regs;
mod setup;
mod verbs;
mod wire;

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::{Arc, Weak};
use std::time::Instant;

use mio::net::TcpListener;
use mio::unix::SourceFd;
use mio::{Events, Interest, Poll};
use rdma_sys as ffi;
use rustc_hash::{FxHashMap, FxHashSet};

use crate::backend::fresh_id;
use crate::{Mem, PeerId, Region, Storage, Token, TransportError};
pub use setup::RdmaConfig;
use setup::HEAD;
use verbs::{Channel, Context, Cq, Mr, Pd, Qp, Srq, LOCAL};

/// The [`RemoteRegion`] kind of a grant of this backend.
const KIND_RDMA: u32 = 3;
const LISTENER: mio::Token = mio::Token(usize::MAX);
const CHANNEL: mio::Token = mio::Token(usize::MAX - 1);
const ASYNC: mio::Token = mio::Token(usize::MAX - 2);
const TIMER: mio::Token = mio::Token(usize::MAX - 3);
/// Tokens of connections still in their handshake start here.
const HANDSHAKE: usize = 1 << 40;
/// Grants a peer may say it revoked (ids kept so that nothing is written there again), and
/// control answers waiting for its credits: a peer past either breaks the protocol.
const REVOKED_MAX: usize = 1 << 16;
const UNSENT_MAX: usize = 1 << 12;
/// A grant's slot is in the bits of its id from here (and in a WRITE_WITH_IMM's immediate
/// above the caller's [`crate::IMM_BITS`]).
const SLOT_SHIFT: u32 = 48;
/// Slots per peer: a grant beyond them is notified by a message.
const SLOTS: u32 = (1 << (32 - crate::IMM_BITS)) - 1;

/// What a device and port offer, read once.
#[derive(Clone, Copy, Debug)]
struct Limits {
    max_msg: usize,
    max_qp_wr: usize,
    max_cqe: usize,
    max_srq_wr: usize,
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

/// An RDMA READ of a piece of a message's data, from the sender's memory into ours.
struct Read {
    /// The message it is for (its inbox entry's tag).
    tag: u64,
    /// Where it lands: address and key of our registration, and length.
    to: u64,
    lkey: u32,
    len: u32,
    /// Where it reads from in the sender's memory.
    from: u64,
    rkey: u32,
}

pub(crate) struct Peer {
    /// Its number (in the work request ids of its receives).
    id: u32,
    // Dropped first: the queue pair goes before the memory its requests named.
    qp: Qp,
    credit_mr: Mr,
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
    /// Since when a count was told by a plain WRITE, which wakes nobody, for want of a credit
    /// for a note (a WRITE_WITH_IMM): the note follows once there is one.
    note_owed: Option<std::time::Instant>,
    /// The work requests a send or put needed when it was told to wait for room (0: none).
    /// While so, a sleep looks at the credit word first (a count written by a plain WRITE
    /// wakes nobody), and does not happen if the room is there: it came back while this side
    /// was busy, and nothing is left to wake it.
    starved: usize,
    /// Buffers it took: never more than it was credited (its first receives and every one
    /// posted again), or it breaks the protocol and would starve the others.
    arrived: u64,
    posted: VecDeque<Posted>,
    next_seq: u64,
    inbox: VecDeque<Inbound>,
    /// Reads of messages' data not yet posted for want of send-queue room: posted, in order,
    /// as completions free it (a read takes room as a send does).
    unread: VecDeque<Read>,
    next_tag: u64,
    paused: bool,
    /// Grants the peer revoked: never put into again.
    revoked: FxHashSet<u64>,
    /// Receives taken while paused: handled, in order, once resumed (their buffers are not
    /// posted again meanwhile, so the peer runs out of credits: backpressure).
    held: VecDeque<Arrival>,
    /// Sources of puts, held alive and registered until the put's last request completes.
    holds: VecDeque<(u64, Region, Arc<Mr>)>,
    /// Control messages waiting for a credit or room.
    unsent: VecDeque<[u8; HEAD]>,
    /// Our messages whose data the peer reads: completed by its RELEASE.
    lent: FxHashMap<u64, (Token, Region)>,
    next_lent: u64,
    max_inline: usize,
    /// The most data a message of its may bring, and whether its queue pair takes READs and
    /// WRITEs: less, and no, for a peer not yet trusted ([`crate::Backend::trust`]).
    max_data: u64,
    remote: bool,
    /// The local GID's index, chosen for the address the TCP link uses.
    gid_index: u32,
    /// This side's grants to the peer by their slot (the number a WRITE_WITH_IMM's immediate
    /// names them by), free slots, and the next never used.
    slots: FxHashMap<u32, u64>,
    free_slots: Vec<u32>,
    next_slot: u32,
}

/// A receive completion: the buffer it took, the bytes, and a WRITE_WITH_IMM's immediate.
#[derive(Clone, Copy)]
pub(crate) struct Arrival {
    buf: u32,
    got: usize,
    imm: Option<u32>,
}

/// The connected peers, by their number: a few dozen at most, kept in a vector and found by a
/// scan, which costs less than hashing on every completion.
#[derive(Default)]
struct Peers(Vec<Peer>);

impl Peers {
    fn get(&self, id: &u32) -> Option<&Peer> {
        self.0.iter().find(|p| p.id == *id)
    }

    fn get_mut(&mut self, id: &u32) -> Option<&mut Peer> {
        self.0.iter_mut().find(|p| p.id == *id)
    }

    fn contains_key(&self, id: &u32) -> bool {
        self.get(id).is_some()
    }

    fn insert(&mut self, p: Peer) {
        self.0.push(p);
    }

    fn remove(&mut self, id: &u32) -> Option<Peer> {
        let i = self.0.iter().position(|p| p.id == *id)?;
        Some(self.0.swap_remove(i))
    }

    fn iter(&self) -> impl Iterator<Item = (&u32, &Peer)> {
        self.0.iter().map(|p| (&p.id, p))
    }

    fn keys(&self) -> impl Iterator<Item = &u32> {
        self.0.iter().map(|p| &p.id)
    }

    fn values(&self) -> impl Iterator<Item = &Peer> {
        self.0.iter()
    }

    fn values_mut(&mut self) -> impl Iterator<Item = &mut Peer> {
        self.0.iter_mut()
    }

    fn len(&self) -> usize {
        self.0.len()
    }

    fn clear(&mut self) {
        self.0.clear();
    }
}

/// A registration in the cache: the storage it was made for (alive or not), and it.
type Cached = (Weak<dyn Storage>, Arc<Mr>);

struct Grant {
    peer: PeerId,
    /// Its slot with the peer (0: none, puts into it are notified by a message).
    slot: u32,
    /// Where the granted range begins in `region`, and its length.
    start: usize,
    len: usize,
    /// Its registration; none for an empty range (nothing to write, and an empty region's
    /// address may be no memory at all).
    _mr: Option<Mr>,
    /// The region granted, held alive with the registration.
    region: Region,
    revoking: Option<Token>,
}

/// RDMA verbs as a [`crate::Backend`]. See the module documentation.
pub struct RdmaBackend {
    id: u64,
    cfg: RdmaConfig,
    lim: Limits,
    // Peers (their queue pairs), and lost peers' queue pairs, go before the completion
    // queue, the PD and the context.
    peers: Peers,
    /// Lost peers' queue pairs, in error, kept until the completions of the receives they
    /// took from the shared queue have been polled: destroying a queue pair takes its
    /// completions out of the completion queue (mlx5 does), and their buffers would never be
    /// posted again.
    draining: Vec<events::Draining>,
    /// The receive buffers of all peers (after them: their queue pairs use its queue).
    rx: wire::Receives,
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
    /// Wakes a sleep now and then while a note is owed ([`NOTE_POLL`]).
    timer: std::os::fd::OwnedFd,
    listener: Option<TcpListener>,
    next_peer: u32,
    next_handshake: usize,
    next_grant: u64,
    done: VecDeque<(Token, Option<TransportError>)>,
    lost: VecDeque<(PeerId, TransportError)>,
    armed: bool,
    registrations: u64,
    /// Registrations of storage that names a dma-buf: tried, taken by the device, and why the
    /// last refused one was.
    dmabuf: (u64, u64, Option<String>),
    /// Progress calls, and when the event descriptors (listener, TCP links, device events)
    /// were last looked at: a busy loop looks every [`EVENTS_EVERY`], not on every call (each
    /// look is a system call, which the completion path does not need).
    calls: u32,
    last_events: std::time::Instant,
    /// Work completions found by the look after arming, or of peers still starting.
    early: ops::Early,
    /// Where a poll of the completion queue puts what it found.
    wcs: Vec<ffi::ibv_wc>,
    /// Peers whose queue pair is up but whose handshake has not ended.
    starting: FxHashSet<u32>,
    /// Peers whose TCP link reached its end: lost once what they sent before it is delivered.
    ended: Vec<u32>,
    accept_retry: crate::backend::AcceptRetry,
    /// The data limit of accepted peers until trusted (none: they are trusted at once), and
    /// whether peers connected to are trusted only when told.
    accepted_max: Option<u64>,
    connected_untrusted: bool,
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
            max_srq_wr: dev.max_srq_wr.max(0) as usize,
            link_layer: port.link_layer,
            lid: port.lid,
            mtu: port.active_mtu,
        };
        let mut cfg = cfg;
        cfg.send_depth = cfg.send_depth.clamp(16, lim.max_qp_wr);
        cfg.receives = cfg.receives.clamp(8, lim.max_qp_wr.min(4096));
        cfg.buffer = cfg.buffer.clamp(HEAD + 256, lim.max_msg);
        if lim.max_srq_wr < cfg.receives {
            return Err(TransportError::Rdma(format!(
                "{} has no shared receive queue of {} receives (max_srq_wr {})",
                ctx.name, cfg.receives, lim.max_srq_wr
            )));
        }
        let per_peer = cfg.send_depth + cfg.receives;
        cfg.max_peers = cfg
            .max_peers
            .clamp(1, (lim.max_cqe / per_peer).max(1))
            .min(lim.max_srq_wr / cfg.receives);
        setup::check_memlock(cfg.sends * cfg.buffer + cfg.receives * cfg.buffer)?;
        let pd = Pd::new(&ctx)?;
        let srq = Srq::new(&pd, (cfg.max_peers * cfg.receives) as u32)?;
        let chan = Channel::new(&ctx)?;
        set_nonblocking(chan.fd())?;
        set_nonblocking(ctx.async_fd())?;
        let cq = Cq::new(&ctx, &chan, (cfg.max_peers * per_peer) as i32)?;
        let send_mem = Mem::zeroed(cfg.sends * cfg.buffer);
        let as_storage: Arc<dyn Storage> = send_mem.clone();
        let send_mr = Mr::new(&pd, &as_storage, 0, send_mem.len(), LOCAL)?;
        let rx = wire::Receives::new(srq, cfg.receives, cfg.buffer);
        let poll = Poll::new()?;
        poll.registry()
            .register(&mut SourceFd(&chan.fd()), CHANNEL, Interest::READABLE)?;
        poll.registry()
            .register(&mut SourceFd(&ctx.async_fd()), ASYNC, Interest::READABLE)?;
        use rustix::time::{timerfd_create, TimerfdClockId, TimerfdFlags};
        let timer = timerfd_create(
            TimerfdClockId::Monotonic,
            TimerfdFlags::NONBLOCK | TimerfdFlags::CLOEXEC,
        )
        .map_err(std::io::Error::from)?;
        poll.registry()
            .register(&mut SourceFd(&timer.as_raw_fd()), TIMER, Interest::READABLE)?;
        let mut b = RdmaBackend {
            id: fresh_id(),
            free_sends: (0..cfg.sends as u32).rev().collect(),
            cfg,
            lim,
            peers: Peers::default(),
            rx,
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
            timer,
            listener: None,
            next_peer: 0,
            next_handshake: 0,
            next_grant: 1,
            done: VecDeque::new(),
            lost: VecDeque::new(),
            armed: false,
            registrations: 0,
            dmabuf: (0, 0, None),
            calls: 0,
            last_events: std::time::Instant::now(),
            early: ops::Early::default(),
            // SAFETY: plain C structs, all zeroes valid.
            wcs: (0..32).map(|_| unsafe { std::mem::zeroed() }).collect(),
            starting: FxHashSet::default(),
            ended: Vec::new(),
            draining: Vec::new(),
            accept_retry: Default::default(),
            accepted_max: None,
            connected_untrusted: false,
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
        // In error first: no write of the peer's lands after this, nor in what follows.
        self.by_qpn.remove(&p.qp.num);
        self.retire(p.qp);
        // Buffers it was holding go back to the shared queue.
        for a in &p.held {
            let _ = self.rx.post(a.buf);
        }
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
            if let Some(g) = self.drop_grant(k) {
                if let Some(t) = g.revoking {
                    self.done.push_back((t, None));
                }
            }
        }
        self.lost.push_back((peer, error));
    }

    /// Puts a queue pair in the error state (no write of it can land after this) and keeps
    /// it until the device took its last receive, or 2 s passed, and the completion queue
    /// was polled dry (`events`): mlx5 strips a destroyed queue pair's completions.
    fn retire(&mut self, qp: queues::Qp) {
        let _ = qp.to_error();
        self.draining.push(events::Draining::new(qp));
    }

    /// Removes grant `id`, freeing its slot with its peer.
    fn drop_grant(&mut self, id: u64) -> Option<Grant> {
        let g = self.grants.remove(&id)?;
        if g.slot != 0 {
            if let Some(p) = self.peers.get_mut(&g.peer.0) {
                p.slots.remove(&g.slot);
                p.free_slots.push(g.slot);
            }
        }
        Some(g)
    }

    fn fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the epoll descriptor lives as long as `self.poll`, which outlives the borrow.
        unsafe { BorrowedFd::borrow_raw(self.poll.as_raw_fd()) }
    }
}

/// How often a busy loop looks at the event descriptors.
const EVENTS_EVERY: std::time::Duration = std::time::Duration::from_micros(500);

/// How long a backend that could not wake a peer (`Peer::note_owed`) spins instead of
/// sleeping: the peer's own count, if it waits too, lands within it.
const NOTE_SPIN: std::time::Duration = std::time::Duration::from_millis(2);

/// After the spin, how soon a sleeping backend that still owes a note looks again: a quarter
/// of the time it has owed it, within these bounds (the peer's count may land at any time, and
/// nothing announces it).
const NOTE_POLL: (std::time::Duration, std::time::Duration) = (
    std::time::Duration::from_millis(1),
    std::time::Duration::from_millis(50),
);

/// How long a backend being dropped waits for its posted operations to be acknowledged.
const LINGER: std::time::Duration = std::time::Duration::from_secs(2);

impl Drop for RdmaBackend {
    fn drop(&mut self) {
        // What was posted leaves first (a worker's goodbye must not go down with its queue
        // pair), for a short while at most.
        self.linger(LINGER);
        // Queue pairs go to the error state first, so no peer writes anything while the
        // registrations are dropped.
        for p in self.peers.values() {
            let _ = p.qp.to_error();
        }
        self.peers.clear();
        self.draining.clear();
        self.grants.clear();
    }
}
