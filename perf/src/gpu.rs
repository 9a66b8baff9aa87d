//! `kvperf gpu` (feature `cuda`): the sum of GPU arrays in a `device` store (a push of several
//! values with the default updater, which sums them into the stored value on its GPU) against
//! a device-to-device copy of the same size. Both are counted as bytes read plus bytes written
//! per second, the bytes each must move: the copy reads its source and writes its destination
//! once; the sum reads each value once and writes the result once. An implementation that
//! moves more than that shows as a lower ratio. Then a GPU array staged through a `local`
//! store, and a push to a `device` store running a built-in optimizer on the GPU, each against
//! its reference.

use std::time::Instant;

use clap::Args;
use kvstore::{cpu, create, gpu, gpu_count, KvError, NDArray, Optimizer};

/// `kvperf gpu`'s options.
#[derive(Args, Debug)]
pub struct GpuArgs {
    /// Bytes per array (f32), e.g. 64M.
    #[arg(long, default_value = "64M")]
    pub size: String,
    /// Values summed by each push (all on gpu(0)).
    #[arg(long, default_value_t = 2)]
    pub values: usize,
    /// Timed repetitions, after one that is not timed (the optimizers' too).
    #[arg(long, default_value_t = 20)]
    pub reps: usize,
}

fn err(e: KvError) -> String {
    e.to_string()
}

/// Seconds per call of `f`, the device's queue drained (`sync`) before the clock stops.
fn per_call(
    reps: usize,
    sync: &NDArray,
    mut f: impl FnMut() -> kvstore::Result<()>,
) -> Result<f64, String> {
    f().map_err(err)?;
    sync.wait_to_read().map_err(err)?;
    let t = Instant::now();
    for _ in 0..reps {
        f().map_err(err)?;
    }
    sync.wait_to_read().map_err(err)?;
    Ok(t.elapsed().as_secs_f64() / reps.max(1) as f64)
}

/// Measures and prints one line: both bandwidths and their ratio.
pub fn run(a: &GpuArgs) -> Result<(), String> {
    if gpu_count() == 0 {
        // The typed error says why (no driver, no device).
        NDArray::zeros(&[1]).on(gpu(0)).map_err(err)?;
        return Err("no GPU".into());
    }
    if a.values < 2 {
        return Err("--values: a sum needs at least 2".into());
    }
    let bytes = crate::parse_size(&a.size)?;
    if bytes % 4 != 0 || a.reps == 0 {
        return Err("--size must be a multiple of 4 bytes (f32) and --reps at least 1".into());
    }
    let n = bytes / 4;
    let on = |v: f64| NDArray::full(&[n], v).on(gpu(0)).map_err(err);
    let src = on(1.0)?;
    let mut dst = on(0.0)?;
    // One stream per device: draining it through any of its arrays drains all its work.
    let copy = per_call(a.reps, &src, || dst.copy_from(&src))?;
    if dst.to_f64_vec().iter().any(|&x| x != 1.0) {
        return Err("the device copy did not copy".into());
    }
    let values: Vec<NDArray> = (0..a.values)
        .map(|i| on(i as f64 + 1.0))
        .collect::<Result<_, _>>()?;
    let mut kv = create("device").map_err(err)?;
    kv.init(0, &on(0.0)?).map_err(err)?;
    let sum = per_call(a.reps, &src, || kv.push(0, &values))?;
    let mut out = on(0.0)?;
    kv.pull(0, &mut out).map_err(err)?;
    let want = (a.values * (a.values + 1) / 2) as f64;
    if out.to_f64_vec().iter().any(|&x| x != want) {
        return Err(format!("the sum is not {want}"));
    }
    let copy_bw = 2.0 * bytes as f64 / copy;
    let sum_bw = (a.values + 1) as f64 * bytes as f64 / sum;
    println!(
        "gpu(0) of {} GPUs, {} per array, {} values: device copy {:.1} GB/s ({:.3} ms), sum in \
         a device store {:.1} GB/s ({:.3} ms), sum/copy {:.2}",
        gpu_count(),
        crate::format_size(bytes),
        a.values,
        copy_bw / 1e9,
        copy * 1e3,
        sum_bw / 1e9,
        sum * 1e3,
        sum_bw / copy_bw
    );
    staged(a.reps, n)?;
    optimizers(a.reps, n, copy_bw)
}

