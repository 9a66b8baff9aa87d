//! The seed's values with GPU arrays (a build with the `cuda` feature, on a GPU machine):
//! values pushed from every GPU (several per GPU where there are fewer than four), pulls into
//! outputs on every GPU.

use kvstore::{gpu, gpu_count, DType, KVStore, NDArray};

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
}
