//! The worker side of a distributed store.
//!
//! A call sends all its requests (every key, every slice, to every server) at once and then
//! drives one mio loop, in the calling thread, until every reply is in: pushes are written
//! straight from the caller's arrays with `writev`, pulls are read straight into the caller's
//! output. Every wait is bounded by the configured timeout; after a timeout or a lost server the
//! store refuses further calls rather than risk reading a stale reply into an array.

use std::collections::HashMap;
use std::io;
use std::net::TcpStream as StdStream;
use std::time::Instant;

use kvstore_transport::tcp::blocking::{read_frame, write_frame};
use kvstore_transport::tcp::{connect_retry, FrameReader, FrameSink, OutQueue};
use kvstore_transport::{FrameHeader, TransportError};
use mio::net::TcpStream;
use mio::{Events, Interest, Poll, Token};

use super::proto::{role, status, Msg, Op, MAX_NDIM};
use super::shard::{placement, Part};
use super::shm::{self, Choice, WorkerLink, WorkerPool};
use kvstore_shm::Region;
use std::time::Duration;

/// Tokens of shared-memory doorbells in the poll set (server rank added).
const SHM_TOKENS: usize = 1 << 30;
/// How long a wait polls the rings before it sleeps on the doorbells.
const SPIN: Duration = Duration::from_micros(200);
use super::{join, Config};
use crate::local::{check_like, sum_into};
use crate::optimizer::Optimizer;
use crate::{DType, Key, KvError, NDArray, Result};

struct KeyInfo {
    id: u64,
    shape: Vec<usize>,
    dtype: DType,
    parts: Vec<Part>,
}

/// One request of a call.
struct Req<'a> {
    server: usize,
    msg: Msg,
    payload: &'a [u8],
    /// Index of the buffer the reply's payload goes to.
    dest: Option<usize>,
    /// Where `payload` lies in this worker's shared pool, if it does (then it is not copied).
    payload_at: Option<usize>,
    /// Where the reply's buffer lies in the shared pool, if it does (the server writes there).
    dest_at: Option<usize>,
}

struct ServerConn {
    stream: TcpStream,
    reader: FrameReader,
    /// The reply being read (it may span many readiness events) and its error text.
    cur: Option<(usize, Msg)>,
    text: Vec<u8>,
}

/// The sockets of a worker.
struct Net {
    poll: Poll,
    events: Events,
    servers: Vec<ServerConn>,
    next_req: u64,
    rank: u32,
    timeout: std::time::Duration,
    broken: Option<String>,
    /// Shared-memory links to the servers on this host, by server rank.
    links: Vec<Option<WorkerLink>>,
    /// This worker's pool, when it has a shared-memory link.
    pool: Option<WorkerPool>,
    /// More of the job's processes on this host (this one and its local servers) than cores:
    /// spinning yields the core.
    crowded: bool,
    /// After a failed call, what a shared-memory server may still write or read: the outputs
    /// taken from the caller (it got fresh arrays in their place) and pool arrays it pushed.
    /// Kept while the servers live; leaked, never freed, if they still do when the store goes.
    withheld: Vec<NDArray>,
    /// Staging pages of failed calls: never freed, so no later array gets them.
    withheld_pages: Vec<Region>,
    /// Copies of tensor bytes this store's shared-memory transport made here.
    copies: shm::Copies,
}

/// Which answers of an exchange have come, from either transport.
struct Tally {
    base: u64,
    done: Vec<bool>,
    remaining: usize,
    first_err: Option<KvError>,
}

impl Tally {
    fn new(base: u64, n: usize) -> Tally {
        Tally {
            base,
            done: vec![false; n],
            remaining: n,
            first_err: None,
        }
    }

    /// The request an answer with `req_id` from `server` is for, if it is one still due.
    fn due(&self, reqs: &[Req<'_>], req_id: u64, server: usize) -> Option<usize> {
        let idx = req_id.wrapping_sub(self.base) as usize;
        (idx < reqs.len() && !self.done[idx] && reqs[idx].server == server).then_some(idx)
    }

    /// Records the answer to request `idx`; a refusal becomes the call's error if it is the
    /// first.
    fn answer(
        &mut self,
        reqs: &[Req<'_>],
        idx: usize,
        status: u16,
        server: usize,
        text: impl FnOnce() -> String,
    ) {
        self.done[idx] = true;
        self.remaining -= 1;
        if status != status::OK && self.first_err.is_none() {
            self.first_err = Some(remote_error(status, reqs[idx].msg.key, server, text()));
        }
    }
}

struct ReplySink<'r, 'd> {
    server: usize,
    reqs: &'r [Req<'r>],
    dests: &'r mut [&'d mut [u8]],
    tally: &'r mut Tally,
    cur: &'r mut Option<(usize, Msg)>,
    text: &'r mut Vec<u8>,
}

