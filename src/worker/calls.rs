//! The worker's protocol state machine: no I/O and no clock reads.
//!
//! A call is a set of requests, one per key slice and server, with the outputs their answers
//! land in. [`Calls::start`] takes a call; [`Calls::poll_action`] says what the I/O loop must do
//! (send a request, release a grant); the loop reports what happened with `on_*` inputs (a
//! request posted, a reply, a data send completed, a server lost, the time); a finished call is
//! taken with [`Calls::take`]. Several calls may be in flight; the requests of all of them go
//! out in the order the calls were started, so a server sees a worker's calls in order.
//!
//! The machine is generic over `G`, the handle of a granted destination (a
//! `kvstore_transport::RemoteRegion` in the real loop, a number in the test harness), which it
//! only stores and hands back.
//!
//! Receive slots: a server's reply to a push may carry a slot for the next push of that key
//! slice (see [`crate::protocol::flags::SLOT`]). The machine keeps it, one credit: the loop may
//! put a request's data into it ([`Calls::slot`], [`Calls::on_put`]) instead of sending it, and
//! the credit is spent until the reply to that request brings it back.
//!
//! Ownership: a call owns its outputs. A call that succeeded hands them back with every grant
//! released (each was written once and answered); a call that failed revokes the grants still
//! unanswered and gives each of their outputs fresh storage, so nothing a peer writes late can
//! land in memory the caller gets back. A value being sent is held (a copy-on-write clone) until
//! its send completes, even after its call failed.

use rustc_hash::FxHashMap;
use std::collections::VecDeque;
use std::ops::Range;
use std::time::{Duration, Instant};

use crate::protocol::{Msg, Op, MAX_REQ_ID};
pub(crate) use crate::worker::{Outputs, Requests};
use crate::{KvError, NDArray, Result};

/// One request of a call.
pub(crate) struct Request {
    /// The server it goes to.
    pub(crate) server: usize,
    /// Its header (the machine sets `req_id` and `sender`).
    pub(crate) msg: Msg,
    /// Tensor data: a range of bytes of a value.
    pub(crate) data: Option<(NDArray, Range<usize>)>,
    /// Control bytes after the header (optimizer parameters, an updater's name).
    pub(crate) text: Vec<u8>,
    /// Where the answer's value goes: an output of the call (by index) and a range of its bytes.
    pub(crate) dest: Option<(usize, Range<usize>)>,
}

/// A call in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct CallId(pub(crate) u64);

/// What the I/O loop must do.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Action<G> {
    /// Post request `req` of `call` ([`Calls::request`] has it). Its data send, if any,
    /// completes as `token`.
    Send {
        call: CallId,
        req: usize,
        token: u64,
    },
    /// A grant is over: `revoke` (fence it, the answer never came) or just forget it (its
    /// answer is in, so the peer wrote it and will not write it again).
    Release {
        server: usize,
        grant: G,
        revoke: bool,
    },
}

/// How a request's data goes, as far as slots go.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum SlotUse<G> {
    /// As a message: no slot, or its credit is out.
    None,
    /// Put into this slot (spending its credit, [`Calls::on_put`]); then, for a pushpull, the
    /// message with the slot flag.
    Put(G),
    /// Its put is posted: only its message (a pushpull's) is left to send.
    Posted,
}

/// A call that is over.
pub(crate) struct Finished {
    pub(crate) result: Result<()>,
    /// The outputs, in the order given to [`Calls::start`]. After a failure those that were
    /// granted and not answered have fresh zeroed storage.
    pub(crate) outputs: Outputs,
}

struct Call<G> {
    reqs: Requests,
    outputs: Outputs,
    /// Per request: its progress (inline for one request, else one allocation for all).
    per: smallvec::SmallVec<[PerReq<G>; 1]>,
    /// Requests not answered yet.
    remaining: usize,
    /// Data sends of this call not yet complete.
    sending: usize,
    deadline: Instant,
    first_err: Option<KvError>,
    /// MXNet's priority: a larger one is posted first among queued requests.
    priority: i32,
}

/// One request's progress: the grant of its destination once it was posted, whether it was
/// answered, and whether its data was put into a slot.
struct PerReq<G> {
    grant: Option<G>,
    answered: bool,
    put: bool,
    /// The server's put filled the destination, and its reply follows.
    filled: bool,
    /// A push of a sliced key's slice, counted in flight until answered ([`rounds`]).
    counted: bool,
}

