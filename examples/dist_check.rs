//! A distributed program that checks the values it pulls; the integration tests run it under
//! `kvrun` (and by hand) in every role. `dist_check SCENARIO dist_sync|dist_async`.
//! It prints `SCENARIO ok rank R` and exits 0 when every value is what MXNet gives, and
//! exits non-zero with the mismatch otherwise.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use kvstore::{cpu, create, DType, KVStore, KvError, NDArray, Optimizer};

const SHAPE: [usize; 2] = [2, 3];

fn fail(msg: String) -> ! {
    eprintln!("CHECK FAILED: {msg}");
    std::process::exit(3)
}

fn expect_vals(what: &str, got: &NDArray, want: &[f64]) {
    let g = got.to_f64_vec();
    if g != want {
        fail(format!("{what}: got {g:?}, want {want:?}"));
    }
}

fn pulled(kv: &mut KVStore, key: i32, shape: &[usize], dtype: DType) -> NDArray {
    let mut out = NDArray::zeros_dtype(shape, dtype);
    kv.pull(key, &mut out)
        .unwrap_or_else(|e| fail(format!("pull {key}: {e}")));
    out
}

fn ok<T>(what: &str, r: kvstore::Result<T>) -> T {
    r.unwrap_or_else(|e| fail(format!("{what}: {e}")))
}

fn seed(kv: &mut KVStore) {
    let w = kv.num_workers() as f64;
    ok("init 3", kv.init(3, &(NDArray::ones(&SHAPE) * 2.0)));
    expect_vals("init", &pulled(kv, 3, &SHAPE, DType::F32), &[2.0; 6]);
    ok("push", kv.push(3, &NDArray::ones(&SHAPE)));
    expect_vals(
        "push ones from every worker",
        &pulled(kv, 3, &SHAPE, DType::F32),
        &[w; 6],
    );
    let b: Vec<NDArray> = (0..4).map(|i| NDArray::ones(&SHAPE).on(cpu(i))).collect();
    ok("push list", kv.push(3, &b));
    expect_vals(
        "push 4 devices",
        &pulled(kv, 3, &SHAPE, DType::F32),
        &[4.0 * w; 6],
    );
    let mut outs: Vec<NDArray> = (0..4).map(|_| NDArray::zeros(&SHAPE)).collect();
    ok("pull list", kv.pull(3, &mut outs));
    for o in &outs {
        expect_vals("pull into 4 outputs", o, &[4.0 * w; 6]);
    }
    let mut out = NDArray::zeros(&SHAPE);
    let mine = NDArray::full(&SHAPE, kv.rank() as f64);
    ok("pushpull", kv.pushpull(3, &mine, &mut out));
    expect_vals("pushpull of ranks", &out, &[w * (w - 1.0) / 2.0; 6]);
    let keys = [5, 7, 9];
    ok("init list", kv.init(keys, &vec![NDArray::ones(&SHAPE); 3]));
    ok("push list", kv.push(keys, &vec![NDArray::ones(&SHAPE); 3]));
    let mut b = vec![NDArray::zeros(&SHAPE); 3];
    ok("pull list", kv.pull(keys, &mut b));
    for x in &b {
        expect_vals("keys [5,7,9] after push ones", x, &[w; 6]);
    }
    let per_dev: Vec<NDArray> = (0..4).map(|i| NDArray::ones(&SHAPE).on(cpu(i))).collect();
    let mut b = vec![per_dev; 3];
    ok("push nested", kv.push(keys, &b));
    ok("pull nested", kv.pull(keys, &mut b));
    for row in &b {
        for x in row {
            expect_vals("keys [5,7,9] after 4 devices", x, &[4.0 * w; 6]);
        }
    }
}

fn arange(n: usize, scale: f64, dtype: DType) -> NDArray {
    // Small multiples of 0.5 are exact in both dtypes, so sums compare exactly.
    let v: Vec<f64> = (0..n).map(|i| i as f64 * scale).collect();
    match dtype {
        DType::F32 => ok(
            "arange",
            NDArray::from_vec(&[n], v.iter().map(|&x| x as f32).collect()),
        ),
        _ => ok("arange", NDArray::from_vec(&[n], v)),
    }
}

