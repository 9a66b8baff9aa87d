//! The scenarios of bad input and faults (refused calls, garbage on the wire, a killed
//! peer, a stalled job, a late answer), and of what the transport copies.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use kvstore::{DType, KVStore, KvError, NDArray};

use crate::{expect_vals, fail, ok, pulled, SHAPE};

pub(crate) fn errors(kv: &mut KVStore) {
    ok("init", kv.init(3, &NDArray::ones(&SHAPE)));
    let checks: Vec<(&str, kvstore::Result<()>)> = vec![
        ("wrong shape", kv.push(3, &NDArray::ones(&[3, 2]))),
        (
            "wrong dtype",
            kv.push(3, &NDArray::full_dtype(&SHAPE, 1.0, DType::F64)),
        ),
        ("unknown key", kv.push(99, &NDArray::ones(&SHAPE))),
        ("double init", kv.init(3, &NDArray::ones(&SHAPE))),
        ("pull wrong shape", kv.pull(3, &mut NDArray::zeros(&[6]))),
        ("pull unknown", kv.pull(98, &mut NDArray::zeros(&SHAPE))),
        ("lengths", kv.push([3, 3], &vec![NDArray::ones(&SHAPE); 3])),
    ];
    for (what, r) in checks {
        match r {
            Err(e) => println!("refused {what}: {e}"),
            Ok(()) => fail(format!("{what} was accepted")),
        }
    }
    // A worker that initialises a key with another shape of the same size than rank 0's
    // (whose value the store keeps) has its pushes and pulls of that shape refused by the
    // servers, which hold rank 0's.
    let other: &[usize] = if kv.rank() == 0 { &[2, 3] } else { &[3, 2] };
    ok("init other shape", kv.init(4, &NDArray::ones(other)));
    if kv.rank() > 0 {
        for (what, r) in [
            (
                "push of another init shape",
                kv.push(4, &NDArray::ones(other)),
            ),
            (
                "pull of another init shape",
                kv.pull(4, &mut NDArray::zeros(other)),
            ),
        ] {
            match r {
                Err(e) if e.to_string().contains("shape") => println!("refused {what}: {e}"),
                Err(e) => fail(format!("{what}: {e}")),
                Ok(()) => fail(format!("{what} was accepted")),
            }
        }
    }
    expect_vals(
        "value intact after refusals",
        &pulled(kv, 3, &SHAPE, DType::F32),
        &[1.0; 6],
    );
    let w = kv.num_workers() as f64;
    let want = if kv.r#type() == "dist_async" {
        ok("updater", kv.set_server_updater("add"));
        1.0 + w
    } else {
        w
    };
    ok("push", kv.push(3, &NDArray::ones(&SHAPE)));
    ok("barrier", kv.barrier());
    expect_vals(
        "store still works",
        &pulled(kv, 3, &SHAPE, DType::F32),
        &[want; 6],
    );
}

fn send_raw(addr: std::net::SocketAddr, bytes: &[u8]) -> bool {
    send_raw_then(addr, bytes, true)
}

/// Sends `bytes` (then ends its side if `end`, else stays silent) and says whether the server
/// closed the connection within 10 s.
fn send_raw_then(addr: std::net::SocketAddr, bytes: &[u8], end: bool) -> bool {
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(5)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
    let _ = s.write_all(bytes);
    if end {
        let _ = s.shutdown(std::net::Shutdown::Write);
    }
    // The server must close the connection: read returns 0 (or an error), not a hang.
    let mut buf = [0u8; 256];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) => {
                return e.kind() != std::io::ErrorKind::WouldBlock
                    && e.kind() != std::io::ErrorKind::TimedOut
            }
        }
    }
}

