//! A server's workers, as its loop sees them: messages from the backends go to the state
//! machine (after the hello, which authenticates the worker), and the state machine's answers
//! go out as puts into the granted destinations and reply messages, in order per worker. A
//! worker whose answers cannot be sent is paused (its requests wait in its link) until they
//! drain: backpressure, with nothing growing without bound. Pushes put into receive slots
//! ([`Slots`]) arrive as puts, and are handled where they landed.

use rustc_hash::{FxHashMap, FxHashSet};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

use kvstore_transport::{Completion, Lent, Region, RemoteRegion, Token, TransportError};

use crate::auth;
use crate::net::{Addr, Medium, Net};
use crate::protocol::{batch, flags, role, status, Msg, Op};
use crate::server::batch::send_batch;
use crate::server::slots::Slots;
use crate::server::state::{Input, Out, Payload, PeerData, ServerState};

mod slot_io;
use crate::{DType, NDArray};

/// Largest control payload (hello, names, optimizer parameters, error text).
pub(super) const MAX_CONTROL: usize = 60 * 1024;
/// Answers a worker may have waiting to be sent before the server stops taking its requests.
const MAX_BACKLOG: usize = 64;
/// How long a link may go without an accepted hello before it is closed: a connection that
/// says nothing, or half a hello, costs the server nothing beyond this.
pub(super) const HELLO_WITHIN: Duration = Duration::from_secs(5);

impl Worker {
    fn new() -> Worker {
        Worker {
            since: Instant::now(),
            rank: None,
            claim: None,
            bye: false,
            backlog: VecDeque::new(),
            paused: false,
        }
    }
}

struct Worker {
    /// When its link came up: a link without an accepted hello is closed at [`HELLO_WITHIN`].
    since: Instant,
    /// The rank, once the hello was accepted.
    rank: Option<usize>,
    /// Its hello's handshake until its proof: the rank claimed, its nonce and ours.
    claim: Option<(usize, [u8; auth::NONCE], [u8; auth::NONCE])>,
    /// Said goodbye: its link closing is no loss.
    bye: bool,
    /// Answers not yet taken by the backend, in order.
    backlog: VecDeque<Pending>,
    paused: bool,
}

pub(super) struct Pending {
    pub(super) out: Out,
    /// Where a value goes, and whether it was put there already.
    pub(super) grant: Option<RemoteRegion>,
    pub(super) put: bool,
    /// The receive slot whose credit the reply carries.
    pub(super) slot: Option<RemoteRegion>,
    /// Its request came in a batch: it goes back in one, carrying its value.
    pub(super) batched: bool,
}

/// The workers of a server and what is addressed to them.
pub(super) struct Workers {
    secret: Vec<u8>,
    /// Each worker rank's token (from the scheduler): a link proves it with the secret.
    tokens: Vec<[u8; auth::MAC]>,
    taken: Vec<bool>,
    peers: FxHashMap<Addr, Worker>,
    /// Destinations that pull requests granted, until their answer goes out.
    grants: FxHashMap<(usize, u64), RemoteRegion>,
    /// Requests that came in batches, until their answer goes out.
    batched: FxHashSet<(usize, u64)>,
    /// Batches of answers are assembled here, reused.
    batch: batch::Writer,
    /// Links to close once the backends are free.
    close: Vec<Addr>,
    /// Links whose worker proved itself: its frames may be as large as the job allows.
    trusted: Vec<Addr>,
    /// When the first link without an accepted hello is due to be closed, while there is one.
    hello_due: Option<Instant>,
    /// Control payloads are made arrays of bytes here, reused.
    scratch: NDArray,
    /// A reply's body is assembled here, reused.
    body: Vec<u8>,
    slots: Slots<Region, RemoteRegion>,
    /// Grants of receive slots to revoke (a lost worker's), by peer.
    fence: Vec<(usize, RemoteRegion)>,
}

