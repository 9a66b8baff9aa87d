//! The distributed store over RDMA verbs (feature `rdma`), with real processes: values exact in
//! both sync modes for several W and S, the faults (a killed worker, a killed server, the port
//! going down), and what a host without a device does. `tests/softroce/rdma-suite.sh` runs
//! the tests that need a device in a VM with soft-RoCE (rxe0), and
//! `rdma_forced_without_a_device_is_an_error_naming_the_reason` on a host without one.
#![cfg(feature = "rdma")]

mod util;

use std::time::{Duration, Instant};

use util::{assert_job_ok, finish, ManualJob};

/// RDMA forced for every pair (the VM is one host: rxe takes its loopback path).
const RDMA: (&str, &str) = ("KVSTORE_TRANSPORT", "rdma");

/// Fails unless this host has an RDMA device: these tests are meant for the soft-RoCE VM.
fn need_device() {
    match kvstore_transport::rdma::devices() {
        Ok(d) if !d.is_empty() => {}
        other => panic!("no RDMA device here ({other:?}): run tests/softroce/rdma-suite.sh"),
    }
}

/// A `dist_check` job over RDMA; asserts it succeeded and every pair used RDMA.
fn job(w: u32, s: u32, scenario: &str, kind: &str, env: &[(&str, &str)]) -> util::Run {
    need_device();
    let mut e = env.to_vec();
    e.push(RDMA);
    let r = util::kvrun_check_timeout(w, s, scenario, kind, &e, 60);
    assert_job_ok(&r, w, scenario);
    let pairs: Vec<&str> = r
        .stdout
        .lines()
        .filter(|l| l.contains("reaches server"))
        .collect();
    assert_eq!(pairs.len() as u32, w * s, "{}", r.all());
    assert!(
        pairs.iter().all(|l| l.ends_with("via rdma")),
        "every pair over rdma\n{}",
        r.all()
    );
    r
}

#[test]
fn rdma_tutorial_values_dist_sync() {
    for (w, s) in [(1, 1), (2, 2), (3, 2)] {
        job(w, s, "seed", "dist_sync", &[]);
    }
}

#[test]
fn rdma_dist_async_applies_every_push() {
    for (w, s) in [(1, 2), (2, 2)] {
        job(
            w,
            s,
            "async",
            "dist_async",
            &[("KVSTORE_BIGARRAY_BOUND", "4")],
        );
    }
}

#[test]
fn rdma_big_tensors_are_sliced_and_reassembled() {
    // Slices of 100 elements over 3 servers; the tensors stay well under 1 MiB.
    job(
        2,
        3,
        "big",
        "dist_sync",
        &[("KVSTORE_BIGARRAY_BOUND", "100")],
    );
}

#[test]
fn rdma_compressed_pushes_sync_and_async() {
    let bound = [("KVSTORE_BIGARRAY_BOUND", "100")];
    job(2, 3, "compress", "dist_sync", &bound);
    job(2, 2, "compress_async", "dist_async", &bound);
}

#[test]
fn rdma_calls_in_flight_slots_and_batches() {
    let bound = [("KVSTORE_BIGARRAY_BOUND", "1000")];
    job(2, 2, "inflight", "dist_sync", &bound);
    job(2, 2, "slots", "dist_sync", &bound);
    job(2, 2, "batches", "dist_sync", &bound);
}

/// Puts that fill their grant go as eager SENDs (8 KiB or less) or WRITEs and a notice
/// (`KVSTORE_RDMA_WRITE_IMM=0`), not as one WRITE_WITH_IMM: the same values, small and
/// sliced, with calls in flight and receive slots.
#[test]
fn rdma_puts_without_write_with_imm_carry_the_same_values() {
    let e = [
        ("KVSTORE_RDMA_WRITE_IMM", "0"),
        ("KVSTORE_BIGARRAY_BOUND", "1000"),
    ];
    job(2, 2, "seed", "dist_sync", &e);
    job(2, 3, "big", "dist_sync", &e);
    job(2, 2, "slots", "dist_sync", &e);
    job(2, 2, "inflight", "dist_sync", &e);
}

