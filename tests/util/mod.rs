//! Helpers shared by the integration tests: finding the built binaries, running jobs with a
//! time limit, starting a job's processes by hand.
#![allow(dead_code)]

/// The secret of the jobs the tests start by hand.
pub const SECRET: &str = "the-test-suite-job-secret";

pub mod raw;

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// `target/<profile>/`, where cargo put the binaries and examples of the workspace.
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    exe.parent()
        .and_then(|deps| deps.parent())
        .expect("target dir")
        .to_path_buf()
}

/// A workspace binary (`kvrun`) or example (`examples/dist_check`), which must be built.
pub fn bin(name: &str) -> PathBuf {
    let p = target_dir().join(name);
    assert!(
        p.exists(),
        "{} is missing: run the tests with `cargo test --workspace`, which builds it",
        p.display()
    );
    p
}

/// A test that cannot run on this machine says why and passes, unless `KVSTORE_TEST_STRICT=1`
/// (CI sets it, having installed every tool): there a skip fails, so that a missing tool cannot
/// turn a test into one that passes without running.
pub fn skip(why: &str) {
    if std::env::var("KVSTORE_TEST_STRICT").is_ok_and(|v| v == "1") {
        panic!("KVSTORE_TEST_STRICT=1 and this test cannot run here: {why}");
    }
    eprintln!("SKIPPED: {why}");
}

/// The result of a finished command.
pub struct Run {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
}

impl Run {
    pub fn all(&self) -> String {
        format!("--- stdout\n{}\n--- stderr\n{}", self.stdout, self.stderr)
    }
}

