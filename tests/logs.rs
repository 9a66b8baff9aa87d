//! Logs: what a job prints at each level, with the filter in kvrun's environment
//! (`KVSTORE_LOG`, or `RUST_LOG`), which kvrun passes to every process.

mod util;

use std::process::Command;
use std::time::Duration;

/// A W=2 S=1 job of `dist_check seed`, kvrun's environment given `env`.
fn job(env: &[(&str, &str)]) -> String {
    let mut cmd = Command::new(util::bin("kvrun"));
    cmd.args(["-n", "2", "-s", "1", "--timeout", "30"])
        .arg(util::bin("examples/dist_check"))
        .args(["seed", "dist_sync"])
        .env_remove("KVSTORE_LOG")
        .env_remove("RUST_LOG");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let r = util::run_limited(&mut cmd, Duration::from_secs(90));
    util::assert_job_ok(&r, 2, "seed");
    format!("{}{}", r.stdout, r.stderr)
}

#[test]
fn info_by_default_says_roles_ranks_and_transports_once() {
    let out = job(&[]);
    for want in [
        "INFO kvstore::server: server 0 of 1: 2 workers, dist_sync",
        "INFO kvstore::scheduler: scheduler: 2 workers and 1 servers joined",
        "INFO kvstore::worker: worker 0 of 2: server 0 shm",
        "INFO kvstore::worker: worker 1 of 2: server 0 shm",
    ] {
        assert_eq!(out.matches(want).count(), 1, "{want:?} once\n{out}");
    }
    assert!(!out.contains("DEBUG"), "{out}");
}

#[test]
fn debug_adds_connections_rounds_and_calls() {
    for var in ["KVSTORE_LOG", "RUST_LOG"] {
        let out = job(&[(var, "debug")]);
        for want in [
            "DEBUG kvstore::server::peers: worker 0 connected over shm",
            "DEBUG kvstore::server::peers: worker 1 connected over shm",
            "DEBUG kvstore::server::state: key 3: round of 2 pushes complete",
            "DEBUG kvstore::worker::requests: call 1: 1 requests",
            "DEBUG kvstore::worker::requests: call 1: done",
        ] {
            assert!(out.contains(want), "{var}: {want:?}\n{out}");
        }
    }
}

#[test]
fn warn_and_module_filters_quiet_the_rest() {
    let out = job(&[("KVSTORE_LOG", "warn")]);
    assert!(!out.contains(" INFO ") && !out.contains("DEBUG"), "{out}");
    // A filter by module: the servers' connections only.
    let out = job(&[("KVSTORE_LOG", "warn,kvstore::server::peers=debug")]);
    assert!(out.contains("worker 0 connected over shm"), "{out}");
    assert!(
        !out.contains("kvstore::worker") && !out.contains("round of"),
        "{out}"
    );
    // A filter that does not parse: the default, and a warning.
    let out = job(&[("KVSTORE_LOG", "kvstore=notalevel")]);
    assert!(out.contains("does not parse"), "{out}");
    assert!(out.contains("INFO kvstore::worker: worker 0 of 2"), "{out}");
}

#[test]
fn kvrun_says_its_version_and_a_jobs_start_and_end() {
    let r = util::run_limited(
        Command::new(util::bin("kvrun")).arg("--version"),
        Duration::from_secs(30),
    );
    assert_eq!(r.code, Some(0), "{}", r.all());
    assert_eq!(
        r.stdout.trim(),
        format!("kvrun {}", env!("CARGO_PKG_VERSION")),
        "{}",
        r.all()
    );
    let out = job(&[]);
    assert!(
        out.contains("kvrun: 2 workers and 1 server of ")
            && out.contains(" on this host; scheduler at 127.0.0.1:"),
        "{out}"
    );
    assert!(
        out.contains("ended with status 0") && out.contains("kvrun: done in "),
        "{out}"
    );
}