pub(crate) fn garbage(kv: &mut KVStore) {
    ok("init", kv.init(3, &NDArray::ones(&SHAPE)));
    if kv.rank() == 0 {
        let header = |payload_len: u64, op: u16| {
            let mut h = [0u8; 128];
            h[0..4].copy_from_slice(b"KVST");
            h[4..6].copy_from_slice(&1u16.to_le_bytes());
            h[8..16].copy_from_slice(&payload_len.to_le_bytes());
            h[16..18].copy_from_slice(&op.to_le_bytes());
            h
        };
        let mut cases: Vec<(&str, Vec<u8>)> = vec![
            ("bad magic", vec![0x42; 300]),
            ("oversize length", header(u64::MAX / 2, 10).to_vec()),
            ("truncated header", header(0, 1)[..60].to_vec()),
            ("push before hello", header(24, 10).to_vec()),
            ("unknown op", header(0, 999).to_vec()),
        ];
        let mut wrong_secret = header(5, 1).to_vec();
        wrong_secret.extend_from_slice(b"guess");
        cases.push(("wrong secret", wrong_secret));
        let mut bad_version = header(0, 1);
        bad_version[4] = 9;
        cases.push(("version skew", bad_version.to_vec()));
        let mut half_hello = header(64, 1).to_vec();
        half_hello.extend_from_slice(b"test");
        for addr in kv.server_addrs() {
            for (what, bytes) in &cases {
                if !send_raw(addr, bytes) {
                    fail(format!(
                        "server {addr} did not close the connection after {what}"
                    ));
                }
            }
            // Connections that stay open saying nothing, or half a hello, are closed at the
            // server's hello deadline (5 s) rather than held.
            for (what, bytes) in [("silence", &[][..]), ("half a hello", &half_hello[..])] {
                if !send_raw_then(addr, bytes, false) {
                    fail(format!("server {addr} held a connection open after {what}"));
                }
            }
        }
        println!("every malformed connection was closed");
    }
    ok("barrier", kv.barrier());
    ok("push", kv.push(3, &NDArray::ones(&SHAPE)));
    expect_vals(
        "served after garbage",
        &pulled(kv, 3, &SHAPE, DType::F32),
        &[kv.num_workers() as f64; 6],
    );
}

/// Copies made by the shared-memory transport, counted: none to push an array from
/// `kv.alloc`, one to push another. A pull of a value the server holds in its send pool (from
/// 32 KiB) is one copy here, out of the server's pages into any output, with or without
/// cross-memory writes (a server can never write a `kv.alloc` array's pages itself: it maps
/// them read-only).
pub(crate) fn zerocopy(kv: &mut KVStore) {
    let shm = kv.transports().iter().all(|t| *t == "shm");
    let w = kv.num_workers() as f64;
    let n = 1 << 16;
    ok("init", kv.init(0, &NDArray::zeros(&[n])));
    // A small value (4 KiB, on the heap of the server): its pull into a heap array goes
    // through landing pages (under 32 KiB, with cross-memory writes or without).
    ok("init small", kv.init(1, &NDArray::full(&[1024], 2.0)));
    let mut a = ok("alloc", kv.alloc(&[n], DType::F32));
    if shm != a.is_shared_memory() {
        fail(format!(
            "alloc in shared memory: {} with transports {:?}",
            a.is_shared_memory(),
            kv.transports()
        ));
    }
    a.fill(kv.rank() as f64 + 1.0);
    let before = kv.transport_copies();
    ok("push alloc", kv.push(0, &a));
    let after_alloc = kv.transport_copies();
    ok("push heap", kv.push(0, &NDArray::full(&[n], 1.0)));
    let after_heap = kv.transport_copies();
    let mut out = ok("alloc out", kv.alloc(&[n], DType::F32));
    ok("pull alloc", kv.pull(0, &mut out));
    let after_pull_alloc = kv.transport_copies();
    let mut hout = NDArray::zeros(&[n]);
    ok("pull heap", kv.pull(0, &mut hout));
    let after_pull_heap = kv.transport_copies();
    expect_vals("pull into alloc", &out, &vec![w; n]);
    expect_vals("pull into heap", &hout, &vec![w; n]);
    let d = |x: (u64, u64), y: (u64, u64)| (y.0 - x.0, y.1 - x.1);
    let counts = [
        d(before, after_alloc),
        d(after_alloc, after_heap),
        d(after_heap, after_pull_alloc),
        d(after_pull_alloc, after_pull_heap),
    ];
    let bytes = (n * 4) as u64;
    let want = if shm {
        [(0, 0), (1, bytes), (1, bytes), (1, bytes)]
    } else {
        [(0, 0); 4]
    };
    if counts != want {
        fail(format!(
            "copies (count, bytes) per step {counts:?}, want {want:?}"
        ));
    }
    let before_small = kv.transport_copies();
    let mut small = NDArray::zeros(&[1024]);
    ok("pull small", kv.pull(1, &mut small));
    expect_vals("pull small", &small, &[2.0; 1024]);
    // Under 32 KiB a heap array's answer lands in pool pages and is copied in here, with
    // cross-memory writes or without (cheaper than the kernel's write for the server).
    let want_small = if shm { (1, 4096) } else { (0, 0) };
    if d(before_small, kv.transport_copies()) != want_small {
        fail(format!(
            "a 4 KiB pull into a heap array made {:?} copies here, want {want_small:?}",
            d(before_small, kv.transport_copies())
        ));
    }
    println!("cross-memory attach: {}", kv.cross_memory());
    println!("copies per step: push alloc {:?}, push other {:?}, pull into alloc {:?}, pull into other {:?}", counts[0], counts[1], counts[2], counts[3]);
}

