//! A pair-style harness for the store's protocol, after quinn-proto's `tests/util.rs`: the
//! workers' state machines ([`Calls`]) and the servers' ([`ServerState`]) connected in memory,
//! with simulated time, a random delay on every message (links stay in order, so messages are
//! reordered across peers only), and peers that die or stall.
//!
//! The harness is the transport: it grants destinations, carries requests, puts and replies,
//! and completes data sends. Workers put pushes into the servers' receive slots when they hold
//! a slot's credit (on a coin toss, as a real loop sends by reference where the medium
//! allows), so both paths of a push run, and the servers' slot budgets vary. It checks what the real backends guarantee and what the
//! machines must never do: a put lands only in a live grant, and never in an output whose
//! call is over (the machine must release or revoke every grant of a call before the call can
//! be taken).

mod schedules;

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::time::{Duration, Instant};

use crate::protocol::{flags, slot_imm, Msg, Op};
use crate::server::slots::{Credit, PutAction, Slots};
use crate::server::state::{Input, Payload, ServerState};
use crate::worker::calls::{Action, CallId, Calls, SlotUse};
use crate::{DType, NDArray};

/// A request from worker `w` to server `s`: its header, data, grant and text.
struct Req {
    w: usize,
    s: usize,
    msg: Msg,
    data: Option<Vec<u8>>,
    grant: Option<u64>,
    text: Vec<u8>,
    token: u64,
}

/// A message in flight.
enum Packet {
    Request(Req),
    /// Server `s`'s answer put into worker `w`'s grant; unless `imm` says a reply follows, it
    /// is the whole answer.
    Put {
        w: usize,
        s: usize,
        grant: u64,
        bytes: Vec<u8>,
        imm: u32,
    },
    /// A push's data put into server `s`'s receive slot `grant`.
    SlotPut {
        w: usize,
        s: usize,
        grant: u64,
        bytes: Vec<u8>,
        imm: u32,
        token: u64,
    },
    Reply {
        w: usize,
        s: usize,
        msg: Msg,
        text: Vec<u8>,
        slot: Option<u64>,
    },
    /// A request's data was taken: the worker's send completes.
    SendDone {
        w: usize,
        token: u64,
    },
    /// Worker `w` sees its link to server `s` end.
    ServerGone {
        w: usize,
        s: usize,
    },
    /// Server `s` sees its link to worker `w` end.
    WorkerGone {
        w: usize,
        s: usize,
    },
}

/// A destination a worker granted.
struct Grant {
    worker: usize,
    call: CallId,
    out: usize,
    range: Range<usize>,
    live: bool,
}

/// A worker of the simulated job.
pub(crate) struct SimWorker {
    pub(crate) calls: Calls<u64>,
    pub(crate) alive: bool,
}

/// A server of the simulated job.
pub(crate) struct SimServer {
    pub(crate) state: ServerState,
    pub(crate) alive: bool,
    /// Extra delay on everything it sends from now on (a stalled process).
    pub(crate) stall: Duration,
    /// Grants that pull requests carried, until the answer goes out.
    grants: HashMap<(usize, u64), u64>,
    /// Receive slots: buffers (memory numbered as grants are) and their grants, and their
    /// bytes.
    slots: Slots<u64, u64>,
    slot_mem: HashMap<u64, Vec<u8>>,
}

/// A job: workers, servers and the messages between them.
pub(crate) struct Job {
    pub(crate) rng: fastrand::Rng,
    pub(crate) now: Instant,
    pub(crate) workers: Vec<SimWorker>,
    pub(crate) servers: Vec<SimServer>,
    queue: BTreeMap<(Instant, u64), Packet>,
    seq: u64,
    /// When the last message on each directed link arrives (links keep order).
    link_last: HashMap<(usize, usize, bool), Instant>,
    grants: HashMap<u64, Grant>,
    next_grant: u64,
    /// The range of a message's delay.
    pub(crate) delay: Range<u64>,
    /// Puts that found their grant revoked (late answers the transport refused).
    pub(crate) late_refused: u64,
    /// Pushes put into receive slots.
    pub(crate) slot_puts: u64,
    /// Credits for a buffer made for another worker (the pool shared).
    pub(crate) shared_credits: u64,
}

