//! The distributed store with real processes over loopback TCP: every value checked exactly,
//! both sync modes, W and S in {1, 2, 3}, and the faults.

mod util;

use std::time::Duration;

use util::{assert_job_ok, finish, ManualJob};

/// Every job runs over each transport between workers and servers on this host.
const TRANSPORTS: [&str; 2] = ["tcp", "shm"];

/// `util::kvrun_check` once per transport; returns the runs.
fn kvrun_check(w: u32, s: u32, scenario: &str, kind: &str, env: &[(&str, &str)]) -> Vec<util::Run> {
    TRANSPORTS
        .iter()
        .map(|t| {
            let mut e = env.to_vec();
            e.push(("KVSTORE_TRANSPORT", t));
            let r = util::kvrun_check(w, s, scenario, kind, &e);
            let via = format!("via {t}");
            let pairs: Vec<&str> = r
                .stdout
                .lines()
                .filter(|l| l.contains("reaches server"))
                .collect();
            // Every worker says how it reaches every server before its scenario starts, so a
            // job that then fails said it too: the transport under test was used.
            let said = pairs.len() == (w * s) as usize;
            assert!(
                said && pairs.iter().all(|l| l.ends_with(&via)),
                "{t} was not used\n{}",
                r.all()
            );
            r
        })
        .collect()
}

fn assert_jobs_ok(runs: &[util::Run], w: u32, scenario: &str) {
    for r in runs {
        assert_job_ok(r, w, scenario);
    }
}

#[test]
fn tutorial_values_dist_sync_every_shape_of_job() {
    for w in 1..=3 {
        for s in 1..=3 {
            let r = kvrun_check(w, s, "seed", "dist_sync", &[]);
            assert_jobs_ok(&r, w, "seed");
        }
    }
}

#[test]
fn a_call_that_waits_long_finishes_its_wait_in_the_slow_wait_wrapper() {
    let r = kvrun_check(2, 1, "slow_wait", "dist_sync", &[]);
    assert_jobs_ok(&r, 2, "slow_wait");
}

#[test]
fn big_tensors_are_sliced_over_servers_and_reassembled() {
    for (w, s) in [(1, 2), (2, 3), (3, 2), (2, 1)] {
        let r = kvrun_check(
            w,
            s,
            "big",
            "dist_sync",
            &[("KVSTORE_BIGARRAY_BOUND", "100")],
        );
        assert_jobs_ok(&r, w, "big");
    }
    // With MXNet's default bound the same program keeps the tensors whole.
    let r = kvrun_check(2, 2, "big", "dist_sync", &[]);
    assert_jobs_ok(&r, 2, "big");
}

#[test]
fn server_optimizers_match_a_local_reference() {
    for (w, s) in [(1, 1), (2, 2), (3, 3)] {
        let r = kvrun_check(
            w,
            s,
            "optimizers",
            "dist_sync",
            &[("KVSTORE_BIGARRAY_BOUND", "100")],
        );
        assert_jobs_ok(&r, w, "optimizers");
    }
}

#[test]
fn the_servers_optimizer_state_is_saved_and_loaded_by_a_worker() {
    for t in TRANSPORTS {
        for (w, s) in [(1, 1), (2, 2)] {
            let env = [("KVSTORE_BIGARRAY_BOUND", "100"), ("KVSTORE_TRANSPORT", t)];
            let r = kvrun_check(w, s, "states", "dist_sync", &env);
            assert_jobs_ok(&r, w, "states");
            for r in &r {
                assert!(r.stdout.contains("refused truncated states"), "{}", r.all());
                assert!(r.stdout.contains("refused another layout"), "{}", r.all());
                assert!(r.stdout.contains("states reloaded exactly"), "{}", r.all());
            }
        }
    }
}

#[test]
fn metrics_count_every_push_pull_and_byte_and_the_placement_prints() {
    for t in TRANSPORTS {
        for (w, s) in [(1, 1), (2, 2), (3, 2)] {
            let env = [("KVSTORE_BIGARRAY_BOUND", "1000"), ("KVSTORE_TRANSPORT", t)];
            let r = kvrun_check(w, s, "metrics", "dist_sync", &env);
            assert_jobs_ok(&r, w, "metrics");
        }
    }
}

#[test]
fn registered_updaters_run_on_the_servers_in_both_modes() {
    for kind in ["dist_sync", "dist_async"] {
        for (w, s) in [(1, 1), (3, 2)] {
            let r = kvrun_check(w, s, "custom", kind, &[]);
            assert_jobs_ok(&r, w, "custom");
        }
    }
}

