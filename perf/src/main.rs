//! `kvperf`: measures the transports and the store, in the manner of perftest and the OSU
//! benchmarks.
//!
//! - `kvperf lat` / `kvperf bw`: latency (HDR histogram: min, p50, p90, p99, p99.9, max) and
//!   bandwidth of a raw transport (`tcp`, `shm`), two-sided (`--mode send`) or one-sided
//!   (`--mode write`). Run `--server` on one side and `kvperf lat HOST` on the other, or
//!   `--local` to start both.
//! - `kvperf pushpull`: push+pull through real servers (a job of W workers and S servers);
//!   `--compress` with 2-bit gradient compression.
//! - `kvperf compress`: quantize and dequantize against memcpy, one core.
//!
//! `--reference` adds figures measured in the same run to read the others against: memcpy
//! bandwidth for shm, a plain blocking-socket ping-pong and stream for tcp.

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use kvstore_perf::conn::{self, Conn};
use kvstore_perf::raw::{self, Plan, Results};
use kvstore_perf::reference;
use kvstore_perf::{format_size, loopback_stream_bandwidth, parse_size, parse_sizes};

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
    /// The cost of 2-bit gradient compression (quantize on the worker, dequantize on the
    /// server) against memcpy of the same bytes, one core.
    Compress(kvstore_perf::compress::CompressArgs),
    /// The sum of GPU arrays in a `device` store against a device-to-device copy, as bytes
    /// read plus written per second (a build with the feature `cuda`).
    #[cfg(feature = "cuda")]
    Gpu(kvstore_perf::gpu::GpuArgs),
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
    /// Start the server side here too (a second process; no host then).
    #[arg(long, conflicts_with = "host")]
    local: bool,
    /// The server's host (the client side; over shm localhost, 127.0.0.1 or ::1). With no host
    /// and no --local, this is the server, as perftest's tools are.
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
    /// Messages in flight at most (bw): a credit window, topped up as the server's counts
    /// come back (perftest's default depth, 128).
    #[arg(long, default_value_t = 128)]
    window: usize,
    /// Two-sided sends or one-sided writes.
    #[arg(long, value_enum, default_value_t = Mode::Send)]
    mode: Mode,
    /// Also measure the reference: two threads passing messages through shared memory (shm
    /// latency), memcpy (shm bandwidth), a plain socket ping-pong and stream (tcp).
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

mod pushpull;
use pushpull::{child, parent, PushPull};