#[test]
fn kvrun_shows_transports_and_progress_from_the_processes_reports() {
    let mut cmd = Command::new(util::bin("kvrun"));
    // A small model, many steps, and the stores kept 2.5 s after them: a job of a few
    // seconds on any machine (the workers report every second, the launcher every 0.5 s).
    cmd.args([
        "--progress",
        "0.5",
        "-x",
        "TRAIN_OUTPUTS=256",
        "-x",
        "TRAIN_STEPS=150",
        "-x",
        "TRAIN_LINGER_MS=2500",
    ])
    .args(["-n", "2", "-s", "2"])
    .arg(util::bin("examples/train"));
    let r = util::run_limited(&mut cmd, Duration::from_secs(120));
    assert_eq!(r.code, Some(0), "{}", r.all());
    let out = r.all();
    assert_eq!(
        out.matches("kvrun: transports: worker 0: server 0 shm, server 1 shm; worker 1: server 0 shm, server 1 shm")
            .count(),
        1,
        "{out}"
    );
    // A heartbeat every half second; once the workers reported, with their calls.
    assert!(out.matches("kvrun: ").count() >= 4, "{out}");
    assert!(
        out.contains(" rounds, ")
            && out.contains("GB (10^9 bytes) pushed and pulled; slowest worker "),
        "{out}"
    );
}

#[test]
fn kvrun_warns_of_a_process_that_never_took_its_role() {
    let dir = std::env::temp_dir().join(format!("kvstore-nojoin-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let script = dir.join("job.sh");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\n# Worker 1 never creates a store.\n\
             if [ \"$DMLC_ROLE\" = worker ] && [ \"$KVSTORE_RANK\" = 1 ]; then exit 0; fi\n\
             exec {} seed dist_sync\n",
            util::bin("examples/dist_check").display()
        ),
    )
    .unwrap();
    let mut perm = std::fs::metadata(&script).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o755);
    std::fs::set_permissions(&script, perm).unwrap();
    let mut cmd = Command::new(util::bin("kvrun"));
    cmd.args(["--timeout", "4", "-n", "2", "-s", "1"])
        .arg(&script);
    let r = util::run_limited(&mut cmd, Duration::from_secs(60));
    std::fs::remove_dir_all(&dir).unwrap();
    let out = r.all();
    assert_ne!(r.code, Some(0), "{out}");
    assert!(
        out.contains("kvrun: warning: worker 1 (pid ")
            && out.contains("ended without taking its role"),
        "{out}"
    );
    assert!(
        !out.contains("warning: worker 0") && !out.contains("warning: server"),
        "{out}"
    );
}

#[test]
fn kvrun_says_so_when_no_process_took_its_role() {
    // Every process ends at once, status 0, before the 300 ms a report may take: a program
    // that forgot `create` (or is no kvstore job's) is not said to be a job the scheduler saw.
    let mut cmd = Command::new(util::bin("kvrun"));
    cmd.args(["-n", "2", "-s", "1", "true"]);
    let r = util::run_limited(&mut cmd, Duration::from_secs(60));
    let out = r.all();
    assert_eq!(
        r.code,
        Some(0),
        "as mpirun, of programs that ended well: {out}"
    );
    for who in ["server 0", "worker 0", "worker 1"] {
        let line = format!("kvrun: warning: {who} (pid ");
        assert!(out.contains(&line), "{line}\n{out}");
    }
    assert!(
        out.contains("1 server and 2 workers ended with status 0; the scheduler saw no job")
            && !out.contains("the scheduler, "),
        "{out}"
    );
}

/// A `dist_check metrics` job (W=2, S=2) with `kvrun --stats FILE`; the file's text.
fn stats(format: &str) -> String {
    stats_of(format, &[])
}

