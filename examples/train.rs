//! The main job: data-parallel training of a wide linear model with a known answer.
//!
//! Every worker holds its own shard of synthetic data `Y = X · W*` (X: n×d, W*: d×k). Each step
//! it pulls the weights, computes the gradient of the mean squared error on its shard and
//! pushes it; the servers average the workers' gradients and apply SGD with momentum in place.
//! At the end every worker checks that the weights it pulls are W*.
//!
//! ```text
//! cargo build --release --workspace --examples
//! target/release/kvrun -n 4 -s 2 target/release/examples/train
//! ```
//! Options (environment): `TRAIN_STEPS` (default 40), `TRAIN_OUTPUTS` k (default 16384),
//! `TRAIN_FEATURES` d (default 64), `TRAIN_SAMPLES` n per worker (default 4d/W, at least 16),
//! `TRAIN_LINGER_MS` (default 0: how long each worker keeps its store after the last step, so
//! that a job lasts long enough for the launcher's progress reports whatever the machine's
//! speed).

use std::time::Instant;

use kvstore::{create, NDArray, Optimizer};

/// xorshift64*: a small deterministic generator for the synthetic data.
struct Rng(u64);

impl Rng {
    fn uniform(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let x = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d);
        ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The answer the job must find.
fn true_weight(j: usize, c: usize) -> f32 {
    ((j * 7 + c * 3) % 11) as f32 * 0.1 - 0.5
}

/// `out = x · w` for x: n×d, w: d×k.
fn matmul(x: &[f32], w: &[f32], n: usize, d: usize, k: usize, out: &mut [f32]) {
    out.fill(0.0);
    for i in 0..n {
        let row = &mut out[i * k..(i + 1) * k];
        for j in 0..d {
            let a = x[i * d + j];
            for (o, &b) in row.iter_mut().zip(&w[j * k..(j + 1) * k]) {
                *o += a * b;
            }
        }
    }
}

fn main() {
    let (d, k) = (env("TRAIN_FEATURES", 64), env("TRAIN_OUTPUTS", 16384));
    let steps = env("TRAIN_STEPS", 40);
    let mut kv = match create("dist_sync") {
        Ok(kv) => kv,
        Err(e) => {
            eprintln!("train: {e}");
            std::process::exit(2);
        }
    };
    let (rank, workers) = (kv.rank(), kv.num_workers());
    // At least 4d samples in all, so the answer is well determined whatever the job's shape.
    let n = env("TRAIN_SAMPLES", (4 * d).div_ceil(workers).max(16));

    // This worker's shard of the data.
    let mut rng =
        Rng(0x9e37_79b9_7f4a_7c15 ^ (rank as u64 + 1).wrapping_mul(0x1234_5678_9abc_def1));
    let x: Vec<f32> = (0..n * d).map(|_| rng.uniform()).collect();
    let w_true: Vec<f32> = (0..d * k).map(|i| true_weight(i / k, i % k)).collect();
    let mut y = vec![0.0f32; n * k];
    matmul(&x, &w_true, n, d, k, &mut y);

    // Heavy-ball parameters from the spread of the data's curvature: for N = n·W samples of d
    // uniform features in [-1, 1], the eigenvalues of XᵀX/N lie near ((1 ± √(d/N))²)/3.
    let r = ((d as f64) / (n * workers) as f64).sqrt().min(0.9) * 1.1;
    let (lo, hi) = (((1.0 - r).max(0.05)).powi(2) / 3.0, (1.0 + r).powi(2) / 3.0);
    let lr = 4.0 / (hi.sqrt() + lo.sqrt()).powi(2);
    let kappa = (hi / lo).sqrt();
    let momentum = ((kappa - 1.0) / (kappa + 1.0)).powi(2);
    let shape = [d, k];
    let mut run = || -> kvstore::Result<f64> {
        kv.init(0, &NDArray::zeros(&shape))?;
        kv.set_optimizer(Optimizer::Sgd {
            lr,
            momentum,
            wd: 0.0,
            rescale_grad: 1.0 / workers as f64,
            clip_gradient: 0.0,
        })?;
        let mut w = NDArray::zeros(&shape);
        let mut grad = NDArray::zeros(&shape);
        let mut pred = vec![0.0f32; n * k];
        let bytes_per_step = 2.0 * (d * k * 4) as f64;
        let start = Instant::now();
        kv.pull(0, &mut w)?;
        let mut comm = 0.0f64;
        for step in 1..=steps {
            matmul(&x, w.as_slice::<f32>()?, n, d, k, &mut pred);
            let mut loss = 0.0f64;
            for (p, t) in pred.iter_mut().zip(&y) {
                *p -= t;
                loss += 0.5 * (*p as f64) * (*p as f64);
            }
            loss /= (n * k) as f64;
            // grad = Xᵀ · residual / n
            let g = grad.as_mut_slice::<f32>()?;
            g.fill(0.0);
            let scale = 1.0 / n as f32;
            for i in 0..n {
                let r = &pred[i * k..(i + 1) * k];
                for j in 0..d {
                    let a = x[i * d + j] * scale;
                    for (gv, &rv) in g[j * k..(j + 1) * k].iter_mut().zip(r) {
                        *gv += a * rv;
                    }
                }
            }
            let t = Instant::now();
            kv.pushpull(0, &grad, &mut w)?;
            comm += t.elapsed().as_secs_f64();
            if rank == 0 && (step % 10 == 0 || step == 1 || step == steps) {
                println!(
                    "step {step:>3}/{steps}  loss {loss:.3e}  push+pull {:.0} MB/s  ({:.1} steps/s)",
                    bytes_per_step * step as f64 / comm / 1e6,
                    step as f64 / start.elapsed().as_secs_f64()
                );
            }
        }
        kv.barrier()?;
        kv.pull(0, &mut w)?;
        std::thread::sleep(std::time::Duration::from_millis(
            env("TRAIN_LINGER_MS", 0) as u64
        ));
        let got = w.as_slice::<f32>()?;
        let (mut err, mut norm) = (0.0f64, 0.0f64);
        for (a, b) in got.iter().zip(&w_true) {
            err += ((a - b) as f64).powi(2);
            norm += (*b as f64).powi(2);
        }
        Ok((err / norm).sqrt())
    };
    match run() {
        Ok(rel) if rel < 1e-3 => {
            println!(
                "reached the known answer: relative error {rel:.2e} (rank {rank} of {workers})"
            );
        }
        Ok(rel) => {
            eprintln!("did not converge: relative error {rel:.2e}");
            std::process::exit(1);
        }
        Err(e) => {
            eprintln!("train: {e}");
            std::process::exit(1);
        }
    }
}