/// The calls of one worker.
pub(crate) struct Calls<G> {
    rank: u32,
    timeout: Duration,
    next_call: u64,
    next_req: u64,
    next_token: u64,
    live: FxHashMap<CallId, Call<G>>,
    done: FxHashMap<CallId, Finished>,
    /// Which call and request a request id is.
    by_req: FxHashMap<u64, (CallId, usize)>,
    /// Data sends not complete: their call (while it is live) and the value, held.
    sends: FxHashMap<u64, (CallId, NDArray)>,
    actions: VecDeque<Action<G>>,
    broken: Option<String>,
    /// Receive slots whose credit this worker holds, by (server, key, slice start).
    slots: FxHashMap<(usize, u64, u64), G>,
    /// The servers run `dist_sync` rounds ([`rounds`]).
    sync: bool,
    /// Pushes of sliced keys in flight, by key and slice start ([`rounds`]).
    sliced_in_flight: FxHashMap<(u64, u64), u32>,
}

impl<G: Clone> Calls<G> {
    /// The calls of worker `rank`; each must finish within `timeout`.
    pub(crate) fn new(rank: u32, timeout: Duration) -> Calls<G> {
        Calls {
            rank,
            timeout,
            next_call: 1,
            next_req: 1,
            next_token: 1,
            live: FxHashMap::default(),
            done: FxHashMap::default(),
            by_req: FxHashMap::default(),
            sends: FxHashMap::default(),
            actions: VecDeque::new(),
            broken: None,
            slots: FxHashMap::default(),
            sync: false,
            sliced_in_flight: FxHashMap::default(),
        }
    }

    /// An error if an earlier failure made the store unusable.
    pub(crate) fn check(&self) -> Result<()> {
        match &self.broken {
            Some(why) => Err(KvError::Aborted(format!("this store is unusable: {why}"))),
            None => Ok(()),
        }
    }

    /// Starts a call. Its outputs get storage of their own first (a grant shares the storage,
    /// so making it unique later would copy it away from the grant). A call the store cannot
    /// make is over at once, with its error.
    pub(crate) fn start(
        &mut self,
        now: Instant,
        mut reqs: Requests,
        mut outputs: Outputs,
    ) -> CallId {
        let id = CallId(self.next_call);
        self.next_call += 1;
        let bad_dest = reqs.iter().any(|r| {
            r.dest
                .as_ref()
                .is_some_and(|(o, range)| outputs.get(*o).is_none_or(|a| a.nbytes() < range.end))
        });
        let refused = match self.check() {
            Err(e) => Some(e),
            Ok(()) if bad_dest => Some(KvError::Protocol(
                "a request's destination is outside its output".into(),
            )),
            // Request ids are reused only once answered: there are this many.
            Ok(()) if self.by_req.len() + reqs.len() >= (MAX_REQ_ID - 1) as usize => {
                Some(KvError::Unsupported(format!(
                    "{} requests in flight and {} more: at most {} can be",
                    self.by_req.len(),
                    reqs.len(),
                    MAX_REQ_ID - 2
                )))
            }
            Ok(()) => self.third_push_of(&reqs),
        };
        // (A GPU out of memory for an output of its own refuses the call.)
        let refused = refused.or_else(|| NDArray::prepare_overwrite(&mut outputs).err());
        if let Some(e) = refused {
            let result = Err(e);
            self.done.insert(id, Finished { result, outputs });
            return id;
        }
        for (i, r) in reqs.iter_mut().enumerate() {
            r.msg.req_id = self.next_req;
            r.msg.sender = self.rank;
            self.by_req.insert(self.next_req, (id, i));
            // Ids fit a slot put's immediate, and one still in flight is never reused.
            self.next_req = self.next_req % (MAX_REQ_ID - 1) + 1;
            while self.by_req.contains_key(&self.next_req) {
                self.next_req = self.next_req % (MAX_REQ_ID - 1) + 1;
            }
            let token = self.next_token;
            self.next_token += 1;
            self.actions.push_back(Action::Send {
                call: id,
                req: i,
                token,
            });
        }
        let n = reqs.len();
        let per = (0..n)
            .map(|i| PerReq {
                grant: None,
                answered: false,
                put: false,
                filled: false,
                counted: self.count_slice(&reqs, i),
            })
            .collect();
        let call = Call {
            reqs,
            outputs,
            per,
            remaining: n,
            sending: 0,
            deadline: now + self.timeout,
            first_err: None,
            priority: 0,
        };
        self.live.insert(id, call);
        self.finish_if_complete(id);
        id
    }

