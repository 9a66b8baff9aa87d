//! The store's metrics after a known job: every push and pull of a known number of slices
//! and bytes is counted, per server, transport and key range; and the placement map.

use kvstore::{KVStore, NDArray};

use crate::{fail, ok};

pub(crate) fn metrics(kv: &mut KVStore) {
    // Key 10 is sliced over the servers when KVSTORE_BIGARRAY_BOUND is below 3000.
    let keys = [1, 2, 10];
    let sizes = [4usize, 8, 3000];
    let vals: Vec<NDArray> = sizes.iter().map(|&n| NDArray::ones(&[n])).collect();
    let mut outs: Vec<NDArray> = sizes.iter().map(|&n| NDArray::zeros(&[n])).collect();
    ok("init", kv.init(keys, &vals));
    let placement = kv.placement();
    let slices: u64 = placement.iter().map(|(_, p)| p.len() as u64).sum();
    // What the placement must be, from the job's own settings, not from the store under test:
    // keys 1 and 2 whole, key 10 in a slice per server where its 3000 elements pass the bound.
    let env = |name: &str, default: u64| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let bound = env(
        "KVSTORE_BIGARRAY_BOUND",
        env("MXNET_KVSTORE_BIGARRAY_BOUND", 1_000_000),
    );
    let servers = env("DMLC_NUM_SERVER", 1);
    // Sliced where its size is at least the bound (MXNet's rule).
    let want = 2 + if 3000 >= bound { servers } else { 1 };
    if slices != want {
        fail(format!(
            "{slices} slices placed, want {want}: {placement:?}"
        ));
    }
    let bytes: u64 = sizes.iter().map(|n| 4 * *n as u64).sum();
    let before = kv.metrics();
    const ROUNDS: u64 = 5;
    for _ in 0..ROUNDS {
        ok("push", kv.push(keys, &vals));
        ok("pull", kv.pull(keys, &mut outs[..]));
    }
    let after = kv.metrics();
    let (b, a) = (before.total(), after.total());
    let check = |what: &str, got: u64, want: u64| {
        if got != want {
            fail(format!("{what}: counted {got}, want {want}"));
        }
    };
    check("calls", after.calls - before.calls, 2 * ROUNDS);
    check("pushes", a.pushes - b.pushes, ROUNDS * slices);
    check("pulls", a.pulls - b.pulls, ROUNDS * slices);
    check(
        "bytes pushed",
        a.bytes_pushed - b.bytes_pushed,
        ROUNDS * bytes,
    );
    check(
        "bytes pulled",
        a.bytes_pulled - b.bytes_pulled,
        ROUNDS * bytes,
    );
    let by_transport: u64 = after.transports.values().map(|t| t.pushes).sum();
    check("pushes over the transports", by_transport, a.pushes);
    let by_range: u64 = after.key_ranges.values().map(|t| t.pushes).sum();
    check("pushes over the key ranges", by_range, a.pushes);
    if after.servers.iter().any(|s| s.latency.count() == 0) {
        fail("a server without call latencies".into());
    }
    // A push whose `Pending` is dropped unwaited is still carried out, and is counted as a
    // call once a later call finds it over (its answer may come after the first pull's,
    // which waits for the push's round: a later pull finds it).
    let before = kv.metrics().calls;
    drop(ok("push_async", kv.push_async(keys, &vals)));
    let mut pulls = 0;
    while kv.metrics().calls - before == pulls && pulls < 50 {
        ok("pull", kv.pull(keys, &mut outs[..]));
        pulls += 1;
    }
    check(
        "calls with a push_async dropped, less the pulls",
        kv.metrics().calls - before - pulls,
        1,
    );
    let map = kv.placement_map();
    let key10 = map
        .lines()
        .find(|l| l.starts_with("key 10: "))
        .unwrap_or("");
    if map.lines().count() != keys.len() || key10.matches("server ").count() as u64 != want - 2 {
        fail(format!("placement map:\n{map}"));
    }
    print!("{map}");
    println!("metrics counted {slices} slices a round");
}
