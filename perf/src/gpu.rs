//! `kvperf gpu` (feature `cuda`): the sum of GPU arrays in a `device` store (a push of several
//! values with the default updater, which sums them into the stored value on its GPU) against
//! a device-to-device copy of the same size. Both are counted as bytes read plus bytes written
//! per second, the bytes each must move: the copy reads its source and writes its destination
//! once; the sum reads each value once and writes the result once. An implementation that
//! moves more than that shows as a lower ratio.

use std::time::Instant;

use clap::Args;
use kvstore::{cpu, create, gpu, gpu_count, KvError, NDArray};

/// `kvperf gpu`'s options.
#[derive(Args, Debug)]
pub struct GpuArgs {
    /// Bytes per array (f32), e.g. 64M.
    #[arg(long, default_value = "64M")]
    pub size: String,
    /// Values summed by each push (all on gpu(0)).
    #[arg(long, default_value_t = 2)]
    pub values: usize,
    /// Timed repetitions, after one that is not timed.
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
    staged(a.reps, n)
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
