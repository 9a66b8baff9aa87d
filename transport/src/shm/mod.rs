//! [`Backend`] over shared memory, for peers on the same host.
//!
//! Descriptors travel on a pair of rings per link; each process has two page pools that all its
//! peers map: a send pool, sealed so that peers can map it only read-only, and a landing pool
//! they map read-write. A message's data from send-pool pages ([`Backend::alloc`] with
//! [`Access::Send`]) is named by the descriptor and read by the receiver where it lies; the
//! receiver's release is the sender's completion. Data from any other memory is copied once
//! into send-pool pages (its token completes at once). A put is a copy straight into the
//! granted range: landing pages of the grantor ([`Access::Land`]), or, from 32 KiB
//! (`CMA_FROM`), any other memory of it by a cross-memory write to the process the kernel
//! named for the socket: up to 64 KiB through its `/proc/<pid>/mem`, opened while its pidfd
//! showed it alive (one system call, bound to that process), larger ones by
//! `process_vm_writev` after a pidfd check. Smaller ranges of other memory, and all of it
//! where the host forbids cross-memory writes, are granted through landing pages and copied
//! into place on arrival.
//!
//! A grant cannot be fenced locally (the peer writes it directly), so a revoke asks the peer and
//! completes on its answer, or when its process has exited. Memory a peer may still write is
//! never freed.

pub(crate) mod link;
mod peer;

pub use link::SendPages;
pub use peer::PeerProcess;

use rustc_hash::{FxHashMap, FxHashSet};
use std::collections::VecDeque;
use std::io::Read;
use std::ops::Range;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvstore_shm::{Channel, ChannelConfig, Pool, Segment, SLOT};
use mio::unix::SourceFd;
use mio::{Events, Interest, Poll};

use crate::backend::{fresh_id, Place};
use crate::table::PeerTable;
use crate::{
    Access, Backend, Completion, Lent, PeerId, Region, RemoteRegion, Sent, Storage, Token,
    TransportError,
};
use link::*;

const KIND_SEG: u32 = 2;
const KIND_CMA: u32 = 3;
/// Granted private memory smaller than this is written through landing pages (the peer's copy
/// into them, then one here) rather than by the kernel for the peer, whose memory-file write
/// walks the pages one by one: a pull of 4-16 KiB into heap arrays (`kvperf pushpull --op
/// pull`, W=1 S=1) took 1.6-1.9x as long with cross-memory writes on the 2-core development
/// machine (call p50 3.0/3.9/5.5 us against 1.6/2.0/3.5 us, paired runs, 2026-11-26). From
/// 32 KiB a server's stored value is in its send pool and answers by reference anyway.
const CMA_FROM: usize = 32 * 1024;
/// The largest message body.
pub const MAX_BODY: usize = 64 * 1024;
const LISTENER: mio::Token = mio::Token(usize::MAX);
const HANDSHAKE: usize = 1 << 40;
/// Descriptors taken from one peer per progress call, so that one busy peer cannot starve the
/// others.
const BATCH: usize = 256;
/// Descriptors waiting for room in a peer's ring (acknowledgements of what it sent) beyond
/// which its own ring is not read: a peer that never drains its ring keeps the backlog in its
/// ring, not in this process's memory.
const UNSENT_MAX: usize = 2 * BATCH;
/// Grants a peer may say it revoked (ids kept so that nothing is written there again): a
/// peer that says more breaks the protocol.
const REVOKED_MAX: usize = 1 << 16;

/// The sizes of a shared-memory backend.
#[derive(Clone, Debug)]
pub struct ShmConfig {
    /// Descriptor slots per ring.
    pub ring_slots: u64,
    /// Pool page size (a power of two, at least 4096).
    pub page_size: usize,
    /// Pages in this process's send pool (reserved, not touched until used).
    pub pages: usize,
    /// Pages in its landing pool (what peers are granted to write: receive slots, bounce
    /// pages); reserved likewise.
    pub landing_pages: usize,
    /// How long a connecting peer has to finish the handshake.
    pub handshake_timeout: Duration,
    /// Whether to write peers' private memory directly where the host allows it
    /// (`process_vm_writev`); otherwise grants of private memory go through pool pages.
    pub cross_memory: bool,
}

