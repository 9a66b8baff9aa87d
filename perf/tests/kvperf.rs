//! Each kvperf subcommand, briefly, with --local: the output parses and the figures are positive.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn kvperf(args: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvperf"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs kvperf with `args`, and `--plot chart` where a chart can be drawn (without a font it
/// cannot be, and kvperf says so); asserts that it succeeded and returns its stdout.
fn kvperf_plotting<'a>(mut args: Vec<&'a str>, chart: &'a std::path::Path, what: &str) -> String {
    if have_font() {
        args.extend(["--plot", chart.to_str().unwrap()]);
    }
    let (code, out, err) = kvperf(&args);
    assert_eq!(code, Some(0), "{what}: {err}");
    out
}

/// A loopback port free a moment ago.
fn free_port() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port().to_string()
}

/// Whether a chart can be drawn here (its text needs a TrueType font); says so if not.
fn have_font() -> bool {
    let found = std::env::var("KVPERF_FONT").is_ok()
        || [
            "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
            "/usr/share/fonts/dejavu/DejaVuSans.ttf",
            "/usr/share/fonts/TTF/DejaVuSans.ttf",
            "/usr/share/fonts/dejavu-sans-fonts/DejaVuSans.ttf",
        ]
        .iter()
        .any(|p| std::path::Path::new(p).exists());
    if !found {
        eprintln!("no TrueType font here (fonts-dejavu-core): charts are not checked");
    }
    found
}

/// The number `name` of a JSON row.
fn field(line: &str, name: &str) -> f64 {
    let v: serde_json::Value = serde_json::from_str(line).unwrap();
    v.get(name)
        .and_then(serde_json::Value::as_f64)
        .unwrap_or_else(|| panic!("no number {name} in {line}"))
}

/// Every line of `--json` output: each is strict JSON (a parser refuses NaN) and says its
/// transport, W, S, op and units.
fn json_lines(stdout: &str) -> Vec<&str> {
    let rows: Vec<&str> = stdout.lines().filter(|l| !l.trim().is_empty()).collect();
    for r in &rows {
        let v: serde_json::Value =
            serde_json::from_str(r).unwrap_or_else(|e| panic!("not JSON ({e}): {r}"));
        for k in ["transport", "op"] {
            assert!(
                v.get(k).is_some_and(serde_json::Value::is_string),
                "{k} in {r}"
            );
        }
        for k in ["workers", "servers"] {
            assert!(
                v.get(k).is_some_and(serde_json::Value::is_u64),
                "{k} in {r}"
            );
        }
        let units = v.get("units").and_then(serde_json::Value::as_object);
        let units = units.unwrap_or_else(|| panic!("units in {r}"));
        // A unit's key never repeats a field's name (scripts grep `"field":NUMBER`), and every
        // field a unit names is in the row.
        for (k, fields) in units {
            assert!(v.get(k).is_none(), "units repeat {k} in {r}");
            for f in fields.as_str().unwrap().split_whitespace() {
                assert!(v.get(f).is_some(), "{f} in {r}");
            }
        }
    }
    rows
}

#[test]
fn latency_over_tcp_and_shm() {
    for t in ["tcp", "shm"] {
        for mode in ["send", "write"] {
            let (code, out, err) = kvperf(&[
                "lat",
                "--transport",
                t,
                "--mode",
                mode,
                "--local",
                "--sizes",
                "8:1K",
                "--iters",
                "50",
                "--warmup",
                "5",
                "--json",
            ]);
            assert_eq!(code, Some(0), "{t} {mode}: {err}");
            let rows = json_lines(&out);
            assert_eq!(rows.len(), 8, "{out}");
            for r in rows {
                assert_eq!(field(r, "iters"), 50.0);
                let (min, p50, p99, max) = (
                    field(r, "min_us"),
                    field(r, "p50_us"),
                    field(r, "p99_us"),
                    field(r, "max_us"),
                );
                assert!(min > 0.0 && min <= p50 && p50 <= p99 && p99 <= max, "{r}");
                let (mean, stdev) = (field(r, "mean_us"), field(r, "stdev_us"));
                assert!(min <= mean && mean <= max && stdev <= max - min, "{r}");
            }
        }
    }
}