#[test]
fn an_updater_registered_after_create_is_refused_on_every_rank() {
    for r in kvrun_check(3, 2, "late_updater", "dist_sync", &[]) {
        assert_job_ok(&r, 3, "late_updater");
        assert_eq!(
            r.stdout.matches("late updater refused").count(),
            3,
            "{}",
            r.all()
        );
    }
}

#[test]
fn a_worker_that_exits_0_after_its_last_call_ends_cleanly() {
    // Worker 1 ends with std::process::exit(0) (no destructor runs): the others' calls that
    // do not wait on it go on, and the job succeeds.
    for r in kvrun_check(3, 2, "exit0", "dist_sync", &[]) {
        assert_job_ok(&r, 3, "exit0");
    }
}

#[test]
fn a_round_that_waits_on_a_departed_worker_fails_at_once_naming_it() {
    // Worker 1 exits 0 without pushing a key the others push: their push fails at once (the
    // job's timeout is 30 s), naming worker 1, and kvrun exits non-zero.
    for r in kvrun_check(3, 2, "leave_early", "dist_sync", &[]) {
        assert_ne!(r.code, Some(0), "{}", r.all());
        for w in [0, 2] {
            let line = format!("[worker {w}] push failed after");
            assert!(r.stdout.contains(&line), "{}", r.all());
        }
        assert!(
            r.stdout.contains("cannot complete: worker 1 left the job"),
            "{}",
            r.all()
        );
        assert!(r.elapsed < Duration::from_secs(15), "took {:?}", r.elapsed);
    }
}

#[test]
fn a_round_held_in_the_pages_of_a_worker_that_left_fails_and_sums_none_of_them() {
    // Worker 0's push from its kv.alloc pages times out (2 s) waiting on worker 1; worker 0
    // leaves and writes NaN into those pages; then worker 1 pushes and pulls. Over shared
    // memory the server held that push in worker 0's pages: the round fails at its goodbye
    // and the stored value stays. Over TCP the push was copied whole and the round completes
    // with it (checked by the scenario).
    for t in TRANSPORTS {
        let env = [("KVSTORE_TRANSPORT", t)];
        let r = util::kvrun_check_timeout(2, 1, "leave_held", "dist_sync", &env, 2);
        assert!(r.stdout.contains(&format!("via {t}")), "{}", r.all());
        assert_eq!(r.code, Some(0), "{}", r.all());
        assert!(
            r.stdout.contains("[worker 1] leave_held ok rank 1 of 2"),
            "{}",
            r.all()
        );
        assert!(
            r.stdout.contains("worker 0 left and wrote NaN"),
            "{}",
            r.all()
        );
    }
}

#[test]
fn a_barrier_without_a_finished_worker_fails_at_once_naming_it() {
    for r in kvrun_check(3, 1, "skip_barrier", "dist_sync", &[]) {
        assert_ne!(r.code, Some(0), "{}", r.all());
        for w in [0, 2] {
            let line = format!("[worker {w}] barrier failed after");
            assert!(r.stdout.contains(&line), "{}", r.all());
        }
        assert!(r.elapsed < Duration::from_secs(15), "took {:?}", r.elapsed);
    }
}

#[test]
fn dist_async_applies_every_push_every_shape_of_job() {
    for w in 1..=3 {
        for s in 1..=3 {
            let r = kvrun_check(
                w,
                s,
                "async",
                "dist_async",
                &[("KVSTORE_BIGARRAY_BOUND", "4")],
            );
            assert_jobs_ok(&r, w, "async");
        }
    }
}

#[test]
fn compressed_pushes_send_what_mxnets_rule_sends_sync_and_async() {
    // Key 1 cut into slices that are no multiple of 16 elements, and kept whole.
    for (w, s, bound) in [(1, 1, "100"), (2, 3, "100"), (3, 2, "1000000")] {
        let env = [("KVSTORE_BIGARRAY_BOUND", bound)];
        let r = kvrun_check(w, s, "compress", "dist_sync", &env);
        assert_jobs_ok(&r, w, "compress");
    }
    let env = [("KVSTORE_BIGARRAY_BOUND", "100")];
    let r = kvrun_check(3, 2, "compress_async", "dist_async", &env);
    assert_jobs_ok(&r, 3, "compress_async");
}

#[test]
fn several_calls_in_flight_every_transport() {
    for (w, s) in [(1, 1), (2, 2), (3, 2)] {
        let r = kvrun_check(
            w,
            s,
            "inflight",
            "dist_sync",
            &[("KVSTORE_BIGARRAY_BOUND", "100")],
        );
        assert_jobs_ok(&r, w, "inflight");
    }
}

