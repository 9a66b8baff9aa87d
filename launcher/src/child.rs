//! One process of a job: spawned with its role, its output prefixed, stopped on demand.

use std::fmt;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::Path;
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// A process's role and rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RoleName {
    /// Server `rank`.
    Server(usize),
    /// Worker `rank`.
    Worker(usize),
}

impl fmt::Display for RoleName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RoleName::Server(r) => write!(f, "server {r}"),
            RoleName::Worker(r) => write!(f, "worker {r}"),
        }
    }
}

/// A running process of the job.
pub struct Child {
    /// Its role.
    pub role: RoleName,
    /// Its process id (also its process group id).
    pub pid: u32,
    proc: std::process::Child,
    status: Option<ExitStatus>,
}

fn forward(prefix: String, from: impl std::io::Read + Send + 'static, to_stderr: bool) {
    std::thread::spawn(move || {
        let mut r = BufReader::new(from);
        let mut line = Vec::new();
        loop {
            line.clear();
            match r.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {
                    let text = String::from_utf8_lossy(&line);
                    let text = text.trim_end_matches('\n');
                    if to_stderr {
                        let _ = writeln!(std::io::stderr().lock(), "{prefix}{text}");
                    } else {
                        let _ = writeln!(std::io::stdout().lock(), "{prefix}{text}");
                    }
                }
            }
        }
    });
}

impl Child {
    /// Starts `program` in `role`, with `env` added to kvrun's environment.
    pub fn spawn(
        role: RoleName,
        program: &Path,
        args: &[String],
        env: &[(String, String)],
    ) -> std::io::Result<Child> {
        let mut cmd = Command::new(program);
        cmd.args(args)
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        let (dmlc, rank) = match role {
            RoleName::Server(r) => ("server", r),
            RoleName::Worker(r) => ("worker", r),
        };
        cmd.env("DMLC_ROLE", dmlc)
            .env("KVSTORE_RANK", rank.to_string());
        // SAFETY: the closure runs in the child between fork and exec and only calls prctl and
        // getppid, which are async-signal-safe; it touches no memory of the parent.
        unsafe {
            cmd.pre_exec(|| {
                // If kvrun dies (even by SIGKILL), the kernel kills its children: no orphans.
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::getppid() == 1 {
                    return Err(std::io::Error::other("kvrun exited during spawn"));
                }
                Ok(())
            });
        }
        let mut proc = cmd.spawn()?;
        let prefix = format!("[{role}] ");
        if let Some(out) = proc.stdout.take() {
            forward(prefix.clone(), out, false);
        }
        if let Some(err) = proc.stderr.take() {
            forward(prefix, err, true);
        }
        Ok(Child {
            role,
            pid: proc.id(),
            proc,
            status: None,
        })
    }

    /// The exit status, if the process has exited.
    pub fn poll(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            if let Ok(Some(s)) = self.proc.try_wait() {
                self.status = Some(s);
            }
        }
        self.status
    }

    /// Whether the process was seen to exit (by the last [`Child::poll`]).
    pub fn exited(&self) -> bool {
        self.status.is_some()
    }

    fn signal_group(&self, sig: libc::c_int) {
        // SAFETY: killpg only sends a signal; the group id is our child's pid, which it leads
        // (process_group(0)), so no unrelated process can be hit while the child is unreaped.
        unsafe {
            libc::killpg(self.pid as libc::pid_t, sig);
        }
    }
}

/// Stops every process still running (SIGTERM, then SIGKILL after a grace period) and reaps
/// them, with their process groups.
pub fn stop_all(children: &mut [Child]) {
    for c in children.iter_mut() {
        if c.poll().is_none() {
            c.signal_group(libc::SIGTERM);
        }
    }
    let deadline = Instant::now() + Duration::from_secs(3);
    while Instant::now() < deadline && !children.iter_mut().all(|c| c.poll().is_some()) {
        std::thread::sleep(Duration::from_millis(10));
    }
    for c in children.iter_mut() {
        if c.poll().is_none() {
            c.signal_group(libc::SIGKILL);
            let _ = c.proc.wait();
        }
    }
}

/// Says how a process ended.
pub fn describe(s: &ExitStatus) -> String {
    match (s.code(), s.signal()) {
        (Some(c), _) => format!("exited with status {c}"),
        (None, Some(sig)) => format!("was killed by signal {sig}"),
        _ => "ended".into(),
    }
}
