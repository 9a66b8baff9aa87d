//! The servers' optimizer state, saved by one worker and loaded back: a job that reloads its
//! momentum after resetting the optimizer ends exactly where a local store that never reset
//! does.

use kvstore::{create, DType, KVStore, NDArray, Optimizer};

use crate::{fail, ok};

fn opt() -> Optimizer {
    Optimizer::sgd(0.1).momentum(0.9).wd(0.01)
}

pub(crate) fn states(kv: &mut KVStore) {
    let w = kv.num_workers() as f64;
    let rank = kv.rank() as f64;
    // The second key is sliced over the servers when KVSTORE_BIGARRAY_BOUND is below 300.
    let shapes = [vec![10usize], vec![300]];
    let ones: Vec<NDArray> = shapes
        .iter()
        .map(|s| NDArray::full_dtype(s, 1.0, DType::F64))
        .collect();
    let mut local = ok("local store", create("local"));
    ok("init", kv.init([0, 1], &ones));
    ok("local init", local.init([0, 1], &ones));
    ok("optimizer", kv.set_optimizer(opt()));
    ok("local optimizer", local.set_optimizer(opt()));
    let step = |kv: &mut KVStore, local: &mut KVStore, s: f64| {
        let mine: Vec<NDArray> = shapes
            .iter()
            .map(|sh| NDArray::full_dtype(sh, s * (rank + 1.0), DType::F64))
            .collect();
        let all: Vec<NDArray> = shapes
            .iter()
            .map(|sh| NDArray::full_dtype(sh, s * w * (w + 1.0) / 2.0, DType::F64))
            .collect();
        ok("push", kv.push([0, 1], &mine));
        ok("local push", local.push([0, 1], &all));
    };
    step(kv, &mut local, 1.0);
    step(kv, &mut local, 2.0);
    ok("barrier", kv.barrier());
    let port = std::env::var("DMLC_PS_ROOT_PORT").unwrap_or_default();
    let path = std::env::temp_dir().join(format!("kvstore-states-{port}"));
    let garbage = std::env::temp_dir().join(format!("kvstore-states-{port}-bad"));
    let dumped = std::env::temp_dir().join(format!("kvstore-states-{port}-dumped"));
    if kv.rank() == 0 {
        ok("save", kv.save_optimizer_states(&path));
        ok(
            "save with the optimizer",
            kv.save_optimizer_and_states(&dumped),
        );
    }
    ok("barrier", kv.barrier());
    // A fresh optimizer forgets the momentum; loading the file brings it back.
    ok("optimizer again", kv.set_optimizer(opt()));
    if kv.rank() == 0 {
        if ok("load", kv.load_optimizer_states(&path)) {
            fail("states saved without their optimizer said they carried it".into());
        }
        let bytes = ok("read", std::fs::read(&path).map_err(kvstore::KvError::from));
        for cut in [0, 9, bytes.len() / 2, bytes.len() - 1] {
            ok(
                "write",
                std::fs::write(&garbage, &bytes[..cut]).map_err(kvstore::KvError::from),
            );
            if kv.load_optimizer_states(&garbage).is_ok() {
                fail(format!("a state file cut to {cut} bytes was loaded"));
            }
        }
        println!("refused truncated states");
    }
    ok("barrier", kv.barrier());
    // Another optimizer: the file that carries the saved one brings it back, with its state,
    // and the job ends where the local store does.
    ok("another optimizer", kv.set_optimizer(Optimizer::adam(5.0)));
    if kv.rank() == 0 && !ok("load with the optimizer", kv.load_optimizer_states(&dumped)) {
        fail("states saved with their optimizer did not bring it back".into());
    }
    ok("barrier", kv.barrier());
    // Another key: the saved state no longer matches the job's keys, and is refused.
    ok("init 2", kv.init(2, &ones[0]));
    if kv.rank() == 0 {
        match kv.load_optimizer_states(&path) {
            Err(e) if e.to_string().contains("keys differ") => println!("refused another layout"),
            other => fail(format!(
                "a state saved with other keys was loaded: {other:?}"
            )),
        }
    }
    ok("barrier", kv.barrier());
    step(kv, &mut local, 3.0);
    ok("barrier", kv.barrier());
    for (key, sh) in shapes.iter().enumerate() {
        let mut got = NDArray::zeros_dtype(sh, DType::F64);
        let mut want = NDArray::zeros_dtype(sh, DType::F64);
        ok("pull", kv.pull(key, &mut got));
        ok("local pull", local.pull(key, &mut want));
        if got.to_f64_vec() != want.to_f64_vec() {
            fail(format!(
                "key {key} after reloading the state: {:?}, a store that kept it: {:?}",
                &got.to_f64_vec()[..3],
                &want.to_f64_vec()[..3]
            ));
        }
    }
    if kv.rank() == 0 {
        let _ = std::fs::remove_file(&path);
        let _ = std::fs::remove_file(&garbage);
        let _ = std::fs::remove_file(&dumped);
    }
    println!("states reloaded exactly");
}
