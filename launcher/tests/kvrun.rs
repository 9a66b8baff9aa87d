//! kvrun's own behaviour: arguments, output prefixes, failure and interrupt handling.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod util;
use util::{kvrun, Bounded};

#[test]
fn bad_arguments_get_a_clear_message() {
    let out = kvrun().bounded_output().unwrap();
    assert_ne!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stderr).contains("Usage"));
    let out = kvrun().args(["-n", "0", "true"]).bounded_output().unwrap();
    assert_ne!(out.status.code(), Some(0));
    let out = kvrun()
        .args(["-n", "1", "/no/such/program"])
        .bounded_output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("cannot start") && err.contains("/no/such/program"),
        "{err}"
    );
}

#[test]
fn output_is_prefixed_and_a_failure_stops_the_job() {
    // Server processes of a non-kvstore program: they run the shell. Worker 1 fails.
    let script = r#"echo "hello from $DMLC_ROLE $KVSTORE_RANK"; if [ "$DMLC_ROLE" = worker ] && [ "$KVSTORE_RANK" = 1 ]; then exit 7; fi; sleep 30"#;
    let start = Instant::now();
    let out = kvrun()
        .args(["-n", "2", "-s", "1", "--", "/bin/sh", "-c", script])
        .bounded_output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    // Worker 1's own status, as mpirun gives it.
    assert_eq!(out.status.code(), Some(7), "{stdout}{stderr}");
    assert!(
        stdout.contains("[worker 1] hello from worker 1"),
        "{stdout}"
    );
    assert!(
        stdout.contains("[server 0] hello from server 0"),
        "{stdout}"
    );
    assert!(
        stderr.contains("first failure: worker 1") && stderr.contains("status 7"),
        "{stderr}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "the sleeping processes were stopped"
    );
}

#[test]
fn the_timeout_in_kvruns_environment_reaches_every_process() {
    let script = r#"echo "timeout $KVSTORE_TIMEOUT"; [ "$DMLC_ROLE" = worker ] || sleep 30"#;
    let out = kvrun()
        .args(["-n", "1", "-s", "1", "--", "/bin/sh", "-c", script])
        .env("KVSTORE_TIMEOUT", "7.5")
        .bounded_output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("[worker 0] timeout 7.5"), "{stdout}");
    assert!(stdout.contains("[server 0] timeout 7.5"), "{stdout}");
    // --timeout wins over the variable.
    let out = kvrun()
        .args([
            "-n",
            "1",
            "-s",
            "1",
            "--timeout",
            "9",
            "--",
            "/bin/sh",
            "-c",
            script,
        ])
        .env("KVSTORE_TIMEOUT", "7.5")
        .bounded_output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("[worker 0] timeout 9"), "{stdout}");
    // A value that is not UTF-8 is refused, as the library refuses it (before, kvrun ran the
    // job with 120 s and gave every process that instead).
    use std::os::unix::ffi::OsStrExt;
    let bad = std::ffi::OsStr::from_bytes(b"\xff");
    let out = kvrun()
        .args(["-n", "1", "--", "true"])
        .env("KVSTORE_TIMEOUT", bad)
        .bounded_output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("not a number of seconds"), "{stderr}");
    let out = kvrun()
        .args(["-n", "1", "-x", "KVRUN_TEST_BYTES", "--", "true"])
        .env("KVRUN_TEST_BYTES", bad)
        .bounded_output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("not UTF-8"), "{stderr}");
}

/// Processes whose environment holds the marker: kvrun's children and their children.
fn pids_with_marker(marker: &str) -> Vec<u32> {
    let needle = format!("KVRUN_TEST_MARKER={marker}");
    let mut pids = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) {
            if env.split(|&b| b == 0).any(|v| v == needle.as_bytes()) {
                pids.push(pid);
            }
        }
    }
    pids
}

#[test]
fn interrupt_stops_everything_and_leaves_no_orphans() {
    let marker = format!("kvrun-orphan-check-{}", std::process::id());
    // A shell with a child of its own: the grandchildren must go too.
    let script = "sleep 60; echo never";
    let mut child = kvrun()
        .env("KVRUN_TEST_MARKER", &marker)
        .args(["-n", "2", "-s", "2", "--", "/bin/sh", "-c", script])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while pids_with_marker(&marker).len() < 9 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    // kvrun, its shepherd, 4 shells and their 4 sleeps carry the marker.
    assert!(
        pids_with_marker(&marker).len() >= 9,
        "{:?}",
        pids_with_marker(&marker)
    );
    Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(130));
    let deadline = Instant::now() + Duration::from_secs(5);
    while !pids_with_marker(&marker).is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        pids_with_marker(&marker).is_empty(),
        "orphans left: {:?}",
        pids_with_marker(&marker)
    );
}

