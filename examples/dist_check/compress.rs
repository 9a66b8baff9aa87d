//! Gradient compression in a distributed job: what every worker's pushes send, computed here
//! by the rule apart from the store's, is what the servers sum.

use kvstore::{Compression, DType, KVStore, Key, KvError, NDArray};

use crate::{expect_vals, fail, ok, pulled};

const T: f32 = 0.25;
const STEPS: usize = 6;
/// Key 0 is small (one server); key 1 is cut over the servers when the job's big-array bound
/// is small, into slices that are no multiple of 16 elements.
const SIZES: [usize; 2] = [5, 1000];

/// Worker `rank`'s gradient of key `key` at `step`: tenths between -0.5 and 0.5.
fn grad(key: usize, rank: usize, step: usize) -> Vec<f32> {
    (0..SIZES[key])
        .map(|i| ((i * 7 + step * 3 + rank * 5 + key) % 11) as f32 * 0.1 - 0.5)
        .collect()
}

/// What worker `rank`'s pushes of `key` send, step by step: MXNet's rule, element by element.
fn sent(key: usize, rank: usize) -> Vec<Vec<f32>> {
    let mut r = vec![0.0f32; SIZES[key]];
    (0..STEPS)
        .map(|s| {
            grad(key, rank, s)
                .iter()
                .zip(r.iter_mut())
                .map(|(g, r)| {
                    let v = *r + g;
                    if v >= T {
                        *r = v - T;
                        T
                    } else if v <= -T {
                        *r = v + T;
                        -T
                    } else {
                        *r = v;
                        0.0
                    }
                })
                .collect()
        })
        .collect()
}

/// Every worker's sends of `key` at `step`, summed (multiples of a power of two: exact in any
/// order).
fn round_sum(key: usize, w: usize, step: usize) -> Vec<f64> {
    let mut sum = vec![0.0f64; SIZES[key]];
    for rank in 0..w {
        for (s, x) in sum.iter_mut().zip(&sent(key, rank)[step]) {
            *s += *x as f64;
        }
    }
    sum
}

fn arr(v: Vec<f32>) -> NDArray {
    ok("array", NDArray::from_vec(&[v.len()], v))
}

fn set_and_init(kv: &mut KVStore) {
    let c = ok("threshold", Compression::two_bit(T));
    ok("set_gradient_compression", kv.set_gradient_compression(c));
    let zeros: Vec<NDArray> = SIZES.iter().map(|n| NDArray::zeros(&[*n])).collect();
    ok("init", kv.init([0, 1], vec![&zeros[0], &zeros[1]]));
    ok(
        "init f64",
        kv.init(2, &NDArray::zeros_dtype(&[3], DType::F64)),
    );
    match kv.set_gradient_compression(c) {
        Err(KvError::Unsupported(m)) if m.contains("before") => {}
        other => fail(format!("set_gradient_compression after init: {other:?}")),
    }
    // A float64 key cannot be compressed: refused before anything is sent.
    match kv.push(2, &NDArray::full_dtype(&[3], 1.0, DType::F64)) {
        Err(KvError::Unsupported(m)) if m.contains("float32") => {}
        other => fail(format!("a compressed f64 push: {other:?}")),
    }
}

/// `dist_sync`, ASSIGN: each round's value is the sum of what the workers' pushes sent.
/// Pushes of both keys in one call, pushpulls, and a list of values (summed, then packed).
pub fn compress(kv: &mut KVStore) {
    let (w, rank) = (kv.num_workers(), kv.rank());
    set_and_init(kv);
    let before = kv.metrics().total().bytes_pushed;
    for step in 0..STEPS {
        let g: Vec<NDArray> = (0..2).map(|k| arr(grad(k, rank, step))).collect();
        let mut outs: Vec<NDArray> = SIZES.iter().map(|n| NDArray::zeros(&[*n])).collect();
        match step % 3 {
            0 => ok("push", kv.push([0, 1], vec![&g[0], &g[1]])),
            1 => {
                let (o0, o1) = outs.split_at_mut(1);
                ok(
                    "pushpull",
                    kv.pushpull([0, 1], vec![&g[0], &g[1]], vec![&mut o0[0], &mut o1[0]]),
                );
                for (k, o) in outs.iter().enumerate() {
                    expect_vals(&format!("pushpull {k}"), o, &round_sum(k, w, step));
                }
            }
            _ => {
                // Halves are exact: the list sums to the gradient.
                let halves: Vec<NDArray> = g.iter().map(|a| a.scaled(0.5)).collect();
                ok("push list", kv.push(0, vec![&halves[0], &halves[0]]));
                ok("push 1", kv.push(1, &g[1]));
            }
        }
        for (k, n) in SIZES.iter().enumerate() {
            let got = pulled(kv, k as i32, &[*n], DType::F32);
            expect_vals(
                &format!("step {step} key {k}"),
                &got,
                &round_sum(k, w, step),
            );
        }
        ok("barrier", kv.barrier());
    }
    // Pushes travelled packed: 4 bytes per 16 elements of each slice.
    let slices = |n: u64, parts: u64| {
        let each = n / parts;
        (0..parts)
            .map(|i| if i + 1 == parts { n - each * i } else { each })
            .map(|l| l.div_ceil(16) * 4)
            .sum::<u64>()
    };
    let parts = kv
        .placement()
        .iter()
        .find(|(k, _)| *k == Key::Int(1))
        .map_or(1, |(_, s)| s.len());
    let packed = slices(5, 1) + slices(1000, parts as u64);
    let pushed = kv.metrics().total().bytes_pushed - before;
    if pushed != packed * STEPS as u64 {
        fail(format!(
            "pushed {pushed} bytes, not {} packed",
            packed * STEPS as u64
        ));
    }
}

/// `dist_async` with an adding updater: every push is applied as it comes, so the value is
/// the sum of everything every worker sent.
pub fn compress_async(kv: &mut KVStore) {
    let (w, rank) = (kv.num_workers(), kv.rank());
    ok("updater", kv.set_server_updater("add"));
    set_and_init(kv);
    for step in 0..STEPS {
        let g: Vec<NDArray> = (0..2).map(|k| arr(grad(k, rank, step))).collect();
        ok("push", kv.push([0, 1], vec![&g[0], &g[1]]));
    }
    ok("barrier", kv.barrier());
    for (k, n) in SIZES.iter().enumerate() {
        let mut want = vec![0.0f64; *n];
        for step in 0..STEPS {
            for (a, b) in want.iter_mut().zip(round_sum(k, w, step)) {
                *a += b;
            }
        }
        expect_vals(
            &format!("async key {k}"),
            &pulled(kv, k as i32, &[*n], DType::F32),
            &want,
        );
    }
}
