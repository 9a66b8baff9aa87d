//! `kvperf`: measures the transports and the store, in the manner of perftest and the OSU
//! benchmarks.
//!
//! - `kvperf lat` / `kvperf bw`: latency (HDR histogram: min, p50, p90, p99, p99.9, max) and
//!   bandwidth of a raw transport (`tcp`, `shm`), two-sided (`--mode send`) or one-sided
//!   (`--mode write`). Run `--server` on one side and `kvperf lat HOST` on the other, or
//!   `--local` to start both.
//! - `kvperf pushpull`: push+pull through real servers (a job of W workers and S servers).
//!
//! `--reference` adds figures measured in the same run to read the others against: memcpy
//! bandwidth for shm, a plain blocking-socket ping-pong and stream for tcp.

use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::{Args, Parser, Subcommand, ValueEnum};
use kvstore::NDArray;
use kvstore_perf::conn::{self, Conn};
use kvstore_perf::raw::{self, Plan, Results};
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
    /// Latency of a raw transport (ping-pong; one-way = half the round trip).
    Lat(RawArgs),
    /// Bandwidth of a raw transport (a window of messages in flight).
    Bw(RawArgs),
    /// push+pull through real servers: bandwidth per size, and the rate of many small keys.
    Pushpull(PushPull),
    /// The ceiling alone: one push+pull round of threads sharing memory (what `pushpull
    /// --reference` divides by), as `../shared/bench/ps_limit.c` measures it.
    Limit(LimitArgs),
}

#[derive(Args, Debug)]
struct LimitArgs {
    /// Workers.
    #[arg(short = 'n', long, default_value_t = 2)]
    workers: usize,
    /// Servers.
    #[arg(short = 's', long, default_value_t = 2)]
    servers: usize,
    /// Bytes per round (f32), e.g. 64M.
    #[arg(long, default_value = "64M")]
    size: String,
    /// Rounds (the first is not timed).
    #[arg(long, default_value_t = 21)]
    rounds: usize,
}