/// The error a server's answer with a non-zero status stands for.
fn remote_error(status: u16, key: u64, server: usize, text: String) -> KvError {
    let key = Key::Int(key as i64);
    match status {
        status::UNKNOWN_KEY => KvError::UnknownKey(key),
        status::DOUBLE_INIT => KvError::DoubleInit(key),
        status::PEER_LOST => KvError::PeerLost(format!("server {server}: {text}")),
        _ => KvError::Remote {
            server,
            message: text,
        },
    }
}

fn refuse(why: String) -> TransportError {
    TransportError::Refused(why)
}

impl FrameSink for ReplySink<'_, '_> {
    fn on_header(&mut self, h: &FrameHeader) -> std::result::Result<(), TransportError> {
        let m = Msg::decode(&h.meta).map_err(|e| refuse(e.to_string()))?;
        if m.op == Op::Abort {
            self.text.resize(h.payload_len.min(1 << 16) as usize, 0);
            *self.cur = Some((usize::MAX, m));
            return Ok(());
        }
        let due = self.tally.due(self.reqs, m.req_id, self.server);
        let Some(idx) = due.filter(|_| m.op == Op::Reply) else {
            return Err(refuse(format!(
                "unexpected {:?} for request {}",
                m.op, m.req_id
            )));
        };
        if m.status != status::OK {
            if h.payload_len > 1 << 16 {
                return Err(refuse("oversized error text".into()));
            }
            self.text.resize(h.payload_len as usize, 0);
        } else {
            let want = self.reqs[idx]
                .dest
                .map_or(0, |d| self.dests[d].len() as u64);
            if h.payload_len != want {
                return Err(refuse(format!(
                    "reply of {} bytes where {want} were expected",
                    h.payload_len
                )));
            }
        }
        *self.cur = Some((idx, m));
        Ok(())
    }

    fn payload_dest(&mut self, _h: &FrameHeader) -> &mut [u8] {
        match *self.cur {
            Some((idx, m)) if idx != usize::MAX && m.status == status::OK => {
                match self.reqs[idx].dest {
                    Some(d) => self.dests[d],
                    None => &mut [],
                }
            }
            _ => self.text,
        }
    }

    fn on_frame(&mut self, _h: &FrameHeader) -> std::result::Result<(), TransportError> {
        let Some((idx, m)) = self.cur.take() else {
            return Err(refuse("frame without header".into()));
        };
        if idx == usize::MAX {
            return Err(refuse(format!(
                "job aborted: {}",
                String::from_utf8_lossy(self.text)
            )));
        }
        let text = &*self.text;
        self.tally
            .answer(self.reqs, idx, m.status, self.server, || {
                String::from_utf8_lossy(text).into_owned()
            });
        Ok(())
    }
}

impl Net {
    /// After a call failed with answers outstanding, a shared-memory server may still write an
    /// output's pages (a late answer) or read a pushed pool array's pages. Each such output
    /// gets fresh storage (zeros; a failed call's output has no defined value) and its old
    /// storage is withheld; each pushed pool array is withheld through a copy-on-write clone,
    /// so the caller's next write moves the caller to new pages.
    fn withhold(
        &mut self,
        pushed: &[(Key, Vec<&NDArray>)],
        outs: Option<&mut [(Key, Vec<&mut NDArray>)]>,
    ) {
        if self.broken.is_none() || self.links.iter().all(Option::is_none) {
            return;
        }
        for v in pushed.iter().flat_map(|(_, vs)| vs) {
            if v.is_shared_memory() {
                self.withheld.push((*v).clone());
            }
        }
        for (_, list) in outs.into_iter().flatten() {
            if let Some(first) = list.first_mut() {
                let fresh = NDArray::zeros_dtype(first.shape(), first.dtype()).on(first.device());
                self.withheld.push(std::mem::replace(&mut **first, fresh));
            }
        }
    }

    fn check(&self) -> Result<()> {
        match &self.broken {
            Some(why) => Err(KvError::Aborted(format!("this store is unusable: {why}"))),
            None => Ok(()),
        }
    }

    fn fail(&mut self, e: KvError) -> KvError {
        self.broken = Some(e.to_string());
        e
    }

