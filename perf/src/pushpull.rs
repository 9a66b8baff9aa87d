//! `kvperf pushpull`: push+pull through a real job (kvrun's launcher, in this process), one
//! line of figures per size, with the references of the same run beside them.

use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::Args;
use kvstore::NDArray;
use kvstore_perf::{
    cell, field, format_size, iperf3_loopback, loopback_stream_bandwidth, parse_size, parse_sizes,
    text_field,
};

#[derive(Args, Debug, Clone)]
pub(crate) struct PushPull {
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
    #[arg(long, conflicts_with = "duration")]
    iters: Option<usize>,
    /// Seconds per size instead of a count (rank 0 times the warmup and picks the count that
    /// every worker then runs).
    #[arg(long)]
    duration: Option<f64>,
    /// Seconds any blocking wait of the job may take (kvrun's --timeout).
    #[arg(long, default_value_t = 120.0)]
    timeout: f64,
    /// Write a chart (GB/s per worker against size) as SVG.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
    /// Untimed iterations first.
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Also measure the references: a plain loopback TCP stream and iperf3 (if installed).
    #[arg(long)]
    reference: bool,
    /// One JSON object per size instead of a table.
    #[arg(long)]
    json: bool,
    /// The transport between workers and servers: auto, tcp, shm or rdma
    /// (KVSTORE_TRANSPORT; rdma needs a kvperf built with `--features rdma`).
    #[arg(long, default_value = "auto", value_parser = ["auto", "tcp", "shm", "rdma"])]
    transport: String,
    /// What each iteration does: push then pull (two calls), push, pull, or pushpull (one
    /// call). The latency columns time the first call of the iteration.
    #[arg(long, default_value = "push+pull", value_parser = ["push+pull", "push", "pull", "pushpull"])]
    op: String,
    /// Push and pull arrays from `kv.alloc` (in the shared-memory pool: no copy to push).
    #[arg(long)]
    alloc: bool,
    /// Compress pushes (`set_gradient_compression`, 2-bit, threshold 1: a push of ones sends
    /// +1 in each element, so the values pulled are checked as without it).
    #[arg(long)]
    compress: bool,
    /// Push and pull arrays on gpu(0), staged through host memory (a build with the feature
    /// `cuda`); with --alloc, through the transport's pages (`kv.alloc_on`).
    #[cfg(feature = "cuda")]
    #[arg(long)]
    gpu: bool,
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

/// Whether the arrays are GPU arrays (`--gpu`).
fn on_gpu(p: &PushPull) -> bool {
    #[cfg(feature = "cuda")]
    return p.gpu;
    #[cfg(not(feature = "cuda"))]
    {
        let _ = p;
        false
    }
}

/// Where the pushed and pulled arrays live, for the header.
fn arrays_name(p: &PushPull) -> &'static str {
    #[cfg(feature = "cuda")]
    if p.gpu {
        return if p.alloc {
            "gpu(0), kv.alloc_on"
        } else {
            "gpu(0)"
        };
    }
    if p.alloc {
        "kv.alloc"
    } else {
        "heap"
    }
}

fn sizes_of(p: &PushPull) -> Result<Vec<usize>, String> {
    let sizes = match &p.size {
        Some(s) => vec![parse_size(s)?],
        None => parse_sizes(&p.sizes)?,
    };
    // The arrays are f32: a size that is not whole elements would be measured as another.
    match sizes.iter().find(|&&n| n % 4 != 0) {
        Some(n) => Err(format!(
            "a size of {n} bytes: sizes are whole f32 elements (4 bytes)"
        )),
        None => Ok(sizes),
    }
}

fn iters_for(p: &PushPull, size: usize) -> usize {
    p.iters
        .unwrap_or_else(|| ((1usize << 30) / (size * p.keys).max(1)).clamp(5, 2000))
}