fn run_limit(a: &LimitArgs) -> Result<(), String> {
    let bytes = parse_size(&a.size)?;
    let l = kvstore_perf::limit::measure(bytes, a.workers, a.servers, a.rounds)?;
    println!(
        "bytes {bytes} W {} S {}: round p50 {:.3} ms zero-copy, {:.3} ms one copy in",
        a.workers,
        a.servers,
        l.zero_copy * 1e3,
        l.one_copy * 1e3
    );
    Ok(())
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum TransportKind {
    Tcp,
    Shm,
    Rdma,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Mode {
    /// Two-sided messages.
    Send,
    /// One-sided puts into a region the peer exposed, with a notification.
    Write,
}

#[derive(Args, Debug, Clone)]
struct RawArgs {
    /// The transport.
    #[arg(long, value_enum, default_value_t = TransportKind::Tcp)]
    transport: TransportKind,
    /// Wait for a client (run the other side with the server's HOST, or nothing for shm).
    #[arg(long, conflicts_with_all = ["local", "host"])]
    server: bool,
    /// Start the server side here too (a second process).
    #[arg(long)]
    local: bool,
    /// The server's host (client side, tcp).
    host: Option<String>,
    /// TCP port, or the shm rendezvous name.
    #[arg(long, default_value_t = 18515)]
    port: u16,
    /// One message size (4, 4K, 64M, ...).
    #[arg(long, conflicts_with = "sizes")]
    size: Option<String>,
    /// A sweep of sizes, powers of two: MIN:MAX.
    #[arg(long, default_value = "8:1M")]
    sizes: String,
    /// Timed iterations per size (default: 1000 for lat, 5000 for bw; or --duration).
    #[arg(long, conflicts_with = "duration")]
    iters: Option<usize>,
    /// Seconds per size instead of a count.
    #[arg(long)]
    duration: Option<f64>,
    /// Untimed iterations first.
    #[arg(long, default_value_t = 100)]
    warmup: usize,
    /// Messages in flight before an ack (bw).
    #[arg(long, default_value_t = 64)]
    window: usize,
    /// Two-sided sends or one-sided writes.
    #[arg(long, value_enum, default_value_t = Mode::Send)]
    mode: Mode,
    /// Also measure the reference: memcpy (shm), a plain socket ping-pong and stream (tcp).
    #[arg(long)]
    reference: bool,
    /// One JSON object per size instead of a table.
    #[arg(long)]
    json: bool,
    /// Write a chart (bandwidth, or p50 latency, against size) as SVG.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
    /// Seconds any wait for the peer may take.
    #[arg(long, default_value_t = 10.0)]
    timeout: f64,
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
    /// The transport between workers and servers on one host: auto, tcp or shm
    /// (KVSTORE_TRANSPORT).
    #[arg(long, default_value = "auto", value_parser = ["auto", "tcp", "shm"])]
    transport: String,
    /// What each iteration does: push then pull (two calls), push, pull, or pushpull (one
    /// call). The latency columns time the first call of the iteration.
    #[arg(long, default_value = "push+pull", value_parser = ["push+pull", "push", "pull", "pushpull"])]
    op: String,
    /// Push and pull arrays from `kv.alloc` (in the shared-memory pool: no copy to push).
    #[arg(long)]
    alloc: bool,
    /// Run every process on this host (the default without --hosts or --hostfile).
    #[arg(long, conflicts_with_all = ["hosts", "hostfile"])]
    local: bool,
    /// Run the job over these hosts (kvrun's -H): servers and workers across the network.
    #[arg(short = 'H', long)]
    hosts: Option<String>,
    /// Run the job over the hosts of this hostfile (kvrun's --hostfile).
    #[arg(long)]
    hostfile: Option<PathBuf>,
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
        // --alloc: arrays in the transport's pool (pushing them copies nothing).
        let make = |fill: f64| -> Result<NDArray, String> {
            if p.alloc {
                let mut a = kv
                    .alloc(&[elems], kvstore::DType::F32)
                    .map_err(|e| e.to_string())?;
                a.fill(fill);
                Ok(a)
            } else {
                Ok(NDArray::full(&[elems], fill))
            }
        };
        let vals: Vec<NDArray> = (0..p.keys).map(|_| make(1.0)).collect::<Result<_, _>>()?;
        let mut outs: Vec<NDArray> = (0..p.keys).map(|_| make(0.0)).collect::<Result<_, _>>()?;
        kv.init(keys.clone(), &vals).map_err(|e| e.to_string())?;
        // At least one full round first, so every op pulls the round's value.
        for _ in 0..p.warmup.max(1) {
            kv.push(keys.clone(), &vals).map_err(|e| e.to_string())?;
            kv.pull(keys.clone(), &mut outs)
                .map_err(|e| e.to_string())?;
        }
        kv.barrier().map_err(|e| e.to_string())?;
        let iters = iters_for(p, size);
        // Each push (request and acknowledgement) is timed too.
        let mut push_lat = hdrhistogram::Histogram::<u64>::new_with_bounds(1, 600_000_000_000, 3)
            .map_err(|e| e.to_string())?;
        let start = Instant::now();
        for _ in 0..iters {
            let t0 = Instant::now();
            match p.op.as_str() {
                "pull" => kv.pull(keys.clone(), &mut outs),
                "pushpull" => kv.pushpull(keys.clone(), &vals, &mut outs),
                _ => kv.push(keys.clone(), &vals),
            }
            .map_err(|e| e.to_string())?;
            let _ = push_lat.record((t0.elapsed().as_nanos() as u64).max(1));
            if p.op == "push+pull" {
                kv.pull(keys.clone(), &mut outs)
                    .map_err(|e| e.to_string())?;
            }
        }
        let secs = start.elapsed().as_secs_f64();
        if p.op == "push" {
            kv.pull(keys.clone(), &mut outs)
                .map_err(|e| e.to_string())?;
        }
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
            "{{\"size\":{},\"keys\":{},\"iters\":{iters},\"secs\":{secs},\"workers\":{},\"servers\":{},\"push_p50_us\":{:.3},\"push_p99_us\":{:.3},\"transport\":\"{}\",\"op\":\"{}\"}}",
            elems * 4,
            p.keys,
            kv.num_workers(),
            p.servers,
            push_lat.value_at_quantile(0.5) as f64 / 1000.0,
            push_lat.value_at_quantile(0.99) as f64 / 1000.0,
            kv.transports().first().copied().unwrap_or("-"),
            p.op,
        ));
    }
    if kv.rank() == 0 {
        std::fs::write(&out, lines.join("\n")).map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// A number for JSON: `null` where there is none (JSON has no NaN).
fn json_num(x: f64) -> String {
    if x.is_finite() {
        format!("{x:.4}")
    } else {
        "null".into()
    }
}

/// A table cell: `-` where there is no figure.
fn cell(x: f64, prec: usize) -> String {
    if x.is_finite() {
        format!("{x:.prec$}")
    } else {
        "-".into()
    }
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
        "-x".into(),
        format!("KVSTORE_TRANSPORT={}", p.transport),
    ];
    if let Some(h) = &p.hosts {
        argv.extend(["-H".into(), h.clone()]);
    }
    if let Some(f) = &p.hostfile {
        argv.extend(["--hostfile".into(), f.display().to_string()]);
    }
    argv.extend(["--".into(), exe.to_string_lossy().into_owned()]);
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
        let transport = text.lines().next().map(|l| {
            l.split("\"transport\":\"")
                .nth(1)
                .and_then(|r| r.split('"').next())
                .unwrap_or("-")
                .to_string()
        });
        let _ = writeln!(
            stdout,
            "W={} S={} keys/call={} transport={} arrays={} op={}\n{:>8} {:>7} {:>10} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8} {:>8} {:>11} {:>9} {:>7}",
            p.workers,
            p.servers,
            p.keys,
            transport.unwrap_or_else(|| "-".into()),
            if p.alloc { "kv.alloc" } else { "heap" },
            p.op,
            "size",
            "iters",
            "us/iter",
            "GB/s/wkr",
            "GB/s all",
            "call p50",
            "call p99",
            "x memcpy",
            "x iperf3",
            "x stream",
            "key-ops/s",
            "limit us",
            "x limit"
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
        let (p50, p99) = (field(line, "push_p50_us"), field(line, "push_p99_us"));
        let per_iter = secs / iters;
        // push + pull (or pushpull): each worker moves 2 x size x keys bytes per iteration;
        // push or pull alone, half that.
        let ways = if matches!(p.op.as_str(), "push" | "pull") {
            1.0
        } else {
            2.0
        };
        let per_worker = ways * size * keys / per_iter;
        let all = per_worker * w;
        let ops = keys * w / per_iter;
        let ratio = |r: Option<f64>| r.map_or(f64::NAN, |r| all / r);
        // One worker's push+pull bandwidth against one core's memcpy of the same size.
        let memcpy = p.reference.then(|| {
            kvstore_perf::raw::memcpy_bandwidth(
                size as usize * keys as usize,
                Duration::from_millis(300),
            )
        });
        let x_memcpy = memcpy.map_or(f64::NAN, |m| per_worker / m);
        // The ceiling of a push+pull round on this host for the same W, S and bytes: zero-copy
        // for kv.alloc arrays, one copy in for ordinary ones.
        let limit = if p.reference && matches!(p.op.as_str(), "push+pull" | "pushpull") {
            let bytes = size as usize * keys as usize;
            let rounds = ((256usize << 20) / bytes.max(1)).clamp(5, 201);
            let l = kvstore_perf::limit::measure(
                bytes,
                p.workers as usize,
                p.servers as usize,
                rounds,
            )?;
            Some(if p.alloc { l.zero_copy } else { l.one_copy })
        } else {
            None
        };
        let limit_us = limit.map_or(f64::NAN, |l| l * 1e6);
        let x_limit = limit.map_or(f64::NAN, |l| per_iter / l);
        if p.json {
            let _ = writeln!(
                stdout,
                "{{\"size\":{size},\"keys\":{keys},\"iters\":{iters},\"us_per_iter\":{:.3},\"gbps_per_worker\":{:.4},\"gbps_all\":{:.4},\"op\":\"{}\",\"call_p50_us\":{p50:.3},\"call_p99_us\":{p99:.3},\"ratio_memcpy\":{},\"ratio_iperf3\":{},\"ratio_stream\":{},\"key_ops_per_s\":{:.1},\"limit_us\":{},\"ratio_limit\":{}}}",
                per_iter * 1e6,
                gbs(per_worker),
                gbs(all),
                p.op,
                json_num(x_memcpy),
                json_num(ratio(iperf_ref)),
                json_num(ratio(stream_ref)),
                ops,
                json_num(limit_us),
                json_num(x_limit),
            );
        } else {
            let _ = writeln!(
                stdout,
                "{:>8} {:>7} {:>10.1} {:>9.3} {:>9.3} {:>9.2} {:>9.2} {:>8} {:>8} {:>8} {:>11.0} {:>9} {:>7}",
                format_size(size as usize),
                iters,
                per_iter * 1e6,
                gbs(per_worker),
                gbs(all),
                p50,
                p99,
                cell(x_memcpy, 2),
                cell(ratio(iperf_ref), 2),
                cell(ratio(stream_ref), 2),
                ops,
                cell(limit_us, 1),
                cell(x_limit, 2),
            );
        }
    }
    if !p.json && p.reference {
        let _ = writeln!(stdout, "call p50/p99: one call of the op (request and answer), us; x memcpy: GB/s/wkr over single-threaded memcpy of the size");
        let _ = writeln!(stdout, "limit us: the ceiling, one push+pull round of W worker and S server threads sharing memory ({}); x limit: us/iter over it", if p.alloc { "gradients already shared: zero-copy" } else { "gradients copied in: one copy" });
    }
    Ok(())
}