fn big(kv: &mut KVStore) {
    let w = kv.num_workers() as f64;
    let r = kv.rank() as f64;
    let a = arange(1000, 1.0, DType::F32);
    let b = ok(
        "reshape",
        NDArray::from_vec(&[13, 17], (0..221).map(|i| i as f64).collect()),
    );
    ok("init big", kv.init([0, 1], vec![&a, &b]));
    expect_vals(
        "big init",
        &pulled(kv, 0, &[1000], DType::F32),
        &a.to_f64_vec(),
    );
    expect_vals(
        "big f64 init",
        &pulled(kv, 1, &[13, 17], DType::F64),
        &b.to_f64_vec(),
    );
    let mine = arange(1000, r + 1.0, DType::F32);
    ok("push big", kv.push(0, &mine));
    let want: Vec<f64> = (0..1000).map(|i| i as f64 * w * (w + 1.0) / 2.0).collect();
    expect_vals("big push sum", &pulled(kv, 0, &[1000], DType::F32), &want);
    let mut out = NDArray::zeros_dtype(&[13, 17], DType::F64);
    ok("pushpull big", kv.pushpull(1, &b, &mut out));
    let want: Vec<f64> = (0..221).map(|i| i as f64 * w).collect();
    expect_vals("big pushpull", &out, &want);
}

/// Several calls in flight at once: pushes, pushpulls and pulls of plain, shared-memory and
/// sliced arrays, waited for in another order than started.
fn inflight(kv: &mut KVStore) {
    let w = kv.num_workers() as f64;
    let r = kv.rank() as f64;
    let shapes = [vec![3usize], vec![1000], vec![4, 5]];
    let zeros: Vec<NDArray> = shapes.iter().map(|s| NDArray::zeros(s)).collect();
    ok("init", kv.init([10, 11, 12], &zeros));
    for step in 1..=4 {
        let g = step as f64 * (r + 1.0);
        let sum = step as f64 * w * (w + 1.0) / 2.0;
        let mut a = ok("alloc", kv.alloc(&shapes[0], DType::F32));
        a.fill(g);
        let push = ok("push_async", kv.push_async(10, &a));
        // The call sends what was given: a change now is the caller's own.
        a.fill(-1000.0);
        let b = NDArray::full(&shapes[1], g);
        let big = ok(
            "pushpull_async big",
            kv.pushpull_async(11, &b, vec![NDArray::zeros(&shapes[1])]),
        );
        let out = ok("alloc", kv.alloc(&shapes[2], DType::F32));
        let c = NDArray::full(&shapes[2], g);
        let small = ok("pushpull_async", kv.pushpull_async(12, &c, vec![out]));
        let small = ok("wait small", kv.wait(small));
        expect_vals("pushpull in flight", &small[0], &[sum; 20]);
        ok("wait push", kv.wait(push));
        let pull = ok(
            "pull_async",
            kv.pull_async([10, 12], vec![NDArray::zeros(&shapes[0]), small[0].clone()]),
        );
        let big = ok("wait big", kv.wait(big));
        expect_vals("big pushpull in flight", &big[0], &vec![sum; 1000]);
        let pulled = ok("wait pull", kv.wait(pull));
        expect_vals("pull in flight", &pulled[0], &[sum; 3]);
        expect_vals("pull into a returned output", &pulled[1], &[sum; 20]);
    }
    // A dropped call is still carried out; wait_all waits for it.
    let _ = ok("push_async", kv.push_async(10, &NDArray::ones(&shapes[0])));
    ok("wait_all", kv.wait_all());
    expect_vals(
        "after wait_all",
        &pulled(kv, 10, &shapes[0], DType::F32),
        &[w; 3],
    );
}

