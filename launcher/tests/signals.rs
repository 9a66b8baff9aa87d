//! kvrun and signals: those passed on to the job's processes, a hang-up ignored at start,
//! SIGCHLD ignored by its parent, and output drained after the job.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod util;
use util::{kvrun, Bounded};

/// Starts `cmd` with its stdout read line by line into a channel.
fn spawn_reading(cmd: &mut Command) -> (std::process::Child, std::sync::mpsc::Receiver<String>) {
    use std::io::BufRead;
    use std::os::unix::process::CommandExt;
    let mut child = cmd
        .process_group(0)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    (child, rx)
}

/// Waits (30 s at most) until `n` lines containing `what` came; the lines seen.
fn wait_lines(rx: &std::sync::mpsc::Receiver<String>, what: &str, n: usize) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut seen = Vec::new();
    while seen.iter().filter(|l: &&String| l.contains(what)).count() < n {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(l) => seen.push(l),
            Err(_) => panic!("{n} lines with {what:?} did not come: {seen:?}"),
        }
    }
    seen
}

fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .unwrap();
    assert!(ok.success());
}

/// Waits (30 s at most) for `child` to end; its exit code.
fn bounded_wait(child: &mut std::process::Child) -> Option<i32> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s.code();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("kvrun did not end");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn usr1_and_usr2_are_passed_on_to_every_process() {
    // As mpirun passes them: a batch system's warning before the time limit (Slurm's
    // --signal=B:USR1@60) reaches the program, which saves a checkpoint; kvrun lives on.
    let script = "trap 'echo got-usr2' USR2; trap 'echo got-usr1; exit 0' USR1; echo ready; \
                  while :; do sleep 0.05; done";
    let (mut child, rx) =
        spawn_reading(kvrun().args(["-n", "2", "-s", "1", "--", "/bin/sh", "-c", script]));
    wait_lines(&rx, "ready", 3);
    signal(child.id(), "-USR2");
    wait_lines(&rx, "got-usr2", 3);
    assert_eq!(
        child.try_wait().unwrap(),
        None,
        "kvrun lives on after SIGUSR2"
    );
    signal(child.id(), "-USR1");
    wait_lines(&rx, "got-usr1", 3);
    assert_eq!(bounded_wait(&mut child), Some(0));
}

#[test]
fn a_stopping_signal_ends_the_job_with_128_and_its_number() {
    // As a shell reports a process a signal ended: a batch system's SIGTERM at the time
    // limit gives 143 (before, 130 whatever the signal, as if it had been Ctrl-C). (Not
    // SIGHUP: a test runner that ignores it passes that on, and kvrun then keeps ignoring it.)
    for (sig, code) in [("-TERM", 143), ("-INT", 130)] {
        let script = "echo ready; while :; do sleep 0.05; done";
        let (mut child, rx) =
            spawn_reading(kvrun().args(["-n", "1", "-s", "1", "--", "/bin/sh", "-c", script]));
        wait_lines(&rx, "ready", 2);
        signal(child.id(), sig);
        assert_eq!(bounded_wait(&mut child), Some(code), "{sig}");
    }
}

#[test]
fn a_hangup_ignored_at_start_stays_ignored_as_nohup_means_it() {
    // `nohup kvrun ...`: the session's end (SIGHUP) leaves the job running.
    let (mut child, rx) = spawn_reading(
        Command::new("nohup")
            .arg(env!("CARGO_BIN_EXE_kvrun"))
            .args([
                "-n",
                "1",
                "--",
                "/bin/sh",
                "-c",
                "echo ready; sleep 1; echo finished",
            ]),
    );
    wait_lines(&rx, "ready", 1);
    signal(child.id(), "-HUP");
    assert_eq!(bounded_wait(&mut child), Some(0));
    wait_lines(&rx, "finished", 1);
}

#[test]
fn a_child_signal_ignored_at_start_is_taken_back_so_kvrun_sees_its_children_end() {
    // A parent that ignores SIGCHLD (which exec keeps): the kernel would reap kvrun's children
    // before kvrun learns how they ended. Before, a job that ended well left kvrun waiting.
    use std::os::unix::process::CommandExt;
    let mut cmd = kvrun();
    cmd.args([
        "-n",
        "1",
        "--timeout",
        "20",
        "--",
        "/bin/sh",
        "-c",
        "echo done",
    ]);
    // SAFETY: between fork and exec the child only sets a signal's disposition, which is
    // async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            libc::signal(libc::SIGCHLD, libc::SIG_IGN);
            Ok(())
        })
    };
    let out = cmd.bounded_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(text.contains("[worker 0] done"), "{text}");
}

#[test]
fn output_is_not_lost_when_kvruns_stdout_drains_slowly() {
    // A reader that takes its time (a pipe to a slow `tee`, a paused terminal): every line
    // reaches it, however long after the program ended.
    use std::io::Read;
    let mut child = kvrun()
        .env("KVSTORE_TIMEOUT", "120")
        .args(["-n", "1", "--", "seq", "1", "6000"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(4));
    // Read in a thread, so that a kvrun that never ends fails the test (bounded_wait) rather
    // than hanging it.
    let mut stdout = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut out = String::new();
        stdout.read_to_string(&mut out).map(|_| out)
    });
    assert_eq!(bounded_wait(&mut child), Some(0));
    let out = reader.join().unwrap().unwrap();
    // The worker's and the server's (every role runs the program), every line of each.
    for who in ["[worker 0] ", "[server 0] "] {
        let mine: Vec<&str> = out.lines().filter(|l| l.starts_with(who)).collect();
        assert_eq!(mine.len(), 6000, "{who}{:?}", mine.last());
        assert_eq!(mine[5999], format!("{who}6000"));
    }
}