fn connect(a: &RawArgs, server: bool) -> Result<Conn, String> {
    let timeout = Duration::from_secs_f64(a.timeout);
    let name = a.port.to_string();
    match (a.transport, server) {
        (TransportKind::Rdma, _) => Err(NO_RDMA.into()),
        (TransportKind::Tcp, true) => Conn::accept(conn::tcp_server(a.port)?, timeout),
        (TransportKind::Tcp, false) => {
            let host = a.host.clone().unwrap_or_else(|| "127.0.0.1".into());
            let addr = std::net::ToSocketAddrs::to_socket_addrs(&(host.as_str(), a.port))
                .map_err(|e| format!("{host}: {e}"))?
                .next()
                .ok_or_else(|| format!("{host} has no address"))?;
            conn::tcp_client(addr, timeout)
        }
        (TransportKind::Shm, true) => Conn::accept(conn::shm_server(&name)?, timeout),
        (TransportKind::Shm, false) => {
            if let Some(h) = &a.host {
                if !matches!(h.as_str(), "localhost" | "127.0.0.1" | "::1") {
                    return Err(format!("shm reaches peers on this host only, not {h}"));
                }
            }
            conn::shm_client(&name, timeout)
        }
    }
}

const NO_RDMA: &str = "the RDMA transport is not built yet (no verbs support in this build)";