fn refusal(m: &Msg, why: impl Into<String>) -> Out {
    let mut r = *m;
    r.op = Op::Reply;
    r.status = status::FAILED;
    // Its text is all that follows (no slot, no value).
    r.flags = 0;
    r.aux = 0;
    Out {
        to: 0,
        msg: r,
        payload: Payload::Text(why.into().into_bytes()),
    }
}

impl Workers {
    pub(super) fn new(secret: &str, tokens: Vec<[u8; auth::MAC]>, slot_bytes: usize) -> Workers {
        Workers {
            secret: secret.as_bytes().to_vec(),
            taken: vec![false; tokens.len()],
            tokens,
            peers: FxHashMap::default(),
            grants: FxHashMap::default(),
            batched: FxHashSet::default(),
            batch: batch::Writer::new(0),
            close: Vec::new(),
            trusted: Vec::new(),
            hello_due: None,
            scratch: NDArray::zeros_dtype(&[0], DType::U8),
            body: Vec::new(),
            slots: Slots::new(slot_bytes),
            fence: Vec::new(),
        }
    }

    /// Takes one completion of a backend.
    pub(super) fn on(&mut self, state: &mut ServerState, medium: Medium, c: Completion<'_>) {
        match c {
            Completion::Connected { peer } => {
                let addr = Addr { medium, peer };
                // Links without an accepted hello are few: beyond as many as there are workers
                // (and a margin), the oldest gives its place. A worker proves itself within a
                // round trip of connecting, so a stranger would have to open that many links
                // within one to turn it away. (Closing the newest let a stranger who kept them
                // open turn every worker away; closing a silent one first, one who said hellos
                // on its own, which costs nothing, the worker whose hello was not read yet.)
                let close = &self.close;
                let oldest = (self.peers.iter())
                    .filter(|(a, w)| w.rank.is_none() && !close.contains(a))
                    .map(|(a, w)| (w.since, *a));
                let waiting: Vec<(Instant, Addr)> = oldest.collect();
                if waiting.len() >= self.taken.len() + 8 {
                    if let Some(&(_, a)) = waiting.iter().min_by_key(|(since, _)| *since) {
                        self.close.push(a);
                    }
                }
                self.peers.insert(addr, Worker::new());
                self.hello_due.get_or_insert(Instant::now() + HELLO_WITHIN);
            }
            Completion::Recv { peer, body, data } => {
                let addr = Addr { medium, peer };
                let r = self.recv(state, addr, body, data);
                self.close_on_error(addr, r);
            }
            Completion::Lost { peer, error } => self.lost(state, Addr { medium, peer }, &error),
            Completion::Put {
                peer,
                grant,
                offset,
                len,
                imm,
            } => {
                let addr = Addr { medium, peer };
                let r = self.slot_put(state, addr, grant, offset, len, imm);
                self.close_on_error(addr, r);
            }
            // Puts and replies complete on their own; a failed one means a lost worker, which is
            // reported as such.
            Completion::Done(_) | Completion::Failed(..) => {}
        }
    }

    /// A worker that broke the protocol: its link is closed once the backends are free.
    fn close_on_error(&mut self, addr: Addr, r: Result<(), String>) {
        if let Err(why) = r {
            tracing::warn!("closing a link: {why}");
            self.close.push(addr);
        }
    }

