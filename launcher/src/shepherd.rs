//! The shepherd: a small process kvrun starts first, which outlives it. kvrun tells it the
//! process group of every child; if kvrun dies without saying `done` (even by SIGKILL, when
//! it cannot clean up), the shepherd sees its pipe close and kills those groups, grandchildren
//! included (which `PR_SET_PDEATHSIG` alone would leave behind).

use std::io::{BufRead, Write};
use std::process::{ChildStdin, Command, Stdio};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

/// The argument that makes kvrun act as the shepherd.
pub const ARG: &str = "--kvrun-shepherd";

/// kvrun's end of the shepherd's pipe.
pub struct Shepherd {
    pipe: ChildStdin,
    child: std::process::Child,
}

impl Shepherd {
    /// Starts the shepherd (this same executable with [`ARG`]).
    pub fn start() -> std::io::Result<Shepherd> {
        let exe = std::env::current_exe()?;
        let mut child = Command::new(exe)
            .arg(ARG)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .process_group(0)
            .spawn()?;
        let pipe = child
            .stdin
            .take()
            .ok_or_else(|| std::io::Error::other("shepherd has no stdin"))?;
        Ok(Shepherd { pipe, child })
    }

    /// Tells the shepherd about a process group to kill if kvrun dies.
    pub fn watch(&mut self, pgid: u32) {
        let _ = writeln!(self.pipe, "g {pgid}");
        let _ = self.pipe.flush();
    }

    /// kvrun has stopped its children itself: the shepherd exits without killing anything.
    /// It is waited for 5 s at most (a stopped shepherd is killed, not waited on forever).
    pub fn done(mut self) {
        let _ = writeln!(self.pipe, "done");
        let _ = self.pipe.flush();
        drop(self.pipe);
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while std::time::Instant::now() < deadline {
            match self.child.try_wait() {
                Ok(None) => std::thread::sleep(Duration::from_millis(10)),
                _ => return,
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

use std::os::unix::process::CommandExt;

fn kill_groups(groups: &[i32], sig: libc::c_int) {
    for &g in groups {
        // SAFETY: killpg only sends a signal to a process group kvrun created for its child.
        unsafe {
            libc::killpg(g, sig);
        }
    }
}

/// The shepherd's main loop; returns the exit status.
pub fn run() -> i32 {
    // Ctrl-C, hang-ups and the signals kvrun passes on are kvrun's to handle; the shepherd
    // must outlive them (under srun, Slurm signals every process of the step, this one too).
    let ignored = Arc::new(AtomicBool::new(false));
    for sig in [
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGHUP,
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGUSR1,
        signal_hook::consts::SIGUSR2,
    ] {
        let _ = signal_hook::flag::register(sig, ignored.clone());
    }
    let mut groups = Vec::new();
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        if line == "done" {
            return 0;
        }
        if let Some(g) = line.strip_prefix("g ").and_then(|g| g.parse::<i32>().ok()) {
            if g > 1 {
                groups.push(g);
            }
        }
    }
    // kvrun is gone without cleaning up.
    kill_groups(&groups, libc::SIGTERM);
    std::thread::sleep(Duration::from_secs(1));
    kill_groups(&groups, libc::SIGKILL);
    0
}
