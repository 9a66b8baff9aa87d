//! One process of a job: spawned with its role, its output prefixed, stopped on demand.

use std::fmt;
use std::io::Write;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::Path;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
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

/// A running process of the job (for a remote process: the ssh client that runs it).
pub struct Child {
    /// Its role.
    pub role: RoleName,
    /// The host it runs on, when not this one.
    pub host: Option<String>,
    /// Its process id (also its process group id).
    pub pid: u32,
    proc: std::process::Child,
    /// A remote process watches this pipe: when kvrun closes it (or dies), the process is killed.
    _lifeline: Option<std::process::ChildStdin>,
    status: Option<ExitStatus>,
    /// The threads copying its output, joined before kvrun exits so no last line is lost.
    forwarders: Vec<std::thread::JoinHandle<()>>,
    /// Whether it runs: a local one at once, a remote one once its wrapper said so.
    started: Arc<AtomicBool>,
    /// Whether its process group was seen empty after it ended (its id may then be reused).
    group_gone: bool,
}

/// Quotes a word for a POSIX shell.
pub fn shell_quote(s: &str) -> String {
    if !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"/._-=:,+@%".contains(&b))
    {
        return s.to_string();
    }
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// POSIX `sh` that decodes the arguments [`remote_word`] marked, in place.
macro_rules! decode_words {
    () => {
        "for a in \"$@\"; do shift; case $a in kvrun-b:*) a=$(printf '%bx' \"${a#kvrun-b:}\"); \
         a=${a%x};; esac; set -- \"$@\" \"$a\"; done; "
    };
}
pub(crate) use decode_words;

/// The remote side of a process started over ssh, a POSIX `sh` script run by the login shell
/// (whatever it is: one line, in single quotes, so that a csh-family shell passes it on too):
/// goes to the directory given first (as kvrun's own), takes the job's secret from the first
/// line of stdin (never from the command line, which `ps` shows to every user), runs the
/// program in a session of its own (setsid) with stdin from /dev/null, and kills that whole
/// process group when the ssh session's stdin closes (kvrun stopped the job, or died), or
/// when the program ends (what it left running would hold the session open, as kvrun stops
/// a local program's group). A
/// login shell's own descriptors are closed first (csh leaves copies of the session's output
/// open in what it runs, which would keep it open after the program ends). Words marked
/// `kvrun-b:` are decoded first ([`remote_word`]). A directory missing there is said, and the
/// program runs where the login starts, as Open MPI's remote processes do.
const REMOTE_WRAPPER: &str = concat!(
    "exec 4>&- 5>&- 6>&- 7>&- 8>&- 9>&-; ",
    decode_words!(),
    "cd \"$1\" 2>/dev/null || printf 'kvrun: no directory %s here: running in %s\\n' \
    \"$1\" \"$PWD\" >&2; shift; \
    printf '%s\\n' kvrun-remote-started >&2; \
    IFS= read -r KVSTORE_SECRET || exit 1; export KVSTORE_SECRET; exec 3<&0; \
    if command -v setsid >/dev/null 2>&1; then setsid \"$@\" </dev/null & \
    else \"$@\" </dev/null & fi; c=$!; \
    ( cat <&3 >/dev/null 2>&1; kill -TERM -$c $c 2>/dev/null; sleep 2; \
    kill -KILL -$c $c 2>/dev/null ) >/dev/null 2>&1 & w=$!; \
    exec 3<&-; wait $c; s=$?; kill $w 2>/dev/null; kill -TERM -$c 2>/dev/null && \
    { ( sleep 2; kill -KILL -$c 2>/dev/null ) </dev/null >/dev/null 2>&1 & }; exit $s"
);

/// The wrapper's first line on stderr: the ssh session is logged in (kvrun keeps few of a
/// host's sessions in their login at once, see [`Child::logging_in`]).
pub(crate) const STARTED: &[u8] = b"kvrun-remote-started\n";

/// The variable that never goes on a command line: it is written to the remote side's stdin.
pub const SECRET_VAR: &str = "KVSTORE_SECRET";