    /// Sets a call's priority (before its requests are queued).
    pub(crate) fn set_priority(&mut self, call: CallId, priority: i32) {
        if let Some(c) = self.live.get_mut(&call) {
            c.priority = priority;
        }
    }

    /// A call's priority, and the (server, key) of one of its requests; `None` once it is over.
    pub(crate) fn order_of(&self, call: CallId, req: usize) -> Option<(i32, usize, u64)> {
        let c = self.live.get(&call)?;
        let r = c.reqs.get(req)?;
        Some((c.priority, r.server, r.msg.key))
    }

    /// The next thing the I/O loop must do.
    pub(crate) fn poll_action(&mut self) -> Option<Action<G>> {
        self.actions.pop_front()
    }

    /// A request to post, with the output its answer goes to; `None` once its call is over
    /// (a queued send of a call that failed is dropped).
    pub(crate) fn request(&self, call: CallId, req: usize) -> Option<(&Request, Option<&NDArray>)> {
        let c = self.live.get(&call)?;
        let r = c.reqs.get(req)?;
        let dest = r.dest.as_ref().map(|(o, _)| &c.outputs[*o]);
        Some((r, dest))
    }

    /// How request `req` of `call` may use a receive slot.
    pub(crate) fn slot(&self, call: CallId, req: usize) -> SlotUse<G> {
        let Some(c) = self.live.get(&call) else {
            return SlotUse::None;
        };
        let Some(r) = c.reqs.get(req) else {
            return SlotUse::None;
        };
        if c.per[req].put {
            return SlotUse::Posted;
        }
        if r.data.is_none() || !matches!(r.msg.op, Op::Push | Op::PushPull) {
            return SlotUse::None;
        }
        match self.slots.get(&(r.server, r.msg.key, r.msg.start)) {
            Some(g) => SlotUse::Put(g.clone()),
            None => SlotUse::None,
        }
    }

    /// The data of request `req` of `call` was put into its slot, as `token`: the credit is
    /// spent, and the value is held until the token completes.
    pub(crate) fn on_put(&mut self, call: CallId, req: usize, token: u64) {
        let Some(c) = self.live.get_mut(&call) else {
            return;
        };
        let r = &c.reqs[req];
        self.slots.remove(&(r.server, r.msg.key, r.msg.start));
        c.per[req].put = true;
        if let Some((v, _)) = &r.data {
            c.sending += 1;
            self.sends.insert(token, (call, v.clone()));
        }
    }

    /// Request `req` of `call` was posted, with its destination granted as `grant`, and its
    /// data (if any, and not put into a slot) sending as `token`.
    pub(crate) fn on_sent(&mut self, call: CallId, req: usize, grant: Option<G>, token: u64) {
        let Some(c) = self.live.get_mut(&call) else {
            return;
        };
        c.per[req].grant = grant;
        if let (Some((v, _)), false) = (&c.reqs[req].data, c.per[req].put) {
            c.sending += 1;
            self.sends.insert(token, (call, v.clone()));
        }
    }

    /// A data send completed (`Ok`) or failed.
    pub(crate) fn on_send_done(&mut self, token: u64, result: std::result::Result<(), String>) {
        let Some((id, _value)) = self.sends.remove(&token) else {
            return;
        };
        let Some(c) = self.live.get_mut(&id) else {
            return;
        };
        c.sending -= 1;
        match result {
            Ok(()) => self.finish_if_complete(id),
            Err(e) => self.fail_all(KvError::PeerLost(format!("a send failed: {e}"))),
        }
    }

    /// A server's link is gone (its slots with it).
    pub(crate) fn on_lost(&mut self, server: usize, error: &str) {
        self.slots.retain(|(s, _, _), _| *s != server);
        self.fail_all(KvError::PeerLost(format!("server {server}: {error}")));
    }

    /// A failure of the I/O loop itself, or one it saw (a malformed answer): every call fails.
    pub(crate) fn on_fatal(&mut self, e: KvError) {
        self.fail_all(e);
    }

    /// A failure outside any call (a barrier, the scheduler): the store becomes unusable for
    /// `why`, and the calls in flight fail as aborted by it.
    pub(crate) fn abort(&mut self, why: String) {
        self.broken.get_or_insert(why.clone());
        self.fail_all(KvError::Aborted(format!("an earlier failure: {why}")));
    }

