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
use kvstore_transport::FrameHeader;

use crate::auth;
mod links;
use crate::protocol::{role, Msg, Op};
use crate::{KvError, Result};
#[cfg(feature = "internals")]
pub(crate) use links::node_lines;
#[cfg(test)]
use links::HELLO_WITHIN;
use links::{reader, Live, Pending, Step, MAX_PENDING};

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

enum Event {
    /// A node that proved the secret, as it described itself (its rank is not yet given).
    Hello(usize, Box<Node>),
    Frame {
        id: usize,
        op: Op,
    },
    Closed {
        id: usize,
        why: String,
    },
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
    /// Its link, written by the scheduler's loop and (a server's) by its reader's beats.
    writer: Writer,
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

/// A node's link, written a frame at a time by whoever holds it.
type Writer = Arc<std::sync::Mutex<TcpStream>>;

/// Sends a frame to a node. A write that failed (timed out after part of a frame, say) shuts
/// the link: the node would otherwise read the next frame out of step.
fn send(w: &Writer, op: Op, text: &str) -> Result<()> {
    let mut s = w.lock().unwrap_or_else(|p| p.into_inner());
    let r = send_on(&mut s, op, text);
    if r.is_err() {
        let _ = s.shutdown(std::net::Shutdown::Both);
    }
    r
}

fn send_on(s: &mut TcpStream, op: Op, text: &str) -> Result<()> {
    let m = Msg::new(op);
    write_frame(
        s,
        &FrameHeader::new(m.encode(), text.len() as u64),
        text.as_bytes(),
    )?;
    Ok(())
}

/// Closes a node's link (its reader thread ends with it).
fn close(w: &Writer) {
    let s = w.lock().unwrap_or_else(|p| p.into_inner());
    let _ = s.shutdown(std::net::Shutdown::Both);
}

/// Ranks the nodes of one role: each its hint (`KVSTORE_RANK`) where that is in range and no
/// earlier node took it, the others the free ranks by arrival. A hint not honoured is named
/// in a warning.
fn assign_ranks(ids: &[usize], nodes: &mut BTreeMap<usize, Node>) {
    let mut taken = vec![false; ids.len()];
    let mut ranks: Vec<Option<usize>> = ids
        .iter()
        .map(|i| {
            let r = nodes[i].hint? as usize;
            (r < taken.len() && !std::mem::replace(&mut taken[r], true)).then_some(r)
        })
        .collect();
    let mut free = (0..ids.len()).filter(|&r| !taken[r]);
    for (n, id) in ids.iter().enumerate() {
        let Some(node) = nodes.get_mut(id) else {
            continue;
        };
        if ranks[n].is_none() {
            ranks[n] = free.next();
            if let Some(h) = node.hint {
                let role = if node.role == role::SERVER {
                    "server"
                } else {
                    "worker"
                };
                tracing::warn!(
                    "a {role} on {}: its rank hint {h} is out of range or taken; it gets rank {}",
                    node.host,
                    ranks[n].unwrap_or(n)
                );
            }
        }
        node.rank = ranks[n].unwrap_or(n);
    }
}

/// Runs the scheduler on `listener` until the job ends: `Ok` when every worker finished and the
/// servers were shut down, an error (after telling every node to abort) when a node was lost.
///
/// Connections are taken only until every node has registered (then the listener is closed).
/// A new connection's handshake is advanced without blocking by the accept thread, at most 64
/// at once, each given 5 seconds to say hello; only a node that proved the job's
/// secret gets a thread (to read its frames), and no more than the job has nodes and a margin.
pub fn run_scheduler(listener: TcpListener, opts: &SchedulerOptions) -> Result<()> {
    // A job without workers would never finish (nothing ends it), and one without servers
    // holds nothing.
    if opts.num_workers == 0 || opts.num_servers == 0 {
        return Err(KvError::Config(format!(
            "a job needs a worker and a server at least, not {} workers and {} servers",
            opts.num_workers, opts.num_servers
        )));
    }
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
                // New connections join the handshakes; beyond the cap, each takes the place
                // of the oldest that is silent (else the oldest). At most a cap's worth a
                // pass, so that a flood of connections cannot keep handshakes from advancing.
                for _ in 0..MAX_PENDING {
                    let Ok((s, _)) = listener.accept() else {
                        break;
                    };
                    if pending.len() >= MAX_PENDING {
                        if let Some(i) = Pending::evict(&pending) {
                            pending.swap_remove(i);
                        }
                    }
                    pending.extend(Pending::new(s));
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
                            let proven = p.proven(next, msg, payload, mask);
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
            Event::Hello(id, node) => {
                let list = match node.role {
                    role::SERVER if servers.len() < opts.num_servers && node.addr.is_some() => {
                        &mut servers
                    }
                    role::WORKER if workers.len() < opts.num_workers => &mut workers,
                    _ => {
                        // Not wanted: closed (its reader thread ends with it).
                        close(&node.writer);
                        continue;
                    }
                };
                list.push(id);
                nodes.insert(id, *node);
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
        if let Err(e) = send(&n.writer, Op::Roster, &text) {
            let why = format!("cannot reach {}: {e}", n.name());
            return abort(&mut nodes, why);
        }
    }

    tracing::info!(
        "scheduler: {} workers and {} servers joined",
        opts.num_workers,
        opts.num_servers
    );
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
            Event::Hello(_, node) => {
                close(&node.writer);
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
                                    let _ = send(&n.writer, Op::BarrierDone, "");
                                }
                            }
                        }
                    }
                    // (Said again by a worker, it is nothing new: the servers were told.)
                    Op::Finish if n.role == role::WORKER && !n.done => {
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
                                    let _ = send(&n.writer, Op::Shutdown, "");
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
            let _ = send(&n.writer, Op::Abort, why);
        }
    }
}

fn abort(nodes: &mut BTreeMap<usize, Node>, why: String) -> Result<()> {
    for n in nodes.values_mut() {
        let _ = send(&n.writer, Op::Abort, &why);
    }
    Err(KvError::Aborted(why))
}

#[cfg(test)]
mod tests;
