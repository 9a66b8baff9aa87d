//! The scheduler's links to the nodes: a new connection's handshake, advanced without
//! blocking by the accept thread ([`Pending`]), and a proven node's reader thread, which
//! forwards its frames and watches its heartbeat.

use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvstore_transport::tcp::{FrameQueue, FrameReader};

use super::{send, send_on, Event, Node, MAX_CONTROL};
use crate::auth;
use crate::protocol::{Msg, Op};

/// Counts a connection's reader thread while it lives.
pub(super) struct Live(pub(super) Arc<AtomicUsize>);

impl Drop for Live {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// How long a connection may take to prove itself.
pub(super) const HELLO_WITHIN: Duration = Duration::from_secs(5);
/// Connections in their handshake at once.
pub(super) const MAX_PENDING: usize = 64;

/// A connection in its handshake ([`crate::auth`]), advanced without blocking by the accept
/// thread: no thread is spent on a connection until it has proven the job's secret.
pub(super) struct Pending {
    s: TcpStream,
    reader: FrameReader,
    frames: FrameQueue,
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

/// What a connection's handshake came to.
pub(super) enum Step {
    /// Still in it.
    Waiting,
    /// Proven: its hello, the hello's lines after the nonce, and the mask of its tokens.
    Proven(Msg, Vec<u8>, [u8; auth::MAC]),
    /// Failed, or too slow: dropped, having learned nothing.
    Dropped,
}

impl Pending {
    /// Which of `pending` (full) gives its place to a new connection: the oldest that has
    /// not said its hello, else the oldest. A stranger's idle connections so make room for
    /// the job's nodes, which say theirs at once and finish within a round trip.
    pub(super) fn evict(pending: &[Pending]) -> Option<usize> {
        let oldest = |silent: bool| {
            pending
                .iter()
                .enumerate()
                .filter(|(_, p)| !silent || p.hello.is_none())
                .min_by_key(|(_, p)| p.deadline)
                .map(|(i, _)| i)
        };
        oldest(true).or_else(|| oldest(false))
    }

    pub(super) fn new(s: TcpStream) -> Option<Pending> {
        s.set_nonblocking(true).ok()?;
        let _ = s.set_nodelay(true);
        Some(Pending {
            s,
            reader: FrameReader::new(MAX_CONTROL),
            frames: FrameQueue::default(),
            hello: None,
            deadline: Instant::now() + HELLO_WITHIN,
        })
    }

    /// The proven link of node `id`: its reader goes on from where the handshake stopped.
    pub(super) fn proven(
        self,
        id: usize,
        msg: Msg,
        payload: Vec<u8>,
        mask: [u8; auth::MAC],
    ) -> Proven {
        Proven {
            id,
            s: self.s,
            msg,
            payload,
            mask,
            reader: self.reader,
            frames: self.frames,
        }
    }

    /// Reads what arrived: the hello (answered with this side's challenge and proof), then
    /// the proof.
    pub(super) fn advance(&mut self, secret: &str) -> Step {
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
        if let Some((h, payload)) = self.frames.pop() {
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
                    if send_on(&mut self.s, Op::Challenge, &text).is_err() {
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
/// listener and shared-memory socket name, each checked; and its heartbeat period in ms
/// (0 where it says none).
#[allow(clippy::type_complexity)]
pub(crate) fn node_lines(
    payload: &[u8],
) -> (
    Option<SocketAddr>,
    String,
    Option<SocketAddr>,
    Option<String>,
    u32,
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
    let beat = lines
        .next()
        .and_then(|a| std::str::from_utf8(a).ok())
        .and_then(|a| a.parse().ok())
        .unwrap_or(0);
    (addr, host, rdma, shm, beat)
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
pub(super) struct Proven {
    id: usize,
    s: TcpStream,
    msg: Msg,
    payload: Vec<u8>,
    mask: [u8; auth::MAC],
    /// The handshake's reader and what it read after the proof.
    reader: FrameReader,
    frames: FrameQueue,
}

pub(super) fn reader(p: Proven, tx: mpsc::Sender<Event>, _live: Live, liveness: Duration) {
    let Proven {
        id,
        mut s,
        msg,
        payload,
        mask,
        reader: p_reader,
        frames: p_frames,
    } = p;
    let (addr, host, rdma, shm, beat) = node_lines(&payload);
    let Ok(writer) = s.try_clone() else { return };
    let _ = writer.set_write_timeout(Some(Duration::from_secs(10)));
    let writer = Arc::new(std::sync::Mutex::new(writer));
    // A server answers each of its beats with one of the scheduler's: the server's loop,
    // which waits on nothing else of the scheduler's, so learns that it lives.
    let beats_back = (msg.key == crate::protocol::role::SERVER).then(|| writer.clone());
    // The node's own beat period, which its hello said: its silence is judged by it (no
    // node beats more seldom than every 5 s: a hello that says more is not believed).
    let beat = Duration::from_millis(u64::from(beat)).min(crate::roles::MAX_HEARTBEAT);
    let liveness = liveness.max(3 * beat);
    let node = Node {
        role: msg.key,
        hint: (msg.sender != u32::MAX).then_some(msg.sender),
        addr,
        host,
        rdma,
        shm,
        mask,
        writer,
        rank: 0,
        done: false,
    };
    if tx.send(Event::Hello(id, Box::new(node))).is_err() {
        return;
    }
    // Every process beats while it lives: a silence as long as `liveness` is a process that
    // was stopped or hangs, and it is lost. The handshake's reader goes on (it may hold what
    // came after the proof), a frame at a time, each read waiting a short while.
    let (mut reader, mut frames) = (p_reader, p_frames);
    let _ = s.set_read_timeout(Some(Duration::from_millis(100)));
    let mut heard = Instant::now();
    loop {
        while let Some((h, _)) = frames.pop() {
            heard = Instant::now();
            match Msg::decode(&h.meta) {
                Ok(m) if m.op == Op::Heartbeat => {
                    if let Some(w) = &beats_back {
                        let _ = send(w, Op::Heartbeat, "");
                    }
                }
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
