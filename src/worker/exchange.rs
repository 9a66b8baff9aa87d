//! The worker's I/O loop: a thin driver of [`Calls`] over the backends of [`Net`]. It posts the
//! requests the machine asks for (granting each pull's destination to its server with the
//! request), releases the grants it says are over, and feeds it every completion and the time.
//! It runs in the calling thread, when a call is started or waited for.
//!
//! Ownership: from the moment a destination is granted until its answer is in, the transport
//! owns it; a revoke completes in the backend only once the peer can no longer write there (the
//! backend keeps the memory alive until then).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use kvstore_transport::{Completion, RemoteRegion, Sent, Token};

use crate::auth;
use crate::net::{region_of, Addr, Medium, Net};
use crate::protocol::{flags, slot_imm, Msg, Op};
use crate::worker::calls::{Action, CallId, Calls, Finished, Outputs, Requests, SlotUse};
use crate::worker::order::queue_place;
use crate::worker::SlowWait;
use crate::{KvError, Result};

#[path = "batch.rs"]
mod batch;

/// A busy wait reads the clock on one turn in this many.
const CLOCK_TURNS: u32 = 32;

/// A worker's links to its servers, and the calls in flight on them.
pub(crate) struct Links {
    pub(crate) net: Net,
    /// The link to each server.
    pub(crate) servers: Vec<Addr>,
    pub(crate) rank: u32,
    pub(crate) timeout: Duration,
    pub(crate) calls: Calls<RemoteRegion>,
    /// Requests to post, in order: those that found their link full wait here with every
    /// request after them.
    queue: VecDeque<Action<RemoteRegion>>,
    /// Batches are assembled here, reused.
    batch: crate::protocol::batch::Writer,
    /// A request's body is assembled here, reused.
    body: Vec<u8>,
    turns: u32,
    /// The scheduler's link, watched while a call waits: the scheduler says so when the job
    /// is aborted (a process died, or stopped beating), and the calls fail at once.
    pub(crate) sched: Option<std::net::TcpStream>,
    /// Why the scheduler aborted the job, once it said so.
    pub(crate) sched_abort: Option<String>,
    /// Pushes put into receive slots.
    pub(crate) slot_puts: u64,
    /// Requests sent in batches.
    pub(crate) batched: u64,
    /// Copies this loop made itself (answers out of a server's pages or a batch, values into
    /// a batch): count, bytes.
    pub(crate) copies: (u64, u64),
    /// Asked about every 50 ms while a call waits: `true` interrupts (see
    /// `KVStore::set_interrupt_check`).
    pub(crate) interrupt: Option<Box<dyn FnMut() -> bool + Send>>,
    last_interrupt_check: Instant,
    /// What runs the rest of a wait that is taking long (see `KVStore::set_slow_wait`).
    pub(crate) slow: Option<SlowWait>,
    /// When the last call started, and the time read on the last turn that read it.
    started: Instant,
    clock: Instant,
}

/// What putting a request's data into its receive slot did.
enum SlotPut {
    /// The put is the whole request (a push).
    Whole,
    /// The link is full: try again after progress.
    Full,
    /// A message follows: with the slot flag (`true`, a pushpull whose data is in the slot),
    /// or carrying the data (`false`: no slot's credit, or the medium sends it by reference).
    Message(bool),
}

/// What posting a send did.
enum Posted {
    Yes,
    /// The link is full: try again after progress.
    Full,
}

impl Links {
    pub(crate) fn new(net: Net, servers: Vec<Addr>, rank: u32, timeout: Duration) -> Links {
        Links {
            net,
            servers,
            rank,
            timeout,
            calls: Calls::new(rank, timeout),
            queue: VecDeque::new(),
            batch: crate::protocol::batch::Writer::new(rank),
            body: Vec::new(),
            turns: 0,
            sched: None,
            sched_abort: None,
            slot_puts: 0,
            batched: 0,
            copies: (0, 0),
            interrupt: None,
            last_interrupt_check: Instant::now(),
            slow: None,
            started: Instant::now(),
            clock: Instant::now(),
        }
    }

    /// An error if an earlier failure made the store unusable.
    pub(crate) fn check(&self) -> Result<()> {
        self.calls.check()
    }

    /// Marks the store unusable after a failure outside a call (the scheduler lost, a barrier
    /// timed out), failing the calls in flight; returns `e` for the caller.
    pub(crate) fn fail(&mut self, e: KvError) -> KvError {
        self.calls.abort(e.to_string());
        e
    }

