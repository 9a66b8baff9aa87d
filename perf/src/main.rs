//! `kvperf`: measures the store. `kvperf pushpull` runs a real job (scheduler, S servers, W
//! workers, over loopback TCP) and reports push+pull bandwidth per tensor size and the rate of
//! many small keys, next to reference figures measured in the same run.

use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::{Args, Parser, Subcommand};
use kvstore::NDArray;
use kvstore_perf::{
    format_size, iperf3_loopback, loopback_stream_bandwidth, parse_size, parse_sizes,
};

#[derive(Parser, Debug)]
#[command(name = "kvperf", about = "Latency and bandwidth of kvstore")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// push+pull through real servers: bandwidth per size, and the rate of many small keys.
    Pushpull(PushPull),
}

#[derive(Args, Debug, Clone)]
struct PushPull {
    /// Worker processes.
    #[arg(short = 'n', long, default_value_t = 2)]
    workers: u32,
    /// Server processes.
    #[arg(short = 's', long, default_value_t = 2)]
    servers: u32,
    /// One tensor size in bytes (4K, 64M, ...).
    #[arg(long, conflicts_with = "sizes")]
    size: Option<String>,
    /// A sweep of sizes, powers of two: MIN:MAX.
    #[arg(long, default_value = "4K:64M")]
    sizes: String,
    /// Keys per call (each of the given size).
    #[arg(long, default_value_t = 1)]
    keys: usize,
    /// Timed iterations per size (default: enough to move about 1 GiB, 5 to 2000).
    #[arg(long)]
    iters: Option<usize>,
    /// Untimed iterations first.
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Also measure the references: a plain loopback TCP stream and iperf3 (if installed).
    #[arg(long)]
    reference: bool,
    /// One JSON object per size instead of a table.
    #[arg(long)]
    json: bool,
}

fn sizes_of(p: &PushPull) -> Result<Vec<usize>, String> {
    match &p.size {
        Some(s) => Ok(vec![parse_size(s)?]),
        None => parse_sizes(&p.sizes),
    }
}

fn iters_for(p: &PushPull, size: usize) -> usize {
    p.iters
        .unwrap_or_else(|| ((1usize << 30) / (size * p.keys).max(1)).clamp(5, 2000))
}

/// The worker side, run in every process of the job (servers never return from `create`).
fn child(p: &PushPull, out: PathBuf) -> Result<(), String> {
    let sizes = sizes_of(p)?;
    let mut kv = kvstore::create("dist_sync").map_err(|e| e.to_string())?;
    let mut lines = Vec::new();
    for (i, &size) in sizes.iter().enumerate() {
        let elems = (size / 4).max(1);
        let keys: Vec<i64> = (0..p.keys as i64)
            .map(|k| (i * p.keys) as i64 + k)
            .collect();
        let vals: Vec<NDArray> = (0..p.keys).map(|_| NDArray::ones(&[elems])).collect();
        let mut outs: Vec<NDArray> = (0..p.keys).map(|_| NDArray::zeros(&[elems])).collect();
        kv.init(keys.clone(), &vals).map_err(|e| e.to_string())?;
        for _ in 0..p.warmup {
            kv.push(keys.clone(), &vals).map_err(|e| e.to_string())?;
            kv.pull(keys.clone(), &mut outs)
                .map_err(|e| e.to_string())?;
        }
        kv.barrier().map_err(|e| e.to_string())?;
        let iters = iters_for(p, size);
        let start = Instant::now();
        for _ in 0..iters {
            kv.push(keys.clone(), &vals).map_err(|e| e.to_string())?;
            kv.pull(keys.clone(), &mut outs)
                .map_err(|e| e.to_string())?;
        }
        let secs = start.elapsed().as_secs_f64();
        kv.barrier().map_err(|e| e.to_string())?;
        // Every worker pushes ones: the pulled value is the number of workers (ASSIGN).
        let w = kv.num_workers() as f32;
        if outs.iter().any(|o| {
            o.as_slice::<f32>()
                .map(|s| s.iter().any(|&x| x != w))
                .unwrap_or(true)
        }) {
            return Err(format!("wrong values pulled at size {size}"));
        }
        lines.push(format!(
            "{{\"size\":{},\"keys\":{},\"iters\":{iters},\"secs\":{secs},\"workers\":{},\"servers\":{}}}",
            elems * 4,
            p.keys,
            kv.num_workers(),
            p.servers
        ));
    }
    if kv.rank() == 0 {
        std::fs::write(&out, lines.join("\n")).map_err(|e| e.to_string())?;
    }
    Ok(())
}