/// The command line run on a remote host: the wrapper, the directory, then `env` with every
/// variable of `env` but the secret (which the wrapper reads from stdin), the program and its
/// arguments. Words only, each quoted: any login shell, POSIX or csh, runs it the same.
pub fn remote_command(program: &Path, args: &[String], env: &[(String, String)]) -> String {
    let cwd = std::env::current_dir()
        .map(|d| d.to_string_lossy().into_owned())
        .unwrap_or_else(|_| ".".into());
    let mut cmd = format!(
        "exec sh -c {} kvrun-remote {} env",
        shell_quote(REMOTE_WRAPPER),
        remote_word(&cwd)
    );
    for (k, v) in env.iter().filter(|(k, _)| k != SECRET_VAR) {
        cmd.push_str(&format!(" {}", remote_word(&format!("{k}={v}"))));
    }
    let program = program.to_string_lossy();
    if program.contains('=') {
        // `env` takes any word with a `=` for a variable (`./runs/lr=0.1/train`), and runs
        // the next word, or with none prints its environment: a shell runs it instead.
        cmd.push_str(" sh -c ");
        cmd.push_str(&remote_word("exec \"$0\" \"$@\""));
    }
    cmd.push(' ');
    cmd.push_str(&remote_word(&program));
    for a in args {
        cmd.push(' ');
        cmd.push_str(&remote_word(a));
    }
    cmd
}

/// A word of the remote command, quoted for a POSIX shell. One that a csh-family login shell
/// would not pass on inside single quotes (a `!`, which it expands from its history; a line
/// break, which ends its command), or that begins with the marker itself, goes as `kvrun-b:`
/// and its bytes, letters and digits as they are and the others in `printf %b`'s octal
/// escapes, which the wrapper decodes.
pub(crate) fn remote_word(s: &str) -> String {
    const MARK: &str = "kvrun-b:";
    if !s.contains(['!', '\n', '\r']) && !s.starts_with(MARK) {
        return shell_quote(s);
    }
    let mut w = String::from(MARK);
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() {
            w.push(char::from(b));
        } else {
            w.push_str(&format!("\\0{b:03o}"));
        }
    }
    shell_quote(&w)
}

impl Child {
    /// Starts `program` in `role`, with `env` added to kvrun's environment.
    pub fn spawn(
        role: RoleName,
        host: Option<&str>,
        ssh: &[String],
        program: &Path,
        args: &[String],
        env: &[(String, String)],
    ) -> std::io::Result<Child> {
        let (dmlc, rank) = match role {
            RoleName::Server(r) => ("server", r),
            RoleName::Worker(r) => ("worker", r),
        };
        let mut env = env.to_vec();
        env.push(("DMLC_ROLE".into(), dmlc.into()));
        env.push(("KVSTORE_RANK".into(), rank.to_string()));
        let mut cmd = match host {
            None => {
                let mut c = Command::new(program);
                c.args(args)
                    .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
                    .stdin(Stdio::null());
                c
            }
            Some(h) => {
                let (ssh_prog, ssh_args) = ssh
                    .split_first()
                    .ok_or_else(|| std::io::Error::other("empty --ssh command"))?;
                let mut c = Command::new(ssh_prog);
                c.args(ssh_args)
                    .arg(h)
                    .arg(remote_command(program, args, &env))
                    .stdin(Stdio::piped());
                c
            }
        };
        cmd.stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        // The child checks that kvrun still lives once its death signal is set: its parent
        // must still be this process (a dead parent's children go to init or to a subreaper).
        let kvrun_pid = std::process::id() as libc::pid_t;
        // SAFETY: the closure runs in the child between fork and exec and only calls prctl and
        // getppid, which are async-signal-safe; it reads one integer copied into it.
        unsafe {
            cmd.pre_exec(move || {
                // If kvrun dies (even by SIGKILL), the kernel kills its children; the shepherd
                // then kills their process groups (grandchildren too).
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::getppid() != kvrun_pid {
                    return Err(std::io::Error::other("kvrun exited during spawn"));
                }
                Ok(())
            });
        }
        let mut proc = cmd.spawn()?;
        let prefix = match host {
            Some(h) => format!("[{h}:{role}] "),
            None => format!("[{role}] "),
        };
        let mut lifeline = proc.stdin.take();
        if let Some(pipe) = &mut lifeline {
            // The secret, as the first line the remote wrapper reads.
            use std::io::Write;
            let secret = env
                .iter()
                .find(|(k, _)| k == SECRET_VAR)
                .map_or("", |(_, v)| v.as_str());
            if let Err(e) = writeln!(pipe, "{secret}") {
                // ssh closed its stdin (`ssh -n`, or it failed at once): it is not the job's.
                let _ = proc.kill();
                let _ = proc.wait();
                return Err(std::io::Error::other(format!(
                    "ssh did not take the job's secret on its stdin ({e}): --ssh must pass \
                     stdin on (no -n)"
                )));
            }
        }
        let mut forwarders = Vec::new();
        let started = Arc::new(AtomicBool::new(host.is_none()));
        if let Some(out) = proc.stdout.take() {
            forwarders.push(crate::output::forward(prefix.clone(), out, false, None));
        }
        if let Some(err) = proc.stderr.take() {
            let watch = host.is_some().then(|| started.clone());
            forwarders.push(crate::output::forward(prefix, err, true, watch));
        }
        Ok(Child {
            role,
            host: host.map(str::to_string),
            pid: proc.id(),
            proc,
            _lifeline: lifeline,
            status: None,
            forwarders,
            started,
            group_gone: false,
        })
    }