fn run_raw(test: &str, a: &RawArgs) -> Result<(), String> {
    let sizes = match &a.size {
        Some(s) => vec![parse_size(s)?],
        None => parse_sizes(&a.sizes)?,
    };
    if a.timeout.is_nan() || a.timeout <= 0.0 || a.window == 0 {
        return Err("--timeout and --window must be positive".into());
    }
    if a.duration.is_some_and(|d| d.is_nan() || d <= 0.0) {
        return Err("--duration must be positive".into());
    }
    if a.transport == TransportKind::Rdma {
        return Err(NO_RDMA.into());
    }
    let timeout = Duration::from_secs_f64(a.timeout);
    if a.server {
        let mut c = connect(a, true)?;
        return raw::server(&mut c, timeout);
    }
    let mut a = a.clone();
    let mut local = None;
    if a.local {
        // A free port (tcp) or a fresh name (shm) for this run's server process.
        a.port = match a.transport {
            TransportKind::Tcp => std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .map(|s| s.port())
                .map_err(|e| e.to_string())?,
            _ => (std::process::id() % 60000) as u16 + 1024,
        };
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let transport = format!("{:?}", a.transport).to_lowercase();
        let child = std::process::Command::new(exe)
            .args([test, "--server", "--transport", &transport])
            .args([
                "--port",
                &a.port.to_string(),
                "--timeout",
                &a.timeout.to_string(),
            ])
            .spawn()
            .map_err(|e| format!("cannot start the local server: {e}"))?;
        local = Some(child);
    }
    let plan = Plan {
        test: test.into(),
        mode: format!("{:?}", a.mode).to_lowercase(),
        sizes,
        iters: match (a.iters, a.duration) {
            (Some(n), _) => n.max(1),
            (None, Some(_)) => 0,
            (None, None) if test == "lat" => 1000,
            (None, None) => 5000,
        },
        duration: a.duration.unwrap_or(0.0),
        warmup: a.warmup,
        window: a.window,
    };
    let result = connect(&a, false).and_then(|mut c| {
        let name = c.name();
        raw::client(&mut c, &plan, timeout).map(|r| (name, r))
    });
    if let Some(mut c) = local {
        if result.is_err() {
            let _ = c.kill();
        }
        let _ = c.wait();
    }
    let (name, results) = result?;
    report(test, name, &a, &results)
}