/// The worker side, run in every process of the job (servers never return from `create`).
pub(crate) fn child(p: &PushPull, out: PathBuf) -> Result<(), String> {
    let sizes = sizes_of(p)?;
    let mut kv = kvstore::create("dist_sync").map_err(|e| e.to_string())?;
    if p.compress {
        let c = kvstore::Compression::two_bit(1.0).map_err(|e| e.to_string())?;
        kv.set_gradient_compression(c).map_err(|e| e.to_string())?;
    }
    let mut lines = Vec::new();
    for (i, &size) in sizes.iter().enumerate() {
        let elems = size / 4;
        let keys: Vec<i64> = (0..p.keys as i64)
            .map(|k| (i * p.keys) as i64 + k)
            .collect();
        // --alloc: arrays in the transport's pool (pushing them copies nothing).
        let mut make = |fill: f64| -> Result<NDArray, String> {
            if p.alloc {
                // With --gpu: GPU arrays staged through the pool's pages (`alloc_on`).
                #[cfg(feature = "cuda")]
                let device = if p.gpu {
                    kvstore::gpu(0)
                } else {
                    kvstore::cpu(0)
                };
                #[cfg(not(feature = "cuda"))]
                let device = kvstore::cpu(0);
                let mut a = if device.is_cpu() {
                    kv.alloc(&[elems], kvstore::DType::F32)
                } else {
                    kv.alloc_on(&[elems], kvstore::DType::F32, device)
                }
                .map_err(|e| e.to_string())?;
                a.fill(fill);
                Ok(a)
            } else {
                let a = NDArray::full(&[elems], fill);
                #[cfg(feature = "cuda")]
                if p.gpu {
                    return a.on(kvstore::gpu(0)).map_err(|e| e.to_string());
                }
                Ok(a)
            }
        };
        let mut vals: Vec<NDArray> = (0..p.keys).map(|_| make(1.0)).collect::<Result<_, _>>()?;
        let mut outs: Vec<NDArray> = (0..p.keys).map(|_| make(0.0)).collect::<Result<_, _>>()?;
        kv.init(keys.clone(), &vals).map_err(|e| e.to_string())?;
        // At least one full round first, so every op pulls the round's value.
        for _ in 0..p.warmup.max(1) {
            kv.push(keys.clone(), &vals).map_err(|e| e.to_string())?;
            kv.pull(keys.clone(), &mut outs)
                .map_err(|e| e.to_string())?;
        }
        let iters = match p.duration {
            None => {
                kv.barrier().map_err(|e| e.to_string())?;
                iters_for(p, size)
            }
            // Every worker runs the count rank 0 picks from its warmup's pace (an init stores
            // rank 0's value): a sync job's workers must run the same rounds.
            Some(secs) => {
                let t = Instant::now();
                for _ in 0..p.warmup.max(1) {
                    kv.push(keys.clone(), &vals).map_err(|e| e.to_string())?;
                    kv.pull(keys.clone(), &mut outs)
                        .map_err(|e| e.to_string())?;
                }
                let per = t.elapsed().as_secs_f64() / p.warmup.max(1) as f64;
                let n = (secs / per.max(1e-9)).clamp(1.0, 1e9) as i64;
                let key = -1 - i as i64;
                let mine = NDArray::from_vec(&[1], vec![n]).map_err(|e| e.to_string())?;
                kv.init(key, &mine).map_err(|e| e.to_string())?;
                let mut agreed = NDArray::zeros_dtype(&[1], kvstore::DType::I64);
                kv.pull(key, &mut agreed).map_err(|e| e.to_string())?;
                agreed.to_vec::<i64>().map_err(|e| e.to_string())?[0].max(1) as usize
            }
        };
        // GPU arrays: written on the GPU before each push and read there after each pull.
        let (push, pull) = (p.op != "pull", p.op != "push");
        let mut stage = kvstore_perf::staging::Staging::new(on_gpu(p), &vals, &outs)?;
        stage.calibrate(&mut vals, &outs, push, pull)?;
        // Each push (request and acknowledgement) is timed too.
        let mut push_lat = hdrhistogram::Histogram::<u64>::new_with_bounds(1, 600_000_000_000, 3)
            .map_err(|e| e.to_string())?;
        let pushed_before = kv.metrics().total().bytes_pushed;
        let start = Instant::now();
        for _ in 0..iters {
            if push {
                stage.before_push(&mut vals)?;
            }
            let t0 = Instant::now();
            match p.op.as_str() {
                "pull" => kv.pull(keys.clone(), &mut outs),
                "pushpull" => kv.pushpull(keys.clone(), &vals, &mut outs),
                _ => kv.push(keys.clone(), &vals),
            }
            .map_err(|e| e.to_string())?;
            push_lat.saturating_record((t0.elapsed().as_nanos() as u64).max(1));
            if p.op == "push+pull" {
                kv.pull(keys.clone(), &mut outs)
                    .map_err(|e| e.to_string())?;
            }
            if pull {
                stage.after_pull(&outs)?;
            }
        }
        let secs = stage.seconds(start.elapsed().as_secs_f64(), iters, size);
        // Bytes this worker's pushes put on the wire per iteration (packed, with --compress).
        let pushed = (kv.metrics().total().bytes_pushed - pushed_before) / iters as u64;
        if p.op == "push" {
            kv.pull(keys.clone(), &mut outs)
                .map_err(|e| e.to_string())?;
        }
        kv.barrier().map_err(|e| e.to_string())?;
        // Every worker pushes ones: the pulled value is the number of workers (ASSIGN), as a
        // GPU's memory holds it for GPU arrays. The outputs are spoiled first, so that a pull
        // that wrote nothing cannot pass; `--op pushpull` checks the call it times.
        for o in &mut outs {
            o.fill(f64::NAN);
        }
        match p.op.as_str() {
            "pushpull" => kv.pushpull(keys.clone(), &vals, &mut outs),
            _ => kv.pull(keys.clone(), &mut outs),
        }
        .map_err(|e| e.to_string())?;
        let w = kv.num_workers() as f32;
        if stage
            .values(&outs)?
            .iter()
            .any(|s| s.iter().any(|&x| x != w))
        {
            return Err(format!("wrong values pulled at size {size}"));
        }
        lines.push(format!(
            "{{\"size\":{},\"keys\":{},\"iters\":{iters},\"secs\":{secs},\"workers\":{},\"servers\":{},\"push_p50_us\":{:.3},\"push_p99_us\":{:.3},\"transport\":\"{}\",\"op\":\"{}\",\"compress\":{},\"push_bytes_per_iter\":{pushed}}}",
            elems * 4,
            p.keys,
            kv.num_workers(),
            p.servers,
            push_lat.value_at_quantile(0.5) as f64 / 1000.0,
            push_lat.value_at_quantile(0.99) as f64 / 1000.0,
            kv.transports().first().copied().unwrap_or("-"),
            p.op,
            p.compress,
        ));
    }
    if kv.rank() == 0 {
        std::fs::write(&out, lines.join("\n")).map_err(|e| e.to_string())?;
    }
    Ok(())
}

