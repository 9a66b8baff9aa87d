//! The worker side of a distributed store.
//!
//! A call sends all its requests (every key, every slice, to every server) at once and then
//! drives the backends, in the calling thread, until every answer is in: pushes are sent
//! straight from the caller's arrays (over shared memory an array from `KVStore::alloc` is
//! named, not copied), and pulls are answered by the server putting the value straight into
//! the output the request granted. Every wait is bounded by the configured timeout; after a
//! timeout or a lost server the store refuses further calls rather than risk a stale answer.

mod at_exit;
pub(crate) mod calls;
mod exchange;
mod notes;
mod optimizer;
pub(crate) use optimizer::ADD_MULTS;
mod order;
mod packed;
pub(crate) mod requests;
mod states;

pub(crate) use requests::Ticket;

use rustc_hash::FxHashMap;
use std::net::TcpStream as StdStream;
use std::time::{Duration, Instant};

use kvstore_transport::tcp::blocking::{read_frame, write_frame};
use kvstore_transport::tcp::connect_retry;
use kvstore_transport::{FrameHeader, TransportError};

use crate::config::TransportChoice;
use crate::net::{self, Addr, Medium, Net};
use crate::protocol::shard::Part;
use crate::protocol::{role, Msg, Op};
use crate::worker::exchange::Links;

use crate::config::Config;
use crate::roles::join;
use crate::{DType, Key, KvError, NDArray, Result};

/// A call's requests: mostly one (one key held by one server), held inline.
pub(crate) type Requests = smallvec::SmallVec<[calls::Request; 1]>;

/// A call's outputs: mostly none (a push) or one (a pull), held inline.
pub(crate) type Outputs = smallvec::SmallVec<[NDArray; 1]>;

/// What a worker knows of a key: its number on the wire, its type, and where its slices live.
pub(crate) struct KeyInfo {
    pub(crate) id: u64,
    pub(crate) shape: Vec<usize>,
    pub(crate) dtype: DType,
    pub(crate) parts: Vec<Part>,
}

/// A worker's handle on a distributed store.
pub struct DistWorker {
    cfg: Config,
    rank: usize,
    num_workers: usize,
    num_servers: usize,
    server_addrs: Vec<std::net::SocketAddr>,
    sched: StdStream,
    net: Links,
    keys: FxHashMap<Key, KeyInfo>,
    str_ids: FxHashMap<String, u64>,
    merge: FxHashMap<Key, NDArray>,
    /// The optimizer sent to the servers last: its multipliers of keys initialised later go
    /// to them at their init ([`DistWorker::set_optimizer`]).
    optimizer: Option<crate::Multiplied>,
    /// The compression of pushes ([`crate::KVStore::set_gradient_compression`]), and what
    /// each key's pushes have not sent yet.
    compression: Option<crate::Compression>,
    residuals: FxHashMap<Key, Vec<f32>>,
    /// The priority of the calls started next (MXNet's `priority`).
    pub(crate) priority: i32,
    /// What this store counted ([`crate::metrics`]).
    pub(crate) metrics: crate::metrics::Tally,
    /// Calls in flight that a [`Ticket`] will claim: when and where they went.
    pub(crate) noted: FxHashMap<calls::CallId, notes::Note>,
    /// Notes of ended calls, kept for their lists' memory.
    pub(crate) spare_notes: Vec<notes::Note>,
    /// Outputs lent by the caller ([`NDArray::from_raw_parts`]) that calls in flight pull into
    /// the store's memory instead, by call: RDMA writes cannot be stopped by this process, and
    /// such memory goes back to its owner even after a failed call.
    staged: FxHashMap<calls::CallId, Vec<(usize, NDArray)>>,
    /// Calls in flight that a [`Ticket`] may still claim, with the ticket's token: a token
    /// held here alone means the ticket is gone.
    claims: Vec<(calls::CallId, std::sync::Arc<()>)>,
    /// Tokens of claimed calls, reused (a call allocates none).
    spare_claims: Vec<std::sync::Arc<()>>,
    /// Why the scheduler aborted the job, once it said so.
    aborted: Option<String>,
    /// This process's heartbeat to the scheduler (its lock orders writes to the scheduler).
    beat: crate::roles::Heartbeat,
    /// Its number among the links told at exit ([`at_exit`]).
    exit_id: u64,
}