#[test]
fn bandwidth_over_tcp_and_shm_with_references_and_a_chart() {
    let svg = std::env::temp_dir().join(format!("kvperf-test-{}.svg", std::process::id()));
    for t in ["tcp", "shm"] {
        for mode in ["send", "write"] {
            let args = vec![
                "bw",
                "--transport",
                t,
                "--mode",
                mode,
                "--local",
                "--sizes",
                "4K:256K",
                "--iters",
                "40",
                "--window",
                "8",
                "--warmup",
                "3",
                "--json",
                "--reference",
            ];
            let out = kvperf_plotting(args, &svg, &format!("{t} {mode}"));
            let rows = json_lines(&out);
            assert_eq!(rows.len(), 7, "{out}");
            for r in rows {
                assert!(field(r, "gbytes_per_s") > 0.0, "{r}");
                assert!(field(r, "msgs_per_s") > 0.0, "{r}");
                assert!(field(r, "ref_gbytes_per_s") > 0.0, "{r}");
            }
            if have_font() {
                // Two lines (kvperf and the reference), a legend, axis titles.
                let chart = std::fs::read_to_string(&svg).unwrap();
                assert!(chart.starts_with("<svg"), "{chart}");
                for text in [
                    "kvperf",
                    "reference",
                    "size, bytes (log scale)",
                    "GB/s (10^9",
                    "stroke=\"#0000FF\"",
                    "stroke=\"#FF0000\"",
                ] {
                    assert!(chart.contains(text), "{text}\n{chart}");
                }
            }
        }
    }
    let (code, out, _) = kvperf(&[
        "bw",
        "--transport",
        "shm",
        "--local",
        "--size",
        "64K",
        "--duration",
        "0.2",
    ]);
    assert_eq!(code, Some(0));
    assert!(out.contains("GB/s") && out.contains("64K"), "{out}");
    let _ = std::fs::remove_file(svg);
}