/// Runs a command to completion; a command still running after `limit` is killed, with its
/// process group (what it started that holds its output open), and the test fails (a hang is
/// a bug).
pub fn run_limited(cmd: &mut Command, limit: Duration) -> Run {
    use std::os::unix::process::CommandExt;
    let start = Instant::now();
    let child = cmd
        .process_group(0)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    let waiter = std::thread::spawn(move || {
        let out: std::io::Result<Output> = child.wait_with_output();
        let _ = tx.send(());
        out
    });
    if rx.recv_timeout(limit).is_err() {
        let _ = Command::new("kill")
            .args(["-9", "--", &format!("-{pid}")])
            .status();
        let out = waiter.join().unwrap().unwrap();
        panic!(
            "hung for more than {limit:?}: {:?}\n{}\n{}",
            cmd,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let out = waiter.join().unwrap().unwrap();
    Run {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        elapsed: start.elapsed(),
    }
}

/// `kvrun -n W -s S [extra...] dist_check SCENARIO KIND`.
pub fn kvrun_check(w: u32, s: u32, scenario: &str, kind: &str, env: &[(&str, &str)]) -> Run {
    kvrun_check_timeout(w, s, scenario, kind, env, 30)
}

/// [`kvrun_check`] with the job's `--timeout` in seconds.
pub fn kvrun_check_timeout(
    w: u32,
    s: u32,
    scenario: &str,
    kind: &str,
    env: &[(&str, &str)],
    secs: u32,
) -> Run {
    let mut cmd = Command::new(bin("kvrun"));
    cmd.args([
        "-n",
        &w.to_string(),
        "-s",
        &s.to_string(),
        "--timeout",
        &secs.to_string(),
    ]);
    for (k, v) in env {
        cmd.args(["-x", &format!("{k}={v}")]);
    }
    cmd.arg(bin("examples/dist_check")).args([scenario, kind]);
    run_limited(&mut cmd, Duration::from_secs(90))
}

/// Asserts a job succeeded and every worker reported success.
pub fn assert_job_ok(r: &Run, w: u32, scenario: &str) {
    assert_eq!(r.code, Some(0), "job failed\n{}", r.all());
    for rank in 0..w {
        let line = format!("[worker {rank}] {scenario} ok rank {rank} of {w}");
        assert!(r.stdout.contains(&line), "missing {line:?}\n{}", r.all());
    }
}

/// A free TCP port on loopback.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A job whose processes the test starts itself (no kvrun), so it can kill one.
pub struct ManualJob {
    /// The scheduler's port on 127.0.0.1 (the job secret is [`SECRET`]).
    pub port: u16,
    /// Taken by a test that waits for its end.
    pub scheduler: Option<Child>,
    pub servers: Vec<Child>,
    pub workers: Vec<Child>,
    num_workers: usize,
}

fn role_cmd(
    role: &str,
    rank: usize,
    port: u16,
    w: usize,
    s: usize,
    args: &[&str],
    env: &[(&str, &str)],
) -> Command {
    let mut c = Command::new(bin("examples/dist_check"));
    c.args(args)
        .env("DMLC_ROLE", role)
        .env("DMLC_PS_ROOT_URI", "127.0.0.1")
        .env("DMLC_PS_ROOT_PORT", port.to_string())
        .env("DMLC_NUM_SERVER", s.to_string())
        .env("DMLC_NUM_WORKER", w.to_string())
        .env("KVSTORE_SECRET", SECRET)
        .env("KVSTORE_RANK", rank.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        c.env(k, v);
    }
    c
}

/// A test that fails midway leaves no process of its job running (one stopped by SIGSTOP
/// would hold its peers until their timeouts).
impl Drop for ManualJob {
    fn drop(&mut self) {
        self.kill_all();
    }
}

impl ManualJob {
    pub fn start(w: usize, s: usize, args: &[&str], env: &[(&str, &str)]) -> ManualJob {
        Self::start_some(w, w, s, args, env)
    }

    /// A job of `w` workers of which only the first `spawned` are started here (the test plays
    /// the others itself).
    pub fn start_some(
        w: usize,
        spawned: usize,
        s: usize,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> ManualJob {
        ManualJob::start_servers_with(w, spawned, s, args, env, &[])
    }

    /// As [`ManualJob::start_some`], the servers with `server_env` too.
    pub fn start_servers_with(
        w: usize,
        spawned: usize,
        s: usize,
        args: &[&str],
        env: &[(&str, &str)],
        server_env: &[(&str, &str)],
    ) -> ManualJob {
        let port = free_port();
        let scheduler = role_cmd("scheduler", 0, port, w, s, args, env)
            .spawn()
            .unwrap();
        let servers = (0..s)
            .map(|r| {
                role_cmd("server", r, port, w, s, args, env)
                    .envs(server_env.iter().copied())
                    .spawn()
                    .unwrap()
            })
            .collect();
        let workers = (0..spawned)
            .map(|r| {
                role_cmd("worker", r, port, w, s, args, env)
                    .spawn()
                    .unwrap()
            })
            .collect();
        ManualJob {
            port,
            scheduler: Some(scheduler),
            servers,
            workers,
            num_workers: w,
        }
    }

    /// Starts worker `rank` of this job now (one `start_some` left to the test).
    pub fn spawn_worker(&self, rank: usize, args: &[&str], env: &[(&str, &str)]) -> Child {
        let (w, s) = (self.num_workers, self.servers.len());
        role_cmd("worker", rank, self.port, w, s, args, env)
            .spawn()
            .unwrap()
    }

    /// Streams a process's stdout, line by line, until it ends.
    pub fn lines(child: &mut Child) -> std::sync::mpsc::Receiver<String> {
        let out = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        rx
    }

    /// Reads lines until one contains `needle`; returns the lines read.
    pub fn wait_for(
        rx: &std::sync::mpsc::Receiver<String>,
        needle: &str,
        limit: Duration,
    ) -> Vec<String> {
        let deadline = Instant::now() + limit;
        let mut lines = Vec::new();
        loop {
            match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(l) => {
                    let hit = l.contains(needle);
                    lines.push(l);
                    if hit {
                        return lines;
                    }
                }
                Err(_) => panic!("no line with {needle:?} within {limit:?}; got {lines:?}"),
            }
        }
    }

    pub fn kill_all(&mut self) {
        for c in self
            .workers
            .iter_mut()
            .chain(self.servers.iter_mut())
            .chain(self.scheduler.iter_mut())
        {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Waits for a child with a limit; returns its exit code and output.
pub fn finish(child: Child, limit: Duration) -> (Option<i32>, String) {
    let (tx, rx) = std::sync::mpsc::channel();
    let pid = child.id();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(limit) {
        Ok(Ok(out)) => (
            out.status.code(),
            format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        ),
        _ => {
            // The process, and its group where it leads one.
            let _ = Command::new("kill")
                .args(["-9", "--", &format!("-{pid}"), &pid.to_string()])
                .status();
            panic!("process {pid} did not end within {limit:?}");
        }
    }
}

/// A `die` job of W=2 S=2 started by hand with `env`: rank 1 aborts itself, and rank 0, the
/// servers and the scheduler must all end with an error instead of hanging.
pub fn killed_worker(env: &[(&str, &str)]) {
    let mut job = ManualJob::start(2, 2, &["die", "dist_sync"], env);
    let workers = std::mem::take(&mut job.workers);
    let mut results = Vec::new();
    for w in workers {
        results.push(finish(w, Duration::from_secs(40)));
    }
    // Rank 1 aborted itself; rank 0 got an error naming it instead of hanging, and not by
    // its calls' timeout (an error of any kind would print "stopped").
    assert_eq!(results[0].0, Some(4), "{}", results[0].1);
    let stopped = results[0]
        .1
        .lines()
        .find(|l| l.contains("worker 0 stopped: "));
    assert!(
        stopped.is_some_and(|l| l.contains("worker 1") && !l.contains("timed out")),
        "{}",
        results[0].1
    );
    for s in std::mem::take(&mut job.servers) {
        let (code, out) = finish(s, Duration::from_secs(40));
        assert_eq!(code, Some(1), "a server stops with an error: {out}");
        assert!(out.contains("worker 1"), "{out}");
    }
    let (code, _) = finish(
        job.scheduler.take().expect("the scheduler"),
        Duration::from_secs(40),
    );
    assert_eq!(code, Some(1));
}