    fn recv(
        &mut self,
        state: &mut ServerState,
        addr: Addr,
        body: &[u8],
        data: Option<Lent<'_>>,
    ) -> Result<(), String> {
        // A link being closed (given its place to a newer one) is taken at its word no more:
        // a proof read after that would make a worker of a link about to be lost.
        if self.close.contains(&addr) {
            return Ok(());
        }
        let (m, rest) = Msg::from_body(body).map_err(|e| e.to_string())?;
        let w = self.peers.entry(addr).or_insert_with(Worker::new);
        let Some(rank) = w.rank else {
            // The handshake ([`crate::auth`]): a hello with its nonce, then its proof of the
            // secret and of the rank's token; nothing else before it.
            let r = m.sender as usize;
            if r >= self.taken.len() || self.taken[r] || m.key != role::WORKER {
                return Err(format!(
                    "a {:?} for worker rank {r}, invalid or taken",
                    m.op
                ));
            }
            let claim = auth::worker_claim(r);
            let mut reply = Msg::new(Op::Challenge);
            reply.req_id = m.req_id;
            let payload = match (m.op, w.claim) {
                (Op::Hello, None) => {
                    let theirs: [u8; auth::NONCE] = rest
                        .get(..auth::NONCE)
                        .and_then(|n| n.try_into().ok())
                        .ok_or("a hello without a nonce")?;
                    let ours = auth::random::<{ auth::NONCE }>().map_err(|e| e.to_string())?;
                    let key: &[&[u8]] = &[&self.secret];
                    let proof = auth::proof(key, auth::Side::Responder, &theirs, &ours, &claim);
                    w.claim = Some((r, theirs, ours));
                    Payload::Text([&ours[..], &proof[..]].concat())
                }
                (Op::Proof, Some((claimed, theirs, ours))) if claimed == r => {
                    let key: &[&[u8]] = &[&self.secret, &self.tokens[r]];
                    let side = auth::Side::Initiator;
                    if !auth::check(key, side, &theirs, &ours, &claim, rest) {
                        return Err(format!(
                            "a link failed to prove the job's secret and worker {r}'s token"
                        ));
                    }
                    self.taken[r] = true;
                    w.rank = Some(r);
                    // With no link left waiting for its hello, the loop stops reading the
                    // clock for them on every turn.
                    if self.peers.values().all(|w| w.rank.is_some()) {
                        self.hello_due = None;
                    }
                    tracing::debug!("worker {r} connected over {}", addr.medium.name());
                    // A proven worker may send what the job's limit allows.
                    self.trusted.push(addr);
                    reply.op = Op::HelloAck;
                    Payload::None
                }
                (op, _) => return Err(format!("{op:?} before the handshake ended")),
            };
            state.outbox.push(Out {
                to: addr.id(),
                msg: reply,
                payload,
            });
            return Ok(());
        };
        match m.op {
            Op::Bye => {
                w.bye = true;
                // A round it never pushed cannot complete: those fail now, naming it.
                state.worker_gone(rank, "finished without pushing it");
                return Ok(());
            }
            Op::Hello => return Err("a second hello".into()),
            Op::Batch => return self.recv_batch(state, addr, rank, &m, rest, data),
            _ => {}
        }
        let refuse = |state: &mut ServerState, why: &str| {
            let mut o = refusal(&m, why);
            o.to = addr.id();
            state.outbox.push(o);
        };
        if matches!(m.op, Op::Pull | Op::PushPull | Op::States) {
            match RemoteRegion::from_bytes(rest) {
                Some(g) if Some(g.len() as u64) == m.value_bytes() => {
                    self.grants.insert((addr.id(), m.req_id), g);
                }
                _ => {
                    refuse(state, "no valid destination for the answer");
                    return Ok(());
                }
            }
        }
        if m.flags & flags::SLOT != 0 {
            if data.is_some() {
                return Err("a slot push with data of its own".into());
            }
            let (id, _) = self.slots.on_slot_msg(addr.id(), &m)?;
            self.serve_slot(state, addr, rank, &m, id)?;
        } else if m.op.carries_data() {
            self.slots.on_push(addr.id(), &m);
            let came = data.is_some();
            let Some(d) = data.filter(|d| Some(d.len() as u64) == m.data_bytes()) else {
                self.grants.remove(&(addr.id(), m.req_id));
                if !came {
                    // Its data dropped as it came (TCP's admission: it does not fit its key),
                    // or none came: answered with what is wrong with it.
                    state.answer_unfit(addr.id(), &m);
                } else {
                    refuse(state, "payload length does not match the message");
                }
                return Ok(());
            };
            let (n, dtype) = m.payload_layout();
            // SAFETY: the backend lends `d.len()` bytes at `d.as_ptr()` for this callback, which
            // the state machine's call does not outlive; they are `n` elements of `dtype`
            // (`data_bytes`, checked above).
            // All of `d`: the state machine may hold it past this message.
            let p = unsafe { PeerData::new(d.as_ptr(), n, dtype) }.of_whole(&d);
            state.handle(addr.id(), rank, &m, Input::Peer(&p, None));
        } else {
            self.control(state, addr, rank, &m, rest)?;
        }
        Ok(())
    }