    /// Whether the program asks to interrupt (its check, `KVStore::set_interrupt_check`).
    pub(crate) fn interrupted(&mut self) -> bool {
        self.interrupt.as_mut().is_some_and(|f| f())
    }

    /// Starts a call at `now` with priority `p`, and posts what its links have room for.
    pub(crate) fn start(&mut self, now: Instant, reqs: Requests, outs: Outputs, p: i32) -> CallId {
        self.started = now;
        self.net.active_at(now);
        let id = self.calls.start(now, reqs, outs);
        self.calls.set_priority(id, p);
        if let Err(e) = self.post_actions() {
            self.calls.on_fatal(e);
        }
        id
    }

    /// Drives the backends until `call` is over, and takes its result.
    pub(crate) fn wait(&mut self, call: CallId) -> Finished {
        self.drive(call, true);
        // The call's grants are released (revoked, if it failed) before it returns.
        if let Err(e) = self.post_actions() {
            self.calls.on_fatal(e);
        }
        self.calls.take(call).unwrap_or_else(|| Finished {
            result: Err(KvError::Protocol("this call was waited for already".into())),
            outputs: Outputs::new(),
        })
    }

    /// Turns until `call` is over; once it has waited long, the rest of the turns run inside
    /// the slow wait's wrapper, if there is one and `may_wrap`.
    fn drive(&mut self, call: CallId, mut may_wrap: bool) {
        while !self.calls.is_done(call) {
            if let Err(e) = self.turn(Some(call), true) {
                self.calls.on_fatal(e);
            }
            // The clock was read on this turn (see `turn`): no read of its own. (A wait spins
            // for 200 µs after the call's start, see `start`: with a shorter `after`, the
            // wrapper runs before the wait first sleeps.)
            let long = |s: &SlowWait| self.clock.saturating_duration_since(self.started) >= s.after;
            if may_wrap && self.turns % CLOCK_TURNS == 0 && self.slow.as_ref().is_some_and(long) {
                may_wrap = false;
                if let Some(mut slow) = self.slow.take() {
                    (slow.wrap)(&mut || self.drive(call, false));
                    self.slow = Some(slow);
                }
            }
        }
    }

    /// Drives the backends until no call is in flight and every send is complete; the grants
    /// of calls that failed meanwhile (or before) are revoked before it returns.
    pub(crate) fn quiesce(&mut self) {
        while self.calls.in_flight() > 0 || self.calls.sending() > 0 {
            if self.calls.in_flight() == 0 {
                // Only sends of failed calls are left: they complete or fail on their own, and
                // are not worth waiting for past a short while.
                let _ = self.turn(None, false);
                break;
            }
            if let Err(e) = self.turn(None, true) {
                self.calls.on_fatal(e);
            }
        }
        let _ = self.post_actions();
    }

    /// One turn: post, take completions, look at the time, and wait a little if there is
    /// nothing to do: while `call` (if given) is not over, else when nothing came. (Waiting
    /// after some completions came is right: a wait returns at once if more is ready, and
    /// skips one poll that would find nothing.)
    fn turn(&mut self, call: Option<CallId>, may_wait: bool) -> Result<()> {
        self.post_actions()?;
        let n = self.pump()?;
        self.post_actions()?;
        let idle = match call {
            Some(c) => !self.calls.is_done(c),
            None => n == 0,
        };
        let may_wait = may_wait && idle;
        // The clock is read on few turns of a busy wait (a wait that sleeps ends within its
        // timeout, so the deadline is still seen in time).
        self.turns = self.turns.wrapping_add(1);
        if self.turns % CLOCK_TURNS != 0 {
            if may_wait {
                self.net.wait(None, Duration::from_millis(1))?;
            }
            return Ok(());
        }
        let now = Instant::now();
        self.clock = now;
        self.calls.on_time(now);
        if now.duration_since(self.last_interrupt_check) >= Duration::from_millis(50) {
            self.last_interrupt_check = now;
            if self.interrupt.as_mut().is_some_and(|f| f()) {
                self.calls.fail_all(KvError::Interrupted(
                    "a call was interrupted; the store refuses further calls".into(),
                ));
                return Ok(());
            }
        }
        if may_wait {
            let until = self
                .calls
                .next_deadline()
                .map_or(Duration::ZERO, |d| d.saturating_duration_since(now));
            let sched = self.sched.as_ref().map(std::os::fd::AsFd::as_fd);
            if self
                .net
                .wait(sched, until.min(Duration::from_millis(100)))?
            {
                self.heed_scheduler();
            }
        }
        Ok(())
    }