/// A push of one f32 gradient to a `device` store running each of a few built-in optimizers
/// on the GPU, counted as the bytes its rule must move (the weight read and written, the
/// gradient read, each f64 moment read and written), against the device copy's rate.
fn optimizers(reps: usize, n: usize, copy_bw: f64) -> Result<(), String> {
    let on = |v: f64| NDArray::full(&[n], v).on(gpu(0)).map_err(err);
    let sync = on(0.0)?;
    let grad = on(0.001)?;
    for (name, opt, moments) in [
        ("sgd", Optimizer::sgd(0.1), 0),
        ("sgd with momentum", Optimizer::sgd(0.1).momentum(0.9), 1),
        ("adam", Optimizer::adam(0.01), 2),
        (
            "centered rmsprop",
            Optimizer::rmsprop(0.01).centered(true),
            3,
        ),
    ] {
        let mut kv = create("device").map_err(err)?;
        kv.init(0, &on(1.0)?).map_err(err)?;
        kv.set_optimizer(opt).map_err(err)?;
        let t = per_call(reps, &sync, || kv.push(0, &grad))?;
        let mut out = on(0.0)?;
        kv.pull(0, &mut out).map_err(err)?;
        if out.to_f64_vec().iter().any(|&x| x >= 1.0 || x.is_nan()) {
            return Err(format!("{name}: the weight did not move"));
        }
        let bw = (12 + 16 * moments) as f64 * n as f64 / t;
        println!(
            "{name} on a GPU, {} f32 weight: {:.1} GB/s of its rule's bytes ({:.3} ms), \
             against the device copy: {:.2}",
            crate::format_size(4 * n),
            bw / 1e9,
            t * 1e3,
            bw / copy_bw
        );
    }
    Ok(())
}

/// A push and a pull of a GPU array in a `local` store (values in host memory, a host copy
/// of the GPU array, page-locked) against the same bytes copied GPU to pinned host memory and
/// back by hand (`copy_from` both ways), both counted as the bytes that cross to the host and
/// back.
fn staged(reps: usize, n: usize) -> Result<(), String> {
    let bytes = 4 * n;
    let g = NDArray::full(&[n], 3.0).on(gpu(0)).map_err(err)?;
    let mut host = g.copy_to(cpu(0)).map_err(err)?;
    let mut back = NDArray::zeros(&[n]).on(gpu(0)).map_err(err)?;
    // One stream per device: draining it through any of its arrays drains all its work.
    let sync = NDArray::zeros(&[1]).on(gpu(0)).map_err(err)?;
    let memcpy = per_call(reps, &sync, || {
        host.copy_from(&g)?;
        back.copy_from(&host)
    })?;
    if back.to_f64_vec().iter().any(|&x| x != 3.0) {
        return Err("the pinned copies did not copy".into());
    }
    let mut kv = create("local").map_err(err)?;
    kv.init(0, &g).map_err(err)?;
    let mut out = NDArray::zeros(&[n]).on(gpu(0)).map_err(err)?;
    let g2 = NDArray::full(&[n], 5.0).on(gpu(0)).map_err(err)?;
    let staged = per_call(reps, &sync, || {
        kv.push(0, &g2)?;
        kv.pull(0, &mut out)
    })?;
    if out.to_f64_vec().iter().any(|&x| x != 5.0) {
        return Err("the staged push and pull did not carry the value".into());
    }
    let (m_bw, s_bw) = (2.0 * bytes as f64 / memcpy, 2.0 * bytes as f64 / staged);
    println!(
        "{} GPU array through a local store (push+pull, staged in pinned host memory: {}) \
         {:.1} GB/s ({:.3} ms), against GPU->pinned->GPU copies {:.1} GB/s ({:.3} ms): {:.2}",
        crate::format_size(bytes),
        if host.is_pinned() { "yes" } else { "no" },
        s_bw / 1e9,
        staged * 1e3,
        m_bw / 1e9,
        memcpy * 1e3,
        s_bw / m_bw
    );
    Ok(())
}