/// As [`stats`], each process started through `wrapper` (a command line that ends with the
/// program's).
fn stats_of(format: &str, wrapper: &[&str]) -> String {
    let path = std::env::temp_dir().join(format!("kvstore-stats-{}-{format}", std::process::id()));
    let mut cmd = Command::new(util::bin("kvrun"));
    cmd.args(["-x", "KVSTORE_BIGARRAY_BOUND=1000", "--stats"])
        .arg(&path)
        .args(["--stats-format", format, "-n", "2", "-s", "2"])
        .args(wrapper)
        .arg(util::bin("examples/dist_check"))
        .args(["metrics", "dist_sync"]);
    let r = util::run_limited(&mut cmd, Duration::from_secs(90));
    util::assert_job_ok(&r, 2, "metrics");
    assert!(
        r.stderr.contains("kvrun: metrics written to"),
        "{}",
        r.all()
    );
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    text
}

#[test]
fn kvrun_collects_every_processs_metrics_as_json_and_prometheus() {
    let j: serde_json::Value = serde_json::from_str(&stats("json")).unwrap();
    let sum = |role: &str, f: &dyn Fn(&serde_json::Value) -> u64| -> u64 {
        j[role].as_object().unwrap().values().map(f).sum()
    };
    let per_server = |field: &'static str| {
        move |w: &serde_json::Value| -> u64 {
            w["servers"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| s[field].as_u64().unwrap())
                .sum()
        }
    };
    assert_eq!(j["workers"].as_object().unwrap().len(), 2, "{j}");
    assert_eq!(j["servers"].as_object().unwrap().len(), 2, "{j}");
    // What the workers sent is what the servers received: 5 rounds of 4 slices a worker, and
    // a push whose `Pending` was dropped (then pulls, as many as it took to count it).
    let pushes = sum("workers", &per_server("pushes"));
    assert_eq!(pushes, 2 * 6 * 4, "{j}");
    assert_eq!(
        sum("servers", &|s| s["pushes"].as_u64().unwrap()),
        pushes,
        "{j}"
    );
    let pushed = sum("workers", &per_server("bytes_pushed"));
    assert_eq!(
        sum("servers", &|s| s["bytes_in"].as_u64().unwrap()),
        pushed,
        "{j}"
    );
    assert_eq!(
        sum("servers", &|s| s["pulls"].as_u64().unwrap()),
        sum("workers", &per_server("pulls")),
        "{j}"
    );
    // Each sync round waited for its other worker once.
    assert_eq!(
        sum("servers", &|s| s["waited"].as_u64().unwrap()),
        sum("servers", &|s| s["rounds"].as_u64().unwrap()),
        "{j}"
    );
    assert!(
        j["workers"]["0"]["transports"]["shm"]["requests"]
            .as_u64()
            .unwrap()
            > 0
    );
    let prom = stats("prometheus");
    for want in [
        "kvstore_server_rounds_total{role=\"server\",rank=\"0\"} ",
        "kvstore_calls_total{role=\"worker\",rank=\"1\"} ",
        "kvstore_requests_by_transport_total{role=\"worker\",rank=\"0\",transport=\"shm\"} ",
        "kvstore_call_latency_by_server_us{role=\"worker\",rank=\"0\",server=\"1\",quantile=\"0.99\"} ",
    ] {
        assert!(prom.contains(want), "{want}\n{prom}");
    }
    for line in prom.lines() {
        let (series, value) = line.rsplit_once(' ').unwrap();
        assert!(
            series.starts_with("kvstore_") && value.parse::<u64>().is_ok(),
            "{line}"
        );
    }
}