fn report(test: &str, name: &str, a: &RawArgs, results: &Results) -> Result<(), String> {
    let mut out = std::io::stdout().lock();
    let mode = format!("{:?}", a.mode).to_lowercase();
    let mut points = Vec::new();
    match results {
        Results::Lat(rows) => {
            if !a.json {
                let _ = writeln!(
                    out,
                    "kvperf lat  transport={name} mode={mode}  one-way latency (half the round trip), us"
                );
                let refcols = if a.reference && a.transport == TransportKind::Tcp {
                    "   ref p50  x ref"
                } else {
                    ""
                };
                let _ = writeln!(
                    out,
                    "{:>8} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}{refcols}",
                    "size", "iters", "min", "p50", "p90", "p99", "p99.9", "max"
                );
            }
            for r in rows {
                let reference = match (a.reference, a.transport) {
                    (true, TransportKind::Tcp) => {
                        Some(raw::socket_pingpong_us(r.size, 500).map_err(|e| e.to_string())?)
                    }
                    _ => None,
                };
                points.push((r.size as f64, r.us[1]));
                if a.json {
                    let refj =
                        reference.map_or(String::new(), |x| format!(",\"ref_p50_us\":{x:.3}"));
                    let _ = writeln!(
                        out,
                        "{{\"test\":\"lat\",\"transport\":\"{name}\",\"mode\":\"{mode}\",\"size\":{},\"iters\":{},\"min_us\":{:.3},\"p50_us\":{:.3},\"p90_us\":{:.3},\"p99_us\":{:.3},\"p999_us\":{:.3},\"max_us\":{:.3}{refj}}}",
                        r.size, r.iters, r.us[0], r.us[1], r.us[2], r.us[3], r.us[4], r.us[5]
                    );
                } else {
                    let refs = reference.map_or(String::new(), |x| {
                        format!(" {:>9.2} {:>6.2}", x, r.us[1] / x)
                    });
                    let _ = writeln!(
                        out,
                        "{:>8} {:>8} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2}{refs}",
                        format_size(r.size),
                        r.iters,
                        r.us[0],
                        r.us[1],
                        r.us[2],
                        r.us[3],
                        r.us[4],
                        r.us[5]
                    );
                }
            }
            if !a.json && a.reference {
                let what = match a.transport {
                    TransportKind::Tcp => "reference: a plain blocking-socket ping-pong over loopback (half its median round trip)",
                    _ => "reference: shared memory is held against memcpy bandwidth (kvperf bw --transport shm --reference)",
                };
                let _ = writeln!(out, "{what}");
            }
        }
        Results::Bw(rows) => {
            if !a.json {
                let _ = writeln!(
                    out,
                    "kvperf bw  transport={name} mode={mode} window={}",
                    a.window
                );
                let refcols = if a.reference {
                    "   ref GB/s  x ref"
                } else {
                    ""
                };
                let _ = writeln!(
                    out,
                    "{:>8} {:>9} {:>10} {:>10} {:>12}{refcols}",
                    "size", "iters", "GB/s", "Gb/s", "Mmsg/s"
                );
            }
            for r in rows {
                let reference = match (a.reference, a.transport) {
                    (false, _) => None,
                    (true, TransportKind::Shm) => {
                        Some(raw::memcpy_bandwidth(r.size, Duration::from_millis(200)))
                    }
                    (true, _) => Some(
                        loopback_stream_bandwidth(r.size.max(4096), Duration::from_millis(300))
                            .map_err(|e| e.to_string())?,
                    ),
                };
                points.push((r.size as f64, r.bytes_per_s / 1e9));
                if a.json {
                    let refj = reference.map_or(String::new(), |x| {
                        format!(",\"ref_gbytes_per_s\":{:.4}", x / 1e9)
                    });
                    let _ = writeln!(
                        out,
                        "{{\"test\":\"bw\",\"transport\":\"{name}\",\"mode\":\"{mode}\",\"size\":{},\"iters\":{},\"gbytes_per_s\":{:.4},\"gbits_per_s\":{:.4},\"msgs_per_s\":{:.1}{refj}}}",
                        r.size,
                        r.iters,
                        r.bytes_per_s / 1e9,
                        r.bytes_per_s * 8.0 / 1e9,
                        r.msgs_per_s
                    );
                } else {
                    let refs = reference.map_or(String::new(), |x| {
                        format!(" {:>10.3} {:>6.2}", x / 1e9, r.bytes_per_s / x)
                    });
                    let _ = writeln!(
                        out,
                        "{:>8} {:>9} {:>10.3} {:>10.3} {:>12.3}{refs}",
                        format_size(r.size),
                        r.iters,
                        r.bytes_per_s / 1e9,
                        r.bytes_per_s * 8.0 / 1e9,
                        r.msgs_per_s / 1e6
                    );
                }
            }
            if !a.json && a.reference {
                let what = match a.transport {
                    TransportKind::Shm => "single-threaded memcpy of the same size",
                    _ => "a plain blocking-socket stream over loopback",
                };
                let _ = writeln!(out, "reference: {what}");
            }
        }
    }
    if let Some(path) = &a.plot {
        let (title, ylabel) = if test == "lat" {
            ("p50 one-way latency", "us")
        } else {
            ("bandwidth", "GB/s")
        };
        let svg = raw::svg_chart(
            &format!("kvperf {test} {name} {mode}: {title}"),
            ylabel,
            &points,
        );
        std::fs::write(path, svg).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(())
}

fn main() {
    // `kvperf pushpull` runs kvrun's launcher in-process, which starts this executable as its
    // shepherd.
    if std::env::args().nth(1).as_deref() == Some(kvstore_launcher::shepherd::ARG) {
        std::process::exit(kvstore_launcher::shepherd::run());
    }
    let cli = Cli::parse();
    let result = match cli.cmd {
        Cmd::Lat(a) => run_raw("lat", &a),
        Cmd::Bw(a) => run_raw("bw", &a),
        Cmd::Limit(a) => run_limit(&a),
        Cmd::Pushpull(p) => match (
            std::env::var("DMLC_ROLE").ok(),
            std::env::var("KVPERF_OUT").ok(),
        ) {
            (Some(_), Some(out)) => child(&p, PathBuf::from(out)),
            _ => parent(&p),
        },
    };
    if let Err(e) = result {
        eprintln!("kvperf: {e}");
        std::process::exit(1);
    }
}
