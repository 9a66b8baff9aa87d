//! The scheduler: rendezvous (addresses and ranks), barriers, shutdown, and abort when a
//! process is lost. Control plane only: a thread per connection reads frames and hands them to
//! one loop that owns all decisions.

use std::collections::{BTreeMap, HashSet};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvstore_transport::tcp::blocking::write_frame;
use kvstore_transport::tcp::{grow_into, FrameReader, FrameSink};
use kvstore_transport::{FrameHeader, TransportError};

use crate::auth;
use crate::protocol::{role, Msg, Op};
use crate::{KvError, Result};

/// How a scheduler is set up.
#[derive(Clone, Debug)]
pub struct SchedulerOptions {
    /// Number of workers to wait for.
    pub num_workers: usize,
    /// Number of servers to wait for.
    pub num_servers: usize,
    /// The job secret every node must present.
    pub secret: String,
    /// How long the registration may take.
    pub timeout: Duration,
}

/// A node that proved the secret, and what it said of itself.
struct Joined {
    id: usize,
    msg: Msg,
    addr: Option<SocketAddr>,
    host: String,
    rdma: Option<SocketAddr>,
    shm: Option<String>,
    mask: [u8; auth::MAC],
    writer: TcpStream,
}

enum Event {
    Hello(Box<Joined>),
    Frame { id: usize, op: Op },
    Closed { id: usize, why: String },
}

struct Node {
    role: u64,
    hint: Option<u32>,
    addr: Option<SocketAddr>,
    host: String,
    /// A server's RDMA listener, when it has an active device.
    rdma: Option<SocketAddr>,
    /// A server's shared-memory socket name.
    shm: Option<String>,
    /// Hides the tokens in its roster (from its handshake).
    mask: [u8; auth::MAC],
    writer: TcpStream,
    rank: usize,
    done: bool,
}

impl Node {
    fn name(&self) -> String {
        let r = if self.role == role::SERVER {
            "server"
        } else {
            "worker"
        };
        format!("{r} {}", self.rank)
    }
}

const MAX_CONTROL: u64 = 64 * 1024;

fn send(w: &mut TcpStream, op: Op, text: &str) -> Result<()> {
    let m = Msg::new(op);
    write_frame(
        w,
        &FrameHeader::new(m.encode(), text.len() as u64),
        text.as_bytes(),
    )?;
    Ok(())
}

/// Counts a connection's reader thread while it lives.
struct Live(Arc<AtomicUsize>);

impl Drop for Live {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// How long a connection may take to prove itself.
const HELLO_WITHIN: Duration = Duration::from_secs(5);
/// Connections in their handshake at once.
const MAX_PENDING: usize = 64;

/// A connection in its handshake ([`crate::auth`]), advanced without blocking by the accept
/// thread: no thread is spent on a connection until it has proven the job's secret.
struct Pending {
    s: TcpStream,
    reader: FrameReader,
    frames: Frames,
    /// After its hello: what it claimed, and both nonces.
    hello: Option<Hello>,
    deadline: Instant,
}

struct Hello {
    msg: Msg,
    rest: Vec<u8>,
    claim: Vec<u8>,
    theirs: [u8; auth::NONCE],
    ours: [u8; auth::NONCE],
}

/// Whole frames of a connection, as they complete.
#[derive(Default)]
struct Frames {
    buf: Vec<u8>,
    done: Vec<(FrameHeader, Vec<u8>)>,
}

impl FrameSink for Frames {
    fn on_header(&mut self, _h: &FrameHeader) -> std::result::Result<(), TransportError> {
        self.buf.clear();
        Ok(())
    }
    fn payload_dest(
        &mut self,
        _h: &FrameHeader,
        got: usize,
        want: usize,
    ) -> std::result::Result<&mut [u8], TransportError> {
        Ok(grow_into(&mut self.buf, got, want))
    }
    fn on_frame(&mut self, h: &FrameHeader) -> std::result::Result<(), TransportError> {
        self.done.push((*h, std::mem::take(&mut self.buf)));
        Ok(())
    }
    /// A frame at a time: each is acted on before the next is read.
    fn wants_more(&self) -> bool {
        self.done.is_empty()
    }
}

/// What a connection's handshake came to.
enum Step {
    /// Still in it.
    Waiting,
    /// Proven: its hello, the hello's lines after the nonce, and the mask of its tokens.
    Proven(Msg, Vec<u8>, [u8; auth::MAC]),
    /// Failed, or too slow: dropped, having learned nothing.
    Dropped,
}

impl Pending {
    fn new(s: TcpStream) -> Option<Pending> {
        s.set_nonblocking(true).ok()?;
        let _ = s.set_nodelay(true);
        Some(Pending {
            s,
            reader: FrameReader::new(MAX_CONTROL),
            frames: Frames::default(),
            hello: None,
            deadline: Instant::now() + HELLO_WITHIN,
        })
    }