    /// The scheduler's link is readable while calls wait: outside a barrier it says nothing
    /// but an abort (or it closed). Every call fails, naming the cause.
    fn heed_scheduler(&mut self) {
        let Some(s) = &mut self.sched else { return };
        let deadline = Instant::now() + Duration::from_secs(1);
        let why = match kvstore_transport::tcp::blocking::read_frame(s, 1 << 20, Some(deadline)) {
            Ok((h, text)) if Msg::decode(&h.meta).is_ok_and(|m| m.op == Op::Abort) => {
                String::from_utf8_lossy(&text).into_owned()
            }
            Ok(_) => return,
            Err(kvstore_transport::TransportError::Timeout(_)) => return,
            Err(e) => format!("the scheduler's link failed: {e}"),
        };
        self.sched = None;
        self.sched_abort = Some(why.clone());
        self.calls.abort(why);
    }

    /// Takes what the backends have and hands it to the machine.
    fn pump(&mut self) -> Result<usize> {
        let servers = &self.servers;
        let calls = &mut self.calls;
        let copies = &mut self.copies;
        self.net.progress(&mut |medium, c| {
            let server = |peer| servers.iter().position(|a| *a == Addr { medium, peer });
            match c {
                Completion::Recv { peer, body, data } => {
                    let Some(s) = server(peer) else {
                        return;
                    };
                    match Msg::from_body(body) {
                        Ok((m, rest)) if m.op == Op::Reply => match m.reply_slot(rest) {
                            Some((slot, text)) if m.flags & flags::DATA != 0 => {
                                let len = data.as_ref().map_or(0, |d| d.len());
                                let fill = |dst: &mut [u8]| {
                                    len == dst.len() && batch::copy_out(copies, &data, 0, dst)
                                };
                                calls.on_reply_value(s, &m, text, slot, fill)
                            }
                            Some((slot, text)) => calls.on_reply(s, &m, text, slot),
                            None => calls.on_fatal(KvError::Protocol(format!(
                                "server {s} sent a receive slot too short to read"
                            ))),
                        },
                        Ok((m, rest)) if m.op == Op::Batch => {
                            batch::on_answers(calls, copies, s, &m, rest, data)
                        }
                        Ok((m, _)) => calls.on_fatal(KvError::Protocol(format!(
                            "server {s} sent {:?}, not a reply",
                            m.op
                        ))),
                        Err(e) => calls.on_fatal(e),
                    }
                }
                Completion::Done(t) => calls.on_send_done(t.0, Ok(())),
                Completion::Failed(t, e) => calls.on_send_done(t.0, Err(e.to_string())),
                Completion::Lost { peer, error } => {
                    if let Some(s) = server(peer) {
                        calls.on_lost(s, &error.to_string());
                    }
                }
                Completion::Put {
                    peer,
                    grant,
                    offset,
                    len,
                    imm,
                } => {
                    if let Some(s) = server(peer) {
                        calls.on_answer_put(s, imm, |g| g.id() == grant, offset, len);
                    }
                }
                Completion::Connected { .. } => {}
            }
        })
    }

    /// Carries out the machine's actions: grants are released at once; requests queue in
    /// order and are posted as far as the links take them ([`Links::post_queue`]).
    fn post_actions(&mut self) -> Result<()> {
        while let Some(a) = self.calls.poll_action() {
            match a {
                Action::Send { call, req, .. } => {
                    let at = queue_place(&self.queue, |c, r| self.calls.order_of(c, r), call, req);
                    self.queue.insert(at, a);
                }
                Action::Release {
                    server,
                    grant,
                    revoke,
                } => {
                    let addr = self.servers[server];
                    let b = self.net.backend(addr.medium)?;
                    if revoke {
                        let _ = b.revoke(addr.peer, &grant, Token(0));
                    } else {
                        b.forget(addr.peer, &grant);
                    }
                }
            }
        }
        if !self.queue.is_empty() {
            self.post_queue()?;
            if !self.queue.is_empty() {
                self.net.flush()?;
            }
        }
        Ok(())
    }

