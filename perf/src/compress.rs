//! `kvperf compress`: the cost of 2-bit gradient compression on one core, against memcpy of
//! the same bytes in the same run. A compressed push quantizes its value on the worker (reads
//! the value and the residual, writes the residual); the server dequantizes it (writes the
//! value). Both are loops over memory: their bandwidth in value bytes per second, next to
//! memcpy's, says what compression costs where the wire is faster than that.

use std::time::{Duration, Instant};

use clap::Args;
use kvstore::Compression;

use crate::{format_size, parse_size, parse_sizes};

/// The arguments of `kvperf compress`.
#[derive(Args, Debug)]
pub struct CompressArgs {
    /// One value size in bytes (f32 elements), e.g. 64M.
    #[arg(long, conflicts_with = "sizes")]
    size: Option<String>,
    /// A sweep of sizes, powers of two: MIN:MAX.
    #[arg(long, default_value = "64K:64M")]
    sizes: String,
    /// Seconds of timing per size and operation.
    #[arg(long, default_value_t = 0.3)]
    secs: f64,
    /// One JSON object per size instead of a table.
    #[arg(long)]
    json: bool,
}

/// Runs `f` for at least `secs` (and three times): bytes per second of `bytes` a run.
fn rate(bytes: usize, secs: f64, mut f: impl FnMut()) -> f64 {
    f();
    let start = Instant::now();
    let mut n = 0usize;
    while start.elapsed() < Duration::from_secs_f64(secs) || n < 3 {
        f();
        n += 1;
    }
    (n * bytes) as f64 / start.elapsed().as_secs_f64()
}

/// Measures and prints each size.
pub fn run(a: &CompressArgs) -> Result<(), String> {
    let sizes = match &a.size {
        Some(s) => vec![parse_size(s)?],
        None => parse_sizes(&a.sizes)?,
    };
    if !(a.secs > 0.0 && a.secs <= 86_400.0) {
        return Err("--secs must be positive seconds, a day at most".into());
    }
    let c = Compression::two_bit(0.25).map_err(|e| e.to_string())?;
    if !a.json {
        println!(
            "2-bit compression, one core; GB/s of f32 values\n{:>8} {:>9} {:>9} {:>9} {:>10} {:>10}",
            "size", "memcpy", "quantize", "dequant", "q x memcpy", "d x memcpy"
        );
    }
    for size in sizes {
        let n = (size / 4).max(1);
        let bytes = n * 4;
        // Tenths from -0.5 to 0.5: every code occurs.
        let grad: Vec<f32> = (0..n).map(|i| (i % 11) as f32 * 0.1 - 0.5).collect();
        let mut residual = vec![0.0f32; n];
        let mut packed = vec![0u8; Compression::packed_bytes(n as u64) as usize];
        let mut value = vec![0.0f32; n];
        let memcpy = crate::reference::memcpy_bandwidth(bytes, Duration::from_secs_f64(a.secs));
        let mut failed = None;
        let q = rate(bytes, a.secs, || {
            if let Err(e) = c.quantize(std::hint::black_box(&grad), &mut residual, &mut packed) {
                failed = Some(e);
            }
        });
        let d = rate(bytes, a.secs, || {
            if let Err(e) = c.dequantize(std::hint::black_box(&packed), &mut value) {
                failed = Some(e);
            }
        });
        if let Some(e) = failed {
            return Err(e.to_string());
        }
        let gb = |x: f64| x / 1e9;
        if a.json {
            // Strict JSON as the other subcommands' rows: a figure that is not a number (a
            // rate of nothing measured) is null.
            let num = crate::json_num;
            let row = serde_json::json!({
                "test": "compress",
                "op": "compress",
                "transport": "none",
                "workers": 1,
                "servers": 0,
                "size": bytes,
                "memcpy_gbps": num(gb(memcpy)),
                "quantize_gbps": num(gb(q)),
                "dequantize_gbps": num(gb(d)),
                "quantize_x_memcpy": num(q / memcpy),
                "dequantize_x_memcpy": num(d / memcpy),
                "units": {
                    "bytes": "size",
                    "10^9 bytes of f32 values per second, one core":
                        "memcpy_gbps quantize_gbps dequantize_gbps",
                    "ratio to memcpy of the same bytes": "quantize_x_memcpy dequantize_x_memcpy",
                },
            });
            println!("{row}");
        } else {
            println!(
                "{:>8} {:>9.2} {:>9.2} {:>9.2} {:>10.2} {:>10.2}",
                format_size(bytes),
                gb(memcpy),
                gb(q),
                gb(d),
                q / memcpy,
                d / memcpy
            );
        }
    }
    Ok(())
}