#[test]
fn pushpull_through_a_real_job() {
    let (code, out, err) = kvperf(&[
        "pushpull", "--local", "-n", "2", "-s", "2", "--sizes", "4K:16K", "--iters", "5", "--json",
    ]);
    assert_eq!(code, Some(0), "{err}");
    let rows = json_lines(&out);
    assert_eq!(rows.len(), 3, "{out}");
    for r in rows {
        assert!(
            field(r, "gbps_all") > 0.0 && field(r, "us_per_iter") > 0.0,
            "{r}"
        );
    }
    // Compressed pushes are checked as the others: the pulled values are the workers' sum.
    for (op, compress) in [
        ("push", ""),
        ("pull", ""),
        ("pushpull", ""),
        ("push+pull", "--compress"),
    ] {
        let mut args = vec![
            "pushpull", "--op", op, "--size", "64K", "--iters", "5", "--json",
        ];
        args.extend([compress].into_iter().filter(|c| !c.is_empty()));
        let (code, out, err) = kvperf(&args);
        assert_eq!(code, Some(0), "{op}: {err}");
        let rows = json_lines(&out);
        assert_eq!(rows.len(), 1, "{out}");
        assert!(
            field(rows[0], "gbps_per_worker") > 0.0 && field(rows[0], "call_p50_us") > 0.0,
            "{out}"
        );
        let v: serde_json::Value = serde_json::from_str(rows[0]).unwrap();
        assert_eq!(v["compress"], !compress.is_empty(), "{out}");
        // What the pushes put on the wire: 64 KiB a push, or packed, a sixteenth.
        let pushed = match (op, compress.is_empty()) {
            ("pull", _) => 0,
            (_, true) => 65536,
            (_, false) => 4096,
        };
        assert_eq!(v["push_bytes_per_iter"], pushed, "{out}");
    }
    // With references, every line is strict JSON (no NaN: a missing figure is null), and the
    // ceiling of the same W, S and size is there with the ratio to it.
    let (code, out, err) = kvperf(&[
        "pushpull",
        "-n",
        "2",
        "-s",
        "1",
        "--transport",
        "shm",
        "--size",
        "64K",
        "--iters",
        "20",
        "--reference",
        "--json",
    ]);
    assert_eq!(code, Some(0), "{err}");
    let rows = json_lines(&out);
    assert_eq!(rows.len(), 1, "{out}");
    assert!(!out.contains("NaN") && !out.contains("inf"), "{out}");
    let (limit, ratio, per_iter) = (
        field(rows[0], "limit_us"),
        field(rows[0], "ratio_limit"),
        field(rows[0], "us_per_iter"),
    );
    assert!(limit > 0.0 && ratio > 0.0, "{out}");
    assert!((ratio - per_iter / limit).abs() <= 0.01 * ratio, "{out}");
    // Without references there is no figure to divide by: null, not NaN.
    let (code, out, err) = kvperf(&["pushpull", "--size", "4K", "--iters", "3", "--json"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        out.contains("\"ratio_limit\":null") && !out.contains("NaN"),
        "{out}"
    );
    let (code, out, err) = kvperf(&["limit", "--size", "1M", "--rounds", "5"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        out.contains("zero-copy") && out.contains("one copy in"),
        "{out}"
    );
    let (code, out, err) = kvperf(&["pushpull", "--size", "1K", "--keys", "100", "--iters", "3"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        out.contains("key-ops/s") && out.contains("keys/call=100"),
        "{out}"
    );
}

#[test]
fn bad_arguments_get_a_clear_message() {
    for (args, needle) in [
        (vec!["lat", "--size", "0"], "out of range"),
        (vec!["lat", "--sizes", "64:8"], "larger than MAX"),
        (vec!["bw", "--transport", "rdma", "--local"], "no RDMA"),
        (
            vec!["lat", "--transport", "carrier-pigeon"],
            "invalid value",
        ),
        (vec!["lat", "--server", "--local"], "cannot be used with"),
        (vec!["lat", "--local", "localhost"], "cannot be used with"),
        (vec!["pushpull", "--keys", "0"], "--keys"),
        (
            vec!["pushpull", "--iters", "0"],
            "--iters must be at least 1",
        ),
        (
            vec!["pushpull", "-H", "localhost:2,elsewhere:4", "--reference"],
            "no reference for a job across hosts",
        ),
        // Times that never end, or overflow a deadline (before: a panic, or a run forever).
        (
            vec!["lat", "--local", "--timeout", "inf"],
            "--timeout must be",
        ),
        (
            vec!["lat", "--local", "--duration", "inf"],
            "--duration must be",
        ),
        (vec!["compress", "--secs", "1e20"], "--secs must be"),
        // f32 arrays: a size that is not whole elements (before: measured as 4 bytes).
        (vec!["pushpull", "--size", "6"], "whole f32 elements"),
    ] {
        let (code, _, err) = kvperf(&args);
        assert_ne!(code, Some(0), "{args:?}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

#[test]
fn a_peer_that_vanishes_ends_the_run_with_an_error() {
    // Nobody listening: the connect gives up after --timeout.
    let port = free_port();
    let start = Instant::now();
    let (code, _, err) = kvperf(&[
        "lat",
        "--transport",
        "tcp",
        "127.0.0.1",
        "--port",
        &port,
        "--timeout",
        "1",
    ]);
    assert_ne!(code, Some(0));
    assert!(err.contains("kvperf:"), "{err}");
    assert!(start.elapsed() < Duration::from_secs(15));
    // A server killed in the middle of a run.
    for t in ["tcp", "shm"] {
        // A free port for TCP; over shared memory the port only names the rendezvous.
        let port = match t {
            "tcp" => free_port(),
            _ => (std::process::id() % 20000 + 30000).to_string(),
        };
        let mut server = Command::new(env!("CARGO_BIN_EXE_kvperf"))
            .args([
                "lat",
                "--server",
                "--transport",
                t,
                "--port",
                &port,
                "--timeout",
                "3",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let client = Command::new(env!("CARGO_BIN_EXE_kvperf"))
            .args([
                "lat",
                "--transport",
                t,
                "127.0.0.1",
                "--port",
                &port,
                "--duration",
                "30",
                "--size",
                "64",
                "--timeout",
                "3",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Time for the client to connect (within its --timeout of 3 s) and be measuring.
        std::thread::sleep(Duration::from_millis(1500));
        server.kill().unwrap();
        let _ = server.wait();
        let start = Instant::now();
        let out = client.wait_with_output().unwrap();
        assert_ne!(out.status.code(), Some(0), "{t}");
        assert!(
            start.elapsed() < Duration::from_secs(15),
            "{t}: took {:?}",
            start.elapsed()
        );
        let err = String::from_utf8_lossy(&out.stderr);
        // Lost in the middle of the run (a client that never connected would say so instead).
        assert!(err.contains("kvperf: peer lost"), "{t}: {err}");
    }
}

#[test]
fn lat_with_no_host_is_the_server_as_perftest_is() {
    let port = free_port();
    let server = Command::new(env!("CARGO_BIN_EXE_kvperf"))
        .args([
            "lat",
            "--port",
            &port,
            "--size",
            "8",
            "--iters",
            "20",
            "--timeout",
            "20",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (code, out, err) = kvperf(&[
        "lat",
        "127.0.0.1",
        "--port",
        &port,
        "--size",
        "8",
        "--iters",
        "20",
        "--json",
    ]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(json_lines(&out).len(), 1, "{out}");
    let s = server.wait_with_output().unwrap();
    let said = String::from_utf8_lossy(&s.stderr);
    assert!(
        said.contains("no host given, so this is the server (tcp"),
        "{said}"
    );
}

#[test]
fn pushpull_takes_a_duration_a_timeout_and_a_chart_and_explains_rdma() {
    let svg = std::env::temp_dir().join(format!("kvperf-pp-{}.png", std::process::id()));
    let args = vec![
        "pushpull",
        "-n",
        "2",
        "-s",
        "1",
        "--sizes",
        "4K:8K",
        "--duration",
        "0.3",
        "--timeout",
        "30",
        "--json",
    ];
    let out = kvperf_plotting(args, &svg, "pushpull --duration");
    let rows = json_lines(&out);
    assert_eq!(rows.len(), 2, "{out}");
    for r in rows {
        assert!(field(r, "iters") >= 1.0, "{r}");
    }
    if have_font() {
        // A PNG this time.
        let png = std::fs::read(&svg).unwrap();
        assert!(
            png.starts_with(b"\x89PNG\r\n\x1a\n") && png.len() > 1000,
            "{} bytes",
            png.len()
        );
    }
    let _ = std::fs::remove_file(&svg);
    if !cfg!(feature = "rdma") {
        let (code, _, err) = kvperf(&["pushpull", "--transport", "rdma", "--size", "4K"]);
        assert_ne!(code, Some(0));
        assert!(
            err.contains("no RDMA") && err.contains("--features rdma"),
            "{err}"
        );
    }
}

#[test]
fn compress_rows_are_strict_json_with_their_units() {
    let (code, out, err) = kvperf(&["compress", "--sizes", "4K:64K", "--secs", "0.02", "--json"]);
    assert_eq!(code, Some(0), "{err}");
    let rows = json_lines(&out);
    assert_eq!(rows.len(), 5, "4K, 8K, 16K, 32K, 64K: {out}");
    for r in rows {
        for f in [
            "memcpy_gbps",
            "quantize_gbps",
            "dequantize_gbps",
            "quantize_x_memcpy",
        ] {
            assert!(field(r, f) > 0.0, "{f} in {r}");
        }
    }
}

/// `--timeout` bounds each wait, not a run: a latency run (and a bandwidth one) longer than
/// it succeeds. Before, the server's wait for pings ended at the size's start plus the timeout.
#[test]
fn a_run_longer_than_its_timeout_succeeds() {
    for test in ["lat", "bw"] {
        let (code, out, err) = kvperf(&[
            test,
            "--transport",
            "shm",
            "--local",
            "--size",
            "64",
            "--duration",
            "2.5",
            "--timeout",
            "1",
            "--json",
        ]);
        assert_eq!(code, Some(0), "{test}: {err}");
        assert!(out.contains("\"size\":64"), "{test}: {out}");
    }
}