#[test]
fn killing_kvrun_itself_takes_its_children_down() {
    let marker = format!("kvrun-sigkill-check-{}", std::process::id());
    let script = "sleep 60; echo never";
    let mut child = kvrun()
        .env("KVRUN_TEST_MARKER", &marker)
        .args(["-n", "1", "-s", "1", "--", "/bin/sh", "-c", script])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while pids_with_marker(&marker).len() < 6 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        pids_with_marker(&marker).len() >= 6,
        "{:?}",
        pids_with_marker(&marker)
    );
    child.kill().unwrap();
    let _ = child.wait();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !pids_with_marker(&marker).is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(pids_with_marker(&marker).is_empty(), "orphans left");
}

/// Waits up to 5 s for the processes carrying `marker` to be gone; returns those left.
fn left_after(marker: &str) -> Vec<u32> {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !pids_with_marker(marker).is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    pids_with_marker(marker)
}

#[test]
fn what_a_failed_or_finished_process_started_does_not_outlive_the_job() {
    // Each process leaves a child behind in the background; worker 1 then fails, the others
    // wait for it to be stopped. Then a job whose every process ends well.
    for (script, code) in [
        (
            r#"sleep 60 & if [ "$DMLC_ROLE" = worker ] && [ "$KVSTORE_RANK" = 1 ]; then exit 7; fi; wait"#,
            7,
        ),
        ("sleep 60 & exit 0", 0),
    ] {
        let marker = format!("kvrun-left-check-{}-{code}", std::process::id());
        let out = kvrun()
            .env("KVRUN_TEST_MARKER", &marker)
            .args(["-n", "2", "-s", "1", "--", "/bin/sh", "-c", script])
            .bounded_output()
            .unwrap();
        assert_eq!(out.status.code(), Some(code), "{out:?}");
        assert_eq!(left_after(&marker), Vec::<u32>::new(), "left behind");
    }
}

#[test]
fn everything_after_the_program_is_the_programs() {
    // `-s 8` and `--timeout 3` after PROGRAM are its arguments ($0 and $1.. of the script),
    // not kvrun's options: one server (the default), the default timeout.
    let script = r#"echo "args $0 $* servers $DMLC_NUM_SERVER timeout $KVSTORE_TIMEOUT""#;
    let out = kvrun()
        .env_remove("KVSTORE_TIMEOUT")
        .args([
            "-n",
            "1",
            "/bin/sh",
            "-c",
            script,
            "-s",
            "8",
            "--timeout",
            "3",
        ])
        .bounded_output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("[worker 0] args -s 8 --timeout 3 servers 1 timeout 120"),
        "{stdout}"
    );
}

#[test]
fn x_cannot_set_what_kvrun_gives_every_process() {
    for var in ["KVSTORE_SECRET=s", "KVSTORE_TIMEOUT=600", "DMLC_NUM_WORKER"] {
        let out = kvrun()
            .env("DMLC_NUM_WORKER", "3")
            .args(["-n", "1", "-x", var, "--", "true"])
            .bounded_output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        let name = var.split('=').next().unwrap();
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(
            err.contains(&format!("-x {name}: kvrun sets {name} itself")),
            "{err}"
        );
    }
    // Nor set what is no name.
    for var in ["=foo", "A B=1", "X\tY=3"] {
        let out = kvrun()
            .args(["-n", "1", "-x", var, "--", "true"])
            .bounded_output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains("is not a variable's name"), "{err}");
    }
}

#[test]
fn output_bytes_pass_through_as_they_are() {
    // A line that is not UTF-8, and a last line without its newline.
    let out = kvrun()
        .args(["-n", "1", "--", "/bin/sh", "-c", r"printf 'a\377b\nend'"])
        .bounded_output()
        .unwrap();
    let want: &[u8] = b"[worker 0] a\xffb\n";
    assert!(
        out.stdout.windows(want.len()).any(|w| w == want),
        "{:?}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(
        out.stdout.ends_with(b"[worker 0] end\n") || {
            let s = String::from_utf8_lossy(&out.stdout);
            s.contains("[worker 0] end\n")
        },
        "{:?}",
        String::from_utf8_lossy(&out.stdout)
    );
    // Seconds that are not a number of seconds are refused, not a panic.
    for bad in [["--grace", "-1"], ["--progress", "inf"]] {
        let out = kvrun()
            .args(["-n", "1"])
            .args(bad)
            .arg("true")
            .bounded_output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{out:?}");
    }
}

