//! A worker's exchange: the requests of one call go out to every server, over TCP or shared
//! memory, and the loop in the calling thread takes every answer, reading payloads straight
//! into the caller's outputs. Every wait is bounded by the configured timeout.

use std::collections::HashMap;
use std::io;
use std::time::{Duration, Instant};

use kvstore_shm::Region;
use kvstore_transport::tcp::{FrameReader, FrameSink, OutQueue};
use kvstore_transport::{FrameHeader, TransportError};
use mio::net::TcpStream;
use mio::{Events, Poll};

use crate::protocol::{status, Msg, Op};
use crate::shm_link::{self as shm, WorkerLink, WorkerPool};
use crate::{Key, KvError, NDArray, Result};

/// Tokens of shared-memory doorbells in the poll set (server rank added).
pub(crate) const SHM_TOKENS: usize = 1 << 30;
/// How long a wait polls the rings before it sleeps on the doorbells.
const SPIN: Duration = Duration::from_micros(200);

/// One request of a call.
pub(crate) struct Req<'a> {
    pub(crate) server: usize,
    pub(crate) msg: Msg,
    pub(crate) payload: &'a [u8],
    /// Index of the buffer the reply's payload goes to.
    pub(crate) dest: Option<usize>,
    /// Where `payload` lies in this worker's shared pool, if it does (then it is not copied).
    pub(crate) payload_at: Option<usize>,
    /// Where the reply's buffer lies in the shared pool, if it does (the server writes there).
    pub(crate) dest_at: Option<usize>,
}

pub(crate) struct ServerConn {
    pub(crate) stream: TcpStream,
    pub(crate) reader: FrameReader,
    /// The reply being read (it may span many readiness events) and its error text.
    pub(crate) cur: Option<(usize, Msg)>,
    pub(crate) text: Vec<u8>,
}

/// The sockets of a worker.
pub(crate) struct Net {
    pub(crate) poll: Poll,
    pub(crate) events: Events,
    pub(crate) servers: Vec<ServerConn>,
    pub(crate) next_req: u64,
    pub(crate) rank: u32,
    pub(crate) timeout: std::time::Duration,
    pub(crate) broken: Option<String>,
    /// Shared-memory links to the servers on this host, by server rank.
    pub(crate) links: Vec<Option<WorkerLink>>,
    /// This worker's pool, when it has a shared-memory link.
    pub(crate) pool: Option<WorkerPool>,
    /// More of the job's processes on this host (this one and its local servers) than cores:
    /// spinning yields the core.
    pub(crate) crowded: bool,
    /// After a failed call, what a shared-memory server may still write or read: the outputs
    /// taken from the caller (it got fresh arrays in their place) and pool arrays it pushed.
    /// Kept while the servers live; leaked, never freed, if they still do when the store goes.
    pub(crate) withheld: Vec<NDArray>,
    /// Staging pages of failed calls: never freed, so no later array gets them.
    pub(crate) withheld_pages: Vec<Region>,
    /// Copies of tensor bytes this store's shared-memory transport made here.
    pub(crate) copies: shm::Copies,
}

/// Which answers of an exchange have come, from either transport.
pub(crate) struct Tally {
    pub(crate) base: u64,
    pub(crate) done: Vec<bool>,
    pub(crate) remaining: usize,
    pub(crate) first_err: Option<KvError>,
}

impl Tally {
    pub(crate) fn new(base: u64, n: usize) -> Tally {
        Tally {
            base,
            done: vec![false; n],
            remaining: n,
            first_err: None,
        }
    }

    /// The request an answer with `req_id` from `server` is for, if it is one still due.
    pub(crate) fn due(&self, reqs: &[Req<'_>], req_id: u64, server: usize) -> Option<usize> {
        let idx = req_id.wrapping_sub(self.base) as usize;
        (idx < reqs.len() && !self.done[idx] && reqs[idx].server == server).then_some(idx)
    }

    /// Records the answer to request `idx`; a refusal becomes the call's error if it is the
    /// first.
    pub(crate) fn answer(
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

pub(crate) struct ReplySink<'r, 'd> {
    pub(crate) server: usize,
    pub(crate) reqs: &'r [Req<'r>],
    pub(crate) dests: &'r mut [&'d mut [u8]],
    pub(crate) tally: &'r mut Tally,
    pub(crate) cur: &'r mut Option<(usize, Msg)>,
    pub(crate) text: &'r mut Vec<u8>,
}

/// The error a server's answer with a non-zero status stands for.
pub(crate) fn remote_error(status: u16, key: u64, server: usize, text: String) -> KvError {
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

pub(crate) fn refuse(why: String) -> TransportError {
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
    pub(crate) fn withhold(
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

    pub(crate) fn check(&self) -> Result<()> {
        match &self.broken {
            Some(why) => Err(KvError::Aborted(format!("this store is unusable: {why}"))),
            None => Ok(()),
        }
    }

    pub(crate) fn fail(&mut self, e: KvError) -> KvError {
        self.broken = Some(e.to_string());
        e
    }

    /// Sends every request and waits for every reply, reading payloads into `dests`.
    ///
    /// Requests to servers on this host go over shared memory: a payload already in the pool
    /// (an array from `KVStore::alloc`) is named, not copied; any other is copied once into the
    /// pool. A reply's value is written by the server straight into the output when the output
    /// is in the pool, else into staging pages copied out here.
    pub(crate) fn exchange(&mut self, reqs: &mut [Req<'_>], dests: &mut [&mut [u8]]) -> Result<()> {
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
                        if let Err(e) = out.flush(&mut c.stream) {
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
    pub(crate) fn drain_shm(
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