impl Default for ShmConfig {
    fn default() -> Self {
        ShmConfig {
            ring_slots: 1024,
            page_size: 64 * 1024,
            pages: 16 * 1024,         // 1 GiB of address space
            landing_pages: 16 * 1024, // 1 GiB
            handshake_timeout: Duration::from_secs(5),
            cross_memory: true,
        }
    }
}

struct RefOut {
    token: Option<Token>,
    /// What the peer may be reading: the caller's pool region, or staging pages.
    _hold: Vec<Region>,
}

struct Peer {
    chan: Channel,
    sock: UnixStream,
    proc: PeerProcess,
    /// The peer's send pool, mapped read-only: data it sends by reference.
    their_seg: Arc<Segment>,
    their_pool: Pool,
    /// The peer's landing pool, mapped read-write: where it grants this process to put.
    their_landing_seg: Arc<Segment>,
    their_landing: Pool,
    bell: OwnedFd,
    peer_writes_me: bool,
    i_write_peer: bool,
    refs: FxHashMap<u64, RefOut>,
    next_seq: u64,
    /// Grants of the peer's that it revoked: never written again.
    revoked: FxHashSet<u64>,
    /// Its messages whose data a callback held ([`crate::Lent::hold`]): released (their pages
    /// given back) when [`Backend::release`] gets them.
    held: FxHashSet<u64>,
    /// Control descriptors waiting for room on the ring, in order.
    unsent: VecDeque<[u8; SLOT]>,
    /// A caller was told "would block" for want of room on the ring, and has not been woken
    /// since to try again.
    starved: bool,
    posted: bool,
    rxbuf: Vec<u8>,
    /// Its ring is not read while set (backpressure).
    paused: bool,
}

impl Peer {
    /// Whether the link is full (control descriptors wait, or the ring has no slot), marking
    /// the caller so told as starved.
    fn full(&mut self) -> bool {
        let full = !self.unsent.is_empty() || self.chan.tx_full();
        self.starved |= full;
        full
    }
}

struct Grant {
    peer: PeerId,
    region: Region,
    range: Range<usize>,
    /// Pool pages the peer writes instead, copied into place on arrival.
    bounce: Option<Region>,
    revoking: Option<Token>,
}

struct Pending {
    sock: UnixStream,
    proc: PeerProcess,
    deadline: Instant,
}

/// What a lost peer whose process lived may still write: its grants' memory, kept with the
/// process until it exits.
struct Quarantined {
    proc: PeerProcess,
    ids: Vec<u64>,
    /// Held until then (and never given back if the backend goes first: `Drop`).
    _regions: Vec<Region>,
}

/// Shared memory as a [`Backend`].
pub struct ShmBackend {
    id: u64,
    name: String,
    cfg: ShmConfig,
    poll: Poll,
    events: Events,
    listener: Option<UnixListener>,
    pending: FxHashMap<usize, Pending>,
    next_pending: usize,
    accept_retry: crate::backend::AcceptRetry,
    /// Pages peers read and never write (sends by reference, `alloc(_, Access::Send)`).
    pool_seg: Arc<Segment>,
    pool: Arc<Pool>,
    /// Pages peers write when granted (receive slots, bounce pages).
    landing_seg: Arc<Segment>,
    landing: Arc<Pool>,
    canary: Box<[u8; 8]>,
    peers: PeerTable<Peer>,
    next_peer: u32,
    grants: FxHashMap<u64, Grant>,
    next_grant: u64,
    /// Memory a lost peer that still lived may write, with that process: kept until it has
    /// exited (looked at as the backend progresses), for good if it never does.
    quarantine: Vec<Quarantined>,
    /// The grants of that memory: a revoke of one fails (the peer may still write it).
    kept: FxHashSet<u64>,
    done: VecDeque<(Token, Option<TransportError>)>,
    lost: VecDeque<(PeerId, TransportError)>,
    /// Whether `arm` marked the rings asleep since the last progress.
    armed: bool,
    /// The bytes a send had to stage (its body's and its data's) when it could not for want
    /// of free pages: a sleep does not happen while they could be had (the pages came back
    /// while this side was busy).
    pool_starved: Option<[usize; 2]>,
    /// When the sockets, doorbells and listener were last polled.
    last_poll: Instant,
    /// Reused list of peers to visit.
    ids: Vec<u32>,
    /// Progress calls, to read the clock on few of them.
    calls: u32,
    /// Copies of data this backend made (into staging pages, out of bounce pages): count, bytes.
    copies: (u64, u64),
}

