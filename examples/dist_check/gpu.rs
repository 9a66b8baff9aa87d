//! The seed's values with GPU arrays (a build with the `cuda` feature, on a GPU machine):
//! values pushed from every GPU (several per GPU where there are fewer than four), pulls into
//! outputs on every GPU; then arrays from `alloc_on`, on a GPU and on the host.

use kvstore::{cpu, gpu, gpu_count, DType, KVStore, NDArray};

use crate::{expect_vals, fail, ok, pulled, SHAPE};

pub(crate) fn gpus(kv: &mut KVStore) {
    let n = gpu_count() as u32;
    if n == 0 {
        fail("no GPU: this scenario needs one".into());
    }
    let w = kv.num_workers() as f64;
    let on = |a: NDArray, i: u32| ok("to a GPU", a.on(gpu(i % n)));
    ok("init", kv.init(3, &on(NDArray::ones(&SHAPE) * 2.0, 0)));
    expect_vals("init", &pulled(kv, 3, &SHAPE, DType::F32), &[2.0; 6]);
    let b: Vec<NDArray> = (0..4).map(|i| on(NDArray::ones(&SHAPE), i)).collect();
    ok("push from GPUs", kv.push(3, &b));
    let mut outs: Vec<NDArray> = (0..4).map(|i| on(NDArray::zeros(&SHAPE), i)).collect();
    ok("pull into GPUs", kv.pull(3, &mut outs));
    for o in &outs {
        if o.device().is_cpu() {
            fail(format!("an output moved to {}", o.device()));
        }
        expect_vals("pull into GPU outputs", o, &[4.0 * w; 6]);
    }
    staged(kv, w);
}

/// Arrays from `alloc_on`: a GPU array staged through the transport's memory (over shared
/// memory, the pool's pages, which a push sends in place), changed on the GPU between rounds;
/// and a page-locked host array.
fn staged(kv: &mut KVStore, w: f64) {
    let shm = std::env::var("KVSTORE_TRANSPORT").is_ok_and(|t| t == "shm");
    ok("init", kv.init(4, &NDArray::zeros(&SHAPE)));
    let mut g = ok("alloc_on a GPU", kv.alloc_on(&SHAPE, DType::F32, gpu(0)));
    let mut out = ok("alloc_on a GPU", kv.alloc_on(&SHAPE, DType::F32, gpu(0)));
    for a in [&g, &out] {
        if a.device() != gpu(0) || !a.is_pinned() || a.is_shared_memory() != shm {
            fail(format!(
                "alloc_on(gpu(0)): on {}, page-locked {}, in shared memory {} (over shm: {shm})",
                a.device(),
                a.is_pinned(),
                a.is_shared_memory()
            ));
        }
    }
    for round in 1..=3 {
        let v = ok("to a GPU", NDArray::full(&SHAPE, round as f64).on(gpu(0)));
        // A device-to-device copy: the host copy is brought up to date by the push.
        ok("copy on the GPU", g.copy_from(&v));
        ok("push an alloc_on GPU array", kv.push(4, &g));
        ok("pull into an alloc_on GPU array", kv.pull(4, &mut out));
        expect_vals("alloc_on GPU arrays", &out, &[round as f64 * w; 6]);
    }
    let mut h = ok("alloc_on a CPU", kv.alloc_on(&SHAPE, DType::F32, cpu(0)));
    if !h.is_pinned() || h.is_shared_memory() != shm {
        fail(format!(
            "alloc_on(cpu(0)) with a GPU: page-locked {}, in shared memory {}",
            h.is_pinned(),
            h.is_shared_memory()
        ));
    }
    h.fill(5.0);
    ok("push a pinned host array", kv.push(4, &h));
    ok("pull into a GPU array", kv.pull(4, &mut out));
    expect_vals("a pinned host array's push", &out, &[5.0 * w; 6]);
}
