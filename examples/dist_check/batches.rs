//! The scenario of many small keys per call: each server gets its slices of a call as
//! batches and answers them as batches.

use kvstore::{DType, KVStore, NDArray};

use crate::{expect_vals, fail, ok};

/// 300 keys of mixed sizes (empty ones among them) and dtypes, pushed, pulled and pushpulled as one list per call
/// (one key with two outputs), every value checked exactly. One size (5000 elements of f32,
/// 20000 bytes) is over the batch limit and goes alone; a list of one key goes alone too. The
/// worker must have sent batches.
pub(crate) fn batches(kv: &mut KVStore) {
    let (w, r) = (kv.num_workers() as f64, kv.rank() as f64);
    let n = 300usize;
    let keys: Vec<i32> = (100..100 + n as i32).collect();
    // Keys of no elements too: a call's pushes of them to one server make a batch with no
    // data at all.
    let size = |i: usize| [1, 7, 256, 2000, 5000, 0][i % 6];
    let dtype = |i: usize| [DType::F32, DType::F64, DType::I32][i % 3];
    let zeros: Vec<NDArray> = (0..n)
        .map(|i| NDArray::zeros_dtype(&[size(i)], dtype(i)))
        .collect();
    ok("init", kv.init(keys.clone(), &zeros));
    let before = kv.batched_requests();
    for round in 0..4 {
        let vals: Vec<NDArray> = (0..n)
            .map(|i| {
                let v = (r + 1.0) * (i + 1) as f64 + round as f64;
                NDArray::full_dtype(&[size(i)], v, dtype(i))
            })
            .collect();
        // Every worker's value summed: ranks 1..=w times (i + 1), plus w times the round.
        let want = |i: usize| (i + 1) as f64 * w * (w + 1.0) / 2.0 + w * round as f64;
        let mut outs = zeros.clone();
        if round % 2 == 0 {
            ok("push", kv.push(keys.clone(), &vals));
            ok("pull", kv.pull(keys.clone(), &mut outs));
        } else {
            ok("pushpull", kv.pushpull(keys.clone(), &vals, &mut outs));
        }
        for (i, o) in outs.iter().enumerate() {
            expect_vals(&format!("key {}", keys[i]), o, &vec![want(i); size(i)]);
        }
        // The empty keys alone: each server's batch of them has no data at all. Pushed, and
        // pulled back empty in their own dtypes (the next round's pushes of them would be
        // refused, were a push of nothing taken for one of bytes).
        let empty: Vec<usize> = (0..n).filter(|&i| size(i) == 0).collect();
        let ek: Vec<i32> = empty.iter().map(|&i| keys[i]).collect();
        let ev: Vec<NDArray> = empty.iter().map(|&i| zeros[i].clone()).collect();
        ok("push empty", kv.push(ek.clone(), &ev));
        let mut eo = ev.clone();
        ok("pull empty", kv.pull(ek, &mut eo));
        for (o, &i) in eo.iter().zip(&empty) {
            if o.dtype() != dtype(i) || o.size() != 0 {
                fail(format!(
                    "empty key {} came back as {:?}",
                    keys[i],
                    o.dtype()
                ));
            }
        }
        // Two outputs of one key, and a list of one key.
        let mut two = [zeros[1].clone(), zeros[1].clone()];
        ok("pull two", kv.pull([keys[1], keys[1]], &mut two));
        for o in &two {
            expect_vals("two outputs", o, &vec![want(1); size(1)]);
        }
        let mut one = [zeros[2].clone()];
        ok("pull one", kv.pull([keys[2]], &mut one));
        expect_vals("one key", &one[0], &vec![want(2); size(2)]);
        ok("barrier", kv.barrier());
    }
    let batched = kv.batched_requests() - before;
    if batched == 0 {
        fail("no request went in a batch".into());
    }
    println!("batched {batched}");
}