/// How often a busy loop that never sleeps looks at its sockets (a peer gone, a new peer): the
/// rings themselves are read on every progress call, without a system call.
const POLL_EVERY: Duration = Duration::from_micros(200);

fn shm_full(e: &kvstore_shm::ShmError) -> bool {
    matches!(e, kvstore_shm::ShmError::Exhausted(_))
}

impl ShmBackend {
    /// A backend with no peers; `name` labels its segments (`/proc/PID/fd`).
    pub fn new(name: &str, cfg: ShmConfig) -> Result<ShmBackend, TransportError> {
        let (pool_seg, pool) = create_pool(name, cfg.pages, cfg.page_size, false)?;
        let (landing_seg, landing) = create_pool(name, cfg.landing_pages, cfg.page_size, true)?;
        Ok(ShmBackend {
            id: fresh_id(),
            name: name.into(),
            cfg,
            poll: Poll::new()?,
            events: Events::with_capacity(256),
            listener: None,
            pending: FxHashMap::default(),
            next_pending: 0,
            accept_retry: Default::default(),
            pool_seg,
            pool,
            landing_seg,
            landing,
            canary: Box::new([0u8; 8]),
            peers: PeerTable::new(),
            next_peer: 0,
            grants: FxHashMap::default(),
            next_grant: 1,
            quarantine: Vec::new(),
            kept: FxHashSet::default(),
            done: VecDeque::new(),
            lost: VecDeque::new(),
            armed: false,
            pool_starved: None,
            last_poll: Instant::now(),
            ids: Vec::new(),
            calls: 0,
            copies: (0, 0),
        })
    }

    fn peer(&mut self, peer: PeerId) -> Result<&mut Peer, TransportError> {
        self.peers
            .get_mut(&peer.0)
            .ok_or_else(|| TransportError::PeerLost(format!("{peer} is not connected")))
    }

    /// Posts a control descriptor, queueing it behind others if the ring is full.
    fn post_control(&mut self, peer: PeerId, d: [u8; SLOT]) {
        if let Some(p) = self.peers.get_mut(&peer.0) {
            p.unsent.push_back(d);
            let _ = recv::push_unsent(p);
        }
    }

    /// Staging pages of this process's pool holding a copy of `len` bytes from `src`.
    /// `(count, bytes)` of the data copies this backend made: a send from memory outside the
    /// pool is copied once into staging pages; a put is one copy into the peer's memory (and a
    /// put into a grant that the peer cannot write directly is copied once more, out of bounce
    /// pages, by the grantor).
    pub fn copies(&self) -> (u64, u64) {
        self.copies
    }

    /// Grants kept for lost peers whose processes had not exited: their memory is freed once
    /// they have. For tests of that.
    pub fn kept_grants(&self) -> usize {
        self.kept.len()
    }

    /// Whether any peer is connected (a loop spins on the rings only when one is).
    pub fn has_peers(&self) -> bool {
        !self.peers.is_empty()
    }

    /// Whether `peer` writes puts of `CMA_FROM` bytes and more straight into this process's
    /// private memory (cross-memory writes), with no bounce copy here.
    pub fn peer_writes_me(&self, peer: PeerId) -> bool {
        self.peers.get(&peer.0).is_some_and(|p| p.peer_writes_me)
    }

