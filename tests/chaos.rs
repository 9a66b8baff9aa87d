//! The chaos suite: real jobs (kvrun, W=2 S=2) over each transport, every value of every round
//! checked exactly, and a process killed (`kill -9`, each role, at a random moment) or stopped
//! (SIGSTOP, past the liveness bound). Each run asserts that the job ends soon after the fault
//! (within about a second of a kill; within the liveness bound of a stop), that kvrun names the
//! process first and the surviving workers name it too, that no process of the job is left and
//! nothing under /dev/shm, and that no wrong value was ever pulled before the fault.

mod util;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const TRANSPORTS: [&str; 2] = ["tcp", "shm"];
/// Runs of each fault, role and transport.
const RUNS: usize = 2;

struct Job {
    kvrun: std::process::Child,
    lines: mpsc::Receiver<String>,
    marker: String,
    seen: Vec<String>,
}

impl Job {
    fn start(transport: &str, timeout: u32) -> Job {
        // Unique in this process whatever the seed (the two tests may replay one seed at once).
        static JOBS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = JOBS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let marker = format!("chaos-{}-{n}", std::process::id());
        let mut kvrun = Command::new(util::bin("kvrun"))
            .args(["-n", "2", "-s", "2", "--timeout", &timeout.to_string()])
            .args(["-x", &format!("KVSTORE_TRANSPORT={transport}")])
            .args(["-x", "KVSTORE_BIGARRAY_BOUND=1000"])
            .args(["-x", &format!("CHAOS_MARKER={marker}")])
            .arg(util::bin("examples/dist_check"))
            .args(["chaos", "dist_sync"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (tx, lines) = mpsc::channel();
        for out in [
            Box::new(kvrun.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
            Box::new(kvrun.stderr.take().unwrap()),
        ] {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for l in BufReader::new(out).lines().map_while(Result::ok) {
                    let _ = tx.send(l);
                }
            });
        }
        Job {
            kvrun,
            lines,
            marker,
            seen: Vec::new(),
        }
    }

    /// Waits until both workers have checked some rounds.
    fn running(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut ok = [false; 2];
        while ok.iter().any(|o| !o) {
            let l = self
                .lines
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
                .unwrap_or_else(|_| panic!("the job never ran\n{}", self.seen.join("\n")));
            for (w, o) in ok.iter_mut().enumerate() {
                *o |= l.starts_with(&format!("[worker {w}] round "));
            }
            self.seen.push(l);
        }
    }

    /// The job's process of `role` and `rank`.
    fn pid(&self, role: &str, rank: usize) -> u32 {
        let want = [
            format!("CHAOS_MARKER={}", self.marker),
            format!("DMLC_ROLE={role}"),
            format!("KVSTORE_RANK={rank}"),
        ];
        processes_with(&want[..])
            .into_iter()
            .next()
            .unwrap_or_else(|| panic!("no {role} {rank}"))
    }

    /// Waits for kvrun to end; its status, how long after `since`, and every line.
    fn end(mut self, since: Instant) -> (Option<i32>, Duration, String) {
        let deadline = Instant::now() + Duration::from_secs(60);
        let status = loop {
            if let Some(s) = self.kvrun.try_wait().unwrap() {
                break s;
            }
            assert!(Instant::now() < deadline, "kvrun did not end");
            std::thread::sleep(Duration::from_millis(5));
        };
        let took = since.elapsed();
        while let Ok(l) = self.lines.recv_timeout(Duration::from_secs(3)) {
            self.seen.push(l);
        }
        // Nothing of the job is left.
        let gone = Instant::now() + Duration::from_secs(5);
        let mark = [format!("CHAOS_MARKER={}", self.marker)];
        while !processes_with(&mark[..]).is_empty() && Instant::now() < gone {
            std::thread::sleep(Duration::from_millis(50));
        }
        let left = processes_with(&mark[..]);
        assert!(left.is_empty(), "left behind: {left:?}");
        (status.code(), took, self.seen.join("\n"))
    }
}

/// Processes whose environment holds every one of `vars`.
fn processes_with(vars: &[String]) -> Vec<u32> {
    let mut pids = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) {
            let have: Vec<&[u8]> = env.split(|&b| b == 0).collect();
            if vars.iter().all(|v| have.contains(&v.as_bytes())) {
                pids.push(pid);
            }
        }
    }
    pids
}

fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill {sig} {pid}");
}