fn connect(a: &RawArgs, server: bool) -> Result<Conn, String> {
    let timeout = Duration::from_secs_f64(a.timeout);
    let name = a.port.to_string();
    match (a.transport, server) {
        #[cfg(feature = "rdma")]
        (TransportKind::Rdma, true) => Conn::accept(conn::rdma_server(a.port)?, timeout),
        #[cfg(feature = "rdma")]
        (TransportKind::Rdma, false) => conn::rdma_client(a.host.as_deref(), a.port, timeout),
        #[cfg(not(feature = "rdma"))]
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

#[cfg(not(feature = "rdma"))]
const NO_RDMA: &str =
    "this kvperf has no RDMA: build it with `--features rdma` (needs libibverbs-dev libclang-dev)";

fn run_raw(test: &str, a: &RawArgs) -> Result<(), String> {
    let sizes = match &a.size {
        Some(s) => vec![parse_size(s)?],
        None => parse_sizes(&a.sizes)?,
    };
    // Seconds up to a day: a time past that, infinity or NaN is a mistake (and a deadline
    // that far would overflow).
    let secs_ok = |s: f64| s > 0.0 && s <= 86_400.0;
    if !secs_ok(a.timeout) || a.window == 0 {
        return Err(
            "--timeout must be positive seconds, a day at most, and --window positive".into(),
        );
    }
    if a.duration.is_some_and(|d| !secs_ok(d)) {
        return Err("--duration must be positive seconds, a day at most".into());
    }
    let remote = a.host.as_deref().is_some_and(|h| {
        let bare = h.trim_start_matches('[').trim_end_matches(']');
        !(bare.eq_ignore_ascii_case("localhost")
            || bare
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_loopback() || ip.to_canonical().is_loopback()))
    });
    if a.reference && remote {
        // The references are this host's (its loopback, its memory): against a link to
        // another host their ratio means nothing.
        return Err(
            "--reference measures this host's loopback and memory, which say nothing \
                    of a link to another host: run iperf3 or perftest between the two instead"
                .into(),
        );
    }
    #[cfg(not(feature = "rdma"))]
    if a.transport == TransportKind::Rdma {
        return Err(NO_RDMA.into());
    }
    let timeout = Duration::from_secs_f64(a.timeout);
    if a.server || (a.host.is_none() && !a.local) {
        if !a.server {
            let t = format!("{:?}", a.transport).to_lowercase();
            eprintln!(
                "kvperf {test}: no host given, so this is the server ({t}, port or name {}); \
                 run `kvperf {test} --transport {t} --port {} HOST` on the client side",
                a.port, a.port
            );
        }
        let mut c = connect(a, true)?;
        return raw::server(&mut c, timeout);
    }
    let mut a = a.clone();
    let mut local = None;
    if a.local {
        // A free port (tcp) or a fresh name (shm) for this run's server process.
        a.port = match a.transport {
            TransportKind::Tcp | TransportKind::Rdma => std::net::TcpListener::bind("127.0.0.1:0")
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

use kvstore_perf::json_num as num;

/// One JSON row of `lat` or `bw`: what ran (the keys `pushpull`'s rows have too), then the
/// row's `figures`.
fn json_row(
    test: &str,
    transport: &str,
    mode: &str,
    size: usize,
    iters: usize,
    figures: serde_json::Value,
) -> serde_json::Value {
    let mut row = serde_json::json!({
        "test": test,
        "op": test,
        "transport": transport,
        "mode": mode,
        "workers": 1,
        "servers": 1,
        "size": size,
        "iters": iters,
    });
    if let (Some(r), serde_json::Value::Object(f)) = (row.as_object_mut(), figures) {
        r.extend(f);
    }
    row
}

fn report(test: &str, name: &str, a: &RawArgs, results: &Results) -> Result<(), String> {
    let mut out = std::io::stdout().lock();
    let mode = format!("{:?}", a.mode).to_lowercase();
    let mut points = Vec::new();
    let mut ref_points = Vec::new();
    match results {
        Results::Lat(rows) => {
            if !a.json {
                let _ = writeln!(
                    out,
                    "kvperf lat  transport={name} mode={mode}  one-way latency (half the round trip), us"
                );
                let refcols = if a.reference && a.transport != TransportKind::Rdma {
                    "   ref p50  x ref"
                } else {
                    ""
                };
                let _ = writeln!(
                    out,
                    "{:>8} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}{refcols}",
                    "size", "iters", "min", "p50", "p90", "p99", "p99.9", "max", "mean", "stdev"
                );
            }
            // A reference's round trips: as many as kvperf's own, or as 2 s hold.
            let budget = Duration::from_secs(2);
            for r in rows {
                let reference = match (a.reference, a.transport) {
                    (true, TransportKind::Tcp) => Some(
                        reference::socket_pingpong_us(r.size, r.iters.clamp(10, 20_000), budget)
                            .map_err(|e| e.to_string())?,
                    ),
                    (true, TransportKind::Shm) => Some(
                        reference::shared_pingpong_us(r.size, r.iters.clamp(10, 20_000), budget)
                            .map_err(|e| e.to_string())?,
                    ),
                    _ => None,
                };
                points.push((r.size as f64, r.us[1]));
                if let Some(x) = reference {
                    ref_points.push((r.size as f64, x));
                }
                if a.json {
                    let figures = serde_json::json!({
                        "min_us": num(r.us[0]),
                        "p50_us": num(r.us[1]),
                        "p90_us": num(r.us[2]),
                        "p99_us": num(r.us[3]),
                        "p999_us": num(r.us[4]),
                        "max_us": num(r.us[5]),
                        "mean_us": num(r.mean_stdev_us[0]),
                        "stdev_us": num(r.mean_stdev_us[1]),
                        "ref_p50_us": reference.map_or(serde_json::Value::Null, num),
                        // Each unit and the fields in it (no key repeats a field's name,
                        // so a script that greps a field finds its number).
                        "units": {
                            "bytes": "size",
                            "microseconds, one way (half the round trip)":
                                "min_us p50_us p90_us p99_us p999_us max_us mean_us stdev_us \
                                 ref_p50_us",
                        },
                    });
                    let row = json_row("lat", name, &mode, r.size, r.iters, figures);
                    let _ = writeln!(out, "{row}");
                } else {
                    let refs = reference.map_or(String::new(), |x| {
                        format!(" {:>9.2} {:>6.2}", x, r.us[1] / x)
                    });
                    let _ = writeln!(
                        out,
                        "{:>8} {:>8} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2}{refs}",
                        format_size(r.size),
                        r.iters,
                        r.us[0],
                        r.us[1],
                        r.us[2],
                        r.us[3],
                        r.us[4],
                        r.us[5],
                        r.mean_stdev_us[0],
                        r.mean_stdev_us[1]
                    );
                }
            }
            if !a.json {
                let _ = writeln!(
                    out,
                    "size: bytes per message; min ... max: one-way latency (half the round \
                     trip), microseconds, at those percentiles; mean and stdev of every round \
                     trip timed"
                );
            }
            if !a.json && a.reference {
                let what = match a.transport {
                    TransportKind::Tcp => "reference: a plain blocking-socket ping-pong over loopback (half its median round trip)",
                    TransportKind::Shm => "reference: two threads passing the message back and forth through shared memory with nothing else (a buffer and a flag each way; half their median round trip). It copies every byte each way: the transport hands a large message over as pages and may be below it",
                    _ => "reference: none for rdma here (perftest's ib_send_lat is the one to run beside it)",
                };
                let _ = writeln!(out, "{what}");
            }
        }
        Results::Bw(rows) => {
            if !a.json {
                // Write mode's slots are one region of at most 256 of them and 256 MiB: the
                // window of a large message is smaller than the one asked for.
                let cap = if mode == "write" {
                    " (at most 256 and 256 MiB of messages in write mode)"
                } else {
                    ""
                };
                let _ = writeln!(
                    out,
                    "kvperf bw  transport={name} mode={mode} window={}{cap}",
                    a.window
                );
                let refcols = if a.reference && a.transport != TransportKind::Rdma {
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
                    (false, _) | (true, TransportKind::Rdma) => None,
                    (true, TransportKind::Shm) => Some(reference::memcpy_bandwidth(
                        r.size,
                        Duration::from_millis(200),
                    )),
                    (true, _) => Some(
                        loopback_stream_bandwidth(r.size.max(1), Duration::from_millis(300))
                            .map_err(|e| e.to_string())?,
                    ),
                };
                points.push((r.size as f64, r.bytes_per_s / 1e9));
                if let Some(x) = reference {
                    ref_points.push((r.size as f64, x / 1e9));
                }
                if a.json {
                    let figures = serde_json::json!({
                        "gbytes_per_s": num(r.bytes_per_s / 1e9),
                        "gbits_per_s": num(r.bytes_per_s * 8.0 / 1e9),
                        "msgs_per_s": num(r.msgs_per_s),
                        "ref_gbytes_per_s": reference.map_or(serde_json::Value::Null, |x| num(x / 1e9)),
                        "units": {
                            "bytes": "size",
                            "10^9 bytes per second": "gbytes_per_s ref_gbytes_per_s",
                            "10^9 bits per second": "gbits_per_s",
                            "messages per second": "msgs_per_s",
                        },
                    });
                    let row = json_row("bw", name, &mode, r.size, r.iters, figures);
                    let _ = writeln!(out, "{row}");
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
            if !a.json {
                let _ = writeln!(
                    out,
                    "size: bytes per message; GB/s: 10^9 bytes per second; Gb/s: 10^9 bits per \
                     second; Mmsg/s: 10^6 messages per second"
                );
            }
            if !a.json && a.reference {
                let what = match a.transport {
                    TransportKind::Shm => "single-threaded memcpy of the same size",
                    TransportKind::Rdma => {
                        "none for rdma here (perftest's ib_write_bw is the one to run beside it)"
                    }
                    _ => "a plain blocking-socket stream over loopback",
                };
                let _ = writeln!(out, "reference: {what}");
            }
        }
    }
    if let Some(path) = &a.plot {
        let (title, ylabel) = if test == "lat" {
            ("p50 one-way latency", "microseconds")
        } else {
            ("bandwidth", "GB/s (10^9 bytes per second)")
        };
        let mut series: Vec<kvstore_perf::chart::Series<'_>> = vec![("kvperf", &points)];
        if !ref_points.is_empty() {
            series.push(("reference", &ref_points));
        }
        kvstore_perf::chart::write(
            path,
            &format!("kvperf {test} {name} {mode}: {title}"),
            ylabel,
            &series,
        )?;
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
        Cmd::Compress(a) => kvstore_perf::compress::run(&a),
        #[cfg(feature = "cuda")]
        Cmd::Gpu(a) => kvstore_perf::gpu::run(&a),
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
