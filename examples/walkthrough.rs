//! MXNet's KVStore tutorial, step by step, on the `local` and `device` stores.
//!
//! `cargo run --example walkthrough` prints what the tutorial prints.

use kvstore::{cpu, create, NDArray, Result};

fn main() -> Result<()> {
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
    let contexts: Vec<_> = (0..4).map(cpu).collect();
    let b: Vec<NDArray> = contexts
        .iter()
        .map(|&c| NDArray::ones(&shape).on(c))
        .collect();
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

    let mut b: Vec<NDArray> = contexts
        .iter()
        .map(|&c| NDArray::ones(&shape).on(c))
        .collect();
    kv.pull(3, &mut b)?;
    println!("{}", b[1]);

    let keys = [5, 7, 9];
    kv.init(keys, &vec![NDArray::ones(&shape); keys.len()])?;
    kv.push(keys, &vec![NDArray::ones(&shape); keys.len()])?;
    let mut b = vec![NDArray::zeros(&shape); keys.len()];
    kv.pull(keys, &mut b)?;
    println!("{}", b[1]);

    let per_device: Vec<NDArray> = contexts
        .iter()
        .map(|&c| NDArray::ones(&shape).on(c))
        .collect();
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
    let contexts: Vec<_> = (0..3).map(cpu).collect();
    let b: Vec<NDArray> = contexts
        .iter()
        .map(|&c| NDArray::ones(&shape).on(c))
        .collect();
    kv.push(3, &b)?;
    kv.pull(3, &mut a)?;
    println!("{a}");

    let keys = [7, 11, 13, 17];
    kv.init(keys, &vec![NDArray::ones(&shape) * -3.0; keys.len()])?;
    let mut c = vec![NDArray::zeros(&shape); keys.len()];
    kv.pull(keys, &mut c)?;
    println!("{}", c[0]);
    let d_row: Vec<NDArray> = contexts
        .iter()
        .map(|&ctx| NDArray::ones(&shape).on(ctx) * -0.1)
        .collect();
    let d = vec![d_row; keys.len()];
    kv.push(keys, &d)?;
    kv.pull(keys, &mut c)?;
    println!("{}", c[0]);
    Ok(())
}