    /// Sends every request and waits for every reply, reading payloads into `dests`.
    ///
    /// Requests to servers on this host go over shared memory: a payload already in the pool
    /// (an array from `KVStore::alloc`) is named, not copied; any other is copied once into the
    /// pool. A reply's value is written by the server straight into the output when the output
    /// is in the pool, else into staging pages copied out here.
    fn exchange(&mut self, reqs: &mut [Req<'_>], dests: &mut [&mut [u8]]) -> Result<()> {
        self.check()?;
        if reqs.is_empty() {
            return Ok(());
        }
        let base = self.next_req;
        self.next_req += reqs.len() as u64;
        let deadline = Instant::now() + self.timeout;
        let mut queues: Vec<OutQueue<&[u8]>> =
            self.servers.iter().map(|_| OutQueue::new()).collect();
        // Staging regions: freed when the exchange ends (pushes: once read; pulls: copied out).
        let mut staging: Vec<Region> = Vec::new();
        let mut recv_staging: HashMap<usize, Region> = HashMap::new();
        let mut tally = Tally::new(base, reqs.len());
        for (i, r) in reqs.iter_mut().enumerate() {
            r.msg.req_id = base + i as u64;
            r.msg.sender = self.rank;
        }
        let reqs: &[Req<'_>] = reqs;
        let result = (|| -> Result<()> {
            // Answers taken while posting (a full ring).
            let mut shm_early = 0usize;
            for (i, r) in reqs.iter().enumerate() {
                if self.links.get(r.server).is_some_and(Option::is_some) {
                    let pool = self
                        .pool
                        .as_ref()
                        .ok_or_else(|| KvError::Protocol("no pool".into()))?;
                    let src = if r.payload.is_empty() {
                        None
                    } else if let Some(off) = r.payload_at {
                        Some(Region {
                            offset: off,
                            len: r.payload.len(),
                        })
                    } else {
                        let reg = pool.pool.alloc(r.payload.len()).map_err(shm::shm)?;
                        staging.push(reg);
                        pool.seg.write(reg.offset, r.payload).map_err(shm::shm)?;
                        self.copies.count(r.payload.len());
                        Some(reg)
                    };
                    let cma = self.links[r.server].as_ref().is_some_and(|l| l.cma);
                    let mut dst_addr = None;
                    let dst = match (r.dest, r.dest_at) {
                        (Some(d), Some(off)) => Some(Region {
                            offset: off,
                            len: dests[d].len(),
                        }),
                        // The server writes the answer straight into the output (one copy).
                        (Some(d), None) if cma && !dests[d].is_empty() => {
                            dst_addr = Some((dests[d].as_mut_ptr() as u64, dests[d].len()));
                            None
                        }
                        (Some(d), None) => {
                            let reg = pool.pool.alloc(dests[d].len().max(1)).map_err(shm::shm)?;
                            recv_staging.insert(i, reg);
                            Some(Region {
                                offset: reg.offset,
                                len: dests[d].len(),
                            })
                        }
                        _ => None,
                    };
                    let desc = shm::encode_to(&r.msg, r.payload.len(), src, dst, dst_addr, &[]);
                    loop {
                        let link = self.links[r.server]
                            .as_ref()
                            .ok_or_else(|| KvError::Protocol("link".into()))?;
                        if link.chan.try_send(&desc).map_err(shm::shm)? {
                            break;
                        }
                        // The ring is full: take answers meanwhile, so neither side waits on the other.
                        shm_early += self.drain_shm(reqs, dests, &mut tally, &recv_staging)?;
                        if Instant::now() >= deadline {
                            return Err(KvError::Timeout {
                                what: "room in a shared-memory ring".into(),
                                secs: self.timeout.as_secs_f64(),
                            });
                        }
                        std::thread::yield_now();
                    }
                } else {
                    let h = r.msg.header(r.payload.len());
                    queues[r.server].push(h, r.payload);
                }
            }
            let tcp_servers: Vec<usize> = (0..self.servers.len())
                .filter(|&s| self.links.get(s).is_none_or(Option::is_none) && !queues[s].is_empty())
                .collect();
            // Answers still due over shared memory; the rest of `remaining` come over TCP.
            let mut shm_left = reqs
                .iter()
                .filter(|r| self.links.get(r.server).is_some_and(Option::is_some))
                .count()
                - shm_early;
            let mut first_pass = true;
            let mut last_progress = Instant::now();
            while tally.remaining > 0 {
                let n = self.drain_shm(reqs, dests, &mut tally, &recv_staging)?;
                if n > 0 {
                    shm_left -= n;
                    last_progress = Instant::now();
                    continue;
                }
                let mut ready: Vec<usize> = Vec::new();
                if first_pass {
                    ready.extend(tcp_servers.iter().copied());
                    first_pass = false;
                } else {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(KvError::Timeout {
                            what: format!("{} replies from the servers", tally.remaining),
                            secs: self.timeout.as_secs_f64(),
                        });
                    }
                    let shm_pending = shm_left > 0;
                    let mut timeout = left;
                    let mut armed = Vec::new();
                    if shm_pending {
                        if last_progress.elapsed() < SPIN {
                            timeout = Duration::ZERO;
                        } else {
                            for (s, l) in self.links.iter().enumerate() {
                                if let Some(l) = l {
                                    match l.chan.arm_rx() {
                                        Ok(true) => armed.push(s),
                                        _ => timeout = Duration::ZERO,
                                    }
                                }
                            }
                            timeout = timeout.min(Duration::from_millis(100));
                        }
                    }
                    // Pure spinning on the rings needs no system call.
                    if timeout.is_zero() && tally.remaining == shm_left && self.crowded {
                        // Spinning with more processes here than cores: let the server run.
                        std::thread::yield_now();
                    }
                    if !timeout.is_zero() || tally.remaining > shm_left {
                        if let Err(e) = self.poll.poll(&mut self.events, Some(timeout)) {
                            if e.kind() != io::ErrorKind::Interrupted {
                                return Err(e.into());
                            }
                        }
                        for ev in self.events.iter() {
                            let t = ev.token().0;
                            if t >= SHM_TOKENS {
                                if let Some(Some(l)) = self.links.get(t - SHM_TOKENS) {
                                    shm::drain(&l.doorbell);
                                }
                            } else {
                                ready.push(t);
                            }
                        }
                    }
                    for s in armed {
                        if let Some(Some(l)) = self.links.get(s) {
                            let _ = l.chan.disarm_rx();
                        }
                    }
                }
                for s in ready {
                    let Some(c) = self.servers.get_mut(s) else {
                        continue;
                    };
                    let out = &mut queues[s];
                    if !out.is_empty() {
                        if let Err(e) = out.flush(&mut c.stream, |p| *p) {
                            return Err(KvError::PeerLost(format!("server {s}: {e}")));
                        }
                    }
                    let mut sink = ReplySink {
                        server: s,
                        reqs,
                        dests,
                        tally: &mut tally,
                        cur: &mut c.cur,
                        text: &mut c.text,
                    };
                    if let Err(e) = c.reader.read_from(&mut c.stream, &mut sink) {
                        return Err(match e {
                            TransportError::Closed | TransportError::Truncated { .. } => {
                                KvError::PeerLost(format!("server {s} closed the connection"))
                            }
                            TransportError::Refused(why) if why.starts_with("job aborted") => {
                                KvError::Aborted(why)
                            }
                            other => KvError::PeerLost(format!("server {s}: {other}")),
                        });
                    }
                }
            }
            Ok(())
        })();
        if let Some(pool) = &self.pool {
            let regions = staging.into_iter().chain(recv_staging.into_values());
            if result.is_ok() {
                for r in regions {
                    let _ = pool.pool.free(r);
                }
            } else {
                // A server may still read or write them: they stay allocated.
                self.withheld_pages.extend(regions);
            }
        }
        match result {
            Err(e) => Err(self.fail(e)),
            Ok(()) => match tally.first_err {
                Some(e) => Err(e),
                None => Ok(()),
            },
        }
    }

    /// Takes every answer waiting on the shared-memory rings; returns how many there were.
    fn drain_shm(
        &self,
        reqs: &[Req<'_>],
        dests: &mut [&mut [u8]],
        tally: &mut Tally,
        recv_staging: &HashMap<usize, Region>,
    ) -> Result<usize> {
        let mut any = 0;
        let mut slot = [0u8; kvstore_shm::SLOT];
        for (s, l) in self.links.iter().enumerate() {
            let Some(l) = l else { continue };
            while l.chan.try_recv(&mut slot).map_err(shm::shm)? {
                any += 1;
                let d = shm::decode(&slot)?;
                let m = d.msg;
                if m.op == Op::Abort {
                    return Err(KvError::Aborted(d.text));
                }
                let due = tally.due(reqs, m.req_id, s);
                let Some(idx) = due.filter(|_| m.op == Op::Reply) else {
                    return Err(KvError::Protocol(format!(
                        "unexpected answer {:?} for request {}",
                        m.op, m.req_id
                    )));
                };
                tally.answer(reqs, idx, m.status, s, || d.text);
                if m.status != status::OK {
                    continue;
                }
                if let (Some(dst), Some(di)) = (recv_staging.get(&idx), reqs[idx].dest) {
                    let pool = self
                        .pool
                        .as_ref()
                        .ok_or_else(|| KvError::Protocol("no pool".into()))?;
                    pool.seg.read(dst.offset, dests[di]).map_err(shm::shm)?;
                    self.copies.count(dests[di].len());
                }
            }
        }
        Ok(any)
    }
}

/// A worker's handle on a distributed store.
pub struct DistWorker {
    cfg: Config,
    rank: usize,
    num_workers: usize,
    num_servers: usize,
    server_addrs: Vec<std::net::SocketAddr>,
    sched: StdStream,
    net: Net,
    keys: HashMap<Key, KeyInfo>,
    str_ids: HashMap<String, u64>,
    merge: HashMap<Key, NDArray>,
}

impl DistWorker {
    /// Joins the job described by `cfg` as a worker and connects to every server.
    pub(crate) fn connect(cfg: Config) -> Result<DistWorker> {
        let mut sched = connect_retry(cfg.root, cfg.timeout)?;
        let roster = join(&cfg, &mut sched, role::WORKER, None)?;
        let poll = Poll::new()?;
        let mut servers = Vec::with_capacity(roster.servers.len());
        for (i, addr) in roster.servers.iter().enumerate() {
            let mut s = connect_retry(*addr, cfg.timeout)?;
            let mut hello = Msg::new(Op::Hello);
            hello.key = role::WORKER;
            hello.sender = roster.rank as u32;
            write_frame(
                &mut s,
                &FrameHeader::new(hello.encode(), cfg.secret.len() as u64),
                cfg.secret.as_bytes(),
            )?;
            let (h, _) = read_frame(&mut s, 1 << 16, Some(Instant::now() + cfg.timeout))
                .map_err(|e| KvError::PeerLost(format!("server {i} refused the hello: {e}")))?;
            if Msg::decode(&h.meta)?.op != Op::HelloAck {
                return Err(KvError::Protocol(format!(
                    "server {i} did not acknowledge the hello"
                )));
            }
            s.set_nonblocking(true)?;
            let mut stream = TcpStream::from_std(s);
            poll.registry().register(
                &mut stream,
                Token(i),
                Interest::READABLE | Interest::WRITABLE,
            )?;
            servers.push(ServerConn {
                stream,
                reader: FrameReader::new(cfg.max_message),
                cur: None,
                text: Vec::new(),
            });
        }
        // Servers on this host: shared memory, unless KVSTORE_TRANSPORT says otherwise.
        let choice = Choice::from_env()?;
        let me = shm::host_id();
        let mut links: Vec<Option<WorkerLink>> = Vec::new();
        let mut pool = None;
        for (i, addr) in roster.servers.iter().enumerate() {
            let local = roster.server_hosts.get(i).is_some_and(|h| *h == me);
            let link = match (choice, local) {
                (Choice::Tcp, _) => None,
                (Choice::Shm, false) => {
                    return Err(KvError::Config(format!(
                        "KVSTORE_TRANSPORT=shm, but server {i} ({addr}) is on another host"
                    )))
                }
                (_, true) => {
                    if pool.is_none() {
                        let bytes = std::env::var("KVSTORE_SHM_POOL")
                            .ok()
                            .and_then(|v| v.parse().ok())
                            .unwrap_or(1usize << 30);
                        pool = Some(WorkerPool::create(bytes)?);
                    }
                    let p = pool
                        .as_ref()
                        .ok_or_else(|| KvError::Protocol("pool".into()))?;
                    match shm::attach(addr.port(), &cfg.secret, roster.rank, p, cfg.timeout) {
                        Ok(l) => Some(l),
                        Err(e) if choice == Choice::Shm => return Err(e),
                        Err(_) => None,
                    }
                }
                (Choice::Auto, false) => None,
            };
            if let Some(l) = &link {
                let fd = std::os::fd::AsRawFd::as_raw_fd(&l.doorbell);
                poll.registry().register(
                    &mut mio::unix::SourceFd(&fd),
                    Token(SHM_TOKENS + i),
                    Interest::READABLE,
                )?;
            }
            links.push(link);
        }
        Ok(DistWorker {
            rank: roster.rank,
            num_workers: roster.num_workers,
            num_servers: roster.num_servers,
            server_addrs: roster.servers.clone(),
            sched,
            net: Net {
                poll,
                events: Events::with_capacity(64),
                servers,
                next_req: 1,
                rank: roster.rank as u32,
                timeout: cfg.timeout,
                broken: None,
                crowded: links.iter().flatten().count() + 1 > cores(),
                withheld: Vec::new(),
                withheld_pages: Vec::new(),
                copies: shm::Copies::default(),
                links,
                pool,
            },
            cfg,
            keys: HashMap::new(),
            str_ids: HashMap::new(),
            merge: HashMap::new(),
        })
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
        (0..self.net.servers.len())
            .map(|i| match self.net.links.get(i) {
                Some(Some(_)) => "shm",
                _ => "tcp",
            })
            .collect()
    }

    /// `(copies, bytes)` of tensor bytes this store's shared-memory transport made here.
    pub(crate) fn transport_copies(&self) -> (u64, u64) {
        self.net.copies.get()
    }

    /// Whether every shared-memory server writes pull answers straight into this process's
    /// memory (cross-memory attach), so a pull into any output is one copy.
    pub(crate) fn cross_memory(&self) -> bool {
        let links: Vec<&WorkerLink> = self.net.links.iter().flatten().collect();
        !links.is_empty() && links.iter().all(|l| l.cma)
    }

    /// An array in this worker's shared pool (pushing it copies nothing), or in process memory
    /// when no server is on this host.
    pub(crate) fn alloc(&self, shape: &[usize], dtype: crate::DType) -> Result<NDArray> {
        match &self.net.pool {
            Some(p) => p.alloc_array(shape, dtype),
            None => Ok(NDArray::zeros_dtype(shape, dtype)),
        }
    }

    /// Waits at the scheduler until every worker has arrived.
    pub(crate) fn barrier(&mut self) -> Result<()> {
        self.net.check()?;
        let m = Msg::new(Op::Barrier);
        write_frame(&mut self.sched, &FrameHeader::new(m.encode(), 0), &[])
            .map_err(|e| self.net.fail(KvError::PeerLost(format!("scheduler: {e}"))))?;
        let deadline = Instant::now() + self.cfg.timeout;
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

    fn data_msg(op: Op, info: &KeyInfo, part: &Part) -> Msg {
        let mut m = Msg::new(op);
        m.key = info.id;
        m.dtype = info.dtype;
        m.ndim = info.shape.len() as u8;
        for (d, s) in m.shape.iter_mut().zip(&info.shape) {
            *d = *s as u64;
        }
        m.total = info.shape.iter().product::<usize>() as u64;
        m.start = part.start;
        m.len = part.len;
        m
    }

    /// Rank 0's value is stored; then every worker waits at a barrier (as MXNet does).
    pub(crate) fn init(&mut self, pairs: &[(Key, Vec<&NDArray>)]) -> Result<()> {
        self.net.check()?;
        for (i, (k, vs)) in pairs.iter().enumerate() {
            if self.keys.contains_key(k) || vs.len() > 1 || pairs[..i].iter().any(|(p, _)| p == k) {
                return Err(KvError::DoubleInit(k.clone()));
            }
            if vs[0].shape().len() > MAX_NDIM {
                return Err(KvError::Unsupported(format!(
                    "key {k}: {} dimensions; the wire carries at most {MAX_NDIM}",
                    vs[0].shape().len()
                )));
            }
        }
        let mut infos = Vec::with_capacity(pairs.len());
        for (k, vs) in pairs {
            let id = self.key_id(k);
            let total = vs[0].size() as u64;
            infos.push(KeyInfo {
                id,
                shape: vs[0].shape().to_vec(),
                dtype: vs[0].dtype(),
                parts: placement(id, total, self.num_servers, self.cfg.bigarray_bound),
            });
        }
        let mut result = Ok(());
        if self.rank == 0 {
            let mut reqs = Vec::new();
            for ((_, vs), info) in pairs.iter().zip(&infos) {
                let bytes = vs[0].as_bytes();
                let at = self.net.pool.as_ref().and_then(|p| p.offset_of(vs[0]));
                let es = info.dtype.size();
                for p in &info.parts {
                    reqs.push(Req {
                        server: p.server,
                        msg: Self::data_msg(Op::Init, info, p),
                        payload: &bytes[p.start as usize * es..(p.start + p.len) as usize * es],
                        dest: None,
                        payload_at: at.map(|o| o + p.start as usize * es),
                        dest_at: None,
                    });
                }
            }
            result = self.net.exchange(&mut reqs, &mut []);
            drop(reqs);
            if result.is_err() {
                self.net.withhold(pairs, None);
            }
        }
        // Every worker waits, so no one pushes or pulls a key before rank 0 has stored it.
        let barrier = self.barrier();
        result?;
        barrier?;
        for ((k, _), info) in pairs.iter().zip(infos) {
            self.keys.insert(k.clone(), info);
        }
        Ok(())
    }

    fn check_values(&self, pairs: &[(Key, Vec<&NDArray>)]) -> Result<()> {
        for (k, vs) in pairs {
            let info = self.info(k)?;
            for v in vs {
                if v.shape() != info.shape.as_slice() {
                    return Err(KvError::ShapeMismatch {
                        key: k.clone(),
                        expected: info.shape.clone(),
                        got: v.shape().to_vec(),
                    });
                }
                if v.dtype() != info.dtype {
                    return Err(KvError::DTypeMismatch {
                        key: k.clone(),
                        expected: info.dtype,
                        got: v.dtype(),
                    });
                }
            }
        }
        Ok(())
    }

    fn check_outputs(&self, pairs: &[(Key, Vec<&mut NDArray>)]) -> Result<()> {
        for (k, outs) in pairs {
            let info = self.info(k)?;
            let like = NDArray::zeros_dtype(&info.shape, info.dtype);
            for o in outs {
                check_like(k, &like, o)?;
            }
        }
        Ok(())
    }

    /// Sums each key's list of values into its merge buffer (single values are sent as they are).
    fn merge_lists(&mut self, pairs: &[(Key, Vec<&NDArray>)]) {
        for (k, vs) in pairs {
            if vs.len() > 1 {
                let m = self
                    .merge
                    .entry(k.clone())
                    .or_insert_with(|| NDArray::zeros_dtype(vs[0].shape(), vs[0].dtype()));
                sum_into(m, vs);
            }
        }
    }

    fn send_values(
        &mut self,
        op: Op,
        pairs: &[(Key, Vec<&NDArray>)],
        outs: Option<&mut [(Key, Vec<&mut NDArray>)]>,
    ) -> Result<()> {
        self.net.check()?;
        self.check_values(pairs)?;
        if let Some(o) = &outs {
            self.check_outputs(o)?;
        }
        self.merge_lists(pairs);
        let mut reqs = Vec::new();
        let mut dests: Vec<&mut [u8]> = Vec::new();
        let mut out_pairs = outs;
        // Where each key's reply goes: the first output of that key.
        let mut firsts: HashMap<Key, Vec<&mut [u8]>> = HashMap::new();
        // Where each key's first output lies in the shared pool, if it does.
        let mut first_at: HashMap<Key, Option<usize>> = HashMap::new();
        if let Some(o) = out_pairs.as_deref() {
            for (k, list) in o.iter() {
                if let Some(first) = list.first() {
                    let at = self.net.pool.as_ref().and_then(|p| p.offset_of(first));
                    first_at.entry(k.clone()).or_insert(at);
                }
            }
        }
        if let Some(o) = out_pairs.as_deref_mut() {
            for (k, list) in o.iter_mut() {
                if let Some(first) = list.first_mut() {
                    if firsts.contains_key(k) {
                        continue;
                    }
                    let info = &self.keys[k];
                    let es = info.dtype.size();
                    let mut rest: &mut [u8] = first.as_bytes_mut();
                    let mut chunks = Vec::new();
                    for p in &info.parts {
                        let (a, b) = rest.split_at_mut(p.len as usize * es);
                        chunks.push(a);
                        rest = b;
                    }
                    firsts.insert(k.clone(), chunks);
                }
            }
        }
        for (k, vs) in pairs {
            let info = &self.keys[k];
            let (bytes, at) = if vs.len() > 1 {
                (self.merge[k].as_bytes(), None)
            } else {
                let at = self.net.pool.as_ref().and_then(|p| p.offset_of(vs[0]));
                (vs[0].as_bytes(), at)
            };
            let es = info.dtype.size();
            let out_at = first_at.get(k).copied().flatten();
            let mut chunks = firsts.remove(k).map(|c| c.into_iter());
            for p in &info.parts {
                let dest = chunks.as_mut().and_then(|c| c.next()).map(|d| {
                    dests.push(d);
                    dests.len() - 1
                });
                let off = p.start as usize * es;
                reqs.push(Req {
                    server: p.server,
                    msg: Self::data_msg(op, info, p),
                    payload: &bytes[off..(p.start + p.len) as usize * es],
                    dest,
                    payload_at: at.map(|o| o + off),
                    dest_at: out_at.filter(|_| dest.is_some()).map(|o| o + off),
                });
            }
        }
        let res = self.net.exchange(&mut reqs, &mut dests);
        drop(dests);
        drop(reqs);
        if let Err(e) = res {
            self.net.withhold(pairs, out_pairs);
            return Err(e);
        }
        if let Some(o) = out_pairs {
            copy_to_other_outputs(o);
        }
        Ok(())
    }

    pub(crate) fn push(&mut self, pairs: &[(Key, Vec<&NDArray>)]) -> Result<()> {
        self.send_values(Op::Push, pairs, None)
    }

    pub(crate) fn pushpull(
        &mut self,
        pairs: &[(Key, Vec<&NDArray>)],
        outs: &mut [(Key, Vec<&mut NDArray>)],
    ) -> Result<()> {
        for (k, _) in outs.iter() {
            if !pairs.iter().any(|(p, _)| p == k) {
                return Err(KvError::UnknownKey(k.clone()));
            }
        }
        self.send_values(Op::PushPull, pairs, Some(outs))
    }

    pub(crate) fn pull(&mut self, pairs: &mut [(Key, Vec<&mut NDArray>)]) -> Result<()> {
        self.net.check()?;
        self.check_outputs(pairs)?;
        let mut reqs = Vec::new();
        let mut dests: Vec<&mut [u8]> = Vec::new();
        for (k, list) in pairs.iter_mut() {
            let info = &self.keys[k];
            let es = info.dtype.size();
            let Some(first) = list.first_mut() else {
                continue;
            };
            let at = self.net.pool.as_ref().and_then(|p| p.offset_of(first));
            let mut rest: &mut [u8] = first.as_bytes_mut();
            for p in &info.parts {
                let (a, b) = rest.split_at_mut(p.len as usize * es);
                rest = b;
                dests.push(a);
                reqs.push(Req {
                    server: p.server,
                    msg: Self::data_msg(Op::Pull, info, p),
                    payload: &[],
                    dest: Some(dests.len() - 1),
                    payload_at: None,
                    dest_at: at.map(|o| o + p.start as usize * es),
                });
            }
        }
        let res = self.net.exchange(&mut reqs, &mut dests);
        drop(dests);
        if let Err(e) = res {
            self.net.withhold(&[], Some(pairs));
            return Err(e);
        }
        copy_to_other_outputs(pairs);
        Ok(())
    }

    fn broadcast(&mut self, op: Op, payload: &[u8]) -> Result<()> {
        let mut result = Ok(());
        if self.rank == 0 {
            let mut reqs: Vec<Req> = (0..self.num_servers)
                .map(|s| Req {
                    server: s,
                    msg: Msg::new(op),
                    payload,
                    dest: None,
                    payload_at: None,
                    dest_at: None,
                })
                .collect();
            result = self.net.exchange(&mut reqs, &mut []);
        }
        let b = self.barrier();
        result?;
        b
    }

    /// Rank 0 sends the optimizer to every server; every worker waits until it is in place.
    pub(crate) fn set_optimizer(&mut self, opt: &Optimizer) -> Result<()> {
        Optimizer::decode(&opt.encode())?;
        let bytes: Vec<u8> = opt.encode().iter().flat_map(|w| w.to_le_bytes()).collect();
        self.broadcast(Op::SetOptimizer, &bytes)
    }

    /// Rank 0 selects a registered updater on every server; every worker waits for it.
    pub(crate) fn set_server_updater(&mut self, name: &str) -> Result<()> {
        // Every process runs the same program: a name unknown here is unknown on the servers,
        // and every worker (not only rank 0) must hear so.
        crate::registry::lookup(name)?;
        self.broadcast(Op::SetUpdater, name.as_bytes())
    }
}

/// The cores this process may run on (read once: the query reads cgroup files).
pub(crate) fn cores() -> usize {
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// After a key's first output was filled, copies it into the key's other outputs.
fn copy_to_other_outputs(pairs: &mut [(Key, Vec<&mut NDArray>)]) {
    let mut filled: HashMap<Key, NDArray> = HashMap::new();
    for (k, list) in pairs.iter_mut() {
        let Some((first, rest)) = list.split_first_mut() else {
            continue;
        };
        let src = filled.entry(k.clone()).or_insert_with(|| (**first).clone());
        if !first.shares_storage_with(src) {
            first.as_bytes_mut().copy_from_slice(src.as_bytes());
        }
        for o in rest {
            o.as_bytes_mut().copy_from_slice(src.as_bytes());
        }
    }
}

impl Drop for DistWorker {
    fn drop(&mut self) {
        // Withheld memory is freed only once no server that could write it is alive.
        if self.net.links.iter().flatten().any(|l| !l.server.exited()) {
            for a in self.net.withheld.drain(..) {
                std::mem::forget(a);
            }
        }
        // Tell the servers this is a clean exit, then the scheduler that this worker is done.
        let bye = Msg::new(Op::Bye);
        for c in &mut self.net.servers {
            let mut q = OutQueue::new();
            q.push(bye.header(0), ());
            let _ = q.flush(&mut c.stream, |_| &[]);
        }
        let fin = Msg::new(Op::Finish);
        let _ = write_frame(&mut self.sched, &FrameHeader::new(fin.encode(), 0), &[]);
    }
}