    /// Whether this is a remote process whose ssh session is still logging in (its wrapper
    /// has not said it runs, and ssh has not ended).
    pub fn logging_in(&mut self) -> bool {
        !self.started.load(Ordering::Relaxed) && self.poll().is_none()
    }

    /// The exit status, if the process has exited.
    pub fn poll(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            if let Ok(Some(s)) = self.proc.try_wait() {
                self.status = Some(s);
            }
        }
        // Once the leader is reaped and the last process of its group has ended, the group's
        // id is free for the kernel to give another group: it is never signalled again.
        if self.status.is_some() && !self.group_gone {
            // SAFETY: a signal of 0 only checks that the group exists.
            let r = unsafe { libc::killpg(self.pid as libc::pid_t, 0) };
            self.group_gone =
                r != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        }
        self.status
    }

    /// Whether the process was seen to exit (by the last [`Child::poll`]).
    pub fn exited(&self) -> bool {
        self.status.is_some()
    }

    /// Whether its process group still has a process (its leader reaped if it ended).
    fn group_lives(&mut self) -> bool {
        self.poll();
        !self.group_gone
            // SAFETY: a signal of 0 only checks that the group exists (see `signal_group`).
            && unsafe { libc::killpg(self.pid as libc::pid_t, 0) == 0 }
    }

    /// Passes `sig` on to the process's group where it runs on this host (false for a remote
    /// one, whose group here is its ssh client's).
    pub(crate) fn forward(&mut self, sig: libc::c_int) -> bool {
        if self.host.is_some() {
            return false;
        }
        if self.poll().is_none() {
            self.signal_group(sig);
        }
        true
    }

    fn signal_group(&self, sig: libc::c_int) {
        if self.group_gone {
            return;
        }
        // SAFETY: killpg only sends a signal. The group id is our child's pid, which it leads
        // (process_group(0)); after the leader is reaped the group lives on while any of its
        // processes does, and is signalled no more once seen empty (`poll`). The id could
        // name another group only if the kernel reused the pid for a new group leader between
        // that look and this signal (the shepherd takes that risk for longer, as every
        // launcher that kills process groups does).
        unsafe {
            libc::killpg(self.pid as libc::pid_t, sig);
        }
    }
}

