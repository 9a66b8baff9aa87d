//! Seeded random schedules of whole jobs over the harness: every worker inits (rank 0), sets
//! an optimizer (rank 0), and runs rounds of several calls in flight (pushes, pulls and
//! pushpulls of random groups of keys, some sliced over every server), with barriers; some
//! schedules lose a server or a worker mid-round, or stall a server past the call timeout so
//! that its answers come late. In a third of the schedules pushes travel packed (2-bit
//! compression, with a threshold per worker and key that is the size of that worker's gradient
//! of the key in every round, so that what a push sends is the gradient). Every value a call returns is checked exactly (dist_sync) or against what
//! dist_async allows, and every run must end: a hang is a failure.

use std::time::Duration;

use super::Job;
use crate::optimizer::Optimizer;
use crate::protocol::shard::placement;
use crate::protocol::{Msg, Op};
use crate::worker::calls::{CallId, Finished, Request};
use crate::worker::requests::{pull_requests, value_requests};
use crate::worker::KeyInfo;
use crate::{DType, KvError, NDArray};

const TIMEOUT: Duration = Duration::from_millis(50);
/// Keys of at least this many elements are sliced over every server.
const BOUND: usize = 16;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Push,
    Pull,
    PushPull,
    /// A push of zeros just before another push of the same keys (dist_async): two pushes of
    /// a key slice in flight at once, so the second finds the slot's credit spent.
    PushZero,
}

#[derive(Clone, Debug)]
enum Step {
    SetOptimizer,
    Init,
    Barrier,
    /// Calls started together, all in flight at once: (kind, keys, round).
    Calls(Vec<(Kind, Vec<usize>, usize)>),
}

#[derive(Clone, Copy, Debug)]
enum Fault {
    None,
    KillServer(usize),
    KillWorker(usize),
    StallServer(usize),
}

struct Config {
    w: usize,
    s: usize,
    sync: bool,
}

/// One schedule: the keys, what each worker does, and the fault.
struct Plan {
    sizes: Vec<usize>,
    rounds: usize,
    optimizer: bool,
    scripts: Vec<Vec<Step>>,
    fault: Fault,
    fault_at: Duration,
    /// Pushes travel packed ([`pack`]).
    packed: bool,
    /// Packed gradients change sign each round.
    alternate: bool,
}

fn init_value(k: usize) -> f64 {
    1000.0 + k as f64
}

/// Worker `w`'s gradient for key `k` in round `r` (every element the same, so a torn value
/// shows as unequal elements); where pushes are packed ([`pack`]), the same size in every
/// round, its sign alternating in dist_sync (so rounds still differ; dist_async's checks
/// bound values by sums of positive gradients).
fn grad(p: &Plan, w: usize, r: usize, k: usize) -> f64 {
    if p.packed {
        let sign = if p.alternate && r % 2 == 1 { -1.0 } else { 1.0 };
        return sign * ((w + 1) as f64 + k as f64);
    }
    (w + 1) as f64 + 10.0 * r as f64 + k as f64
}

fn plan(rng: &mut fastrand::Rng, c: &Config) -> Plan {
    let nkeys = rng.usize(2..=4);
    let sizes: Vec<usize> = (0..nkeys).map(|_| rng.usize(1..=40)).collect();
    let rounds = rng.usize(1..=3);
    let optimizer = !c.sync || rng.bool();
    let mut scripts = Vec::new();
    for _ in 0..c.w {
        let mut s = Vec::new();
        if optimizer {
            s.push(Step::SetOptimizer);
            s.push(Step::Barrier);
        }
        s.push(Step::Init);
        s.push(Step::Barrier);
        for r in 0..rounds {
            let mut keys: Vec<usize> = (0..nkeys).collect();
            rng.shuffle(&mut keys);
            let mut calls = Vec::new();
            let mut pulls = Vec::new();
            while !keys.is_empty() {
                let n = rng.usize(1..=keys.len());
                let group: Vec<usize> = keys.drain(..n).collect();
                if !c.sync && rng.u8(..) < 64 {
                    calls.push((Kind::PushZero, group.clone(), r));
                }
                if rng.bool() {
                    calls.push((Kind::PushPull, group, r));
                } else {
                    calls.push((Kind::Push, group.clone(), r));
                    pulls.push((Kind::Pull, group, r));
                }
            }
            s.push(Step::Calls(calls));
            if !pulls.is_empty() {
                s.push(Step::Calls(pulls));
            }
        }
        s.push(Step::Barrier);
        s.push(Step::Calls(vec![(
            Kind::Pull,
            (0..nkeys).collect(),
            rounds,
        )]));
        scripts.push(s);
    }
    let fault = match rng.u32(0..10) {
        0 => Fault::KillServer(rng.usize(0..c.s)),
        1 => Fault::KillWorker(rng.usize(0..c.w)),
        2 => Fault::StallServer(rng.usize(0..c.s)),
        _ => Fault::None,
    };
    Plan {
        sizes,
        rounds,
        optimizer,
        scripts,
        fault,
        fault_at: Duration::from_micros(rng.u64(0..3000)),
        packed: false,
        alternate: false,
    }
}