/// Receiver-not-ready NAKs the devices sent and received (rxe's `send_rnr_err` and
/// `rcvd_rnr_err` counters), summed over every device and port.
fn rnr_naks() -> u64 {
    let mut total = 0;
    let mut found = 0;
    for dev in std::fs::read_dir("/sys/class/infiniband").expect("no /sys/class/infiniband") {
        let ports = dev.expect("a device").path().join("ports");
        for port in std::fs::read_dir(ports).expect("no ports") {
            let c = port.expect("a port").path().join("hw_counters");
            for name in ["send_rnr_err", "rcvd_rnr_err"] {
                if let Ok(v) = std::fs::read_to_string(c.join(name)) {
                    total += v.trim().parse::<u64>().expect("a count");
                    found += 1;
                }
            }
        }
    }
    assert!(found > 0, "this device has no RNR counters");
    total
}

#[test]
fn rdma_receive_credits_mean_no_receiver_not_ready_naks() {
    // Every push, pull, reply and WRITE_WITH_IMM takes a receive from a shared queue; a
    // sender uses only the buffers it was credited, so no receiver is ever found not ready.
    need_device();
    let before = rnr_naks();
    let bound = [("KVSTORE_BIGARRAY_BOUND", "1000")];
    job(3, 2, "batches", "dist_sync", &bound);
    job(2, 2, "inflight", "dist_sync", &bound);
    job(
        2,
        2,
        "async",
        "dist_async",
        &[("KVSTORE_BIGARRAY_BOUND", "4")],
    );
    assert_eq!(rnr_naks(), before, "receiver-not-ready NAKs were drawn");
}

#[test]
fn rdma_optimizers_and_registered_updaters() {
    job(
        2,
        2,
        "optimizers",
        "dist_sync",
        &[("KVSTORE_BIGARRAY_BOUND", "100")],
    );
    job(2, 2, "custom", "dist_async", &[]);
}

#[test]
fn rdma_bad_input_is_refused_and_changes_nothing() {
    let r = job(2, 2, "errors", "dist_sync", &[]);
    assert!(r.stdout.contains("refused unknown key"), "{}", r.all());
}

#[test]
fn rdma_a_late_answer_never_lands_in_memory_a_failed_call_gave_back() {
    need_device();
    // The job's timeout is what a call waits before it fails; 6 s, as the processes' start
    // in the emulated VM can take most of 3 (it did once, with its host loaded).
    let r = util::kvrun_check_timeout(2, 1, "late", "dist_sync", &[RDMA], 6);
    for want in [
        "timed out as configured",
        "late round done",
        "no late write landed",
    ] {
        assert!(r.stdout.contains(want), "{want}\n{}", r.all());
    }
    assert_eq!(r.code, Some(0), "{}", r.all());
}

#[test]
fn rdma_a_killed_worker_fails_the_others_and_the_servers() {
    need_device();
    let t0 = Instant::now();
    util::killed_worker(&[("KVSTORE_TIMEOUT", "30"), RDMA]);
    // Detected through the TCP link and the queue pair, not by a timeout.
    assert!(t0.elapsed() < Duration::from_secs(60), "{:?}", t0.elapsed());
}

/// Starts a job whose workers push and pull until an error, waits for worker 0 to be ready,
/// does `fault`, and asserts that worker 0's pending call failed (peer lost or job aborted)
/// within `bound`, and that the store then refused further calls.
fn fault_fails_pending_calls(fault: impl FnOnce(&mut ManualJob), bound: Duration) {
    need_device();
    let env = [("KVSTORE_TIMEOUT", "60"), RDMA];
    let mut job = ManualJob::start(2, 2, &["until_error", "dist_sync"], &env);
    let mut w0 = job.workers.remove(0);
    let lines = ManualJob::lines(&mut w0);
    ManualJob::wait_for(&lines, "ready", Duration::from_secs(60));
    let t0 = Instant::now();
    fault(&mut job);
    let (code, err) = finish(w0, bound);
    let took = t0.elapsed();
    let mut got = Vec::new();
    while let Ok(l) = lines.recv_timeout(Duration::from_secs(5)) {
        got.push(l);
    }
    let out = format!("{}\n{err}", got.join("\n"));
    job.kill_all();
    assert_eq!(code, Some(5), "{out}");
    assert!(
        out.contains("error kind PeerLost") || out.contains("error kind Aborted"),
        "{out}"
    );
    assert!(out.contains("later call refused"), "{out}");
    assert!(took < bound, "took {took:?}");
}