fn optimizers(kv: &mut KVStore) {
    let w = kv.num_workers();
    let sgd = Optimizer::Sgd {
        lr: 0.1,
        momentum: 0.9,
        wd: 0.01,
        rescale_grad: 1.0 / w as f64,
        clip_gradient: 0.0,
    };
    // The reference: a local store with the same optimizer, fed the same summed gradients.
    let mut reference = create("local").unwrap();
    ok("set_optimizer", kv.set_optimizer(sgd.clone()));
    ok("ref optimizer", reference.set_optimizer(sgd));
    let init = NDArray::ones(&[3, 4]);
    let bigw = arange(600, 0.5, DType::F32);
    ok("init", kv.init([4, 6], vec![&init, &bigw]));
    ok("ref init", reference.init([4, 6], vec![&init, &bigw]));
    for step in 0..5 {
        let g = NDArray::full(&[3, 4], (kv.rank() + step) as f64);
        let gb = NDArray::full(&[600], (kv.rank() + 1) as f64);
        let mut out = NDArray::zeros(&[3, 4]);
        ok("pushpull sgd", kv.pushpull(4, &g, &mut out));
        ok("push sgd big", kv.push(6, &gb));
        let all: Vec<NDArray> = (0..w)
            .map(|r| NDArray::full(&[3, 4], (r + step) as f64))
            .collect();
        let allb: Vec<NDArray> = (0..w)
            .map(|r| NDArray::full(&[600], (r + 1) as f64))
            .collect();
        ok("ref push", reference.push([4, 6], &vec![all, allb]));
        expect_vals(
            "sgd step",
            &out,
            &pulled(&mut reference, 4, &[3, 4], DType::F32).to_f64_vec(),
        );
        expect_vals(
            "sgd step on a sliced key",
            &pulled(kv, 6, &[600], DType::F32),
            &pulled(&mut reference, 6, &[600], DType::F32).to_f64_vec(),
        );
    }
    // Plain SGD lr 0.1 on ones from every worker, rescaled by 1/W: -0.1 whatever W (MXNet).
    ok(
        "sgd plain",
        kv.set_optimizer(Optimizer::Sgd {
            lr: 0.1,
            momentum: 0.0,
            wd: 0.0,
            rescale_grad: 1.0 / w as f64,
            clip_gradient: 0.0,
        }),
    );
    ok("init 8", kv.init(8, &NDArray::zeros(&SHAPE)));
    ok("push 8", kv.push(8, &NDArray::ones(&SHAPE)));
    let got = pulled(kv, 8, &SHAPE, DType::F32).to_f64_vec();
    if got.iter().any(|&x| (x + 0.1).abs() > 1e-7) {
        fail(format!("sgd on ones: {got:?}"));
    }
    let adam = Optimizer::adam(0.01);
    ok("adam", kv.set_optimizer(adam.clone()));
    let mut reference = create("local").unwrap();
    ok("ref adam", reference.set_optimizer(adam));
    ok("init 10", kv.init(10, &NDArray::ones(&[5])));
    ok("ref init 10", reference.init(10, &NDArray::ones(&[5])));
    for _ in 0..3 {
        ok(
            "push adam",
            kv.push(10, &NDArray::full(&[5], (kv.rank() + 1) as f64)),
        );
        let all: Vec<NDArray> = (0..w)
            .map(|r| NDArray::full(&[5], (r + 1) as f64))
            .collect();
        ok("ref push adam", reference.push(10, &all));
    }
    expect_vals(
        "adam",
        &pulled(kv, 10, &[5], DType::F32),
        &pulled(&mut reference, 10, &[5], DType::F32).to_f64_vec(),
    );
}

fn custom(kv: &mut KVStore) {
    let w = kv.num_workers() as f64;
    ok("init", kv.init(3, &NDArray::ones(&SHAPE)));
    if kv.set_updater(|_, _, _| Ok(())).is_ok() {
        fail("a closure updater was accepted by a distributed store".into());
    }
    if kv.set_server_updater("not_registered").is_ok() {
        fail("an unknown updater name was accepted".into());
    }
    ok("set_server_updater", kv.set_server_updater("half_add"));
    ok("push", kv.push(3, &NDArray::ones(&SHAPE)));
    ok("barrier", kv.barrier());
    // Sync: once per round on the sum (1 + 0.5 W); async: once per push, the same total.
    let want = 1.0 + 0.5 * w;
    expect_vals(
        "custom updater",
        &pulled(kv, 3, &SHAPE, DType::F32),
        &[want; 6],
    );
}

fn async_mode(kv: &mut KVStore) {
    let w = kv.num_workers() as f64;
    ok("init", kv.init([1, 2], &vec![NDArray::zeros(&SHAPE); 2]));
    match kv.push(2, &NDArray::ones(&SHAPE)) {
        Err(KvError::Remote { .. }) => {}
        other => fail(format!("async push without an updater: {other:?}")),
    }
    expect_vals(
        "refused async push changed nothing",
        &pulled(kv, 2, &SHAPE, DType::F32),
        &[0.0; 6],
    );
    ok("barrier", kv.barrier());
    ok("updater", kv.set_server_updater("add"));
    for _ in 0..20 {
        ok("push", kv.push(1, &NDArray::ones(&SHAPE)));
    }
    ok("barrier", kv.barrier());
    expect_vals(
        "async sum of every push",
        &pulled(kv, 1, &SHAPE, DType::F32),
        &[20.0 * w; 6],
    );
}