/// The value every worker must see for key `k` after round `r` (dist_sync), or at the end.
fn expected(p: &Plan, c: &Config, k: usize, r: usize) -> f64 {
    let sum = |r: usize| (0..c.w).map(|w| grad(p, w, r, k)).sum::<f64>();
    if p.optimizer {
        init_value(k) - (0..=r.min(p.rounds - 1)).map(sum).sum::<f64>()
    } else {
        sum(r.min(p.rounds - 1))
    }
}

/// Packs a push's data with threshold `t`, the size of its worker's gradient of the key: it
/// sends exactly the gradient (or zeros), and leaves no residual. (A worker's threshold never changes: the
/// server reads a push put into a slot by the header of the slice's first push.)
fn pack(r: &mut Request, t: f32) {
    let Some((v, bytes)) = r.data.take() else {
        return;
    };
    let vals = &v.as_slice::<f32>().unwrap()[bytes.start / 4..bytes.end / 4];
    let c = crate::Compression::two_bit(t).unwrap();
    let mut residual = vec![0.0f32; vals.len()];
    let mut packed = vec![0u8; crate::Compression::packed_bytes(vals.len() as u64) as usize];
    c.quantize(vals, &mut residual, &mut packed).unwrap();
    assert!(residual.iter().all(|r| *r == 0.0), "a push left a residual");
    r.msg.flags |= crate::protocol::flags::PACKED;
    r.msg.aux = c.to_wire();
    let n = packed.len();
    r.data = Some((NDArray::from_vec(&[n], packed).unwrap(), 0..n));
}

/// A worker's progress through its script.
#[derive(Default)]
struct Prog {
    pc: usize,
    inflight: Vec<(CallId, Kind, Vec<usize>, usize)>,
    at_barrier: bool,
    failed: bool,
    /// Sum of this worker's gradients sent so far, per key.
    pushed: Vec<f64>,
}

struct Run<'a> {
    c: &'a Config,
    p: Plan,
    job: Job,
    infos: Vec<KeyInfo>,
    progs: Vec<Prog>,
    seed: u64,
    /// Errors the workers got, for the fault checks.
    errors: Vec<String>,
}