    /// The time is `now`: a call past its deadline fails, and with it the store.
    pub(crate) fn on_time(&mut self, now: Instant) {
        if self.live.values().any(|c| now >= c.deadline) {
            self.fail_all(KvError::Timeout {
                what: "the servers' answers".into(),
                secs: self.timeout.as_secs_f64(),
            });
        }
    }

    /// The earliest deadline of a call in flight.
    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        self.live.values().map(|c| c.deadline).min()
    }

    /// Whether `call` is over (its result can be taken).
    pub(crate) fn is_done(&self, call: CallId) -> bool {
        self.done.contains_key(&call) || !self.live.contains_key(&call)
    }

    /// Takes the result of a call that is over.
    pub(crate) fn take(&mut self, call: CallId) -> Option<Finished> {
        self.done.remove(&call)
    }

    /// Calls in flight.
    pub(crate) fn in_flight(&self) -> usize {
        self.live.len()
    }

    /// Data sends not yet complete (of live calls or of failed ones).
    pub(crate) fn sending(&self) -> usize {
        self.sends.len()
    }

    /// Whether an output of a live call is granted and not answered (a peer may write it):
    /// for the test harness's checks.
    #[cfg(test)]
    pub(crate) fn live_grants(&self) -> Vec<G> {
        let per = self.live.values().flat_map(|c| &c.per);
        per.filter(|p| !p.answered)
            .filter_map(|p| p.grant.clone())
            .collect()
    }

    /// The output of a live call that a grant names, for the test harness's puts.
    #[cfg(test)]
    pub(crate) fn output_mut(&mut self, call: CallId, out: usize) -> Option<&mut NDArray> {
        self.live.get_mut(&call)?.outputs.get_mut(out)
    }

    fn finish_if_complete(&mut self, id: CallId) {
        let complete = self
            .live
            .get(&id)
            .is_some_and(|c| c.remaining == 0 && c.sending == 0);
        if !complete {
            return;
        }
        let Some(mut c) = self.live.remove(&id) else {
            return;
        };
        let result = match c.first_err.take() {
            Some(e) => Err(e),
            None => Ok(()),
        };
        self.end(id, c, result);
    }

    /// Ends a call: releases its grants (revoking the unanswered ones, whose outputs get fresh
    /// storage) and keeps its result.
    fn end(&mut self, id: CallId, mut c: Call<G>, result: Result<()>) {
        for (i, p) in c.per.iter_mut().enumerate() {
            let answered = p.answered;
            let Some(grant) = p.grant.take() else {
                continue;
            };
            if !answered {
                if let Some((o, _)) = &c.reqs[i].dest {
                    c.outputs[*o].replace_storage();
                }
            }
            self.actions.push_back(Action::Release {
                server: c.reqs[i].server,
                grant,
                revoke: !answered,
            });
        }
        for r in &c.reqs {
            self.by_req.remove(&r.msg.req_id);
        }
        for (r, p) in c.reqs.iter().zip(&c.per) {
            if p.counted && !p.answered {
                rounds::uncount(&mut self.sliced_in_flight, r.msg.key, r.msg.start);
            }
        }
        self.done.insert(
            id,
            Finished {
                result,
                outputs: std::mem::take(&mut c.outputs),
            },
        );
    }

    /// Fails every live call: the first (oldest) with `e`, the others as aborted by it, or,
    /// where `e` is an interruption, as interrupted too (each was: what waits for any of them
    /// hears the interruption, as a Python caller hears KeyboardInterrupt). The store refuses
    /// calls from now on.
    pub(crate) fn fail_all(&mut self, e: KvError) {
        let why = e.to_string();
        let interrupted = match &e {
            KvError::Interrupted(text) => Some(text.clone()),
            _ => None,
        };
        self.broken.get_or_insert_with(|| why.clone());
        let mut ids: Vec<CallId> = self.live.keys().copied().collect();
        ids.sort();
        let mut first = Some(e);
        for id in ids {
            let Some(c) = self.live.remove(&id) else {
                continue;
            };
            let err = first.take().unwrap_or_else(|| match &interrupted {
                Some(text) => KvError::Interrupted(text.clone()),
                None => KvError::Aborted(format!("an earlier call failed: {why}")),
            });
            self.end(id, c, Err(err));
        }
    }
}

#[path = "answers.rs"]
mod answers;
#[path = "rounds.rs"]
mod rounds;

#[cfg(test)]
#[path = "calls_tests.rs"]
mod tests;