#[test]
fn bad_input_is_refused_and_changes_nothing() {
    for kind in ["dist_sync", "dist_async"] {
        for r in kvrun_check(2, 2, "errors", kind, &[]) {
            assert_job_ok(&r, 2, "errors");
            for what in [
                "wrong shape",
                "wrong dtype",
                "unknown key",
                "double init",
                "pull wrong shape",
                "push of another init shape",
                "pull of another init shape",
            ] {
                assert!(
                    r.stdout.contains(&format!("refused {what}")),
                    "{what}\n{}",
                    r.all()
                );
            }
        }
    }
}

#[test]
fn malformed_connections_are_closed_and_the_server_serves_on() {
    for r in kvrun_check(2, 2, "garbage", "dist_sync", &[]) {
        assert_job_ok(&r, 2, "garbage");
        assert!(
            r.stdout.contains("every malformed connection was closed"),
            "{}",
            r.all()
        );
    }
}

#[test]
fn a_killed_worker_stops_the_job_with_a_clear_error() {
    for r in kvrun_check(3, 2, "die", "dist_sync", &[]) {
        // Worker 1's own status: it aborted itself (SIGABRT, 128 + 6).
        assert_eq!(r.code, Some(134), "{}", r.all());
        assert!(r.stderr.contains("kvrun: "), "{}", r.all());
        // kvrun names the first failure first (worker 1 aborted itself: SIGABRT), before the
        // processes that stopped because of it.
        assert!(
            r.stderr.contains("first failure: worker 1 (pid") && r.stderr.contains("SIGABRT"),
            "the message names the dead worker first\n{}",
            r.all()
        );
        // The survivors say the job was aborted because of it.
        for w in [0, 2] {
            let line = format!("[worker {w}] worker {w} stopped: job aborted: worker 1 was lost");
            assert!(r.stdout.contains(&line), "{}", r.all());
        }
        assert!(r.elapsed < Duration::from_secs(30), "took {:?}", r.elapsed);
    }
}

#[test]
fn a_killed_worker_without_kvrun_fails_the_others_and_the_servers() {
    for t in TRANSPORTS {
        killed_worker(t);
    }
}

fn killed_worker(t: &str) {
    let t0 = std::time::Instant::now();
    util::killed_worker(&[("KVSTORE_TIMEOUT", "30"), ("KVSTORE_TRANSPORT", t)]);
    // Found by the link's end, well before the calls' timeout of 30 s.
    assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
}

#[test]
fn a_killed_server_makes_pending_calls_fail_with_peer_lost() {
    for t in TRANSPORTS {
        killed_server(t);
    }
}

#[test]
fn a_stopped_server_is_found_by_its_silence_and_named() {
    // SIGSTOP keeps a server's connections open and its kernel answering: only its silence
    // shows. With a timeout of 20 s a heartbeat is due every 2.5 s and the liveness bound is
    // 7.5 s: the workers fail well before the calls' own timeout, naming the server.
    for t in ["tcp", "shm"] {
        let env = [("KVSTORE_TIMEOUT", "20"), ("KVSTORE_TRANSPORT", t)];
        let mut job = ManualJob::start(2, 2, &["until_error", "dist_sync"], &env);
        let mut w0 = job.workers.remove(0);
        let lines = ManualJob::lines(&mut w0);
        ManualJob::wait_for(&lines, "ready", Duration::from_secs(30));
        let stopped = job.servers[1].id();
        let signal = |sig: &str| {
            let ok = std::process::Command::new("kill")
                .args([sig, &stopped.to_string()])
                .status()
                .is_ok_and(|s| s.success());
            assert!(ok, "kill {sig} {stopped}");
        };
        signal("-STOP");
        let start = std::time::Instant::now();
        let (code, err) = finish(w0, Duration::from_secs(40));
        let took = start.elapsed();
        let mut got = Vec::new();
        while let Ok(l) = lines.recv_timeout(Duration::from_secs(5)) {
            got.push(l);
        }
        let out = format!("{}\n{err}", got.join("\n"));
        signal("-CONT");
        assert_eq!(code, Some(5), "{t}: {out}");
        assert!(
            out.contains("server 1 was lost (no heartbeat"),
            "{t}: the error names the stopped server\n{out}"
        );
        assert!(took < Duration::from_secs(15), "{t}: took {took:?}\n{out}");
        job.kill_all();
    }
}