/// Connects to every server: over shared memory to those on this host, over RDMA to those on
/// other hosts where both ends have an active device (feature `rdma`), over TCP to the others;
/// `KVSTORE_TRANSPORT` forces one, and a pair that cannot use it is an error naming the
/// reason. Prints the choice, one line. Every connection is made by `deadline`, one for all.
fn connect_servers(
    cfg: &Config,
    rank: usize,
    roster: &crate::roles::Roster,
    deadline: Instant,
) -> Result<(Net, Vec<Addr>)> {
    let left = || deadline.saturating_duration_since(Instant::now());
    let choice = cfg.transport;
    let me = net::host_id();
    let local: Vec<bool> = (0..roster.servers.len())
        .map(|i| roster.server_hosts.get(i).is_some_and(|h| *h == me))
        .collect();
    if choice == TransportChoice::Shm {
        if let Some(i) = local.iter().position(|l| !l) {
            return Err(KvError::Config(format!(
                "KVSTORE_TRANSPORT=shm, but server {i} ({}) is on another host",
                roster.servers[i]
            )));
        }
    }
    let want_shm =
        matches!(choice, TransportChoice::Auto | TransportChoice::Shm) && local.iter().any(|l| *l);
    // The send pool holds kv.alloc arrays and staged sends; the landing pool what servers
    // are granted to write (small answers, and any where cross-memory writes are refused).
    let mut net = Net::new(
        cfg.max_message,
        want_shm,
        cfg.shm_pool_bytes,
        cfg.shm_pool_bytes,
    )?;
    let mut rdma = crate::rdma::Connector::open(cfg, roster, &local);
    let mut links = Vec::with_capacity(roster.servers.len());
    let mut notes = Vec::new();
    for (i, addr) in roster.servers.iter().enumerate() {
        let mut link = None;
        let name = roster.server_shm.get(i).and_then(|n| n.as_deref());
        if let (true, Some(shm), Some(name)) = (local[i], &mut net.shm, name) {
            match shm.connect(name, left()) {
                Ok(peer) => {
                    link = Some(Addr {
                        medium: Medium::Shm,
                        peer,
                    })
                }
                Err(e) if choice == TransportChoice::Shm => return Err(e.into()),
                Err(_) => {}
            }
        } else if choice == TransportChoice::Shm && local[i] && name.is_none() {
            return Err(KvError::Config(format!(
                "KVSTORE_TRANSPORT=shm, but server {i} ({addr}) has no shared-memory listener"
            )));
        }
        if link.is_none() && (choice == TransportChoice::Rdma || !local[i]) {
            // Where TCP may follow (an RDMA listener this worker cannot reach), half of what
            // is left, so that it still has time.
            let within = match choice {
                TransportChoice::Rdma => left(),
                _ => left() / 2,
            };
            match rdma.connect(roster, i, within) {
                Ok(Some(peer)) => {
                    link = Some(Addr {
                        medium: Medium::Rdma,
                        peer,
                    })
                }
                Ok(None) => {}
                Err(why) if choice == TransportChoice::Rdma => {
                    return Err(KvError::Config(format!(
                        "KVSTORE_TRANSPORT=rdma, but server {i} ({addr}) cannot be reached over \
                         RDMA: {why}"
                    )))
                }
                Err(why) => notes.push(format!("server {i} over TCP: {why}")),
            }
        }
        let link = match link {
            Some(l) => l,
            None => Addr {
                medium: Medium::Tcp,
                peer: net.tcp.connect(*addr, left())?,
            },
        };
        links.push(link);
    }
    let shm_links = links.iter().filter(|a| a.medium == Medium::Shm).count();
    if shm_links == 0 {
        net.shm = None;
    }
    let device = rdma.finish(&mut net, &links);
    // The job's processes on this host (the scheduler counts them) share its cores.
    net.set_local_processes(roster.local_processes);
    let pairs: Vec<String> = links
        .iter()
        .enumerate()
        .map(|(i, a)| match (a.medium, &device) {
            (Medium::Rdma, Some(d)) => format!("server {i} rdma ({d})"),
            (m, _) => format!("server {i} {}", m.name()),
        })
        .collect();
    tracing::info!(
        "worker {rank} of {}: {}",
        roster.num_workers,
        pairs.join(", ")
    );
    for n in notes {
        tracing::info!("worker {rank}: {n}");
    }
    crate::report::send(&crate::report::Report::Transports {
        rank,
        text: pairs.join(", "),
    });
    crate::report::progress_every_second(rank);
    Ok((net, links))
}