    /// Pages of `len` bytes for `access` (send or landing pool), zeroed if `zero`.
    fn alloc_pages(
        &mut self,
        len: usize,
        zero: bool,
        access: Access,
    ) -> Result<Region, TransportError> {
        let (seg, pool, place): (_, _, fn(usize) -> Place) = match access {
            Access::Send => (&self.pool_seg, &self.pool, Place::Pool),
            Access::Land => (&self.landing_seg, &self.landing, Place::Landing),
        };
        pages_of(self.id, seg, pool, len, zero, place)
    }

    /// A handle that allocates this backend's send-pool pages from anywhere in this thread
    /// (a server's stored values, which its answers send by reference).
    pub fn send_pages(&self) -> SendPages {
        SendPages {
            id: self.id,
            seg: self.pool_seg.clone(),
            pool: self.pool.clone(),
        }
    }

    fn stage(&mut self, src: *const u8, len: usize) -> Result<Option<Region>, TransportError> {
        let region = match self.pool.alloc(len) {
            Ok(r) => r,
            Err(e) if shm_full(&e) && len <= self.pool.capacity() => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let pages = Arc::new(PoolPages {
            seg: self.pool_seg.clone(),
            pool: self.pool.clone(),
            region,
            len,
        });
        // SAFETY: `src` is valid for `len` bytes (the caller's contract); the pages are freshly
        // allocated to this process and handed to no one yet.
        unsafe { crate::copy::copy_nonoverlapping(src, pages.ptr(), len) };
        Ok(Some(Region::new(
            self.id,
            pages,
            Place::Pool(region.offset),
        )))
    }

    fn lose(&mut self, peer: PeerId, error: TransportError) {
        let Some(p) = self.peers.remove(&peer.0) else {
            return;
        };
        let r = self.poll.registry();
        let _ = r.deregister(&mut SourceFd(&p.sock.as_raw_fd()));
        let _ = r.deregister(&mut SourceFd(&p.bell.as_raw_fd()));
        for (_, out) in p.refs {
            if let Some(t) = out.token {
                let e = TransportError::PeerLost(format!("{peer}: {error}"));
                self.done.push_back((t, Some(e)));
            }
        }
        // Grants to it are fenced only if its process is gone; otherwise their memory is kept.
        let exited = p.proc.exited();
        let (mut kept, mut regions): (Vec<u64>, Vec<Region>) = (Vec::new(), Vec::new());
        let ids: Vec<u64> = self
            .grants
            .iter()
            .filter(|(_, g)| g.peer == peer)
            .map(|(&id, _)| id)
            .collect();
        for id in ids {
            let Some(g) = self.grants.remove(&id) else {
                continue;
            };
            if let Some(t) = g.revoking {
                let e = (!exited).then(|| {
                    TransportError::PeerLost(format!(
                        "{peer} closed its link but still runs: grant {id} kept, never freed"
                    ))
                });
                self.done.push_back((t, e));
            }
            if !exited {
                self.kept.insert(id);
                kept.push(id);
                regions.push(g.region);
                regions.extend(g.bounce);
            }
        }
        if !kept.is_empty() {
            // Its process may be between closing its files and exiting (its pidfd becomes
            // readable last), or live on: what it may write is freed once it has exited.
            self.quarantine.push(Quarantined {
                proc: p.proc,
                ids: kept,
                _regions: regions,
            });
        }
        self.lost.push_back((peer, error));
    }

    /// Frees the memory kept for lost peers whose processes have exited since, and forgets
    /// its grants (a revoke of one completes then, as for any peer that is gone).
    fn release_quarantine(&mut self) {
        if self.quarantine.is_empty() {
            return;
        }
        let (gone, live): (Vec<_>, Vec<_>) = std::mem::take(&mut self.quarantine)
            .into_iter()
            .partition(|q| q.proc.exited());
        self.quarantine = live;
        for q in gone {
            for id in &q.ids {
                self.kept.remove(id);
            }
        }
    }
}

mod ops;
mod recv;
mod setup;