/// Stops the job's processes and whatever they started: every process group gets SIGTERM
/// (those whose leader has exited too: a failed worker's or a finished server's helpers are
/// not left behind), then SIGKILL after a grace period. Each leader is reaped, waiting a bounded
/// time: a process in an uninterruptible sleep (a hung file system) is named and left.
pub fn stop_all(children: &mut [Child]) {
    for c in children.iter_mut() {
        c.poll();
        c.signal_group(libc::SIGTERM);
        // A stopped process acts on the TERM only once it runs again.
        c.signal_group(libc::SIGCONT);
    }
    // The grace period lasts while any group has a process left (a leader's background
    // children too, after it ended), at most 3 s.
    let deadline = Instant::now() + Duration::from_secs(3);
    while Instant::now() < deadline && children.iter_mut().any(|c| c.group_lives()) {
        std::thread::sleep(Duration::from_millis(10));
    }
    for c in children.iter_mut() {
        c.signal_group(libc::SIGKILL);
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline && !children.iter_mut().all(|c| c.poll().is_some()) {
        std::thread::sleep(Duration::from_millis(10));
    }
    for c in children.iter_mut().filter(|c| !c.exited()) {
        // One write, as every line of kvrun's (`say`).
        let line = format!(
            "kvrun: {} did not end 5 s after SIGKILL (an uninterruptible sleep?); leaving it\n",
            c.name()
        );
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
    }
}

/// Waits for every process's output to be copied out, so the last lines are not lost when kvrun
/// exits: 2 s at most (`limit`, if less), and longer while it still flows (kvrun's own stdout may
/// drain slowly, into a pipe), up to `limit`, unless kvrun is told to stop (`stop`: Ctrl-C on a
/// reader that never reads ends the wait). A pipe still held open by a stray grandchild, with
/// nothing coming, is not waited for long.
pub fn flush_output(children: &mut [Child], limit: Duration, stop: &AtomicBool) {
    let quiet = Duration::from_secs(2);
    let start = Instant::now();
    let deadline = start + quiet.min(limit);
    for c in children.iter_mut() {
        for h in c.forwarders.drain(..) {
            while !h.is_finished()
                && (Instant::now() < deadline
                    || (crate::output::flowing(quiet)
                        && start.elapsed() < limit
                        && !stop.load(Ordering::Relaxed)))
            {
                std::thread::sleep(Duration::from_millis(5));
            }
            if h.is_finished() {
                let _ = h.join();
            }
        }
    }
}

/// A signal's name, as `kill -l` gives it.
pub fn signal_name(sig: i32) -> String {
    let name = match sig {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        libc::SIGXCPU => "SIGXCPU",
        libc::SIGXFSZ => "SIGXFSZ",
        _ => return format!("signal {sig}"),
    };
    name.to_string()
}

/// The signal that likely ended a process: the status's own, or for a remote process (whose
/// wrapper shell can only pass a signal death on as the status 128 + n) one read from that.
pub fn likely_signal(s: &ExitStatus, remote: bool) -> Option<i32> {
    match (s.code(), s.signal()) {
        (Some(c), _) if remote && (129..=128 + 31).contains(&c) => Some(c - 128),
        (_, sig) => sig,
    }
}

/// The status a failed process gives the job, as a shell (or ssh) reports it: its exit
/// status, or 128 + n for a process killed by signal n; 1 for a status that says neither.
pub fn exit_code(s: &ExitStatus) -> i32 {
    match (s.code(), s.signal()) {
        (Some(c), _) if c != 0 => c,
        (None, Some(sig)) => 128 + sig,
        _ => 1,
    }
}

/// Says how a process ended (`remote`: it ran over ssh).
pub fn describe(s: &ExitStatus, remote: bool) -> String {
    match (s.code(), s.signal()) {
        (Some(255), _) if remote => "could not be started or lost its connection: ssh failed \
             (status 255: host unreachable or login refused), or the program's own status 255"
            .into(),
        (Some(127), _) => "exited with status 127: the program was not found there".into(),
        (Some(126), _) => "exited with status 126: the program cannot be executed there".into(),
        (Some(c), _) => match likely_signal(s, remote) {
            Some(sig) => format!(
                "exited with status {c}: killed by signal {sig} ({}) there, or its own status {c}",
                signal_name(sig)
            ),
            None => format!("exited with status {c}"),
        },
        (None, Some(sig)) => format!("was killed by signal {sig} ({})", signal_name(sig)),
        _ => "ended".into(),
    }
}

impl Child {
    /// `worker 1`, or `worker 1 on host` for a remote process.
    pub fn name(&self) -> String {
        match &self.host {
            Some(h) => format!("{} on {h} (ssh pid {})", self.role, self.pid),
            None => format!("{} (pid {})", self.role, self.pid),
        }
    }
}

#[cfg(test)]
#[path = "child_tests.rs"]
mod tests;