fn killed_server(t: &str) {
    let env = [("KVSTORE_TIMEOUT", "30"), ("KVSTORE_TRANSPORT", t)];
    let mut job = ManualJob::start(2, 2, &["until_error", "dist_sync"], &env);
    let mut w0 = job.workers.remove(0);
    let lines = ManualJob::lines(&mut w0);
    ManualJob::wait_for(&lines, "ready", Duration::from_secs(30));
    job.servers[0].kill().unwrap();
    let _ = job.servers[0].wait();
    let (code, err) = finish(w0, Duration::from_secs(40));
    // Every line, up to the end of the stream.
    let mut got = Vec::new();
    while let Ok(l) = lines.recv_timeout(Duration::from_secs(10)) {
        got.push(l);
    }
    let out = format!("{}\n{err}", got.join("\n"));
    assert_eq!(code, Some(5), "{out}");
    assert!(
        out.contains("error kind PeerLost") || out.contains("error kind Aborted"),
        "{out}"
    );
    assert!(out.contains("later call refused"), "{out}");
    job.kill_all();
}

#[test]
fn every_wait_has_a_timeout() {
    for t in TRANSPORTS {
        let r =
            util::kvrun_check_timeout(2, 1, "stall", "dist_sync", &[("KVSTORE_TRANSPORT", t)], 3);
        // The stalled round must end in a Timeout error after --timeout 3, not hang.
        assert_ne!(r.code, Some(0), "{}", r.all());
        assert!(r.stdout.contains("timed out as configured"), "{}", r.all());
    }
}

#[test]
fn a_late_answer_never_lands_in_memory_a_failed_call_gave_back() {
    for t in TRANSPORTS {
        let r =
            util::kvrun_check_timeout(2, 1, "late", "dist_sync", &[("KVSTORE_TRANSPORT", t)], 2);
        assert!(
            r.stdout.contains("timed out as configured"),
            "{t}\n{}",
            r.all()
        );
        assert!(r.stdout.contains("late round done"), "{t}\n{}", r.all());
        assert!(
            r.stdout.contains("no late write landed"),
            "{t}\n{}",
            r.all()
        );
        assert_eq!(r.code, Some(0), "{t}\n{}", r.all());
    }
}

#[test]
fn the_main_job_reaches_the_known_answer() {
    let mut cmd = std::process::Command::new(util::bin("kvrun"));
    cmd.args([
        "-n",
        "4",
        "-s",
        "2",
        "-x",
        "TRAIN_OUTPUTS=4096",
        "-x",
        "KVSTORE_BIGARRAY_BOUND=10000",
    ])
    .arg(util::bin("examples/train"));
    // Only a hang is caught here, not slowness: a debug build on a busy 2-core host (this
    // file's other jobs beside it) took more than 120 s for the 40 steps, 76 s alone.
    let r = util::run_limited(&mut cmd, Duration::from_secs(300));
    assert_eq!(r.code, Some(0), "{}", r.all());
    for rank in 0..4 {
        assert!(
            r.stdout
                .contains(&format!("[worker {rank}] reached the known answer")),
            "{}",
            r.all()
        );
    }
    assert!(r.stdout.contains("[worker 0] step  40/40"), "{}", r.all());
}

#[test]
fn shared_memory_copies_are_counted_and_nothing_is_left_in_dev_shm() {
    let list = || -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir("/dev/shm")
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    };
    let before = list();
    for (w, s) in [(1, 1), (2, 1), (3, 2)] {
        // Over shm: 0 copies to push a kv.alloc array, 1 otherwise; over tcp: none counted.
        let runs = kvrun_check(w, s, "zerocopy", "dist_sync", &[]);
        assert_jobs_ok(&runs, w, "zerocopy");
        assert!(
            runs[1].stdout.contains("push alloc (0, 0)"),
            "{}",
            runs[1].all()
        );
    }
    assert_eq!(
        list(),
        before,
        "segments are anonymous (memfd): nothing may stay under /dev/shm"
    );
}

