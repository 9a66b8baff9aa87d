//! A distributed program that checks the values it pulls; the integration tests run it under
//! `kvrun` (and by hand) in every role. `dist_check SCENARIO dist_sync|dist_async`.
//! It prints `SCENARIO ok rank R` and exits 0 when every value is what MXNet gives, and
//! exits non-zero with the mismatch otherwise.

use kvstore::{cpu, create, DType, KVStore, KvError, NDArray};

mod batches;
mod compress;
mod faults;
mod gpu;
mod held;
mod metrics;
mod optimizers;
mod states;
mod stores;

use faults::{die, errors, garbage, late, slots, stall, until_error, zerocopy};
use stores::{str_errors, two_stores};

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
    let b: Vec<NDArray> = (0..4)
        .map(|i| NDArray::ones(&SHAPE).on(cpu(i)).unwrap())
        .collect();
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
    let per_dev: Vec<NDArray> = (0..4)
        .map(|i| NDArray::ones(&SHAPE).on(cpu(i)).unwrap())
        .collect();
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
    // Rows 0, 4..=6 and 12 (runs that cross the servers' slices when the value is cut): they
    // get the stored rows, the others zero.
    let mut rows = ok("ones", NDArray::from_vec(&[13, 17], vec![1.0f64; 221]));
    ok(
        "row_sparse_pull big",
        kv.row_sparse_pull(1, &mut rows, &[12, 4, 5, 0, 6, 4]),
    );
    let want: Vec<f64> = (0..221)
        .map(|i| match i / 17 {
            0 | 4..=6 | 12 => i as f64 * w,
            _ => 0.0,
        })
        .collect();
    expect_vals("big row_sparse_pull", &rows, &want);
    if kv.row_sparse_pull(1, &mut rows, &[13]).is_ok() {
        fail("a row past the last was pulled".into());
    }
    expect_vals("big row_sparse_pull refused", &rows, &want);
    let mut one = ok("ones", NDArray::from_vec(&[1000], vec![1.0f32; 1000]));
    ok(
        "row_sparse_pull 1-d",
        kv.row_sparse_pull(0, &mut one, &[999, 3]),
    );
    let want: Vec<f64> = (0..1000)
        .map(|i| match i {
            3 | 999 => i as f64 * w * (w + 1.0) / 2.0,
            _ => 0.0,
        })
        .collect();
    expect_vals("1-d row_sparse_pull", &one, &want);
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
    // A pull right after this worker's own push, not waited for, sees the round's result
    // (the server answers it once the round is in, as MXNet's engine orders a pull after the
    // push before it); the other workers push late, so the pull comes in mid-round.
    for step in 5..=6 {
        let g = step as f64 * (r + 1.0);
        let sum = step as f64 * w * (w + 1.0) / 2.0;
        if r > 0.0 {
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        let push = ok(
            "push_async",
            kv.push_async(10, &NDArray::full(&shapes[0], g)),
        );
        let out = pulled(kv, 10, &shapes[0], DType::F32);
        expect_vals("pull after an unwaited push", &out, &[sum; 3]);
        ok("wait push", kv.wait(push));
    }
    // Two pushes of one key in a row, the first not waited for, the other workers late: each
    // server holds the second for the round after the first (the key is sliced: no slice runs
    // a round ahead of another), and a pull after them sees the second round.
    for step in 7..=8 {
        let g = step as f64 * (r + 1.0);
        let sum = step as f64 * w * (w + 1.0) / 2.0;
        if r > 0.0 {
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        let first = NDArray::full(&shapes[1], 1000.0 * (r + 1.0));
        let first = ok("push_async", kv.push_async(11, &first));
        ok("a second push", kv.push(11, &NDArray::full(&shapes[1], g)));
        ok("wait first", kv.wait(first));
        let out = pulled(kv, 11, &shapes[1], DType::F32);
        expect_vals("pull after two pushes", &out, &vec![sum; 1000]);
    }
    if w > 1.0 {
        third_push(kv, &shapes[1]);
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

/// Worker 0 pushes key 11 three times while the others wait (for a file it makes after, as
/// they run on this host: a barrier would wait for its pushes in flight): the third is refused
/// (by the worker where the key is sliced over several servers, by the one server otherwise),
/// the store goes on, and the two rounds pushed are summed as they should be.
fn third_push(kv: &mut KVStore, shape: &[usize]) {
    let w = kv.num_workers() as f64;
    let r = kv.rank() as f64;
    // Sliced where there are several servers and its size reaches the bound (the store's
    // default, 10^6, or the job's).
    let bound = ["KVSTORE_BIGARRAY_BOUND", "MXNET_KVSTORE_BIGARRAY_BOUND"]
        .iter()
        .find_map(|v| std::env::var(v).ok()?.parse::<usize>().ok())
        .unwrap_or(1_000_000);
    let servers = std::env::var("DMLC_NUM_SERVER").map_or(1, |s| s.parse().unwrap_or(1));
    let sliced = servers > 1 && shape.iter().product::<usize>() >= bound;
    let job = std::env::var("DMLC_PS_ROOT_PORT").unwrap_or_default();
    let sign = std::env::temp_dir().join(format!("kvstore-third-push-{job}"));
    let g = |step: f64| NDArray::full(shape, step * (r + 1.0));
    if r == 0.0 {
        let first = ok("push_async", kv.push_async(11, &g(9.0)));
        let second = ok("push_async", kv.push_async(11, &g(10.0)));
        match (kv.push_async(11, &g(11.0)).and_then(|p| kv.wait(p)), sliced) {
            (Err(kvstore::KvError::Unsupported(_)), true) => {}
            (Err(kvstore::KvError::Remote { .. }), false) => {}
            (other, _) => fail(format!("a third push in flight: {other:?}")),
        }
        ok(
            "sign",
            std::fs::write(&sign, b"").map_err(kvstore::KvError::from),
        );
        ok("wait first", kv.wait(first));
        ok("wait second", kv.wait(second));
    } else {
        let until = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while !sign.exists() {
            if std::time::Instant::now() > until {
                fail("worker 0's third push did not end".into());
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        ok("push", kv.push(11, &g(9.0)));
        ok("push", kv.push(11, &g(10.0)));
    }
    let sum = 10.0 * w * (w + 1.0) / 2.0;
    let out = pulled(kv, 11, shape, DType::F32);
    expect_vals(
        "pull after a refused third push",
        &out,
        &vec![sum; shape[0]],
    );
    ok("barrier", kv.barrier());
    if r == 0.0 {
        let _ = std::fs::remove_file(&sign);
    }
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
    // An updater's own error reaches every worker whole, said once.
    ok("barrier", kv.barrier());
    ok("set_server_updater", kv.set_server_updater("reject_nan"));
    match kv.push(3, &NDArray::full(&SHAPE, f64::NAN)) {
        Err(e) => {
            let text = e.to_string();
            if !text.contains("reject_nan: gradient contained NaN")
                || text.matches("updater failed").count() != 1
            {
                fail(format!("the updater's error, as a worker got it: {text}"));
            }
            println!("updater error: {text}");
        }
        Ok(()) => fail("a NaN push was applied".into()),
    }
}

/// `register_updater` after `create`: a server never ran it (its `create` does not return), and
/// every rank gets the same error saying so.
fn late_updater(kv: &mut KVStore) {
    kvstore::register_updater("late", |_, input, stored| stored.add_assign(input));
    ok("init", kv.init(3, &NDArray::ones(&SHAPE)));
    match kv.set_server_updater("late") {
        Err(e) if e.to_string().contains("register_updater must run before") => {
            println!("late updater refused: {e}");
        }
        other => fail(format!("set_server_updater of a late updater: {other:?}")),
    }
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

/// A call that waits long runs the rest of its wait inside the store's slow wait, once, and a
/// wrapper that never runs it costs nothing but the wrapping: rank 1 pushes a second late.
fn slow_wait(kv: &mut KVStore) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Duration;
    let w = kv.num_workers() as f64;
    ok("init", kv.init(3, &NDArray::zeros(&SHAPE)));
    let wrapped = Arc::new(AtomicUsize::new(0));
    let count = wrapped.clone();
    kv.set_slow_wait(Duration::from_micros(20), move |rest| {
        count.fetch_add(1, Ordering::Relaxed);
        rest();
    });
    for round in 1..=2 {
        if round == 2 {
            // A wrapper that forgets to run the rest: the call still waits for its answer.
            kv.set_slow_wait(Duration::from_micros(20), |_| {});
        }
        if kv.rank() == 1 {
            std::thread::sleep(Duration::from_secs(1));
        }
        let start = std::time::Instant::now();
        ok("push", kv.push(3, &NDArray::ones(&SHAPE)));
        let long = start.elapsed() >= Duration::from_millis(500);
        if kv.rank() == 0 && !long {
            fail(format!("round {round}: the push did not wait for rank 1"));
        }
        expect_vals(
            "pushes of every worker",
            &pulled(kv, 3, &SHAPE, DType::F32),
            &[w; 6],
        );
        if round == 1 && kv.rank() == 0 && wrapped.load(Ordering::Relaxed) == 0 {
            fail("a push that waited a second never ran its slow wait".into());
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let scenario = args.get(1).cloned().unwrap_or_else(|| "seed".into());
    let kind = args.get(2).cloned().unwrap_or_else(|| "dist_sync".into());
    kvstore::register_updater("half_add", |_, input, stored| stored.axpy(0.5, input));
    kvstore::register_updater("add", |_, input, stored| stored.add_assign(input));
    kvstore::register_updater("reject_nan", |key, input, stored| {
        let nan = input
            .to_vec::<f32>()
            .map_or(true, |v| v.iter().any(|x| x.is_nan()));
        if nan {
            return Err(KvError::Updater {
                key: key.clone(),
                reason: "gradient contained NaN".into(),
            });
        }
        stored.add_assign(input)
    });
    // (The other roles serve, as in every scenario, in `create`.)
    if scenario == "two_stores" && std::env::var("DMLC_ROLE").as_deref() == Ok("worker") {
        return two_stores(&kind);
    }
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
        "optimizers" => optimizers::optimizers(&mut kv),
        "inflight" => inflight(&mut kv),
        "custom" => custom(&mut kv),
        "late_updater" => late_updater(&mut kv),
        "exit0" => faults::exit0(&mut kv),
        "leave_early" => faults::leave_early(&mut kv),
        "skip_barrier" => faults::skip_barrier(&mut kv),
        "leave_held" => held::leave_held(&mut kv),
        "chaos" => faults::chaos(&mut kv),
        "async" => async_mode(&mut kv),
        "slow_wait" => slow_wait(&mut kv),
        "errors" => errors(&mut kv),
        "str_errors" => str_errors(&mut kv),
        "garbage" => garbage(&mut kv),
        "die" => die(&mut kv),
        "until_error" => until_error(&mut kv),
        "stall" => stall(&mut kv),
        "late" => late(&mut kv),
        "zerocopy" => zerocopy(&mut kv),
        "slots" => slots(&mut kv),
        "batches" => batches::batches(&mut kv),
        "states" => states::states(&mut kv),
        "metrics" => metrics::metrics(&mut kv),
        "gpu" => gpu::gpus(&mut kv),
        "compress" => compress::compress(&mut kv),
        "compress_async" => compress::compress_async(&mut kv),
        other => fail(format!("unknown scenario {other}")),
    }
    println!("{scenario} ok rank {} of {}", kv.rank(), kv.num_workers());
}