#[test]
fn kvrun_doctor_checks_this_host_and_says_what_would_fail() {
    let doctor = |shell: &str| {
        let mut cmd = Command::new("sh");
        cmd.args(["-c", shell, "doctor"]).arg(util::bin("kvrun"));
        util::run_limited(&mut cmd, Duration::from_secs(60))
    };
    let train = util::bin("examples/train");
    let ok = doctor(&format!("exec \"$1\" doctor {}", train.display()));
    assert_eq!(ok.code, Some(0), "{}", ok.all());
    for want in [
        "ok localhost: reachable",
        "is there and executable",
        "pair localhost - localhost: shm (the same host: shared memory)",
        "kvrun doctor: no problem found",
    ] {
        assert!(ok.stdout.contains(want), "{want}\n{}", ok.all());
    }
    // A bare name is looked up on the PATH, as the job's processes find it.
    let bare = doctor("exec \"$1\" doctor sh");
    assert!(
        bare.stdout
            .contains("ok localhost: sh is there and executable"),
        "{}",
        bare.all()
    );
    // A missing program, an unreachable host and a low memlock limit.
    let bad = doctor(
        "ulimit -l 64; exec \"$1\" doctor -H localhost,nohost.invalid \
         --ssh 'ssh -o BatchMode=yes -o ConnectTimeout=2' /no/such/program",
    );
    assert_eq!(bad.code, Some(1), "{}", bad.all());
    for want in [
        "FAIL localhost: /no/such/program is missing or not executable there; fix:",
        "FAIL nohost.invalid: not reachable over ssh",
        "localhost: memlock limit 64 KiB",
        "kvrun doctor: 2 problem(s)",
    ] {
        assert!(bad.stdout.contains(want), "{want}\n{}", bad.all());
    }
    // Its stdout read by nobody (`| head -1`): every host is checked all the same, and the
    // status says so (before, the first line written after the reader left panicked, 101).
    let unread = doctor(
        "(\"$1\" doctor -H localhost,nohost.invalid --ssh 'ssh -o BatchMode=yes \
         -o ConnectTimeout=2' /no/such/program; echo \"doctor-status=$?\" >&2) | true",
    );
    assert!(
        unread.stderr.contains("doctor-status=1"),
        "{}",
        unread.all()
    );
    assert!(!unread.stderr.contains("panicked"), "{}", unread.all());
}

/// A `--stats` file that cannot be written is refused before the job starts (before, the
/// job ran and its metrics were lost at the end).
#[test]
fn kvrun_refuses_a_stats_file_it_cannot_write_before_the_job() {
    let mut cmd = Command::new(util::bin("kvrun"));
    cmd.args(["--stats", "/no/such/dir/stats.json", "-n", "1", "-s", "1"])
        .arg(util::bin("examples/train"));
    let r = util::run_limited(&mut cmd, Duration::from_secs(60));
    assert_eq!(r.code, Some(2), "{}", r.all());
    assert!(
        r.stderr
            .contains("--stats /no/such/dir/stats.json: No such file or directory"),
        "{}",
        r.all()
    );
    assert!(
        !r.stderr.contains("scheduler at"),
        "the job started: {}",
        r.all()
    );
    // A job that fails before it starts leaves no empty file where there was none.
    let path = std::env::temp_dir().join(format!("kvstore-stats-none-{}", std::process::id()));
    let mut cmd = Command::new(util::bin("kvrun"));
    cmd.arg("--stats")
        .arg(&path)
        .args(["--hostfile", "/no/such/hostfile", "-n", "1", "-s", "1"])
        .arg(util::bin("examples/train"));
    let r = util::run_limited(&mut cmd, Duration::from_secs(60));
    assert_eq!(r.code, Some(2), "{}", r.all());
    assert!(!path.exists(), "{}", r.all());
}

/// A program path that is not UTF-8 is checked as any other (before, kvrun stopped on it).
#[test]
fn kvrun_doctor_takes_a_program_path_that_is_not_utf8() {
    use std::os::unix::ffi::OsStrExt;
    let dir = std::env::temp_dir().join(std::ffi::OsStr::from_bytes(b"kvstore-\xff-doctor"));
    let mut cmd = Command::new(util::bin("kvrun"));
    cmd.arg("doctor").arg(dir.join("train"));
    let r = util::run_limited(&mut cmd, Duration::from_secs(60));
    assert_eq!(r.code, Some(1), "{}", r.all());
    assert!(
        r.stdout.contains("is missing or not executable there"),
        "{}",
        r.all()
    );
}