    /// Reads what arrived: the hello (answered with this side's challenge and proof), then
    /// the proof.
    fn advance(&mut self, secret: &str) -> Step {
        if Instant::now() >= self.deadline {
            return Step::Dropped;
        }
        if self
            .reader
            .read_from(&mut self.s, &mut self.frames)
            .is_err()
        {
            return Step::Dropped;
        }
        let key: &[&[u8]] = &[secret.as_bytes()];
        if let Some((h, payload)) = self.frames.done.pop() {
            let Ok(msg) = Msg::decode(&h.meta) else {
                return Step::Dropped;
            };
            match (&self.hello, msg.op) {
                (None, Op::Hello) => {
                    let Some(hello) = hello_of(msg, &payload) else {
                        return Step::Dropped;
                    };
                    let proof = auth::proof(
                        key,
                        auth::Side::Responder,
                        &hello.theirs,
                        &hello.ours,
                        &hello.claim,
                    );
                    let text = format!("{}\n{}", auth::hex(&hello.ours), auth::hex(&proof));
                    // A fresh connection's buffer takes these few bytes at once.
                    if send(&mut self.s, Op::Challenge, &text).is_err() {
                        return Step::Dropped;
                    }
                    self.hello = Some(hello);
                }
                (Some(hello), Op::Proof) => {
                    let side = auth::Side::Initiator;
                    if !auth::check(
                        key,
                        side,
                        &hello.theirs,
                        &hello.ours,
                        &hello.claim,
                        &payload,
                    ) {
                        return Step::Dropped;
                    }
                    if self.s.set_nonblocking(false).is_err() {
                        return Step::Dropped;
                    }
                    let mask = auth::token_mask(secret.as_bytes(), &hello.theirs, &hello.ours);
                    return Step::Proven(hello.msg, hello.rest.clone(), mask);
                }
                _ => return Step::Dropped,
            }
        }
        Step::Waiting
    }
}

/// What a node's hello says of it after the nonce: its address (a server's), host, RDMA
/// listener and shared-memory socket name, each checked.
#[allow(clippy::type_complexity)]
pub(crate) fn node_lines(
    payload: &[u8],
) -> (
    Option<SocketAddr>,
    String,
    Option<SocketAddr>,
    Option<String>,
) {
    let mut lines = payload.split(|&b| b == b'\n');
    let addr = lines
        .next()
        .and_then(|a| std::str::from_utf8(a).ok())
        .and_then(|a| a.parse().ok());
    let host = lines
        .next()
        .and_then(|h| std::str::from_utf8(h).ok())
        .filter(|h| !h.is_empty() && !h.contains(char::is_whitespace))
        .unwrap_or("-")
        .to_string();
    let rdma = lines
        .next()
        .and_then(|a| std::str::from_utf8(a).ok())
        .and_then(|a| a.parse().ok());
    let shm = lines
        .next()
        .and_then(|a| std::str::from_utf8(a).ok())
        .filter(|n| !n.is_empty() && *n != "-" && n.chars().all(|c| c.is_ascii_alphanumeric()))
        .map(str::to_string);
    (addr, host, rdma, shm)
}

/// A hello's nonce and claim, with a fresh nonce of this side.
fn hello_of(msg: Msg, payload: &[u8]) -> Option<Hello> {
    let at = payload.iter().position(|&b| b == b'\n')?;
    let theirs = std::str::from_utf8(&payload[..at])
        .ok()
        .and_then(auth::unhex::<{ auth::NONCE }>)?;
    let rest = payload[at + 1..].to_vec();
    let claim = auth::hello_claim(msg.key, msg.sender, &String::from_utf8_lossy(&rest));
    Some(Hello {
        msg,
        rest,
        claim,
        theirs,
        ours: auth::random::<{ auth::NONCE }>().ok()?,
    })
}

/// A proven node's link, read by a thread of its own until it ends.
struct Proven {
    id: usize,
    s: TcpStream,
    msg: Msg,
    payload: Vec<u8>,
    mask: [u8; auth::MAC],
    /// The handshake's reader and what it read after the proof.
    reader: FrameReader,
    frames: Frames,
}

fn reader(p: Proven, tx: mpsc::Sender<Event>, _live: Live, liveness: Duration) {
    let Proven {
        id,
        mut s,
        msg,
        payload,
        mask,
        reader: p_reader,
        frames: p_frames,
    } = p;
    let (addr, host, rdma, shm) = node_lines(&payload);
    let Ok(writer) = s.try_clone() else { return };
    let _ = writer.set_write_timeout(Some(Duration::from_secs(10)));
    if tx
        .send(Event::Hello(Box::new(Joined {
            id,
            msg,
            addr,
            host,
            rdma,
            shm,
            mask,
            writer,
        })))
        .is_err()
    {
        return;
    }
    // Every process beats while it lives: a silence as long as `liveness` is a process that
    // was stopped or hangs, and it is lost. The handshake's reader goes on (it may hold what
    // came after the proof), a frame at a time, each read waiting a short while.
    let (mut reader, mut frames) = (p_reader, p_frames);
    let _ = s.set_read_timeout(Some(Duration::from_millis(100)));
    let mut heard = Instant::now();
    loop {
        for (h, _) in std::mem::take(&mut frames.done) {
            heard = Instant::now();
            match Msg::decode(&h.meta) {
                Ok(m) if m.op == Op::Heartbeat => {}
                Ok(m) => {
                    if tx.send(Event::Frame { id, op: m.op }).is_err() {
                        return;
                    }
                }
                Err(e) => {
                    let _ = tx.send(Event::Closed {
                        id,
                        why: e.to_string(),
                    });
                    return;
                }
            }
        }
        if heard.elapsed() >= liveness {
            let why = format!(
                "no heartbeat for {:.1} s: the process was stopped or hangs",
                liveness.as_secs_f64()
            );
            let _ = tx.send(Event::Closed { id, why });
            return;
        }
        if let Err(e) = reader.read_from(&mut s, &mut frames) {
            let _ = tx.send(Event::Closed {
                id,
                why: e.to_string(),
            });
            return;
        }
    }
}

/// Orders nodes of one role: by their rank hints when those are a permutation, else by arrival.
fn assign_ranks(ids: &[usize], nodes: &mut BTreeMap<usize, Node>) {
    let hints: Vec<Option<u32>> = ids.iter().map(|i| nodes[i].hint).collect();
    let mut seen = HashSet::new();
    let valid = hints
        .iter()
        .all(|h| matches!(h, Some(r) if (*r as usize) < ids.len() && seen.insert(*r)));
    for (n, id) in ids.iter().enumerate() {
        if let Some(node) = nodes.get_mut(id) {
            node.rank = if valid {
                hints[n].unwrap_or(0) as usize
            } else {
                n
            };
        }
    }
}

/// Runs the scheduler on `listener` until the job ends: `Ok` when every worker finished and the
/// servers were shut down, an error (after telling every node to abort) when a node was lost.
///
/// Connections are taken only until every node has registered (then the listener is closed).
/// A new connection's handshake is advanced without blocking by the accept thread, at most
/// [`MAX_PENDING`] at once, each given [`HELLO_WITHIN`]; only a node that proved the job's
/// secret gets a thread (to read its frames), and no more than the job has nodes and a margin.
pub fn run_scheduler(listener: TcpListener, opts: &SchedulerOptions) -> Result<()> {
    let (tx, rx) = mpsc::channel();
    let accepting = Arc::new(AtomicBool::new(true));
    listener.set_nonblocking(true)?;
    let cap = opts.num_servers + opts.num_workers + 16;
    let liveness = crate::roles::liveness(opts.timeout);
    {
        let accepting = accepting.clone();
        let secret = opts.secret.clone();
        let live = Arc::new(AtomicUsize::new(0));
        std::thread::spawn(move || {
            let mut next = 0;
            let mut pending: Vec<Pending> = Vec::new();
            while accepting.load(Ordering::Relaxed) {
                // New connections join the handshakes, as many as the cap allows; beyond it,
                // or out of descriptors, a connection is closed at once.
                while let Ok((s, _)) = listener.accept() {
                    if pending.len() < MAX_PENDING {
                        pending.extend(Pending::new(s));
                    }
                }
                let mut i = 0;
                while i < pending.len() {
                    match pending[i].advance(&secret) {
                        Step::Waiting => i += 1,
                        Step::Dropped => {
                            pending.swap_remove(i);
                        }
                        Step::Proven(msg, payload, mask) => {
                            let p = pending.swap_remove(i);
                            // Proven nodes are the job's: a thread each, a bounded number.
                            if live.load(Ordering::Relaxed) >= cap {
                                continue;
                            }
                            let proven = Proven {
                                id: next,
                                s: p.s,
                                msg,
                                payload,
                                mask,
                                reader: p.reader,
                                frames: p.frames,
                            };
                            next += 1;
                            live.fetch_add(1, Ordering::Relaxed);
                            let guard = Live(live.clone());
                            let tx = tx.clone();
                            // A thread the system refuses drops the connection, not the
                            // scheduler.
                            let _ = std::thread::Builder::new()
                                .name("kvstore-sched-link".into())
                                .spawn(move || reader(proven, tx, guard, liveness));
                        }
                    }
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        });
    }
    let result = serve(&rx, opts, &accepting);
    accepting.store(false, Ordering::Relaxed);
    result
}

fn serve(
    rx: &mpsc::Receiver<Event>,
    opts: &SchedulerOptions,
    accepting: &AtomicBool,
) -> Result<()> {
    let mut nodes: BTreeMap<usize, Node> = BTreeMap::new();
    let (mut servers, mut workers) = (Vec::new(), Vec::new());
    let deadline = Instant::now() + opts.timeout;

    // Rendezvous.
    while servers.len() < opts.num_servers || workers.len() < opts.num_workers {
        let left = deadline.saturating_duration_since(Instant::now());
        let ev = match rx.recv_timeout(left) {
            Ok(ev) => ev,
            Err(RecvTimeoutError::Timeout) => {
                let why = format!(
                    "only {} of {} servers and {} of {} workers registered within {:.0} s",
                    servers.len(),
                    opts.num_servers,
                    workers.len(),
                    opts.num_workers,
                    opts.timeout.as_secs_f64()
                );
                return abort(&mut nodes, why);
            }
            Err(RecvTimeoutError::Disconnected) => {
                return Err(KvError::Aborted("scheduler stopped".into()))
            }
        };
        match ev {
            Event::Hello(j) => {
                let Joined {
                    id,
                    msg,
                    addr,
                    host,
                    rdma,
                    shm,
                    mask,
                    writer,
                } = *j;
                let list = match msg.key {
                    role::SERVER if servers.len() < opts.num_servers && addr.is_some() => {
                        &mut servers
                    }
                    role::WORKER if workers.len() < opts.num_workers => &mut workers,
                    _ => {
                        // Not wanted: closed (its reader thread ends with it).
                        let _ = writer.shutdown(std::net::Shutdown::Both);
                        continue;
                    }
                };
                list.push(id);
                let hint = (msg.sender != u32::MAX).then_some(msg.sender);
                nodes.insert(
                    id,
                    Node {
                        role: msg.key,
                        hint,
                        addr,
                        host,
                        rdma,
                        shm,
                        mask,
                        writer,
                        rank: 0,
                        done: false,
                    },
                );
            }
            Event::Frame { .. } => {}
            Event::Closed { id, why } => {
                if let Some(n) = nodes.remove(&id) {
                    servers.retain(|&s| s != id);
                    workers.retain(|&w| w != id);
                    let why = format!(
                        "a {} left during rendezvous: {why}",
                        if n.role == role::SERVER {
                            "server"
                        } else {
                            "worker"
                        }
                    );
                    return abort(&mut nodes, why);
                }
            }
        }
    }
    // Every node is here: no more connections are taken.
    accepting.store(false, Ordering::Relaxed);
    assign_ranks(&servers, &mut nodes);
    assign_ranks(&workers, &mut nodes);
    let mut addrs = vec![String::new(); opts.num_servers];
    for id in &servers {
        let n = &nodes[id];
        let addr = n.addr.map(|a| a.to_string()).unwrap_or_default();
        let rdma = n.rdma.map_or_else(|| "-".to_string(), |a| a.to_string());
        let shm = n.shm.as_deref().unwrap_or("-");
        addrs[n.rank] = format!("{addr} {} {rdma} {shm}", n.host);
    }
    // Each worker rank's token: given to that worker and to the servers, so that a link to a
    // server can claim only the rank its process was given here.
    let mut tokens = Vec::with_capacity(opts.num_workers);
    for _ in 0..opts.num_workers {
        match auth::random::<{ auth::MAC }>() {
            Ok(t) => tokens.push(t),
            Err(e) => return abort(&mut nodes, format!("no random bytes: {e}")),
        }
    }
    let hosts: Vec<String> = nodes.values().map(|n| n.host.clone()).collect();
    for n in nodes.values_mut() {
        let local = match n.host.as_str() {
            "-" => 1,
            h => hosts.iter().filter(|o| *o == h).count(),
        };
        let mine: Vec<&[u8; auth::MAC]> = if n.role == role::SERVER {
            tokens.iter().collect()
        } else {
            tokens.get(n.rank).into_iter().collect()
        };
        let tokens_text: String = mine
            .iter()
            .map(|t| format!("\ntoken {}", auth::hex(&auth::xor(t, &n.mask))))
            .collect();
        let text = format!(
            "{} {} {} {local}\n{}{tokens_text}",
            n.rank,
            opts.num_workers,
            opts.num_servers,
            addrs.join("\n")
        );
        if let Err(e) = send(&mut n.writer, Op::Roster, &text) {
            let why = format!("cannot reach {}: {e}", n.name());
            return abort(&mut nodes, why);
        }
    }

    // The job.
    let mut at_barrier: HashSet<usize> = HashSet::new();
    // Workers that finished and closed, by name (a barrier waits for them in vain).
    let mut left: BTreeMap<usize, String> = BTreeMap::new();
    // Workers in the order they finished: a failed barrier names the first.
    let mut finished: Vec<usize> = Vec::new();
    let mut shutdown_at: Option<Instant> = None;
    loop {
        let ev = match shutdown_at {
            Some(t) => match rx.recv_timeout(t.saturating_duration_since(Instant::now())) {
                Ok(ev) => ev,
                // Servers that do not close in time are still told; the job's work is done.
                Err(_) => return Ok(()),
            },
            None => match rx.recv() {
                Ok(ev) => ev,
                Err(_) => return Err(KvError::Aborted("scheduler stopped".into())),
            },
        };
        match ev {
            Event::Hello(j) => {
                let _ = j.writer.shutdown(std::net::Shutdown::Both);
            }
            Event::Frame { id, op } => {
                let Some(n) = nodes.get_mut(&id) else {
                    continue;
                };
                match op {
                    Op::Barrier if n.role == role::WORKER => {
                        at_barrier.insert(id);
                        if let Some(why) = barrier_blocked(&finished, &nodes, &left) {
                            fail_barrier(&mut at_barrier, &mut nodes, &why);
                        } else if at_barrier.len() == opts.num_workers {
                            at_barrier.clear();
                            for &w in &workers {
                                if let Some(n) = nodes.get_mut(&w) {
                                    let _ = send(&mut n.writer, Op::BarrierDone, "");
                                }
                            }
                        }
                    }
                    Op::Finish if n.role == role::WORKER => {
                        n.done = true;
                        finished.push(id);
                        // The others waiting at a barrier wait for it in vain.
                        if let Some(why) = barrier_blocked(&finished, &nodes, &left) {
                            fail_barrier(&mut at_barrier, &mut nodes, &why);
                        }
                        // A worker that is gone was done: losing one that was not aborts the job.
                        if workers.iter().all(|w| nodes.get(w).is_none_or(|n| n.done)) {
                            for &s in &servers {
                                if let Some(n) = nodes.get_mut(&s) {
                                    n.done = true;
                                    let _ = send(&mut n.writer, Op::Shutdown, "");
                                }
                            }
                            shutdown_at = Some(Instant::now() + Duration::from_secs(10));
                        }
                    }
                    _ => {}
                }
            }
            Event::Closed { id, why } => {
                let Some(n) = nodes.remove(&id) else { continue };
                left.insert(id, n.name());
                if !n.done {
                    let why = format!("{} was lost ({why})", n.name());
                    return abort(&mut nodes, why);
                }
                if shutdown_at.is_some() && !nodes.values().any(|n| n.role == role::SERVER) {
                    return Ok(());
                }
            }
        }
    }
}

/// Why a barrier cannot complete: a worker finished (or left) before it.
fn barrier_blocked(
    finished: &[usize],
    nodes: &BTreeMap<usize, Node>,
    left: &BTreeMap<usize, String>,
) -> Option<String> {
    finished.iter().find_map(|w| {
        let name = match nodes.get(w) {
            Some(n) if n.done => n.name(),
            Some(_) => return None,
            None => left.get(w).cloned().unwrap_or_else(|| "a worker".into()),
        };
        Some(format!("a barrier cannot complete: {name} finished"))
    })
}

/// Tells the workers waiting at a barrier that it cannot complete.
fn fail_barrier(at: &mut HashSet<usize>, nodes: &mut BTreeMap<usize, Node>, why: &str) {
    for id in at.drain() {
        if let Some(n) = nodes.get_mut(&id) {
            let _ = send(&mut n.writer, Op::Abort, why);
        }
    }
}

fn abort(nodes: &mut BTreeMap<usize, Node>, why: String) -> Result<()> {
    for n in nodes.values_mut() {
        let _ = send(&mut n.writer, Op::Abort, &why);
    }
    Err(KvError::Aborted(why))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    /// This process's threads named as the scheduler names a connection's reader.
    fn link_threads() -> usize {
        std::fs::read_dir("/proc/self/task")
            .map(|d| {
                d.filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
                    .filter(|c| c.trim() == "kvstore-sched-l")
                    .count()
            })
            .unwrap_or(0)
    }

    #[test]
    fn idle_connections_cost_no_thread_and_are_dropped() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let at = listener.local_addr().unwrap();
        let opts = SchedulerOptions {
            num_workers: 1,
            num_servers: 1,
            secret: "s".into(),
            timeout: Duration::from_secs(8),
        };
        let t = std::thread::spawn(move || run_scheduler(listener, &opts));
        // 200 connections that never say a hello.
        let idle: Vec<_> = (0..200)
            .filter_map(|_| std::net::TcpStream::connect(at).ok())
            .collect();
        std::thread::sleep(Duration::from_millis(500));
        // No thread is spent on a connection that has not proven the secret.
        let n = link_threads();
        assert_eq!(n, 0, "{n} reader threads for 200 idle connections");
        assert!(
            n <= 1 + 1 + 16,
            "{n} reader threads for 200 idle connections"
        );
        // Past the hello deadline every one of them is closed, and its thread gone.
        std::thread::sleep(HELLO_WITHIN + Duration::from_secs(1));
        assert_eq!(link_threads(), 0);
        let closed = idle
            .into_iter()
            .filter(|s| {
                let _ = s.set_read_timeout(Some(Duration::from_millis(100)));
                matches!((&mut &*s).read(&mut [0u8; 1]), Ok(0) | Err(_))
            })
            .count();
        assert_eq!(closed, 200);
        // The rendezvous times out as it would have (no node came).
        assert!(t.join().unwrap().is_err());
    }
}