impl Job {
    /// `w` workers and `s` servers, in sync or async mode, with `slot_bytes` of receive slots
    /// each; calls time out after `timeout`.
    pub(crate) fn new(
        seed: u64,
        w: usize,
        s: usize,
        sync: bool,
        slot_bytes: usize,
        timeout: Duration,
    ) -> Job {
        Job {
            rng: fastrand::Rng::with_seed(seed),
            now: Instant::now(),
            workers: (0..w)
                .map(|r| SimWorker {
                    calls: Calls::new(r as u32, timeout),
                    alive: true,
                })
                .collect(),
            servers: (0..s)
                .map(|_| SimServer {
                    state: ServerState::new(w, sync),
                    alive: true,
                    stall: Duration::ZERO,
                    grants: HashMap::new(),
                    slots: Slots::new(slot_bytes),
                    slot_mem: HashMap::new(),
                })
                .collect(),
            queue: BTreeMap::new(),
            seq: 0,
            link_last: HashMap::new(),
            grants: HashMap::new(),
            next_grant: 1,
            delay: 1..200,
            late_refused: 0,
            slot_puts: 0,
            shared_credits: 0,
        }
    }

    /// Sends `p` on the link between worker `w` and server `s` (`up`: towards the server).
    fn send(&mut self, w: usize, s: usize, up: bool, p: Packet) {
        let mut delay = Duration::from_micros(self.rng.u64(self.delay.clone()));
        if !up {
            delay += self.servers[s].stall;
        }
        let last = self.link_last.entry((w, s, up)).or_insert(self.now);
        let at = (*last).max(self.now + delay);
        *last = at;
        self.seq += 1;
        self.queue.insert((at, self.seq), p);
    }

    /// Starts a call on worker `w`.
    pub(crate) fn start(
        &mut self,
        w: usize,
        reqs: impl Into<crate::worker::calls::Requests>,
        outs: impl Into<crate::worker::calls::Outputs>,
    ) -> CallId {
        let id = self.workers[w]
            .calls
            .start(self.now, reqs.into(), outs.into());
        self.actions(w);
        id
    }

    /// Does what worker `w`'s machine asks: posts requests, releases grants.
    fn actions(&mut self, w: usize) {
        while let Some(a) = self.workers[w].calls.poll_action() {
            match a {
                Action::Send { call, req, token } => self.post(w, call, req, token),
                Action::Release { grant, .. } => {
                    if let Some(g) = self.grants.get_mut(&grant) {
                        g.live = false;
                    }
                }
            }
        }
    }

    fn post(&mut self, w: usize, call: CallId, req: usize, token: u64) {
        let Some((r, _)) = self.workers[w].calls.request(call, req) else {
            return;
        };
        let (s, mut msg, text, dest) = (r.server, r.msg, r.text.clone(), r.dest.clone());
        let mut data = r
            .data
            .as_ref()
            .map(|(v, range)| v.as_bytes()[range.clone()].to_vec());
        let slot = self.workers[w].calls.slot(call, req);
        if let (SlotUse::Put(grant), Some(bytes), true) = (slot, &mut data, self.rng.u8(..) < 200) {
            let bytes = std::mem::take(bytes);
            let imm = slot_imm(msg.req_id, msg.op == Op::PushPull);
            self.workers[w].calls.on_put(call, req, token);
            self.slot_puts += 1;
            let p = Packet::SlotPut {
                w,
                s,
                grant,
                bytes,
                imm,
                token,
            };
            self.send(w, s, true, p);
            if msg.op == Op::Push {
                self.workers[w].calls.on_sent(call, req, None, token);
                return;
            }
            msg.flags |= flags::SLOT;
            data = None;
        }
        let grant = dest.map(|(out, range)| {
            let id = self.next_grant;
            self.next_grant += 1;
            self.grants.insert(
                id,
                Grant {
                    worker: w,
                    call,
                    out,
                    range,
                    live: true,
                },
            );
            id
        });
        self.workers[w].calls.on_sent(call, req, grant, token);
        let p = Packet::Request(Req {
            w,
            s,
            msg,
            data,
            grant,
            text,
            token,
        });
        self.send(w, s, true, p);
    }