impl DistWorker {
    /// Joins the job described by `cfg` as a worker and connects to every server, whose
    /// rounds are `dist_sync`'s where `sync`.
    pub(crate) fn connect(cfg: Config, sync: bool) -> Result<DistWorker> {
        let mut sched = connect_retry(cfg.root, cfg.timeout)?;
        let (roster, beat) = join(&cfg, &mut sched, role::WORKER, None, None, None)?;
        // Connecting to the servers and the handshakes with them: one timeout for all (a
        // server that died after it registered costs it once, not once per step).
        let deadline = Instant::now() + cfg.timeout;
        let (net, servers) = connect_servers(&cfg, roster.rank, &roster, deadline)?;
        let mut links = Links::new(net, servers, roster.rank as u32, cfg.timeout);
        links.calls.set_sync(sync);
        links.sched = Some(sched.try_clone()?);
        let exit_id = at_exit::keep(sched.try_clone()?, beat.lock());
        let token = roster
            .tokens
            .first()
            .copied()
            .ok_or_else(|| KvError::Protocol("the roster gave this worker no token".into()))?;
        links.hello(&cfg.secret, &token, deadline)?;
        Ok(DistWorker {
            rank: roster.rank,
            num_workers: roster.num_workers,
            num_servers: roster.num_servers,
            server_addrs: roster.servers.clone(),
            sched,
            net: links,
            cfg,
            keys: FxHashMap::default(),
            str_ids: FxHashMap::default(),
            merge: FxHashMap::default(),
            optimizer: None,
            compression: None,
            residuals: FxHashMap::default(),
            priority: 0,
            metrics: crate::metrics::Tally::default(),
            noted: FxHashMap::default(),
            spare_notes: Vec::new(),
            staged: FxHashMap::default(),
            claims: Vec::new(),
            spare_claims: Vec::new(),
            aborted: None,
            beat,
            exit_id,
        })
    }

    /// An error if an earlier failure made the store unusable, explained as [`Self::explain`]
    /// does.
    pub(crate) fn checked(&mut self) -> Result<()> {
        self.net.check().map_err(|e| self.explain(e))
    }

    /// A failure that a lost peer caused, explained by the scheduler where it can: the job is
    /// being aborted because of whichever process failed first, and the scheduler says which
    /// (its word arrives within moments of the loss). The error then names that process first,
    /// and what this worker saw after it.
    pub(crate) fn explain(&mut self, e: KvError) -> KvError {
        // A server names a key by its number on the wire: a str key's is its own.
        let named = |id: &Key| match id {
            Key::Int(i) => self
                .str_ids
                .iter()
                .find(|(_, n)| **n == *i as u64)
                .map(|(s, _)| Key::Str(s.clone())),
            Key::Str(_) => None,
        };
        let e = match e {
            KvError::UnknownKey(id) => KvError::UnknownKey(named(&id).unwrap_or(id)),
            KvError::DoubleInit(id) => KvError::DoubleInit(named(&id).unwrap_or(id)),
            e => e,
        };
        if !matches!(e, KvError::PeerLost(_) | KvError::Aborted(_)) {
            return e;
        }
        if self.aborted.is_none() {
            self.aborted = self.net.sched_abort.clone();
        }
        if self.aborted.is_none() && self.net.sched.is_some() {
            // Outside a barrier the scheduler sends a worker nothing but an abort.
            let deadline =
                Instant::now() + std::time::Duration::from_millis(500).min(self.cfg.timeout);
            if let Ok((h, text)) = read_frame(&mut self.sched, 1 << 20, Some(deadline)) {
                if Msg::decode(&h.meta).is_ok_and(|m| m.op == Op::Abort) {
                    self.aborted = Some(String::from_utf8_lossy(&text).into_owned());
                }
            }
        }
        match &self.aborted {
            // The cause first; what this worker saw after it, unless that only repeats it.
            Some(why) if matches!(&e, KvError::Aborted(w) if w == why) => e,
            Some(why) if e.to_string().contains(why.as_str()) => {
                let e = KvError::Aborted(why.clone());
                self.net.fail(e)
            }
            Some(why) => {
                let e = KvError::Aborted(format!("{why} (here: {e})"));
                self.net.fail(e)
            }
            None => e,
        }
    }

    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    pub(crate) fn num_workers(&self) -> usize {
        self.num_workers
    }

