//! The worker side of a distributed store.
//!
//! A call sends all its requests (every key, every slice, to every server) at once and then
//! drives one mio loop, in the calling thread, until every reply is in: pushes are written
//! straight from the caller's arrays with `writev`, pulls are read straight into the caller's
//! output. Every wait is bounded by the configured timeout; after a timeout or a lost server the
//! store refuses further calls rather than risk reading a stale reply into an array.

mod exchange;

use std::collections::HashMap;
use std::net::TcpStream as StdStream;
use std::time::Instant;

use kvstore_transport::tcp::blocking::{read_frame, write_frame};
use kvstore_transport::tcp::{connect_retry, FrameReader, OutQueue};
use kvstore_transport::{FrameHeader, TransportError};
use mio::net::TcpStream;
use mio::{Events, Interest, Poll, Token};

use crate::config::TransportChoice;
use crate::protocol::shard::{placement, Part};
use crate::protocol::{role, Msg, Op, MAX_NDIM};
use crate::shm_link::{self as shm, WorkerLink, WorkerPool};
use crate::worker::exchange::{Net, Req, ServerConn, SHM_TOKENS};

use crate::config::Config;
use crate::local::{check_like, sum_into};
use crate::optimizer::Optimizer;
use crate::roles::join;
use crate::{DType, Key, KvError, NDArray, Result};

struct KeyInfo {
    id: u64,
    shape: Vec<usize>,
    dtype: DType,
    parts: Vec<Part>,
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
        let choice = cfg.transport;
        let me = shm::host_id();
        let mut links: Vec<Option<WorkerLink>> = Vec::new();
        let mut pool = None;
        for (i, addr) in roster.servers.iter().enumerate() {
            let local = roster.server_hosts.get(i).is_some_and(|h| *h == me);
            let link = match (choice, local) {
                (TransportChoice::Tcp, _) => None,
                (TransportChoice::Shm, false) => {
                    return Err(KvError::Config(format!(
                        "KVSTORE_TRANSPORT=shm, but server {i} ({addr}) is on another host"
                    )))
                }
                (_, true) => {
                    if pool.is_none() {
                        pool = Some(WorkerPool::create(cfg.shm_pool_bytes)?);
                    }
                    let p = pool
                        .as_ref()
                        .ok_or_else(|| KvError::Protocol("pool".into()))?;
                    match shm::attach(addr.port(), &cfg.secret, roster.rank, p, cfg.timeout) {
                        Ok(l) => Some(l),
                        Err(e) if choice == TransportChoice::Shm => return Err(e),
                        Err(_) => None,
                    }
                }
                (TransportChoice::Auto, false) => None,
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
            let _ = q.flush(&mut c.stream);
        }
        let fin = Msg::new(Op::Finish);
        let _ = write_frame(&mut self.sched, &FrameHeader::new(fin.encode(), 0), &[]);
    }
}