pub(crate) fn parent(p: &PushPull) -> Result<(), String> {
    sizes_of(p)?;
    if p.keys == 0 {
        return Err("--keys must be at least 1".into());
    }
    let remote = |names: &[kvstore_launcher::Host]| {
        names
            .iter()
            .any(|h| !kvstore_launcher::hosts::is_local(&h.name))
    };
    let across = match (&p.hosts, &p.hostfile) {
        (Some(h), _) => remote(&kvstore_launcher::hosts::parse_host_list(h)?),
        (None, Some(f)) => {
            let text = std::fs::read_to_string(f).map_err(|e| format!("{}: {e}", f.display()))?;
            remote(&kvstore_launcher::hosts::parse_hostfile(&text)?)
        }
        (None, None) => false,
    };
    if p.reference && across {
        return Err(
            "--reference measures this host's loopback and memory, no reference for a \
                    job across hosts: run iperf3 or ib_write_bw between them"
                .into(),
        );
    }
    if p.iters == Some(0) {
        return Err("--iters must be at least 1".into());
    }
    if !(p.timeout > 0.0 && p.timeout.is_finite()) {
        return Err("--timeout must be a positive number of seconds".into());
    }
    if p.duration.is_some_and(|d| !(d > 0.0 && d <= 86_400.0)) {
        return Err("--duration must be positive".into());
    }
    #[cfg(not(feature = "rdma"))]
    if p.transport == "rdma" {
        return Err(crate::NO_RDMA.into());
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
        "--timeout".into(),
        p.timeout.to_string(),
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
    if text.trim().is_empty() {
        // Worker 0 writes the results on its own host.
        return Err(format!(
            "the job wrote no results at {}: worker 0 writes them on its own host, which must \
             be this one",
            out.display()
        ));
    }
    let mut stdout = std::io::stdout().lock();
    print_header(p, &text, stream_ref, iperf_ref, &mut stdout);
    let mut points = Vec::new();
    let mut ref_points = Vec::new();
    for line in text.lines() {
        print_row(p, line, stream_ref, iperf_ref, &mut stdout)?;
        let (size, keys, iters, secs) = (
            field(line, "size"),
            field(line, "keys"),
            field(line, "iters"),
            field(line, "secs"),
        );
        let ways = if matches!(p.op.as_str(), "push" | "pull") {
            1.0
        } else {
            2.0
        };
        points.push((size, ways * size * keys * iters / secs / 1e9));
        if p.reference {
            let m = kvstore_perf::reference::memcpy_bandwidth(
                (size * keys) as usize,
                Duration::from_millis(100),
            );
            ref_points.push((size, m / 1e9));
        }
    }
    if let Some(path) = &p.plot {
        let mut series: Vec<kvstore_perf::chart::Series<'_>> = vec![("kvperf pushpull", &points)];
        // One worker's memcpy of the same bytes, where references were measured.
        if !ref_points.is_empty() {
            series.push(("memcpy (reference)", &ref_points));
        }
        kvstore_perf::chart::write(
            path,
            &format!(
                "kvperf pushpull W={} S={} {} {}: GB/s per worker",
                p.workers, p.servers, p.transport, p.op
            ),
            "GB/s per worker (10^9 bytes per second)",
            &series,
        )?;
    }
    if !p.json {
        let _ = writeln!(stdout, "size: bytes per key; us/iter: microseconds per iteration (the op on every key); GB/s: 10^9 bytes per second, per worker and for all; call p50/p99: one call of the op (request and answer; for push+pull, the push), microseconds; key-ops/s: key operations per second (a push and a pull of a key are two), all workers");
    }
    if !p.json && p.reference {
        let _ = writeln!(stdout, "x memcpy: GB/s/wkr over single-threaded memcpy of the size; x iperf3, x stream: GB/s all over the loopback references");
        let _ = writeln!(stdout, "limit us: the ceiling, one push+pull round of W worker and S server threads sharing memory ({}); x limit: us/iter over it", if p.alloc { "gradients already shared: zero-copy" } else { "gradients copied in: one copy" });
    }
    Ok(())
}

/// The references measured before the job, and the table's header.
fn print_header(
    p: &PushPull,
    text: &str,
    stream_ref: Option<f64>,
    iperf_ref: Option<f64>,
    stdout: &mut impl Write,
) {
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
        let transport = text.lines().next().map(|l| text_field(l, "transport"));
        let _ = writeln!(
            stdout,
            "W={} S={} keys/call={} transport={} arrays={} op={}{}\n{:>8} {:>7} {:>10} {:>9} {:>9} {:>9} {:>9} {:>11}{}",
            p.workers,
            p.servers,
            p.keys,
            transport.unwrap_or_else(|| "-".into()),
            arrays_name(p),
            p.op,
            if p.compress { " compressed (2-bit)" } else { "" },
            "size",
            "iters",
            "us/iter",
            "GB/s/wkr",
            "GB/s all",
            "call p50",
            "call p99",
            "key-ops/s",
            if p.reference {
                format!(
                    " {:>8} {:>8} {:>8} {:>9} {:>7}",
                    "x memcpy", "x iperf3", "x stream", "limit us", "x limit"
                )
            } else {
                String::new()
            }
        );
    }
}