    /// A request with no data (a pull, or a control request with its text).
    fn control(
        &mut self,
        state: &mut ServerState,
        addr: Addr,
        rank: usize,
        m: &Msg,
        rest: &[u8],
    ) -> Result<(), String> {
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
        state.handle(addr.id(), rank, m, Input::Owned(&mut self.scratch));
        Ok(())
    }

    /// A batch of pushes, pulls and pushpulls: each is handled as if it had come alone, its
    /// data read where the batch's data lies; their answers go back as a batch.
    fn recv_batch(
        &mut self,
        state: &mut ServerState,
        addr: Addr,
        rank: usize,
        h: &Msg,
        rest: &[u8],
        data: Option<Lent<'_>>,
    ) -> Result<(), String> {
        let len = data.as_ref().map_or(0, |d| d.len());
        let entries = batch::read(h, rest, len, |op| {
            matches!(op, Op::Push | Op::Pull | Op::PushPull)
        })?;
        // Every entry is judged before any is handled: a malformed batch does nothing but
        // close its link (none of its pushes counted into a round).
        for e in &entries {
            if e.msg.flags & !flags::PACKED != 0 || !e.text.is_empty() {
                return Err("a batched request with flags or text".into());
            }
            let answer = matches!(e.msg.op, Op::Pull | Op::PushPull);
            let big = |n: Option<u64>| n.is_none_or(|n| n > batch::ITEM_MAX as u64);
            if big(e.msg.data_bytes()) || (answer && big(e.msg.value_bytes())) {
                return Err(format!("a batched request for {} elements", e.msg.len));
            }
        }
        for e in entries {
            self.batched.insert((addr.id(), e.msg.req_id));
            match (e.data, &data) {
                (Some(r), Some(d)) => {
                    let (n, dtype) = e.msg.payload_layout();
                    // SAFETY: `batch::read` checked that the range lies within the `d.len()`
                    // bytes the backend lends at `d.as_ptr()` for this callback, which the
                    // state machine's call does not outlive; the range is the entry's
                    // `data_bytes`: `n` elements of `dtype`.
                    let p = unsafe { PeerData::new(d.as_ptr().add(r.start), n, dtype) };
                    state.handle(addr.id(), rank, &e.msg, Input::Peer(&p, None));
                }
                (Some(r), None) => {
                    // An entry of no bytes in a batch of none (its keys all empty): a push of
                    // nothing, in its key's dtype, as if it had come alone. Never a control
                    // request, whose scratch input is bytes.
                    if !r.is_empty() {
                        return Err("a batched push with data, in a batch with none".into());
                    }
                    let (n, dtype) = e.msg.payload_layout();
                    if n != 0 {
                        return Err(format!("a batched push of {n} elements and no bytes"));
                    }
                    // SAFETY: 0 elements: nothing is read, and a dangling pointer is
                    // non-null and aligned for every dtype.
                    let p = unsafe {
                        PeerData::new(
                            std::ptr::NonNull::<u64>::dangling().as_ptr().cast(),
                            0,
                            dtype,
                        )
                    };
                    state.handle(addr.id(), rank, &e.msg, Input::Peer(&p, None));
                }
                (None, _) => self.control(state, addr, rank, &e.msg, &[])?,
            }
        }
        Ok(())
    }