impl Run<'_> {
    fn start(&mut self, w: usize, kind: Kind, keys: &[usize], r: usize) -> CallId {
        let reqs = match kind {
            Kind::Pull => pull_requests(keys.iter().map(|k| &self.infos[*k])),
            Kind::Push | Kind::PushPull | Kind::PushZero => {
                let op = if kind == Kind::PushPull {
                    Op::PushPull
                } else {
                    Op::Push
                };
                let g = |k| {
                    if kind == Kind::PushZero {
                        0.0
                    } else {
                        grad(&self.p, w, r, k)
                    }
                };
                let items = keys
                    .iter()
                    .enumerate()
                    .map(|(i, k)| {
                        let v = NDArray::full(&[self.p.sizes[*k]], g(*k));
                        self.progs[w].pushed[*k] += g(*k);
                        let dest = (kind == Kind::PushPull).then_some(i);
                        (&self.infos[*k], v, dest)
                    })
                    .collect::<Vec<_>>();
                let mut reqs = value_requests(op, items.into_iter());
                if self.p.packed {
                    for r in reqs.iter_mut() {
                        pack(r, grad(&self.p, w, 0, r.msg.key as usize) as f32);
                    }
                }
                reqs
            }
        };
        let outs = match kind {
            Kind::Push | Kind::PushZero => Vec::new(),
            _ => keys
                .iter()
                .map(|k| NDArray::full(&[self.p.sizes[*k]], -1.0))
                .collect(),
        };
        self.job.start(w, reqs, outs)
    }

    fn control(&mut self, w: usize, step: &Step) -> Option<CallId> {
        if w != 0 {
            return None;
        }
        let reqs = match step {
            Step::SetOptimizer => {
                let text = crate::Multiplied::from(Optimizer::sgd(1.0)).encode_head();
                (0..self.c.s)
                    .map(|s| Request {
                        server: s,
                        msg: Msg::new(Op::SetOptimizer),
                        data: None,
                        text: text.clone(),
                        dest: None,
                    })
                    .collect()
            }
            _ => {
                let items = (0..self.infos.len()).map(|k| {
                    let v = NDArray::full(&[self.p.sizes[k]], init_value(k));
                    (&self.infos[k], v, None)
                });
                value_requests(Op::Init, items)
            }
        };
        Some(self.job.start(w, reqs, Vec::new()))
    }

    /// Moves worker `w` on as far as it can go now; `true` if it did anything.
    fn advance(&mut self, w: usize) -> bool {
        let script = &self.p.scripts[w];
        let prog = &self.progs[w];
        if prog.failed || !self.job.workers[w].alive || prog.at_barrier || prog.pc >= script.len() {
            return false;
        }
        if !prog.inflight.is_empty() {
            let all_done = prog
                .inflight
                .iter()
                .all(|(id, ..)| self.job.workers[w].calls.is_done(*id));
            if !all_done {
                return false;
            }
            let inflight = std::mem::take(&mut self.progs[w].inflight);
            for (id, kind, keys, r) in inflight {
                let f = self.job.take(w, id).expect("a finished call has a result");
                self.check(w, kind, &keys, r, f);
            }
            if !self.progs[w].failed {
                self.progs[w].pc += 1;
            }
            return true;
        }
        let step = script[self.progs[w].pc].clone();
        match &step {
            Step::Barrier => self.progs[w].at_barrier = true,
            Step::SetOptimizer | Step::Init => match self.control(w, &step) {
                Some(id) => self.progs[w].inflight.push((id, Kind::Push, Vec::new(), 0)),
                None => self.progs[w].pc += 1,
            },
            Step::Calls(calls) => {
                for (kind, keys, r) in calls {
                    let id = self.start(w, *kind, keys, *r);
                    self.progs[w].inflight.push((id, *kind, keys.clone(), *r));
                }
            }
        }
        true
    }

    fn fail(&mut self, w: usize, e: KvError) {
        assert!(
            !matches!(self.p.fault, Fault::None),
            "seed {}: worker {w} failed with no fault: {e}",
            self.seed
        );
        self.errors.push(e.to_string());
        self.progs[w].failed = true;
        // A worker that gets an error exits (its servers see it go), or stays and does other
        // things: then late answers come to a live process.
        if self.job.rng.bool() {
            self.job.kill_worker(w);
        }
    }

    fn check(&mut self, w: usize, kind: Kind, keys: &[usize], r: usize, f: Finished) {
        if let Err(e) = f.result {
            return self.fail(w, e);
        }
        if matches!(kind, Kind::Push | Kind::PushZero) {
            return;
        }
        assert_eq!(f.outputs.len(), keys.len());
        for (k, out) in keys.iter().zip(&f.outputs) {
            let got = out.to_f64_vec();
            let seed = self.seed;
            if self.c.sync {
                let want = expected(&self.p, self.c, *k, r);
                assert!(
                    got.iter().all(|g| *g == want),
                    "seed {seed}: worker {w} key {k} round {r}: {got:?}, want {want}"
                );
                continue;
            }
            // dist_async: each slice is one value (never torn); it holds at least this
            // worker's own pushes, and at most everyone's.
            for part in &self.infos[*k].parts {
                let s = &got[part.start as usize..(part.start + part.len) as usize];
                assert!(
                    s.iter().all(|x| *x == s[0]),
                    "seed {seed}: a torn value {s:?}"
                );
                let own = init_value(*k) - self.progs[w].pushed[*k];
                let all = expected(&self.p, self.c, *k, self.p.rounds);
                assert!(
                    s[0] <= own && s[0] >= all,
                    "seed {seed}: worker {w} key {k}: {} outside [{all}, {own}]",
                    s[0]
                );
                if r == self.p.rounds {
                    assert_eq!(s[0], all, "seed {seed}: worker {w} key {k} at the end");
                }
            }
        }
    }

    /// Lets a barrier go when every worker is at it, or fails it when one never will come.
    fn barriers(&mut self) -> bool {
        let waiting: Vec<usize> = (0..self.c.w)
            .filter(|w| self.progs[*w].at_barrier)
            .collect();
        if waiting.is_empty() {
            return false;
        }
        let gone = (0..self.c.w).any(|w| self.progs[w].failed || !self.job.workers[w].alive);
        if gone {
            for w in waiting {
                self.progs[w].at_barrier = false;
                self.fail(w, KvError::Aborted("a worker left the job".into()));
            }
            return true;
        }
        if waiting.len() == self.c.w {
            for w in waiting {
                self.progs[w].at_barrier = false;
                self.progs[w].pc += 1;
            }
            return true;
        }
        false
    }

    fn finished(&self) -> bool {
        (0..self.c.w).all(|w| {
            let p = &self.progs[w];
            p.failed || !self.job.workers[w].alive || p.pc >= self.p.scripts[w].len()
        })
    }
}