/// One size's line: its figures, and its ratios to the references and the ceiling.
fn print_row(
    p: &PushPull,
    line: &str,
    stream_ref: Option<f64>,
    iperf_ref: Option<f64>,
    stdout: &mut impl Write,
) -> Result<(), String> {
    let gbs = |b: f64| b / 1e9;
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
    // Key operations: a push + pull (or a pushpull, which is both) counts two per key, as its
    // bytes do.
    let ops = ways * keys * w / per_iter;
    let ratio = |r: Option<f64>| r.map_or(f64::NAN, |r| all / r);
    // One worker's push+pull bandwidth against one core's memcpy of the same size.
    let memcpy = p.reference.then(|| {
        kvstore_perf::reference::memcpy_bandwidth(
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
        let l =
            kvstore_perf::limit::measure(bytes, p.workers as usize, p.servers as usize, rounds)?;
        Some(if p.alloc { l.zero_copy } else { l.one_copy })
    } else {
        None
    };
    let limit_us = limit.map_or(f64::NAN, |l| l * 1e6);
    let x_limit = limit.map_or(f64::NAN, |l| per_iter / l);
    if p.json {
        let num =
            |x: f64| serde_json::Number::from_f64(x).map_or(serde_json::Value::Null, Into::into);
        let row = serde_json::json!({
            "test": "pushpull",
            "op": p.op,
            "compress": p.compress,
            "push_bytes_per_iter": field(line, "push_bytes_per_iter") as u64,
            "transport": text_field(line, "transport"),
            "workers": w as u64,
            "servers": p.servers,
            "size": size as u64,
            "keys": keys as u64,
            "iters": iters as u64,
            "us_per_iter": num(per_iter * 1e6),
            "gbps_per_worker": num(gbs(per_worker)),
            "gbps_all": num(gbs(all)),
            "call_p50_us": num(p50),
            "call_p99_us": num(p99),
            "ratio_memcpy": num(x_memcpy),
            "ratio_iperf3": num(ratio(iperf_ref)),
            "ratio_stream": num(ratio(stream_ref)),
            "key_ops_per_s": num(ops),
            "limit_us": num(limit_us),
            "ratio_limit": num(x_limit),
            // Each unit and the fields in it (no key repeats a field's name, so a script that
            // greps a field finds its number).
            "units": {
                "bytes per key": "size",
                "microseconds": "us_per_iter call_p50_us call_p99_us limit_us",
                "10^9 bytes per second": "gbps_per_worker gbps_all",
                "key operations per second, all workers": "key_ops_per_s",
            },
        });
        let _ = writeln!(stdout, "{row}");
    } else {
        // Reference columns only where references were measured.
        let refs = if p.reference {
            format!(
                " {:>8} {:>8} {:>8} {:>9} {:>7}",
                cell(x_memcpy, 2),
                cell(ratio(iperf_ref), 2),
                cell(ratio(stream_ref), 2),
                cell(limit_us, 1),
                cell(x_limit, 2),
            )
        } else {
            String::new()
        };
        let _ = writeln!(
            stdout,
            "{:>8} {:>7} {:>10.1} {:>9.3} {:>9.3} {:>9.2} {:>9.2} {:>11.0}{refs}",
            format_size(size as usize),
            iters,
            per_iter * 1e6,
            gbs(per_worker),
            gbs(all),
            p50,
            p99,
            ops,
        );
    }
    Ok(())
}