    /// The earliest time something happens: a message arrives or a call's deadline passes.
    fn next_time(&self) -> Option<Instant> {
        let msg = self.queue.keys().next().map(|(t, _)| *t);
        let deadline = self
            .workers
            .iter()
            .filter(|w| w.alive)
            .filter_map(|w| w.calls.next_deadline())
            .min();
        match (msg, deadline) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Moves time to the next event and handles it. `false`: nothing will ever happen.
    pub(crate) fn step(&mut self) -> bool {
        let Some(t) = self.next_time() else {
            return false;
        };
        self.now = self.now.max(t);
        for w in 0..self.workers.len() {
            if self.workers[w].alive {
                self.workers[w].calls.on_time(self.now);
                self.actions(w);
            }
        }
        let first = self.queue.keys().next().copied();
        if let Some(k) = first.filter(|(t, _)| *t <= self.now) {
            if let Some(p) = self.queue.remove(&k) {
                self.deliver(p);
            }
        }
        true
    }

    fn deliver(&mut self, p: Packet) {
        match p {
            Packet::Request(r) => self.serve(r),
            Packet::Put {
                w,
                s,
                grant,
                bytes,
                imm,
            } => self.put(w, s, grant, &bytes, imm),
            Packet::SlotPut {
                w,
                s,
                grant,
                bytes,
                imm,
                token,
            } => self.slot_put(w, s, grant, bytes, imm, token),
            Packet::Reply {
                w,
                s,
                msg,
                text,
                slot,
            } => {
                if self.workers[w].alive {
                    self.workers[w].calls.on_reply(s, &msg, &text, slot);
                    self.actions(w);
                }
            }
            Packet::SendDone { w, token } => {
                if self.workers[w].alive {
                    self.workers[w].calls.on_send_done(token, Ok(()));
                    self.actions(w);
                }
            }
            Packet::ServerGone { w, s } => {
                if self.workers[w].alive {
                    self.workers[w].calls.on_lost(s, "the link closed");
                    self.actions(w);
                }
            }
            Packet::WorkerGone { w, s } => {
                if self.servers[s].alive {
                    let st = &mut self.servers[s].state;
                    st.worker_gone(w, "disconnected");
                    st.forget_peer(w);
                    for mem in self.servers[s].slots.drop_peer(w).mems {
                        self.servers[s].slot_mem.remove(&mem);
                    }
                    self.route(s);
                }
            }
        }
    }

    fn serve(&mut self, r: Req) {
        let Req {
            w,
            s,
            msg,
            data,
            grant,
            text,
            token,
        } = r;
        if !self.servers[s].alive {
            return;
        }
        if let Some(g) = grant {
            self.servers[s].grants.insert((w, msg.req_id), g);
        }
        let srv = &mut self.servers[s];
        let slot_data;
        let mut slot_id = None;
        let data = if msg.flags & flags::SLOT != 0 {
            let (id, mem) = srv
                .slots
                .on_slot_msg(w, &msg)
                .unwrap_or_else(|e| panic!("a worker broke the slot protocol: {e}"));
            slot_id = Some(id);
            slot_data = srv.slot_mem[mem].clone();
            Some(&slot_data)
        } else {
            srv.slots.on_push(w, &msg);
            data.as_ref()
        };
        let mut input = match data {
            Some(d) => {
                let (n, dtype) = msg.payload_layout();
                NDArray::from_bytes(&[n], dtype, d)
            }
            None => NDArray::from_bytes(&[text.len()], DType::U8, &text),
        }
        .expect("a request's bytes match its header");
        self.servers[s]
            .state
            .handle(w, w, &msg, Input::Owned(&mut input));
        if let Some(id) = slot_id {
            self.servers[s].slots.give_back(id);
        }
        if data.is_some() && msg.flags & flags::SLOT == 0 {
            self.send(w, s, false, Packet::SendDone { w, token });
        }
        self.route(s);
    }

    /// A push's data lands in server `s`'s slot `grant`, which must be this worker's and
    /// credited; the put completes at the worker, and a push is served.
    fn slot_put(&mut self, w: usize, s: usize, grant: u64, bytes: Vec<u8>, imm: u32, token: u64) {
        if !self.servers[s].alive {
            return;
        }
        let srv = &mut self.servers[s];
        let (action, id, mem) = srv
            .slots
            .on_put(w, grant, 0, bytes.len(), imm)
            .unwrap_or_else(|e| panic!("a worker broke the slot protocol: {e}"));
        let mem = *mem;
        srv.slot_mem.insert(mem, bytes);
        self.send(w, s, false, Packet::SendDone { w, token });
        if let PutAction::Push(m) = action {
            let srv = &mut self.servers[s];
            let (n, dtype) = m.payload_layout();
            let mut input = NDArray::from_bytes(&[n], dtype, &srv.slot_mem[&mem])
                .expect("a slot's bytes match its header");
            srv.state.handle(w, w, &m, Input::Owned(&mut input));
            self.route(s);
        }
        // The harness hands slot data over as a copy: the slot is free at once.
        self.servers[s].slots.give_back(id);
    }

    /// Sends what server `s` answered: a value's put into its grant, then the reply.
    fn route(&mut self, s: usize) {
        let outs: Vec<_> = self.servers[s].state.outbox.drain(..).collect();
        for mut o in outs {
            let w = o.to;
            let slot = self.credit(s, w, &mut o.msg);
            let grant = self.servers[s].grants.remove(&(w, o.msg.req_id));
            let follows = o.msg.follows_put();
            if let (Payload::Array(a), Some(grant)) = (&o.payload, grant) {
                let bytes = a.as_bytes().to_vec();
                let imm = slot_imm(o.msg.req_id, follows);
                self.send(
                    w,
                    s,
                    false,
                    Packet::Put {
                        w,
                        s,
                        grant,
                        bytes,
                        imm,
                    },
                );
                if !follows {
                    continue;
                }
            }
            let text = match o.payload {
                Payload::Text(t) => t,
                _ => Vec::new(),
            };
            debug_assert_eq!(o.msg.op, Op::Reply);
            self.send(
                w,
                s,
                false,
                Packet::Reply {
                    w,
                    s,
                    msg: o.msg,
                    text,
                    slot,
                },
            );
        }
    }

    /// The receive slot credit that server `s`'s reply `m` to worker `w` carries, if any:
    /// buffers made and granted as the real loop does (fresh numbers for memory and grants).
    fn credit(&mut self, s: usize, w: usize, m: &mut Msg) -> Option<u64> {
        let srv = &mut self.servers[s];
        let id = match srv.slots.credit(w, 0, m) {
            Credit::None => return None,
            Credit::Granted(g) => {
                m.flags |= flags::SLOT;
                return Some(g);
            }
            Credit::Grant(id, _) => {
                self.shared_credits += 1;
                id
            }
            Credit::Make(bytes) => {
                let mem = self.next_grant;
                self.next_grant += 1;
                srv.slot_mem.insert(mem, vec![0; bytes]);
                srv.slots.made(mem, 0, bytes)
            }
        };
        let g = self.next_grant;
        self.next_grant += 1;
        srv.slots.granted(w, id, g, g);
        m.flags |= flags::SLOT;
        Some(g)
    }

    /// A put arrives at worker `w`: it lands only in a live grant, in an output of a call
    /// that is not over.
    fn put(&mut self, w: usize, s: usize, grant: u64, bytes: &[u8], imm: u32) {
        if !self.workers[w].alive {
            return;
        }
        let Some(g) = self.grants.get(&grant).filter(|g| g.live) else {
            self.late_refused += 1;
            return;
        };
        assert_eq!(g.worker, w, "a put reached another worker's grant");
        assert_eq!(g.range.len(), bytes.len(), "a put of the wrong length");
        let range = g.range.clone();
        let out = self.workers[w]
            .calls
            .output_mut(g.call, g.out)
            .expect("a put landed in an output whose call had returned");
        out.as_bytes_mut()[range].copy_from_slice(bytes);
        let len = bytes.len();
        self.workers[w]
            .calls
            .on_answer_put(s, imm, |g| *g == grant, 0, len);
        self.actions(w);
    }

    /// Kills server `s`: it answers nothing more, and each worker sees its link end after
    /// what was already in flight.
    pub(crate) fn kill_server(&mut self, s: usize) {
        self.servers[s].alive = false;
        for w in 0..self.workers.len() {
            self.send(w, s, false, Packet::ServerGone { w, s });
        }
    }

    /// Worker `w` exits (or dies): each server sees its link end.
    pub(crate) fn kill_worker(&mut self, w: usize) {
        if !self.workers[w].alive {
            return;
        }
        self.workers[w].alive = false;
        for s in 0..self.servers.len() {
            self.send(w, s, true, Packet::WorkerGone { w, s });
        }
    }

    /// Takes a finished call of worker `w`, after checking that none of its grants is live.
    pub(crate) fn take(
        &mut self,
        w: usize,
        call: CallId,
    ) -> Option<crate::worker::calls::Finished> {
        let f = self.workers[w].calls.take(call)?;
        assert!(
            !self
                .grants
                .values()
                .any(|g| g.live && g.worker == w && g.call == call),
            "a call returned with a grant a server may still write"
        );
        assert!(
            self.workers[w]
                .calls
                .live_grants()
                .iter()
                .all(|g| self.grants[g].call != call),
            "the machine still counts a grant of a call it returned"
        );
        Some(f)
    }
}
