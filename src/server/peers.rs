//! A server's workers, as its loop sees them: messages from the backends go to the state
//! machine (after the hello, which authenticates the worker), and the state machine's answers
//! go out as puts into the granted destinations and reply messages, in order per worker. A
//! worker whose answers cannot be sent is paused (its requests wait in its link) until they
//! drain: backpressure, with nothing growing without bound.

use std::collections::{HashMap, VecDeque};

use kvstore_transport::{Completion, Lent, RemoteRegion, Sent, Token, TransportError};

use crate::config::secret_matches;
use crate::net::{region_of, Addr, Medium, Net};
use crate::protocol::{role, status, Msg, Op};
use crate::server::state::{Input, Out, Payload, PeerData, ServerState};
use crate::{DType, NDArray};

/// Largest control payload (hello, names, optimizer parameters, error text).
pub(super) const MAX_CONTROL: usize = 60 * 1024;
/// Answers a worker may have waiting to be sent before the server stops taking its requests.
const MAX_BACKLOG: usize = 64;

#[derive(Default)]
struct Worker {
    /// The rank, once the hello was accepted.
    rank: Option<usize>,
    /// Said goodbye: its link closing is no loss.
    bye: bool,
    /// Answers not yet taken by the backend, in order.
    backlog: VecDeque<Pending>,
    paused: bool,
}

struct Pending {
    out: Out,
    /// Where a value goes, and whether it was put there already.
    grant: Option<RemoteRegion>,
    put: bool,
}

/// The workers of a server and what is addressed to them.
pub(super) struct Workers {
    secret: Vec<u8>,
    taken: Vec<bool>,
    peers: HashMap<Addr, Worker>,
    /// Destinations that pull requests granted, until their answer goes out.
    grants: HashMap<(usize, u64), RemoteRegion>,
    /// Links to close once the backends are free.
    close: Vec<Addr>,
    /// Control payloads are made arrays of bytes here, reused.
    scratch: NDArray,
    /// A reply's body is assembled here, reused.
    body: Vec<u8>,
    /// Workers attached over shared memory.
    local: usize,
}

fn refusal(m: &Msg, why: impl Into<String>) -> Out {
    let mut r = *m;
    r.op = Op::Reply;
    r.status = status::FAILED;
    Out {
        to: 0,
        msg: r,
        payload: Payload::Text(why.into().into_bytes()),
    }
}

impl Workers {
    pub(super) fn new(secret: &str, num_workers: usize) -> Workers {
        Workers {
            secret: secret.as_bytes().to_vec(),
            taken: vec![false; num_workers],
            peers: HashMap::new(),
            grants: HashMap::new(),
            close: Vec::new(),
            scratch: NDArray::zeros_dtype(&[0], DType::U8),
            body: Vec::new(),
            local: 0,
        }
    }

    /// Takes one completion of a backend.
    pub(super) fn on(&mut self, state: &mut ServerState, medium: Medium, c: Completion<'_>) {
        match c {
            Completion::Connected { peer } => {
                self.local += (medium == Medium::Shm) as usize;
                self.peers.insert(Addr { medium, peer }, Worker::default());
            }
            Completion::Recv { peer, body, data } => {
                let addr = Addr { medium, peer };
                if let Err(why) = self.recv(state, addr, body, data) {
                    eprintln!("kvstore server: closing a link: {why}");
                    self.close.push(addr);
                }
            }
            Completion::Lost { peer, error } => self.lost(state, Addr { medium, peer }, &error),
            // Puts and replies complete on their own; a failed one means a lost worker, which is
            // reported as such.
            Completion::Done(_) | Completion::Failed(..) | Completion::Put { .. } => {}
        }
    }

    fn recv(
        &mut self,
        state: &mut ServerState,
        addr: Addr,
        body: &[u8],
        data: Option<Lent<'_>>,
    ) -> Result<(), String> {
        let (m, rest) = Msg::from_body(body).map_err(|e| e.to_string())?;
        let w = self.peers.entry(addr).or_default();
        let Some(rank) = w.rank else {
            if m.op != Op::Hello || m.key != role::WORKER {
                return Err(format!("{:?} before the hello", m.op));
            }
            let secret = rest.split(|&b| b == b'\n').next().unwrap_or(&[]);
            if !secret_matches(secret, &self.secret) {
                return Err("wrong job secret".into());
            }
            let r = m.sender as usize;
            if r >= self.taken.len() || self.taken[r] {
                return Err(format!("worker rank {r} is invalid or taken"));
            }
            self.taken[r] = true;
            w.rank = Some(r);
            let mut ack = Msg::new(Op::HelloAck);
            ack.req_id = m.req_id;
            state.outbox.push(Out {
                to: addr.id(),
                msg: ack,
                payload: Payload::None,
            });
            return Ok(());
        };
        let refuse = |state: &mut ServerState, why: &str| {
            let mut o = refusal(&m, why);
            o.to = addr.id();
            state.outbox.push(o);
        };
        match m.op {
            Op::Bye => {
                w.bye = true;
                return Ok(());
            }
            Op::Hello => return Err("a second hello".into()),
            _ => {}
        }
        if matches!(m.op, Op::Pull | Op::PushPull) {
            match RemoteRegion::from_bytes(rest) {
                Some(g) if Some(g.len() as u64) == m.data_bytes() => {
                    self.grants.insert((addr.id(), m.req_id), g);
                }
                _ => {
                    refuse(state, "no valid destination for the answer");
                    return Ok(());
                }
            }
        }
        if m.op.carries_data() {
            let Some(d) = data.filter(|d| Some(d.len() as u64) == m.data_bytes()) else {
                self.grants.remove(&(addr.id(), m.req_id));
                refuse(state, "payload length does not match the message");
                return Ok(());
            };
            // SAFETY: the backend lends `d.len()` bytes at `d.as_ptr()` for this callback, which
            // the state machine's call does not outlive.
            let p = unsafe { PeerData::new(d.as_ptr(), m.len as usize, m.dtype) };
            state.handle(addr.id(), rank, &m, Input::Peer(&p));
        } else {
            let bytes = if matches!(m.op, Op::SetOptimizer | Op::SetUpdater) {
                rest
            } else {
                &[]
            };
            if bytes.len() > MAX_CONTROL {
                return Err("an oversized control payload".into());
            }
            self.scratch.reset_as(&[bytes.len()], DType::U8);
            self.scratch.as_bytes_mut().copy_from_slice(bytes);
            state.handle(addr.id(), rank, &m, Input::Owned(&mut self.scratch));
        }
        Ok(())
    }