    fn lost(&mut self, state: &mut ServerState, addr: Addr, error: &TransportError) {
        let Some(w) = self.peers.remove(&addr) else {
            return;
        };
        if let Some(r) = w.rank {
            tracing::debug!(
                "worker {r}'s link closed ({}): {error}",
                if w.bye {
                    "it said goodbye"
                } else {
                    "unannounced"
                }
            );
            self.taken[r] = false;
            if !w.bye {
                // Whether the job goes on is the scheduler's to say (a process that exited 0
                // is no failure; one killed is): here the rounds that wait on it fail.
                let why = match error {
                    TransportError::Closed | TransportError::Truncated { .. } => {
                        "left the job (its link closed)".to_string()
                    }
                    other => format!("lost its link ({other})"),
                };
                state.worker_gone(r, &why);
            } else {
                state.worker_left(r);
            }
        }
        let id = addr.id();
        self.grants.retain(|(p, _), _| *p != id);
        self.batched.retain(|(p, _)| *p != id);
        // Its buffers' memory is dropped here; each backend keeps what a grant names alive
        // until the revoke completes.
        self.fence.extend(self.slots.drop_peer(id).grants);
        state.forget_peer(id);
    }

    /// Revokes the slot grants of lost workers.
    fn fence(&mut self, net: &mut Net) {
        for (id, g) in self.fence.drain(..) {
            let addr = Addr::from_id(id);
            if let Ok(b) = net.backend(addr.medium) {
                // The backend keeps the memory alive if it cannot tell that the peer is done.
                let _ = b.revoke(addr.peer, &g, Token(0));
            }
        }
    }

    /// Closes the links that broke the protocol.
    pub(super) fn close_refused(&mut self, state: &mut ServerState, net: &mut Net) {
        // Lifted before anything is answered to it (its HelloAck, its slot's grant).
        for a in std::mem::take(&mut self.trusted) {
            // (A link lost in the same turn is gone already.)
            if !self.peers.contains_key(&a) {
                continue;
            }
            let r = net.backend(a.medium).map(|b| b.trust(a.peer));
            if let Ok(Err(e)) = r {
                tracing::warn!("closing a proven link that cannot be trusted: {e}");
                self.close.push(a);
            }
        }
        // Links without an accepted hello are looked at only while there are any, when the
        // first of them is due (no clock read or scan on a turn otherwise).
        if self.hello_due.is_some_and(|t| Instant::now() >= t) {
            let late = self
                .peers
                .iter()
                .filter(|(_, w)| w.rank.is_none() && w.since.elapsed() > HELLO_WITHIN);
            self.close.extend(late.map(|(a, _)| *a));
            self.hello_due = self
                .peers
                .values()
                .filter(|w| w.rank.is_none() && w.since.elapsed() <= HELLO_WITHIN)
                .map(|w| w.since + HELLO_WITHIN)
                .min();
        }
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
        for id in state.take_released() {
            self.slots.give_back(id);
        }
        for (peer, held) in state.take_released_held() {
            let addr = Addr::from_id(peer);
            if let Ok(b) = net.backend(addr.medium) {
                b.release(addr.peer, held);
            }
        }
        self.fence(net);
        // Drained in place, so that the outbox keeps its memory from turn to turn.
        let mut outbox = std::mem::take(&mut state.outbox);
        for mut out in outbox.drain(..) {
            let batched = self.batched.remove(&(out.to, out.msg.req_id));
            let grant = self.grants.remove(&(out.to, out.msg.req_id));
            let slot = self.credit(net, &mut out);
            if let Some(w) = self.peers.get_mut(&Addr::from_id(out.to)) {
                w.backlog.push_back(Pending {
                    out,
                    grant,
                    put: false,
                    slot,
                    batched,
                });
            }
        }
        state.outbox = outbox;
        let mut broken = Vec::new();
        for (addr, w) in self.peers.iter_mut() {
            let Ok(b) = net.backend(addr.medium) else {
                continue;
            };
            while let Some(p) = w.backlog.front_mut() {
                let sent = if p.batched {
                    send_batch(b, addr, &w.backlog, &mut self.batch)
                } else {
                    super::answers::send(b, addr, p, &mut self.body).map(usize::from)
                };
                match sent {
                    Ok(0) => break,
                    Ok(n) => {
                        w.backlog.drain(..n);
                    }
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

    /// Whether answers are still waiting to go out.
    pub(super) fn pending(&self) -> bool {
        self.peers.values().any(|w| !w.backlog.is_empty())
    }
}

#[cfg(test)]
#[path = "peers_tests.rs"]
mod tests;