#[test]
fn kvrun_doctor_names_each_rdma_port_its_gid_and_mtu() {
    // A sysfs tree of one soft-RoCE port: a link-local RoCE v1 GID, a usable RoCE v1 one,
    // then RoCE v2 ones at 2 and 10. The first v2 is 2 (a glob lists 10 before 2; before,
    // that picked 10).
    let root = std::env::temp_dir().join(format!("kvstore-sysfs-{}", std::process::id()));
    let port = root.join("class/infiniband/rxe0/ports/1");
    let files = [
        ("state", "4: ACTIVE"),
        ("link_layer", "Ethernet"),
        ("gids/0", "fe80:0000:0000:0000:5054:00ff:fe12:3456"),
        ("gid_attrs/types/0", "IB/RoCE v1"),
        ("gids/1", "0000:0000:0000:0000:0000:ffff:0a00:020e"),
        ("gid_attrs/types/1", "IB/RoCE v1"),
        ("gid_attrs/ndevs/1", "eth9"),
        ("gids/2", "0000:0000:0000:0000:0000:ffff:0a00:020f"),
        ("gid_attrs/types/2", "RoCE v2"),
        ("gid_attrs/ndevs/2", "eth9"),
        ("gids/10", "0000:0000:0000:0000:0000:ffff:0a00:0210"),
        ("gid_attrs/types/10", "RoCE v2"),
        ("gid_attrs/ndevs/10", "eth9"),
    ];
    for (f, text) in files {
        let p = port.join(f);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, format!("{text}\n")).unwrap();
    }
    std::fs::create_dir_all(root.join("class/net/eth9")).unwrap();
    std::fs::write(root.join("class/net/eth9/mtu"), "1500\n").unwrap();
    // And Yama at 1, which allows cross-memory writes to descendants only (a job's processes
    // are siblings) and to root.
    let yama = root.join("proc/sys/kernel/yama");
    std::fs::create_dir_all(&yama).unwrap();
    std::fs::write(yama.join("ptrace_scope"), "1\n").unwrap();
    let r = util::run_limited(
        Command::new(util::bin("kvrun"))
            .args(["doctor"])
            .arg(util::bin("kvrun"))
            .env("KVRUN_SYSFS", &root)
            .env("KVRUN_PROC", root.join("proc")),
        Duration::from_secs(60),
    );
    std::fs::remove_dir_all(&root).unwrap();
    assert_eq!(r.code, Some(0), "{}", r.all());
    let want = "ok localhost: RDMA rxe0 port 1: ACTIVE, Ethernet, GID 2 \
                0000:0000:0000:0000:0000:ffff:0a00:020f (RoCE v2), MTU 1500";
    assert!(r.stdout.contains(want), "{}", r.all());
    let uid = Command::new("id").arg("-u").output().unwrap().stdout;
    let yama = match String::from_utf8_lossy(&uid).trim() {
        "0" => "ok localhost: cross-memory writes allowed to root (ptrace_scope 1)",
        _ => "note localhost: kernel.yama.ptrace_scope is 1: cross-memory writes between a job's",
    };
    assert!(r.stdout.contains(yama), "{}", r.all());
}

/// A stranger holding more idle connections to kvrun's report address than it serves at
/// once (here worker 0's shell, which opens 40 before the job's processes report): the
/// oldest unproven gives its place to each new one, so every process's report arrives.
/// Before, the newest was dropped: kvrun warned that every process ended without taking its
/// role, and the statistics were empty.
#[test]
fn idle_connections_to_kvruns_report_address_do_not_keep_the_reports_out() {
    let script = r#"if [ "$DMLC_ROLE" = worker ] && [ "$KVSTORE_RANK" = 0 ]; then
        for i in $(seq 11 50); do
            eval "exec $i<>/dev/tcp/${KVSTORE_REPORT%:*}/${KVSTORE_REPORT##*:}"
        done
    fi
    sleep 1
    exec "$0" "$@""#;
    let j: serde_json::Value =
        serde_json::from_str(&stats_of("json", &["/bin/bash", "-c", script])).unwrap();
    assert_eq!(j["workers"].as_object().unwrap().len(), 2, "{j}");
    assert_eq!(j["servers"].as_object().unwrap().len(), 2, "{j}");
}