    fn lost(&mut self, state: &mut ServerState, addr: Addr, error: &TransportError) {
        let Some(w) = self.peers.remove(&addr) else {
            return;
        };
        self.local = self
            .local
            .saturating_sub((addr.medium == Medium::Shm) as usize);
        if let Some(r) = w.rank {
            self.taken[r] = false;
            if !w.bye {
                let why = match error {
                    TransportError::Closed | TransportError::Truncated { .. } => {
                        format!("worker {r} disconnected")
                    }
                    other => format!("the link of worker {r} failed: {other}"),
                };
                state.worker_lost(&why);
            }
        }
        let id = addr.id();
        self.grants.retain(|(p, _), _| *p != id);
        state.forget_peer(id);
    }

    /// Closes the links that broke the protocol.
    pub(super) fn close_refused(&mut self, state: &mut ServerState, net: &mut Net) {
        for addr in std::mem::take(&mut self.close) {
            if let Ok(b) = net.backend(addr.medium) {
                b.close(addr.peer);
            }
            self.lost(state, addr, &TransportError::Closed);
        }
    }

    /// Sends what the state machine answered, in order per worker, as far as the links take
    /// it; pauses the workers whose answers back up, and resumes the ones whose answers
    /// drained.
    pub(super) fn route(&mut self, state: &mut ServerState, net: &mut Net) {
        for out in state.outbox.drain(..) {
            let grant = self.grants.remove(&(out.to, out.msg.req_id));
            if let Some(w) = self.peers.get_mut(&Addr::from_id(out.to)) {
                w.backlog.push_back(Pending {
                    out,
                    grant,
                    put: false,
                });
            }
        }
        let mut broken = Vec::new();
        for (addr, w) in self.peers.iter_mut() {
            let Ok(b) = net.backend(addr.medium) else {
                continue;
            };
            while let Some(p) = w.backlog.front_mut() {
                match send(b, addr, p, &mut self.body) {
                    Ok(true) => {
                        w.backlog.pop_front();
                    }
                    Ok(false) => break,
                    Err(e) => {
                        broken.push((*addr, e));
                        break;
                    }
                }
            }
            let full = w.backlog.len() >= MAX_BACKLOG;
            if full != w.paused {
                w.paused = full;
                b.pause(addr.peer, full);
            }
        }
        for (addr, e) in broken {
            if let Ok(b) = net.backend(addr.medium) {
                b.close(addr.peer);
            }
            self.lost(state, addr, &e);
        }
    }

    /// How many workers are attached over shared memory.
    pub(super) fn local(&self) -> usize {
        self.peers
            .keys()
            .filter(|a| a.medium == Medium::Shm)
            .count()
    }

    /// Whether answers are still waiting to go out.
    pub(super) fn pending(&self) -> bool {
        self.peers.values().any(|w| !w.backlog.is_empty())
    }
}

/// Posts one answer: the value's put (once), then the reply. `false`: the link is full.
fn send(
    b: &mut dyn kvstore_transport::Backend,
    addr: &Addr,
    p: &mut Pending,
    body: &mut Vec<u8>,
) -> Result<bool, TransportError> {
    if let (Payload::Array(a), Some(g), false) = (&p.out.payload, &p.grant, p.put) {
        let region = region_of(b, a)?;
        // SAFETY: the stored value is never written through this storage while the put reads
        // it: the region holds a clone of the array's storage, and the store writes its values
        // copy-on-write, so an update after this point writes other memory.
        let sent = unsafe {
            b.put(
                addr.peer,
                &region,
                0..a.nbytes(),
                g,
                0,
                p.out.msg.req_id as u32,
                Token(0),
            )
        };
        match sent {
            Ok(Sent::WouldBlock) => return Ok(false),
            Ok(Sent::Posted) => p.put = true,
            // The destination is gone (the worker revoked it after giving up on the call) or
            // was never valid: the answer says so instead.
            Err(TransportError::PeerLost(e)) => return Err(TransportError::PeerLost(e)),
            Err(e) => {
                p.put = true;
                p.out.msg.status = status::FAILED;
                p.out.payload =
                    Payload::Text(format!("the answer was not delivered: {e}").into_bytes());
            }
        }
    }
    let text: &[u8] = match &p.out.payload {
        Payload::Text(t) => &t[..t.len().min(MAX_CONTROL)],
        _ => &[],
    };
    body.clear();
    body.extend_from_slice(&p.out.msg.encode());
    body.extend_from_slice(text);
    // SAFETY: no data rides with the reply.
    match unsafe { b.send(addr.peer, body, None) }? {
        Sent::Posted => Ok(true),
        Sent::WouldBlock => Ok(false),
    }
}
