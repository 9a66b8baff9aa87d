//! MXNet's KVStore tutorial, step by step, on the `local` and `device` stores.
//!
//! `cargo run --example walkthrough` prints what the tutorial prints. With `-- --gpus N`
//! (a build with the `cuda` feature), the per-device values live on GPUs 0 to N-1, several
//! on one GPU where there are fewer than the tutorial's devices.

use kvstore::{cpu, create, gpu, Device, NDArray, Result};

/// The tutorial's `n` devices: CPUs, or the GPUs given (round robin).
fn devices(n: u32, gpus: u32) -> Vec<Device> {
    (0..n)
        .map(|i| if gpus > 0 { gpu(i % gpus) } else { cpu(i) })
        .collect()
}

/// Ones of `shape` on each device.
fn ones_on(shape: &[usize], devices: &[Device]) -> Result<Vec<NDArray>> {
    devices
        .iter()
        .map(|&c| NDArray::ones(shape).on(c))
        .collect()
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let gpus = match args.iter().position(|a| a == "--gpus") {
        Some(i) => args
            .get(i + 1)
            .and_then(|n| n.parse().ok())
            .ok_or_else(|| kvstore::KvError::Config("--gpus takes a number".into()))?,
        None => 0,
    };
    let shape = [2, 3];

    println!("== local ==");
    let mut kv = create("local")?;
    kv.init(3, &(NDArray::ones(&shape) * 2.0))?;
    let mut a = NDArray::zeros(&shape);
    kv.pull(3, &mut a)?;
    println!("{a}");

    kv.push(3, &(NDArray::ones(&shape) * 8.0))?;
    kv.pull(3, &mut a)?;
    println!("{a}");

    // A list of values (one per device) is summed before it is stored.
    let contexts = devices(4, gpus);
    let b = ones_on(&shape, &contexts)?;
    kv.push(3, &b)?;
    kv.pull(3, &mut a)?;
    println!("{a}");

    kv.set_updater(|key, input, stored| {
        println!("update on key: {key}");
        stored.axpy(2.0, input)
    })?;
    kv.pull(3, &mut a)?;
    println!("{a}");
    kv.push(3, &NDArray::ones(&shape))?;
    kv.pull(3, &mut a)?;
    println!("{a}");

    let mut b = ones_on(&shape, &contexts)?;
    kv.pull(3, &mut b)?;
    println!("{}", b[1]);

    let keys = [5, 7, 9];
    kv.init(keys, &vec![NDArray::ones(&shape); keys.len()])?;
    kv.push(keys, &vec![NDArray::ones(&shape); keys.len()])?;
    let mut b = vec![NDArray::zeros(&shape); keys.len()];
    kv.pull(keys, &mut b)?;
    println!("{}", b[1]);

    let per_device = ones_on(&shape, &contexts)?;
    let mut b = vec![per_device; keys.len()];
    kv.push(keys, &b)?;
    kv.pull(keys, &mut b)?;
    println!("{}", b[1][1]);

    println!("== device ==");
    let mut kv = create("device")?;
    kv.init(3, &(NDArray::ones(&shape) * -2.0))?;
    let mut a = NDArray::zeros(&shape);
    kv.pull(3, &mut a)?;
    println!("{a}");
    kv.push(3, &(NDArray::ones(&shape) * -7.0))?;
    kv.pull(3, &mut a)?;
    println!("{a}");
    let contexts = devices(3, gpus);
    let b = ones_on(&shape, &contexts)?;
    kv.push(3, &b)?;
    kv.pull(3, &mut a)?;
    println!("{a}");

    let keys = [7, 11, 13, 17];
    kv.init(keys, &vec![NDArray::ones(&shape) * -3.0; keys.len()])?;
    let mut c = vec![NDArray::zeros(&shape); keys.len()];
    kv.pull(keys, &mut c)?;
    println!("{}", c[0]);
    let d_row: Vec<NDArray> = ones_on(&shape, &contexts)?
        .into_iter()
        .map(|a| a * -0.1)
        .collect();
    let d = vec![d_row; keys.len()];
    kv.push(keys, &d)?;
    kv.pull(keys, &mut c)?;
    println!("{}", c[0]);
    Ok(())
}