/// Seeds this test's random choices (its thread's generator) from `KVSTORE_CHAOS_SEED` or at
/// random, and says the seed, which a failure's output then shows: a run can be replayed.
fn seeded() {
    let seed = std::env::var("KVSTORE_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| fastrand::u64(..));
    fastrand::seed(seed);
    eprintln!("KVSTORE_CHAOS_SEED={seed}");
}

fn dev_shm() -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// The process kvrun names as the first failure, which exited on its own, and its status.
fn first_exit(out: &str) -> (String, i32) {
    let line = out
        .lines()
        .find_map(|l| l.split_once("kvrun: first failure: ").map(|(_, r)| r))
        .unwrap_or_else(|| panic!("kvrun named no first failure\n{out}"));
    let (name, rest) = line
        .split_once(" (pid ")
        .unwrap_or_else(|| panic!("no pid in {line}"));
    let status = rest
        .split_once(") exited with status ")
        .and_then(|(_, s)| s.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("the first failure did not exit on its own: {line}"));
    (name.to_string(), status)
}

/// The surviving workers' last words name `dead`, and at least one spoke.
fn survivors_name(out: &str, dead: &str) {
    let stops: Vec<&str> = out
        .lines()
        .filter(|l| l.contains(" stopped in round "))
        .collect();
    assert!(!stops.is_empty(), "no survivor said why\n{out}");
    for l in &stops {
        assert!(l.contains(dead), "a survivor blames another: {l}\n{out}");
    }
}

#[test]
fn kill_9_of_any_process_ends_the_job_at_once_naming_it() {
    seeded();
    let shm_before = dev_shm();
    for t in TRANSPORTS {
        for (role, ranks) in [("server", 2), ("worker", 2)] {
            for _ in 0..RUNS {
                let mut job = Job::start(t, 30);
                job.running();
                std::thread::sleep(Duration::from_millis(fastrand::u64(0..300)));
                let rank = fastrand::usize(0..ranks);
                let pid = job.pid(role, rank);
                signal(pid, "-KILL");
                let killed = Instant::now();
                let (code, took, out) = job.end(killed);
                let name = format!("{role} {rank}");
                // The first failure's own status: killed by SIGKILL.
                assert_eq!(code, Some(128 + 9), "{t}: {out}");
                assert!(!out.contains("WRONG VALUE"), "{t}: {out}");
                let first = format!("first failure: {name} (pid {pid}) was killed by signal 9");
                assert!(out.contains(&first), "{t}: kvrun names {name} first\n{out}");
                survivors_name(&out, &name);
                assert!(
                    took < Duration::from_millis(2500),
                    "{t}: the job took {took:?} to end after {name} was killed\n{out}"
                );
            }
        }
    }
    assert_eq!(dev_shm(), shm_before, "left under /dev/shm");
}

#[test]
fn a_stopped_server_ends_the_job_within_the_liveness_bound_naming_it() {
    seeded();
    // A timeout of 8 s: a heartbeat every second, a silence of 3 s is a stopped process.
    for t in TRANSPORTS {
        let mut job = Job::start(t, 8);
        job.running();
        let rank = fastrand::usize(0..2);
        let pid = job.pid("server", rank);
        signal(pid, "-STOP");
        let stopped = Instant::now();
        let (code, took, out) = job.end(stopped);
        let name = format!("server {rank}");
        // The stopped server does not exit: the first to fail is a survivor that learnt of the
        // loss (a server exits 1, a worker of this job 4), and kvrun returns its own status.
        let (first, status) = first_exit(&out);
        assert_ne!(first, name, "{t}: {out}");
        assert!(
            [1, 4].contains(&status),
            "{t}: {first} exited {status}\n{out}"
        );
        assert_eq!(code, Some(status), "{t}: {out}");
        assert!(!out.contains("WRONG VALUE"), "{t}: {out}");
        assert!(
            out.contains(&format!("{name} was lost (no heartbeat")),
            "{t}: the stopped server is named\n{out}"
        );
        // kvrun says the scheduler's verdict too, which names the cause (the first failure
        // is a survivor).
        assert!(
            out.lines()
                .any(|l| l.starts_with("kvrun: scheduler:") && l.contains(&name)),
            "{t}: kvrun gives the scheduler's verdict\n{out}"
        );
        survivors_name(&out, &name);
        assert!(
            took < Duration::from_secs(7),
            "{t}: took {took:?} after {name} was stopped\n{out}"
        );
    }
}

#[test]
fn a_server_stopped_before_a_worker_connects_costs_it_one_timeout() {
    // The job's one server registers, then is stopped (SIGSTOP) before the worker joins. The
    // worker's connections to the servers and its handshakes with them share one timeout
    // (4 s), so it fails within about that; each step took a timeout of its own before (over
    // shared memory, then the hello over TCP: 8 s). (The scheduler finds the server silent
    // and aborts the job, but a worker that is connecting does not read it.)
    let env = [("KVSTORE_TIMEOUT", "4")];
    let args = ["seed", "dist_sync"];
    let mut job = util::ManualJob::start_some(1, 0, 1, &args, &env);
    // The server registers at once; two seconds are plenty.
    std::thread::sleep(Duration::from_secs(2));
    let stopped = job.servers[0].id().to_string();
    let signal = |sig: &str| {
        let ok = Command::new("kill").args([sig, &stopped]).status();
        assert!(ok.is_ok_and(|s| s.success()), "kill {sig} {stopped}");
    };
    signal("-STOP");
    let start = Instant::now();
    let worker = job.spawn_worker(0, &args, &env);
    let (code, out) = util::finish(worker, Duration::from_secs(60));
    let took = start.elapsed();
    signal("-CONT");
    job.kill_all();
    assert!(code.is_some_and(|c| c != 0), "{code:?}\n{out}");
    // Its own wait ended it (not the scheduler's abort, which it would not hear).
    assert!(out.contains("timed out"), "{out}");
    assert!(took < Duration::from_millis(6500), "took {took:?}\n{out}");
}