/// Rank 1 dies abruptly after init; the others keep calling until they get an error.
pub(crate) fn die(kv: &mut KVStore) {
    ok("init", kv.init(3, &NDArray::ones(&SHAPE)));
    if kv.rank() == 1 {
        std::process::abort();
    }
    println!("ready");
    let _ = std::io::stdout().flush();
    for _ in 0..100_000 {
        if let Err(e) = kv.push(3, &NDArray::ones(&SHAPE)) {
            println!("worker {} stopped: {e}", kv.rank());
            std::process::exit(4);
        }
        let mut out = NDArray::zeros(&SHAPE);
        if let Err(e) = kv.pull(3, &mut out) {
            println!("worker {} stopped: {e}", kv.rank());
            std::process::exit(4);
        }
    }
    fail("no error after a worker died".into());
}

/// Keeps pushing and pulling until an error, and reports its kind (for the server-loss test).
pub(crate) fn until_error(kv: &mut KVStore) {
    ok("init", kv.init(3, &NDArray::ones(&SHAPE)));
    println!("ready");
    let _ = std::io::stdout().flush();
    loop {
        let r = kv
            .push(3, &NDArray::ones(&SHAPE))
            .and_then(|_| kv.pull(3, &mut NDArray::zeros(&SHAPE)));
        if let Err(e) = r {
            let kind = match e {
                KvError::PeerLost(_) => "PeerLost",
                KvError::Aborted(_) => "Aborted",
                KvError::Timeout { .. } => "Timeout",
                _ => "Other",
            };
            println!("error kind {kind}: {e}");
            // A store that lost a peer refuses further calls instead of hanging.
            match kv.pull(3, &mut NDArray::zeros(&SHAPE)) {
                Err(_) => println!("later call refused"),
                Ok(()) => fail("a later call succeeded on a broken store".into()),
            }
            std::process::exit(5);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Rank 1 never pushes: rank 0's push must time out (KVSTORE_TIMEOUT), not hang.
pub(crate) fn stall(kv: &mut KVStore) {
    ok("init", kv.init(3, &NDArray::ones(&SHAPE)));
    if kv.rank() == 1 {
        std::thread::sleep(Duration::from_secs(60));
        std::process::exit(0);
    }
    match kv.push(3, &NDArray::ones(&SHAPE)) {
        Err(KvError::Timeout { .. }) => {
            println!("timed out as configured");
            std::process::exit(6);
        }
        other => fail(format!("expected a timeout, got {other:?}")),
    }
}

/// The late-answer reproduction: rank 0's pushpull times out because rank 1 pushes late. The
/// outputs rank 0 got back, and memory it allocates afterwards (heap arrays, which malloc hands
/// out at the freed addresses, and pool arrays), must never receive the late answer.
/// Memory a caller lends to the store ([`NDArray::from_raw_parts`]): the owner of an output
/// the store writes in place, which this scenario reads and writes itself after a call.
struct Lent(Box<[std::cell::UnsafeCell<f32>]>);

// SAFETY: the scenario reads and writes the cells only while no call uses them (the store's
// contract for lent memory), from one thread.
unsafe impl Sync for Lent {}

impl Lent {
    fn new(n: usize) -> std::sync::Arc<Lent> {
        std::sync::Arc::new(Lent((0..n).map(|_| 0.0f32.into()).collect()))
    }

    /// An array over the cells, holding them alive.
    fn array(self: &std::sync::Arc<Lent>) -> NDArray {
        let ptr = self.0.as_ptr() as *mut u8;
        // SAFETY: the cells are `len` f32s, aligned, alive while the owner (a clone of the Arc)
        // is, and touched by no one else while a call uses the array.
        ok("lend", unsafe {
            NDArray::from_raw_parts(ptr, &[self.0.len()], DType::F32, Box::new(self.clone()))
        })
    }

    fn fill(&self, v: f32) {
        for c in self.0.iter() {
            // SAFETY: no call uses the cells now (see the Sync impl).
            unsafe { *c.get() = v };
        }
    }

    fn values(&self) -> NDArray {
        // SAFETY: as in `fill`.
        let v: Vec<f32> = self.0.iter().map(|c| unsafe { *c.get() }).collect();
        ok("values", NDArray::from_vec(&[v.len()], v))
    }
}

pub(crate) fn late(kv: &mut KVStore) {
    const N: usize = 1000;
    // Large enough that a server could write it by a cross-memory write, were it not lent.
    const LENT: usize = 50_000;
    let secs: f64 = std::env::var("KVSTORE_TIMEOUT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2.0);
    ok("init 9", kv.init(9, &NDArray::zeros(&[N])));
    ok("init 10", kv.init(10, &NDArray::zeros(&[N])));
    ok("init 11", kv.init(11, &NDArray::zeros(&[LENT])));
    let keys = [9, 10, 11];
    let ones = [
        NDArray::ones(&[N]),
        NDArray::ones(&[N]),
        NDArray::ones(&[LENT]),
    ];
    // Pulls into lent memory work, in place.
    let lent = Lent::new(LENT);
    let mut out = lent.array();
    ok("pull into lent memory", kv.pull(11, &mut out));
    drop(out);
    expect_vals("lent output", &lent.values(), &[0.0; LENT]);
    ok("barrier", kv.barrier());
    if kv.rank() == 1 {
        std::thread::sleep(Duration::from_secs_f64(secs * 2.0));
        let mut outs = [
            NDArray::zeros(&[N]),
            NDArray::zeros(&[N]),
            NDArray::zeros(&[LENT]),
        ];
        ok(
            "the late pushpull",
            kv.pushpull(&keys[..], &ones[..], &mut outs[..]),
        );
        // Rank 0's push was in the round before it timed out: both pushes are summed.
        expect_vals("the round rank 0 left", &outs[0], &[2.0; N]);
        println!("late round done");
        return;
    }
    let heap_out = NDArray::zeros(&[N]);
    let pool_out = ok("alloc", kv.alloc(&[N], DType::F32));
    let mut outs = vec![heap_out, pool_out, lent.array()];
    match kv.pushpull(&keys[..], &ones[..], &mut outs[..]) {
        Err(KvError::Timeout { .. }) => println!("timed out as configured"),
        other => fail(format!("expected a timeout, got {other:?}")),
    }
    // What the caller holds now is its own: fill it, drop one, allocate more of the same size.
    drop(outs.pop());
    lent.fill(-7.0);
    let mut pool_out = outs.pop().unwrap_or_else(|| fail("outputs".into()));
    pool_out.fill(-7.0);
    drop(outs);
    let fresh: Vec<NDArray> = (0..64).map(|_| NDArray::full(&[N], -7.0)).collect();
    let fresh_pool: Vec<NDArray> = (0..8)
        .map(|_| {
            let mut a = ok("alloc after failure", kv.alloc(&[N], DType::F32));
            a.fill(-7.0);
            a
        })
        .collect();
    // The round completes (rank 1 pushes at 2 x timeout) and its answers go out meanwhile.
    std::thread::sleep(Duration::from_secs_f64(secs * 2.0 + 2.0));
    expect_vals(
        "an output given back by a failed call",
        &pool_out,
        &[-7.0; N],
    );
    expect_vals(
        "lent memory given back by a failed call",
        &lent.values(),
        &[-7.0; LENT],
    );
    for a in fresh.iter().chain(&fresh_pool) {
        expect_vals("memory allocated after a failed call", a, &[-7.0; N]);
    }
    println!("no late write landed");
}

/// Pushes put into the servers' receive slots: the first push of each key slice is a message
/// whose reply brings the slot, every later one a put (push and pushpull alike), unless the
/// slot budget (`KVSTORE_SLOT_BYTES=0`) allows none; pushes of a `kv.alloc` array over shared
/// memory go by reference instead. Every value is checked, and the counts where the budget is
/// the default or none (with another budget the test adds up every worker's counts).
pub(crate) fn slots(kv: &mut KVStore) {
    let shm = kv.transports().iter().all(|t| *t == "shm");
    let budget = std::env::var("KVSTORE_SLOT_BYTES").ok();
    let none = budget.as_deref() == Some("0");
    let exact = none || budget.is_none();
    let (w, r) = (kv.num_workers() as f64, kv.rank() as f64);
    // Key 5 lives on one server; key 6 (over the bound the test sets) is sliced over all.
    let (small, big) = (100, 5000);
    ok(
        "init",
        kv.init([5, 6], &[NDArray::zeros(&[small]), NDArray::zeros(&[big])]),
    );
    let parts = 1 + kv.server_addrs().len() as u64;
    let before = kv.slot_puts();
    for round in 0..4u32 {
        let g = |n: usize| NDArray::full(&[n], (r + 1.0) * (round + 1) as f64);
        let want = (round + 1) as f64 * w * (w + 1.0) / 2.0;
        let vals = [g(small), g(big)];
        // One key per call: slices of several keys to one server would go as a batch, which
        // carries their data itself (the scenario "batches").
        if round % 2 == 0 {
            ok("push", kv.push(5, &vals[0]));
            ok("push", kv.push(6, &vals[1]));
            expect_vals(
                "pulled",
                &pulled(kv, 5, &[small], DType::F32),
                &vec![want; small],
            );
            expect_vals(
                "pulled",
                &pulled(kv, 6, &[big], DType::F32),
                &vec![want; big],
            );
        } else {
            let mut outs = [NDArray::zeros(&[small]), NDArray::zeros(&[big])];
            ok("pushpull", kv.pushpull(5, &vals[0], &mut outs[0]));
            ok("pushpull", kv.pushpull(6, &vals[1], &mut outs[1]));
            expect_vals("pushpull", &outs[0], &vec![want; small]);
            expect_vals("pushpull", &outs[1], &vec![want; big]);
        }
        kv.barrier()
            .unwrap_or_else(|e| fail(format!("barrier: {e}")));
    }
    let puts = kv.slot_puts() - before;
    let want = if none { 0 } else { 3 * parts };
    if exact && puts != want {
        fail(format!("{puts} slot puts in 4 rounds, want {want}"));
    }
    let mut a = ok("alloc", kv.alloc(&[small], DType::F32));
    a.fill(1.0);
    ok("push alloc", kv.push(5, &a));
    expect_vals(
        "pulled",
        &pulled(kv, 5, &[small], DType::F32),
        &vec![w; small],
    );
    let alloc_puts = kv.slot_puts() - before - puts;
    let want = if none || shm { 0 } else { 1 };
    if exact && alloc_puts != want {
        fail(format!(
            "{alloc_puts} slot puts for a kv.alloc push, want {want}"
        ));
    }
    println!("slot puts {puts} + {alloc_puts}");
}

/// Worker 1 ends its process with `std::process::exit(0)` right after its last call (no
/// destructor runs); the others go on with calls that do not wait on it, and the job ends
/// cleanly.
pub(crate) fn exit0(kv: &mut KVStore) {
    ok("init", kv.init(3, &NDArray::ones(&SHAPE)));
    ok("push", kv.push(3, &NDArray::ones(&SHAPE)));
    ok("barrier", kv.barrier());
    if kv.rank() == 1 {
        println!("exit0 ok rank 1 of {}", kv.num_workers());
        let _ = std::io::stdout().flush();
        std::process::exit(0);
    }
    // Pulls wait on no one.
    std::thread::sleep(Duration::from_millis(300));
    expect_vals(
        "pulled after worker 1 left",
        &pulled(kv, 3, &SHAPE, DType::F32),
        &[kv.num_workers() as f64; 6],
    );
}

/// Worker 1 ends with `exit(0)` without pushing key 5, which the others push: their push fails
/// at once (not at the timeout), naming worker 1.
pub(crate) fn leave_early(kv: &mut KVStore) {
    ok("init", kv.init(5, &NDArray::ones(&SHAPE)));
    if kv.rank() == 1 {
        let _ = std::io::stdout().flush();
        std::process::exit(0);
    }
    let start = std::time::Instant::now();
    match kv.push(5, &NDArray::ones(&SHAPE)) {
        Err(e) if e.to_string().contains("worker 1") => {
            println!(
                "push failed after {:.1} s: {e}",
                start.elapsed().as_secs_f64()
            );
            std::process::exit(3);
        }
        other => fail(format!("a round waiting on a departed worker: {other:?}")),
    }
}

/// Worker 1 finishes (drops its store) while the others go to a barrier: theirs fails at once,
/// naming it, instead of waiting out the timeout.
pub(crate) fn skip_barrier(kv: &mut KVStore) {
    ok("init", kv.init(5, &NDArray::ones(&SHAPE)));
    if kv.rank() == 1 {
        return;
    }
    let start = std::time::Instant::now();
    match kv.barrier() {
        Err(e) if e.to_string().contains("worker 1 finished") => {
            println!(
                "barrier failed after {:.1} s: {e}",
                start.elapsed().as_secs_f64()
            );
            std::process::exit(3);
        }
        other => fail(format!("a barrier without worker 1: {other:?}")),
    }
}

/// Rounds until an error, each checked exactly: every worker pushes `round + rank` to a small
/// key and to a key big enough to be sliced over the servers, and the pulled value must be
/// the sum over the workers. A wrong value is reported (`WRONG VALUE`, exit 9) and never
/// taken for an error; an error (a process of the job died or stopped) is printed with its
/// text and ends the worker with status 4.
pub(crate) fn chaos(kv: &mut KVStore) {
    let w = kv.num_workers() as f64;
    let rank = kv.rank() as f64;
    let big = [64usize, 1024];
    ok(
        "init",
        kv.init([7, 8], &[NDArray::zeros(&SHAPE), NDArray::zeros(&big)]),
    );
    let mut round = 0u64;
    loop {
        round += 1;
        let v = round as f64 + rank;
        let want = w * round as f64 + w * (w - 1.0) / 2.0;
        let r = kv
            .push([7, 8], &[NDArray::full(&SHAPE, v), NDArray::full(&big, v)])
            .and_then(|()| {
                let mut out = [NDArray::zeros(&SHAPE), NDArray::zeros(&big)];
                kv.pull([7, 8], &mut out).map(|()| out)
            });
        match r {
            Ok([a, b]) => {
                let bad = a
                    .to_f64_vec()
                    .iter()
                    .chain(b.to_f64_vec().iter())
                    .any(|&x| x != want);
                if bad {
                    println!("WRONG VALUE in round {round}");
                    std::process::exit(9);
                }
                if round % 20 == 0 {
                    println!("round {round} ok");
                    let _ = std::io::stdout().flush();
                }
            }
            Err(e) => {
                println!("worker {} stopped in round {round}: {e}", kv.rank());
                let _ = std::io::stdout().flush();
                std::process::exit(4);
            }
        }
    }
}