fn field(line: &str, name: &str) -> f64 {
    let key = format!("\"{name}\":");
    line.split(&key)
        .nth(1)
        .and_then(|r| r.split([',', '}']).next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN)
}

fn parent(p: &PushPull) -> Result<(), String> {
    sizes_of(p)?;
    if p.keys == 0 {
        return Err("--keys must be at least 1".into());
    }
    let (mut stream_ref, mut iperf_ref) = (None, None);
    if p.reference {
        stream_ref = Some(
            loopback_stream_bandwidth(1 << 20, Duration::from_secs(1))
                .map_err(|e| e.to_string())?,
        );
        iperf_ref = iperf3_loopback(2);
    }
    let out = std::env::temp_dir().join(format!("kvperf-{}.jsonl", std::process::id()));
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut argv: Vec<String> = vec![
        "kvrun".into(),
        "-n".into(),
        p.workers.to_string(),
        "-s".into(),
        p.servers.to_string(),
        "-x".into(),
        format!("KVPERF_OUT={}", out.display()),
        "--".into(),
        exe.to_string_lossy().into_owned(),
    ];
    argv.extend(std::env::args().skip(1));
    let opts = <kvstore_launcher::Options as clap::Parser>::try_parse_from(argv)
        .map_err(|e| e.to_string())?;
    let code = kvstore_launcher::run(&opts);
    let text = std::fs::read_to_string(&out).unwrap_or_default();
    let _ = std::fs::remove_file(&out);
    if code != 0 {
        return Err(format!("the benchmark job failed (status {code})"));
    }
    let mut stdout = std::io::stdout().lock();
    let gbs = |b: f64| b / 1e9;
    if !p.json {
        if let Some(s) = stream_ref {
            let _ = writeln!(
                stdout,
                "reference: plain loopback TCP stream {:.2} GB/s",
                gbs(s)
            );
        }
        match (p.reference, iperf_ref) {
            (true, Some(i)) => {
                let _ = writeln!(
                    stdout,
                    "reference: iperf3 single stream loopback {:.2} GB/s",
                    gbs(i)
                );
            }
            (true, None) => {
                let _ = writeln!(
                    stdout,
                    "reference: iperf3 not installed (apt-get install iperf3)"
                );
            }
            _ => {}
        }
        let _ = writeln!(
            stdout,
            "W={} S={} keys/call={}\n{:>8} {:>7} {:>11} {:>10} {:>10} {:>9} {:>9} {:>12}",
            p.workers,
            p.servers,
            p.keys,
            "size",
            "iters",
            "us/iter",
            "GB/s/wkr",
            "GB/s all",
            "x iperf3",
            "x stream",
            "key-ops/s"
        );
    }
    for line in text.lines() {
        let (size, keys, iters, secs, w) = (
            field(line, "size"),
            field(line, "keys"),
            field(line, "iters"),
            field(line, "secs"),
            field(line, "workers"),
        );
        let per_iter = secs / iters;
        // push + pull: each worker moves 2 x size x keys bytes per iteration.
        let per_worker = 2.0 * size * keys / per_iter;
        let all = per_worker * w;
        let ops = keys * w / per_iter;
        let ratio = |r: Option<f64>| r.map_or(f64::NAN, |r| all / r);
        if p.json {
            let _ = writeln!(
                stdout,
                "{{\"size\":{size},\"keys\":{keys},\"iters\":{iters},\"us_per_iter\":{:.3},\"gbps_per_worker\":{:.4},\"gbps_all\":{:.4},\"ratio_iperf3\":{:.4},\"ratio_stream\":{:.4},\"key_ops_per_s\":{:.1}}}",
                per_iter * 1e6,
                gbs(per_worker),
                gbs(all),
                ratio(iperf_ref),
                ratio(stream_ref),
                ops
            );
        } else {
            let _ = writeln!(
                stdout,
                "{:>8} {:>7} {:>11.1} {:>10.3} {:>10.3} {:>9.2} {:>9.2} {:>12.0}",
                format_size(size as usize),
                iters,
                per_iter * 1e6,
                gbs(per_worker),
                gbs(all),
                ratio(iperf_ref),
                ratio(stream_ref),
                ops
            );
        }
    }
    Ok(())
}

fn main() {
    let cli = Cli::parse();
    let Cmd::Pushpull(p) = cli.cmd;
    let result = match (
        std::env::var("DMLC_ROLE").ok(),
        std::env::var("KVPERF_OUT").ok(),
    ) {
        (Some(_), Some(out)) => child(&p, PathBuf::from(out)),
        _ => parent(&p),
    };
    if let Err(e) = result {
        eprintln!("kvperf: {e}");
        std::process::exit(1);
    }
}