#[test]
fn rdma_a_killed_server_makes_pending_calls_fail() {
    fault_fails_pending_calls(
        |job| {
            job.servers[0].kill().unwrap();
            let _ = job.servers[0].wait();
        },
        Duration::from_secs(30),
    );
}

/// The network device under the first RDMA device (rxe0's eth0).
fn netdev() -> String {
    let dev = kvstore_transport::rdma::devices().unwrap().remove(0);
    let p = format!("/sys/class/infiniband/{dev}/ports/1/gid_attrs/ndevs/0");
    std::fs::read_to_string(&p)
        .unwrap_or_else(|e| panic!("{p}: {e}"))
        .trim()
        .to_string()
}

fn ip_link(dev: &str, state: &str) {
    let ok = std::process::Command::new("ip")
        .args(["link", "set", dev, state])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "ip link set {dev} {state}");
}

#[test]
fn rdma_the_port_going_down_fails_pending_calls() {
    need_device();
    let dev = netdev();
    fault_fails_pending_calls(|_| ip_link(&dev, "down"), Duration::from_secs(30));
    ip_link(&dev, "up");
    // The port comes back for whatever runs next.
    let deadline = Instant::now() + Duration::from_secs(30);
    while kvstore_transport::RdmaBackend::new(Default::default()).is_err() {
        assert!(Instant::now() < deadline, "the port did not come back");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn rdma_forced_without_a_device_is_an_error_naming_the_reason() {
    assert!(
        kvstore_transport::rdma::devices().is_err_and(|_| true)
            || kvstore_transport::rdma::devices().is_ok_and(|d| d.is_empty()),
        "this test is for a host without an RDMA device"
    );
    let r = util::kvrun_check_timeout(1, 1, "seed", "dist_sync", &[RDMA], 20);
    assert_ne!(r.code, Some(0), "{}", r.all());
    assert!(
        r.stderr
            .contains("KVSTORE_TRANSPORT=rdma, but this server has no RDMA"),
        "{}",
        r.all()
    );
    // Without the variable the same build runs, and says why it has no RDMA.
    let r = util::kvrun_check(1, 1, "seed", "dist_sync", &[]);
    assert_job_ok(&r, 1, "seed");
    assert!(r.stderr.contains("no RDMA ("), "{}", r.all());
}

/// Run as a user without CAP_IPC_LOCK under a small `ulimit -l` (the suite does: root's
/// capability ignores the limit): the backend refuses up front, naming the limit and the fix,
/// never a bare ENOMEM from `ibv_reg_mr`.
#[test]
fn rdma_the_locked_memory_limit_is_reported_with_the_fix() {
    need_device();
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let uid = status.lines().find_map(|l| l.strip_prefix("Uid:")).unwrap();
    assert_ne!(
        uid.split_whitespace().nth(1),
        Some("0"),
        "run this test as a user other than root"
    );
    let e = match kvstore_transport::RdmaBackend::new(Default::default()) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("the backend opened under a locked-memory limit too small for it"),
    };
    for want in ["RLIMIT_MEMLOCK", "ulimit -l", "limits.conf", "LimitMEMLOCK"] {
        assert!(e.contains(want), "{want}: {e}");
    }
    // A job under the same limit fails with the same advice.
    let r = util::kvrun_check_timeout(1, 1, "seed", "dist_sync", &[RDMA], 20);
    assert_ne!(r.code, Some(0), "{}", r.all());
    assert!(r.stderr.contains("ulimit -l"), "{}", r.all());
}