fn errors(kv: &mut KVStore) {
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
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(5)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
    let _ = s.write_all(bytes);
    let _ = s.shutdown(std::net::Shutdown::Write);
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

fn garbage(kv: &mut KVStore) {
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
        for addr in kv.server_addrs() {
            for (what, bytes) in &cases {
                if !send_raw(addr, bytes) {
                    fail(format!(
                        "server {addr} did not close the connection after {what}"
                    ));
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
/// `kv.alloc`, one to push another; none here to pull into an array from `kv.alloc` (the server
/// writes it, once), one to pull into another.
fn zerocopy(kv: &mut KVStore) {
    let shm = kv.transports().iter().all(|t| *t == "shm");
    let w = kv.num_workers() as f64;
    let n = 1 << 16;
    ok("init", kv.init(0, &NDArray::zeros(&[n])));
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
    let want = if shm && kv.cross_memory() {
        // The server writes a pull into any output itself: nothing is copied here.
        [(0, 0), (1, bytes), (0, 0), (0, 0)]
    } else if shm {
        [(0, 0), (1, bytes), (0, 0), (1, bytes)]
    } else {
        [(0, 0); 4]
    };
    if counts != want {
        fail(format!(
            "copies (count, bytes) per step {counts:?}, want {want:?}"
        ));
    }
    println!("cross-memory attach: {}", kv.cross_memory());
    println!("copies per step: push alloc {:?}, push other {:?}, pull into alloc {:?}, pull into other {:?}", counts[0], counts[1], counts[2], counts[3]);
}

/// Rank 1 dies abruptly after init; the others keep calling until they get an error.
fn die(kv: &mut KVStore) {
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
fn until_error(kv: &mut KVStore) {
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
fn stall(kv: &mut KVStore) {
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
fn late(kv: &mut KVStore) {
    const N: usize = 1000;
    let secs: f64 = std::env::var("KVSTORE_TIMEOUT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2.0);
    ok("init 9", kv.init(9, &NDArray::zeros(&[N])));
    ok("init 10", kv.init(10, &NDArray::zeros(&[N])));
    if kv.rank() == 1 {
        std::thread::sleep(Duration::from_secs_f64(secs * 2.0));
        let mut outs = [NDArray::zeros(&[N]), NDArray::zeros(&[N])];
        let ones = [NDArray::ones(&[N]), NDArray::ones(&[N])];
        ok(
            "the late pushpull",
            kv.pushpull(&[9, 10][..], &ones[..], &mut outs[..]),
        );
        // Rank 0's push was in the round before it timed out: both pushes are summed.
        expect_vals("the round rank 0 left", &outs[0], &[2.0; N]);
        println!("late round done");
        return;
    }
    let heap_out = NDArray::zeros(&[N]);
    let pool_out = ok("alloc", kv.alloc(&[N], DType::F32));
    let pushed = NDArray::ones(&[N]);
    let mut outs = vec![heap_out, pool_out];
    match kv.pushpull(&[9, 10][..], &[pushed.clone(), pushed][..], &mut outs[..]) {
        Err(KvError::Timeout { .. }) => println!("timed out as configured"),
        other => fail(format!("expected a timeout, got {other:?}")),
    }
    // What the caller holds now is its own: fill it, drop one, allocate more of the same size.
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
    for a in fresh.iter().chain(&fresh_pool) {
        expect_vals("memory allocated after a failed call", a, &[-7.0; N]);
    }
    println!("no late write landed");
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let scenario = args.get(1).cloned().unwrap_or_else(|| "seed".into());
    let kind = args.get(2).cloned().unwrap_or_else(|| "dist_sync".into());
    kvstore::register_updater("half_add", |_, input, stored| stored.axpy(0.5, input));
    kvstore::register_updater("add", |_, input, stored| stored.add_assign(input));
    let mut kv = match create(&kind) {
        Ok(kv) => kv,
        Err(e) => fail(format!("create {kind}: {e}")),
    };
    for (i, (addr, t)) in kv.server_addrs().iter().zip(kv.transports()).enumerate() {
        println!("rank {} reaches server {i} at {addr} via {t}", kv.rank());
    }
    match scenario.as_str() {
        "seed" => seed(&mut kv),
        "big" => big(&mut kv),
        "optimizers" => optimizers(&mut kv),
        "inflight" => inflight(&mut kv),
        "custom" => custom(&mut kv),
        "async" => async_mode(&mut kv),
        "errors" => errors(&mut kv),
        "garbage" => garbage(&mut kv),
        "die" => die(&mut kv),
        "until_error" => until_error(&mut kv),
        "stall" => stall(&mut kv),
        "late" => late(&mut kv),
        "zerocopy" => zerocopy(&mut kv),
        other => fail(format!("unknown scenario {other}")),
    }
    println!("{scenario} ok rank {} of {}", kv.rank(), kv.num_workers());
}