    /// Puts a request's data into its receive slot, if it has one's credit and the medium
    /// would not move the data by reference anyway.
    fn put(&mut self, call: CallId, req: usize, token: u64) -> Result<SlotPut> {
        let (src, range, slot, msg, addr) = {
            let Some((r, _)) = self.calls.request(call, req) else {
                return Ok(SlotPut::Whole);
            };
            let (slot, v, range) = match (self.calls.slot(call, req), &r.data) {
                (SlotUse::Posted, _) => return Ok(SlotPut::Message(true)),
                (SlotUse::Put(slot), Some((v, range))) => (slot, v, range),
                _ => return Ok(SlotPut::Message(false)),
            };
            let addr = self.servers[r.server];
            let b = self.net.backend(addr.medium)?;
            let src = region_of(b, v)?;
            if b.sends_in_place(&src) {
                return Ok(SlotPut::Message(false));
            }
            (src, range.clone(), slot, r.msg, addr)
        };
        let b = self.net.backend(addr.medium)?;
        let imm = slot_imm(msg.req_id, msg.op == Op::PushPull);
        // SAFETY: the value is only read, and stays alive: the call holds a clone of it until
        // the token completes. A write by the caller goes to a copy, except into memory it
        // lent (`NDArray::from_raw_parts`), whose owner keeps it alive; a send of it that
        // outlives a failed call may then carry what the caller wrote since (reads only).
        match unsafe { b.put(addr.peer, &src, range, &slot, 0, imm, Token(token)) }? {
            Sent::WouldBlock => Ok(SlotPut::Full),
            Sent::Posted => {
                self.slot_puts += 1;
                self.calls.on_put(call, req, token);
                if msg.op == Op::Push {
                    self.calls.on_sent(call, req, None, token);
                    return Ok(SlotPut::Whole);
                }
                Ok(SlotPut::Message(true))
            }
        }
    }

    /// Posts one request: its data put into its receive slot or sent from registered memory,
    /// its destination granted and named in the body.
    fn post(&mut self, call: CallId, req: usize, token: u64) -> Result<Posted> {
        let in_slot = match self.put(call, req, token)? {
            SlotPut::Full => return Ok(Posted::Full),
            SlotPut::Whole => return Ok(Posted::Yes),
            SlotPut::Message(in_slot) => in_slot,
        };
        let Some((r, dest)) = self.calls.request(call, req) else {
            return Ok(Posted::Yes);
        };
        let addr = self.servers[r.server];
        let b = self.net.backend(addr.medium)?;
        let body = &mut self.body;
        body.clear();
        let mut msg = r.msg;
        if in_slot {
            msg.flags |= flags::SLOT;
        }
        body.extend_from_slice(&msg.encode());
        let mut grant = None;
        if let (Some((_, range)), Some(out)) = (&r.dest, dest) {
            let region = region_of(b, out)?;
            // SAFETY: the call owns the output and no one reads it until the answer is in; a
            // call that fails first revokes the grant and gives the output fresh storage.
            let g = unsafe { b.grant(addr.peer, &region, range.clone()) }?;
            body.extend_from_slice(&g.to_bytes());
            grant = Some(g);
        }
        body.extend_from_slice(&r.text);
        let data = match &r.data {
            Some((v, range)) if !in_slot => Some(region_of(b, v).map(|g| (g, range.clone()))),
            _ => None,
        }
        .transpose();
        let sent = data.and_then(|data| {
            let d = data
                .as_ref()
                .map(|(g, range)| (g, range.clone(), Token(token)));
            // SAFETY: the value is only read, and stays alive: the call holds a clone of it
            // until the token completes. A write by the caller goes to a copy, except into
            // memory it lent (`NDArray::from_raw_parts`), whose owner keeps it alive; a send
            // of it that outlives a failed call may carry what the caller wrote since.
            unsafe { b.send(addr.peer, body, d) }
        });
        match sent {
            Ok(Sent::Posted) => {
                self.calls.on_sent(call, req, grant, token);
                Ok(Posted::Yes)
            }
            not_sent => {
                // Not sent (refused, or failed): the peer never heard of the grant, and the
                // call's end would not revoke it. Forgotten, it grants nothing any more.
                if let Some(g) = grant {
                    b.forget(addr.peer, &g);
                }
                Ok(not_sent.map(|_| Posted::Full)?)
            }
        }
    }

    /// Sends a message with no data and no answer expected (a goodbye), best effort.
    pub(crate) fn notify(&mut self, op: Op) {
        let mut m = Msg::new(op);
        m.sender = self.rank;
        let body = m.encode();
        for addr in self.servers.clone() {
            if let Ok(b) = self.net.backend(addr.medium) {
                // SAFETY: no data rides with it.
                let _ = unsafe { b.send(addr.peer, &body, None) };
            }
        }
        let _ = self.net.flush();
        let _ = self.pump();
    }