#[test]
fn pushes_after_the_first_are_put_into_receive_slots_within_the_budget() {
    for (w, s) in [(1, 1), (2, 2), (3, 2)] {
        let env = [("KVSTORE_BIGARRAY_BOUND", "1000")];
        let runs = kvrun_check(w, s, "slots", "dist_sync", &env);
        assert_jobs_ok(&runs, w, "slots");
        // No room for slots: every push is a message, and every value is still right.
        let env = [
            ("KVSTORE_BIGARRAY_BOUND", "1000"),
            ("KVSTORE_SLOT_BYTES", "0"),
        ];
        let runs = kvrun_check(w, s, "slots", "dist_sync", &env);
        assert_jobs_ok(&runs, w, "slots");
    }
    // Room for one buffer: the small key's (400 bytes), which the servers' pool credits to
    // one worker a round (whichever worker's answer takes it first); the big key's slices
    // (10000 bytes) never fit. So the job puts 3 pushes in all (and, over TCP, the kv.alloc
    // push too), however many workers there are.
    let env = [
        ("KVSTORE_BIGARRAY_BOUND", "1000"),
        ("KVSTORE_SLOT_BYTES", "400"),
    ];
    for (t, runs) in TRANSPORTS
        .iter()
        .zip(kvrun_check(2, 2, "slots", "dist_sync", &env))
    {
        assert_job_ok(&runs, 2, "slots");
        let total: u64 = runs
            .stdout
            .lines()
            .filter_map(|l| l.split("slot puts ").nth(1))
            .flat_map(|c| c.split(" + ").map(|n| n.trim().parse::<u64>().unwrap()))
            .sum();
        let want = if *t == "tcp" { 4 } else { 3 };
        assert_eq!(total, want, "over {t}\n{}", runs.all());
    }
}

#[test]
fn many_small_keys_go_in_batches_and_every_value_is_exact() {
    for (w, s) in [(1, 1), (2, 2), (3, 2)] {
        // Keys over 1000 elements are sliced: batches mix whole keys and slices.
        let env = [("KVSTORE_BIGARRAY_BOUND", "1000")];
        let runs = kvrun_check(w, s, "batches", "dist_sync", &env);
        assert_jobs_ok(&runs, w, "batches");
    }
}

#[test]
fn kvrun_host_names_the_address_every_process_is_told_ipv6_too() {
    // `--host ::1`: the scheduler listens on IPv6 loopback, and the processes are told that
    // address (and reach the servers on it), over TCP and shared memory alike.
    if std::net::TcpListener::bind("[::1]:0").is_err() {
        return util::skip("this host has no IPv6 loopback");
    }
    for t in TRANSPORTS {
        let mut cmd = std::process::Command::new(util::bin("kvrun"));
        cmd.args(["--host", "::1", "-n", "2", "-s", "2", "--timeout", "30"])
            .args(["-x", &format!("KVSTORE_TRANSPORT={t}")])
            .arg(util::bin("examples/dist_check"))
            .args(["seed", "dist_sync"]);
        let r = util::run_limited(&mut cmd, Duration::from_secs(90));
        assert_job_ok(&r, 2, "seed");
        assert!(r.stderr.contains("scheduler at [::1]:"), "{}", r.all());
        for w in 0..2 {
            for s in 0..2 {
                let line = format!("rank {w} reaches server {s} at [::1]:");
                assert!(
                    r.stdout
                        .lines()
                        .any(|l| l.contains(&line) && l.ends_with(&format!("via {t}"))),
                    "{line}\n{}",
                    r.all()
                );
            }
        }
    }
}

#[test]
fn dmlc_interface_names_the_address_servers_are_reached_at() {
    // The scheduler on IPv6 loopback: a server would tell workers ::1, the address it reaches
    // the scheduler from, but `DMLC_INTERFACE=lo` names lo's IPv4 address, as ps-lite takes it.
    if std::net::TcpListener::bind("[::1]:0").is_err() {
        return util::skip("this host has no IPv6 loopback");
    }
    let job = |interface: &str| {
        let mut cmd = std::process::Command::new(util::bin("kvrun"));
        cmd.args(["--host", "::1", "-n", "1", "-s", "2", "--timeout", "30"])
            .args(["-x", &format!("DMLC_INTERFACE={interface}")])
            .arg(util::bin("examples/dist_check"))
            .args(["seed", "dist_sync"]);
        util::run_limited(&mut cmd, Duration::from_secs(90))
    };
    let r = job("lo");
    assert_job_ok(&r, 1, "seed");
    for s in 0..2 {
        let line = format!("rank 0 reaches server {s} at 127.0.0.1:");
        assert!(
            r.stdout.lines().any(|l| l.contains(&line)),
            "{line}\n{}",
            r.all()
        );
    }
    // An interface this host lacks ends the job, the server saying which and why.
    let r = job("nosuch0");
    assert_ne!(r.code, Some(0), "{}", r.all());
    assert!(
        r.all()
            .contains("DMLC_INTERFACE=\"nosuch0\": no such interface"),
        "{}",
        r.all()
    );
}