#[test]
fn what_a_process_left_running_gets_its_grace_period_before_the_kill() {
    // Each process leaves a background child that, on SIGTERM, takes half a second to write
    // what it must (a checkpoint, say) before it exits: it gets the time, where before the
    // SIGKILL followed at once once every leader had ended.
    let dir = std::env::temp_dir().join(format!("kvrun-grace-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let script = r#"(trap 'sleep 0.5; echo done > "$MARK.$DMLC_ROLE$KVSTORE_RANK"; exit 0' TERM; while :; do sleep 0.1; done) & sleep 0.3; exit 0"#;
    let out = kvrun()
        .env("MARK", dir.join("m"))
        .args(["-n", "1", "-s", "1", "--", "/bin/sh", "-c", script])
        .bounded_output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    for who in ["worker0", "server0"] {
        let f = dir.join(format!("m.{who}"));
        assert!(f.exists(), "{who} wrote nothing: {out:?}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_redraw_goes_out_as_it_comes() {
    // The program waits (at most 30 s) for a file the test makes once it saw the redraw.
    let dir = std::env::temp_dir().join(format!("kvrun-redraw-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let go = dir.join("go");
    let script = format!(
        "printf '10%%\\r'; i=0; while [ ! -e '{}' ] && [ $i -lt 600 ]; do sleep 0.05; \
         i=$((i+1)); done; echo end",
        go.display()
    );
    let mut child = kvrun()
        .args(["-n", "1", "-s", "1", "--", "/bin/sh", "-c", &script])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        use std::io::Read;
        let mut buf = [0u8; 4096];
        while let Ok(n @ 1..) = stdout.read(&mut buf) {
            if tx.send(buf[..n].to_vec()).is_err() {
                break;
            }
        }
    });
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !String::from_utf8_lossy(&seen).contains("10%\r") {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(b) => seen.extend(b),
            Err(_) => break,
        }
    }
    let redrawn = String::from_utf8_lossy(&seen).into_owned();
    std::fs::write(&go, b"").unwrap();
    let status = child.wait().unwrap();
    reader.join().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        redrawn.contains("] 10%\r"),
        "the redraw was held back: {redrawn:?}"
    );
    assert!(!redrawn.contains("end"), "{redrawn:?}");
    assert_eq!(status.code(), Some(0));
}

#[test]
fn the_open_file_limit_is_raised_to_the_hard_one() {
    // kvrun holds pipes for each process: a low soft limit would cap the job's size.
    let out = Command::new("/bin/sh")
        .args([
            "-c",
            "hard=$(ulimit -Hn); ulimit -Sn 64 || exit 3; echo \"hard $hard\"; \
             exec \"$0\" -n 1 -s 1 -- /bin/sh -c 'echo soft $(ulimit -Sn)'",
            env!("CARGO_BIN_EXE_kvrun"),
        ])
        .bounded_output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    let hard = stdout
        .lines()
        .find_map(|l| l.strip_prefix("hard "))
        .unwrap();
    let want = if hard == "unlimited" { "1048576" } else { hard };
    assert!(
        stdout.contains(&format!("[worker 0] soft {want}")),
        "{stdout}"
    );
}

#[test]
fn ssh_logins_that_never_end_are_bounded_by_the_jobs_timeout() {
    // An "ssh" that never logs in: with 8 sessions of a host logging in at once, the 9th
    // waits, and the wait ends with the job's timeout, every session stopped.
    let dir = std::env::temp_dir().join(format!("kvrun-logins-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ssh = dir.join("ssh");
    std::fs::write(&ssh, "#!/bin/sh\nexec sleep 97\n").unwrap();
    let mut perm = std::fs::metadata(&ssh).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o755);
    std::fs::set_permissions(&ssh, perm).unwrap();
    let out = kvrun()
        .args(["--ssh", ssh.to_str().unwrap(), "--timeout", "2"])
        .args(["-H", "nohost:20", "--scheduler-host", "127.0.0.1"])
        .args(["-n", "10", "-s", "2", "--", "true"])
        .bounded_output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    // The job's timeout ended it: 1, as the help says (before, 2, as for a wrong command line).
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("8 ssh sessions to nohost were still logging in when the job's timeout"),
        "{err}"
    );
    // Every session was stopped (before, each process beyond the 8th waited 60 s, and an
    // interrupt started them all at once).
    let left = Command::new("pgrep")
        .args(["-f", "sleep 97"])
        .bounded_output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(left.trim().is_empty(), "left running: {left}");
}