    /// The handshake with every server ([`crate::auth`]): a hello with a nonce; the server's
    /// challenge, whose proof of the secret is checked; this worker's proof of the secret and
    /// of its rank's `token`; the server's acknowledgement.
    pub(crate) fn hello(
        &mut self,
        secret: &str,
        token: &[u8; auth::MAC],
        deadline: Instant,
    ) -> Result<()> {
        let mut m = Msg::new(Op::Hello);
        m.key = crate::protocol::role::WORKER;
        m.sender = self.rank;
        let claim = auth::worker_claim(self.rank as usize);
        let n = self.servers.len();
        let mut nonces = Vec::with_capacity(n);
        for _ in 0..n {
            nonces.push(auth::random::<{ auth::NONCE }>()?);
        }
        for (addr, nonce) in self.servers.clone().into_iter().zip(&nonces) {
            let mut body = m.encode().to_vec();
            body.extend_from_slice(nonce);
            self.send_control(addr, &body)?;
        }
        // 0: challenged, 1: proven, 2: acknowledged.
        let mut step = vec![0u8; n];
        let mut proofs: Vec<Option<Vec<u8>>> = vec![None; n];
        let mut failure: Option<KvError> = None;
        while step.iter().any(|&s| s < 2) {
            let servers = &self.servers;
            self.net.progress(&mut |medium, c| match c {
                Completion::Recv { peer, body, .. } => {
                    let Some(s) = servers.iter().position(|a| *a == Addr { medium, peer }) else {
                        return;
                    };
                    match (Msg::from_body(body), step[s]) {
                        (Ok((r, rest)), 0) if r.op == Op::Challenge => {
                            let theirs: Option<[u8; auth::NONCE]> =
                                rest.get(..auth::NONCE).and_then(|x| x.try_into().ok());
                            let proof = rest.get(auth::NONCE..).unwrap_or(&[]);
                            let key: &[&[u8]] = &[secret.as_bytes()];
                            let ok = theirs.is_some_and(|t| {
                                auth::check(
                                    key,
                                    auth::Side::Responder,
                                    &nonces[s],
                                    &t,
                                    &claim,
                                    proof,
                                )
                            });
                            match theirs.filter(|_| ok) {
                                Some(t) => {
                                    let key: &[&[u8]] = &[secret.as_bytes(), token];
                                    let p = auth::proof(
                                        key,
                                        auth::Side::Initiator,
                                        &nonces[s],
                                        &t,
                                        &claim,
                                    );
                                    proofs[s] = Some(p.to_vec());
                                    step[s] = 1;
                                }
                                None => {
                                    failure.get_or_insert(KvError::PeerLost(format!(
                                        "server {s} does not know this job's secret"
                                    )));
                                }
                            }
                        }
                        (Ok((r, _)), 1) if r.op == Op::HelloAck => step[s] = 2,
                        _ => {
                            failure.get_or_insert(KvError::Protocol(format!(
                                "server {s} did not answer the hello as the handshake goes"
                            )));
                        }
                    }
                }
                Completion::Lost { peer, error } => {
                    if let Some(s) = servers.iter().position(|a| *a == Addr { medium, peer }) {
                        failure.get_or_insert(KvError::PeerLost(format!(
                            "server {s} refused the hello: {error}"
                        )));
                    }
                }
                _ => {}
            })?;
            if let Some(e) = failure.take() {
                return Err(e);
            }
            for (s, p) in proofs.iter_mut().enumerate() {
                if let Some(p) = p.take() {
                    let addr = self.servers[s]; // proven: it may reach what this worker grants
                    let lost = |e| KvError::PeerLost(format!("server {s} refused the hello: {e}"));
                    let b = self.net.backend(addr.medium)?;
                    b.trust(addr.peer).map_err(lost)?;
                    let mut r = Msg::new(Op::Proof);
                    r.key = crate::protocol::role::WORKER;
                    r.sender = self.rank;
                    let mut body = r.encode().to_vec();
                    body.extend_from_slice(&p);
                    self.send_control(addr, &body)?;
                }
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(KvError::Timeout {
                    what: "the servers' answers to the hello".into(),
                    secs: self.timeout.as_secs_f64(),
                });
            }
            self.net
                .wait(None, (deadline - now).min(Duration::from_millis(50)))?;
        }
        Ok(())
    }

    /// Sends a control message on a new link (which has room for it).
    fn send_control(&mut self, addr: Addr, body: &[u8]) -> Result<()> {
        let b = self.net.backend(addr.medium)?;
        // SAFETY: no data rides with it.
        if let Sent::WouldBlock = unsafe { b.send(addr.peer, body, None) }? {
            return Err(KvError::Protocol("a new link is full".into()));
        }
        b.flush()?;
        Ok(())
    }

    /// The medium of each server's link.
    pub(crate) fn media(&self) -> impl Iterator<Item = Medium> + '_ {
        self.servers.iter().map(|a| a.medium)
    }
}
