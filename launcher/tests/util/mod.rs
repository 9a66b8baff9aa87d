//! What the launcher's test files share: kvrun itself, and a bounded wait for its output.

use std::process::{Command, Stdio};
use std::time::Duration;

pub fn kvrun() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvrun"))
}

/// `Command::output` with a bound: a command still running after 120 s is killed with its
/// process group, and the test fails (a hang is a bug, never a test that waits for good).
pub trait Bounded {
    fn bounded_output(&mut self) -> std::io::Result<std::process::Output>;
}

impl Bounded for Command {
    fn bounded_output(&mut self) -> std::io::Result<std::process::Output> {
        use std::os::unix::process::CommandExt;
        let child = self
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        let pid = child.id();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(child.wait_with_output());
        });
        match rx.recv_timeout(Duration::from_secs(120)) {
            Ok(out) => out,
            Err(_) => {
                let _ = Command::new("kill")
                    .args(["-9", "--", &format!("-{pid}")])
                    .status();
                panic!("still running after 120 s: {self:?}");
            }
        }
    }
}