/// What one schedule did.
struct Outcome {
    late_refused: u64,
    slot_puts: u64,
    shared_credits: u64,
    errors: Vec<String>,
    fault: Fault,
}

/// Runs one seeded schedule to its end.
fn run(c: &Config, seed: u64) -> Outcome {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut p = plan(&mut rng, c);
    p.packed = seed % 3 == 0;
    p.alternate = p.packed && c.sync;
    // Room for every slot, or for few (pushes beyond them go as messages).
    let slot_bytes = if rng.bool() {
        1 << 20
    } else {
        rng.usize(0..400)
    };
    let job = Job::new(seed, c.w, c.s, c.sync, slot_bytes, TIMEOUT);
    let infos = p
        .sizes
        .iter()
        .enumerate()
        .map(|(k, n)| KeyInfo {
            id: k as u64,
            shape: vec![*n],
            dtype: DType::F32,
            parts: placement(k as u64, *n as u64, c.s, BOUND),
        })
        .collect();
    let progs = (0..c.w)
        .map(|_| Prog {
            pushed: vec![0.0; p.sizes.len()],
            ..Prog::default()
        })
        .collect();
    let mut run = Run {
        c,
        p,
        job,
        infos,
        progs,
        seed,
        errors: Vec::new(),
    };
    let start = run.job.now;
    let mut fault_done = false;
    loop {
        let mut moved = true;
        while moved {
            moved = false;
            for w in 0..c.w {
                moved |= run.advance(w);
            }
            moved |= run.barriers();
        }
        if run.finished() {
            break;
        }
        if !fault_done && run.job.now - start >= run.p.fault_at {
            fault_done = true;
            match run.p.fault {
                Fault::None => {}
                Fault::KillServer(s) => run.job.kill_server(s),
                Fault::KillWorker(w) => {
                    run.job.kill_worker(w);
                    run.progs[w].failed = true;
                }
                Fault::StallServer(s) => run.job.servers[s].stall = TIMEOUT * 3,
            }
            continue;
        }
        assert!(
            run.job.step(),
            "seed {seed}: the job hangs with nothing in flight"
        );
        assert!(
            run.job.now - start < TIMEOUT * 20,
            "seed {seed}: the job did not end in simulated time"
        );
    }
    // What is still in flight arrives (late answers included) and must land nowhere.
    while run.job.step() {}
    Outcome {
        late_refused: run.job.late_refused,
        slot_puts: run.job.slot_puts,
        shared_credits: run.job.shared_credits,
        errors: run.errors,
        fault: run.p.fault,
    }
}

fn many(c: Config) {
    let mut late = 0;
    let mut lost = 0;
    let mut timeouts = 0;
    let mut slot_puts = 0;
    let mut shared = 0;
    for seed in 0..1000u64 {
        let o = run(&c, seed * 7919 + c.w as u64 * 31 + c.s as u64);
        late += o.late_refused;
        slot_puts += o.slot_puts;
        shared += o.shared_credits;
        if matches!(o.fault, Fault::KillServer(_)) {
            lost += o.errors.iter().any(|e| e.contains("server")) as u32;
        }
        timeouts += o.errors.iter().any(|e| e.contains("timed out")) as u32;
    }
    assert!(slot_puts > 0, "no push was put into a receive slot");
    // In dist_sync a round's answers credit the buffers its puts freed, whoever made them (in
    // dist_async a worker's answer follows its put at once, so its buffer comes back to it).
    if c.w > 1 && c.sync {
        assert!(
            shared > 0,
            "no worker was credited a buffer made for another"
        );
    }
    // The faults really happened: servers were lost mid-call, and stalled servers' answers
    // came after their calls had timed out.
    assert!(lost > 0, "no schedule lost a server mid-call");
    assert!(timeouts > 0, "no schedule timed out");
    if c.w > 1 || c.s > 1 {
        assert!(late > 0, "no late answer was refused");
    }
}

#[test]
fn dist_sync_one_worker_one_server() {
    many(Config {
        w: 1,
        s: 1,
        sync: true,
    });
}

#[test]
fn dist_sync_two_workers_two_servers() {
    many(Config {
        w: 2,
        s: 2,
        sync: true,
    });
}

#[test]
fn dist_sync_three_workers_four_servers() {
    many(Config {
        w: 3,
        s: 4,
        sync: true,
    });
}

#[test]
fn dist_sync_four_workers_three_servers() {
    many(Config {
        w: 4,
        s: 3,
        sync: true,
    });
}

#[test]
fn dist_async_two_workers_three_servers() {
    many(Config {
        w: 2,
        s: 3,
        sync: false,
    });
}

#[test]
fn dist_async_four_workers_four_servers() {
    many(Config {
        w: 4,
        s: 4,
        sync: false,
    });
}