    pub(crate) fn server_addrs(&self) -> &[std::net::SocketAddr] {
        &self.server_addrs
    }

    /// The transport used to reach each server.
    pub(crate) fn transports(&self) -> Vec<&'static str> {
        self.net.media().map(Medium::name).collect()
    }

    /// `(copies, bytes)` of tensor bytes this store's shared-memory transport made here, with
    /// those its loop made (answers copied out of a server's pages, values into and out of
    /// batches).
    pub(crate) fn transport_copies(&self) -> (u64, u64) {
        let (n, bytes) = self.net.net.shm.as_ref().map_or((0, 0), |s| s.copies());
        let (an, abytes) = self.net.copies;
        (n + an, bytes + abytes)
    }

    /// Pushes this store put into receive slots.
    pub(crate) fn slot_puts(&self) -> u64 {
        self.net.slot_puts
    }

    /// Requests this store sent in batches.
    pub(crate) fn batched(&self) -> u64 {
        self.net.batched
    }

    /// What this store counted.
    pub(crate) fn metrics(&self) -> crate::metrics::Metrics {
        let mut m = self.metrics.view();
        m.copies = self.transport_copies();
        m.slot_puts = self.slot_puts();
        m.batched = self.batched();
        m
    }

    /// Where each key lives: its slices.
    pub(crate) fn placement(&self) -> crate::metrics::Placement {
        let mut out: crate::metrics::Placement = self
            .keys
            .iter()
            .map(|(k, info)| {
                let slices = info
                    .parts
                    .iter()
                    .map(|p| crate::metrics::Slice {
                        server: p.server,
                        start: p.start,
                        len: p.len,
                    })
                    .collect();
                (k.clone(), slices)
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// Whether every shared-memory server writes pull answers of 32 KiB and more straight into
    /// this process's memory (cross-memory writes), so such a pull into any output is one copy.
    pub(crate) fn cross_memory(&self) -> bool {
        let Some(shm) = &self.net.net.shm else {
            return false;
        };
        let shm_links: Vec<&Addr> = self
            .net
            .servers
            .iter()
            .filter(|a| a.medium == Medium::Shm)
            .collect();
        !shm_links.is_empty() && shm_links.iter().all(|a| shm.peer_writes_me(a.peer))
    }

    /// An array in this worker's shared pool (pushing it copies nothing), or in process memory
    /// when no server is on this host.
    pub(crate) fn alloc(&mut self, shape: &[usize], dtype: crate::DType) -> Result<NDArray> {
        match self.send_pages(crate::ndarray::checked_bytes(shape, dtype)?)? {
            Some(r) => Ok(NDArray::from_region(shape, dtype, r)),
            None => NDArray::try_zeros_dtype(shape, dtype),
        }
    }

    /// `bytes` zeroed bytes of shared-memory pages that a push sends in place, where servers
    /// share memory with this process (and `bytes` is not 0).
    pub(crate) fn send_pages(&mut self, bytes: usize) -> Result<Option<kvstore_transport::Region>> {
        match &mut self.net.net.shm {
            Some(s) if bytes > 0 => Ok(Some(kvstore_transport::Backend::alloc(
                s,
                bytes,
                kvstore_transport::Access::Send,
            )?)),
            _ => Ok(None),
        }
    }

    /// Waits at the scheduler until every worker has arrived.
    /// This worker's calls in flight complete first.
    pub(crate) fn barrier(&mut self) -> Result<()> {
        self.net.quiesce();
        self.checked()?;
        let m = Msg::new(Op::Barrier);
        let w = {
            let _g = self.beat.write_lock();
            write_frame(&mut self.sched, &FrameHeader::new(m.encode(), 0), &[])
        };
        w.map_err(|e| self.net.fail(KvError::PeerLost(format!("scheduler: {e}"))))?;
        let deadline = Instant::now() + self.cfg.timeout;
        // The interrupt check (Ctrl-C in Python) is heard while the barrier waits.
        while Instant::now() < deadline && !readable(&self.sched, Duration::from_millis(50)) {
            if self.net.interrupted() {
                return Err(self.net.fail(KvError::Interrupted(
                    "a barrier was interrupted; the store refuses further calls".into(),
                )));
            }
        }
        let (h, text) = read_frame(&mut self.sched, 1 << 20, Some(deadline)).map_err(|e| {
            let e = match e {
                TransportError::Timeout(_) => KvError::Timeout {
                    what: "the other workers at a barrier".into(),
                    secs: self.cfg.timeout.as_secs_f64(),
                },
                other => KvError::PeerLost(format!("scheduler: {other}")),
            };
            self.net.fail(e)
        })?;
        let m = Msg::decode(&h.meta)?;
        match m.op {
            Op::BarrierDone => Ok(()),
            Op::Abort => {
                let e = KvError::Aborted(String::from_utf8_lossy(&text).into_owned());
                Err(self.net.fail(e))
            }
            other => Err(self.net.fail(KvError::Protocol(format!(
                "expected barrier done, got {other:?}"
            )))),
        }
    }

    fn key_id(&mut self, k: &Key) -> u64 {
        match k {
            Key::Int(i) => *i as u64,
            Key::Str(s) => {
                let next = self.str_ids.len() as u64;
                *self.str_ids.entry(s.clone()).or_insert(next)
            }
        }
    }

    fn info(&self, k: &Key) -> Result<&KeyInfo> {
        self.keys
            .get(k)
            .ok_or_else(|| KvError::UnknownKey(k.clone()))
    }

    pub(crate) fn set_interrupt(&mut self, f: Box<dyn FnMut() -> bool + Send>) {
        self.net.interrupt = Some(f);
    }

    pub(crate) fn set_slow_wait(&mut self, slow: SlowWait) {
        self.net.slow = Some(slow);
    }

    /// Fails every call in flight with `why` and revokes their grants: the store refuses
    /// every later call.
    pub(crate) fn abort(&mut self, why: &str) {
        self.net.fail(KvError::Aborted(why.to_string()));
        self.net.quiesce();
    }

    /// Rank 0 selects a registered updater on every server; every worker waits for it.
    pub(crate) fn set_server_updater(&mut self, name: &str) -> Result<()> {
        // Every process runs the same program: a name unknown here is unknown on the servers,
        // and every worker (not only rank 0) must hear so.
        crate::registry::lookup(name)?;
        self.optimizer = None;
        // Every rank asks (setting the same updater twice is harmless), so that a server
        // that lacks it answers every rank with the same error.
        self.broadcast(Op::SetUpdater, name.as_bytes(), true)
    }
}

impl Drop for DistWorker {
    fn drop(&mut self) {
        // Tell the servers this is a clean exit, then the scheduler that this worker is done.
        self.net.quiesce();
        let m = self.metrics();
        crate::report::send_metrics("worker", self.rank, m.to_json(), |l| m.to_prometheus(l));
        self.net.notify(Op::Bye);
        let fin = Msg::new(Op::Finish);
        let _g = self.beat.write_lock();
        let _ = write_frame(&mut self.sched, &FrameHeader::new(fin.encode(), 0), &[]);
        at_exit::forget(self.exit_id);
    }
}

/// Whether `s` has something to read within `wait` (or an error to report: it is then read).
/// A signal that cuts the wait short is no data (the caller asks whether to stop).
fn readable(s: &StdStream, wait: Duration) -> bool {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    use std::os::fd::AsFd;
    let mut fds = [PollFd::from_borrowed_fd(s.as_fd(), PollFlags::IN)];
    let ts = Timespec {
        tv_sec: wait.as_secs() as i64,
        tv_nsec: wait.subsec_nanos() as i64,
    };
    !matches!(
        poll(&mut fds, Some(&ts)),
        Ok(0) | Err(rustix::io::Errno::INTR)
    )
}

/// A wait's slow part: once a call has waited `after`, the rest of its wait runs inside
/// `wrap`.
pub(crate) struct SlowWait {
    pub(crate) after: std::time::Duration,
    pub(crate) wrap: Wrapper,
}

/// What runs the rest of a wait, given to it.
pub(crate) type Wrapper = Box<dyn FnMut(&mut (dyn FnMut() + Send)) + Send>;
