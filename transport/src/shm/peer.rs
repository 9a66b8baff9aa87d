//! The other process of a shared-memory link: who it is, from the kernel, held by a pidfd so
//! that a reused pid is never mistaken for it.

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;

use crate::TransportError;

/// The process at the other end of a Unix socket, as the kernel reports it (`SO_PEERCRED`). A
/// peer of another user is refused: shared memory and cross-memory writes are for one user's
/// own processes.
pub struct PeerProcess {
    pid: i32,
    pidfd: OwnedFd,
    /// Its `/proc/<pid>/mem`, opened while the pidfd showed it alive: the file is bound to
    /// that process's memory, never to a later holder of the pid, so a write through it needs
    /// no liveness check (it fails once the process is gone). `None` where it cannot be opened.
    mem: Option<std::fs::File>,
}

/// Writes up to this size go through `/proc/<pid>/mem` (one system call); larger ones through
/// `process_vm_writev` (one copy, where the file's copies through a kernel page cost more than
/// the liveness check before it).
const MEM_FILE_UP_TO: usize = 64 * 1024;

/// Whether the other end of `sock` is closed (without waiting).
fn hung_up(sock: &UnixStream) -> bool {
    use rustix::event::{poll, PollFd, PollFlags};
    let mut fds = [PollFd::new(sock, PollFlags::RDHUP)];
    let zero = rustix::event::Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    matches!(poll(&mut fds, Some(&zero)), Ok(n) if n > 0)
        && fds[0]
            .revents()
            .intersects(PollFlags::HUP | PollFlags::RDHUP | PollFlags::ERR)
}

impl PeerProcess {
    /// The process at the other end of `sock`.
    pub fn of(sock: &UnixStream) -> Result<PeerProcess, TransportError> {
        let cred = rustix::net::sockopt::socket_peercred(sock).map_err(std::io::Error::from)?;
        if cred.uid != rustix::process::geteuid() {
            return Err(TransportError::Refused(format!(
                "a shared-memory peer of another user (uid {})",
                cred.uid.as_raw()
            )));
        }
        let pidfd = rustix::process::pidfd_open(cred.pid, rustix::process::PidfdFlags::empty())
            .map_err(std::io::Error::from)?;
        // The pid is the one that connected, which may have died since and its pid gone to
        // another process before the pidfd was opened. Its end of the socket still open after
        // the pidfd says it had not (a process's pid is not reused while it lives), short of
        // a child that inherited the socket and outlived it.
        if hung_up(sock) {
            return Err(TransportError::PeerLost(
                "the shared-memory peer closed its socket before it could be identified".into(),
            ));
        }
        let pid = cred.pid.as_raw_nonzero().get();
        let mut p = PeerProcess {
            pid,
            pidfd,
            mem: None,
        };
        // Opened after the pidfd and kept only if the process was still alive afterwards: then
        // the pid had not been reused in between, and the file is that process's memory.
        let mem = std::fs::OpenOptions::new()
            .write(true)
            .open(format!("/proc/{pid}/mem"));
        if let Ok(f) = mem {
            if !p.exited() {
                p.mem = Some(f);
            }
        }
        Ok(p)
    }

    /// Its pid.
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// Whether the process has exited (its pidfd is readable).
    pub fn exited(&self) -> bool {
        use rustix::event::{poll, PollFd, PollFlags};
        let mut fds = [PollFd::new(&self.pidfd, PollFlags::IN)];
        let zero = rustix::event::Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        matches!(poll(&mut fds, Some(&zero)), Ok(n) if n > 0)
    }

    /// Writes `len` bytes from `src` at `addr` in this process, if it is still the process the
    /// socket named: through its memory file when small, else by `process_vm_writev` (one
    /// copy, by the kernel) after a liveness check. The kernel refuses unmapped addresses
    /// either way; the memory file also writes the process's read-only private pages (as a
    /// debugger does), which `process_vm_writev` refuses. The address is one the process
    /// granted for its own memory, so that reaches only memory it named itself.
    ///
    /// # Safety
    /// `src` is valid for reads of `len` bytes for the call.
    pub unsafe fn write(&self, addr: u64, src: *const u8, len: usize) -> std::io::Result<()> {
        match &self.mem {
            // SAFETY: the caller's promise.
            Some(f) if len <= MEM_FILE_UP_TO => unsafe { write_file(f, addr, src, len) },
            // SAFETY: the caller's promise.
            _ => unsafe { self.write_vm(addr, src, len) },
        }
    }

    /// Whether both ways of writing reach `addr` (8 bytes the peer set aside to be written).
    /// A memory file that does not is dropped; `false` if `process_vm_writev` does not.
    pub fn probe(&mut self, addr: u64) -> bool {
        let v = *b"kvstoreC";
        if let Some(f) = &self.mem {
            // SAFETY: `v` is 8 bytes of this frame, valid for the call.
            if unsafe { write_file(f, addr, v.as_ptr(), v.len()) }.is_err() {
                self.mem = None;
            }
        }
        // SAFETY: as above.
        unsafe { self.write_vm(addr, v.as_ptr(), v.len()) }.is_ok()
    }

    /// # Safety
    /// As `write`.
    unsafe fn write_vm(&self, addr: u64, src: *const u8, len: usize) -> std::io::Result<()> {
        if self.exited() {
            return Err(std::io::Error::other("the peer process has exited"));
        }
        let mut done = 0usize;
        while done < len {
            let local = libc::iovec {
                // SAFETY: within the `len` bytes the caller vouched for.
                iov_base: unsafe { src.add(done) } as *mut libc::c_void,
                iov_len: len - done,
            };
            let remote = libc::iovec {
                iov_base: (addr as usize).wrapping_add(done) as *mut libc::c_void,
                iov_len: len - done,
            };
            // SAFETY: `local` describes bytes of this process valid for reads (the caller's
            // promise; the kernel only reads them); `remote` names memory of another process,
            // which the kernel checks (EFAULT) and which cannot alias ours.
            let n = unsafe { libc::process_vm_writev(self.pid, &local, 1, &remote, 1, 0) };
            if n < 0 {
                return Err(std::io::Error::last_os_error());
            }
            if n == 0 {
                return Err(std::io::ErrorKind::WriteZero.into());
            }
            done += n as usize;
        }
        Ok(())
    }
}

/// Writes through a process's memory file (it fails once the process is gone).
///
/// # Safety
/// `src` is valid for reads of `len` bytes for the call.
unsafe fn write_file(
    f: &std::fs::File,
    addr: u64,
    src: *const u8,
    len: usize,
) -> std::io::Result<()> {
    // SAFETY: the caller's promise.
    let bytes = unsafe { std::slice::from_raw_parts(src, len) };
    std::os::unix::fs::FileExt::write_all_at(f, bytes, addr)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_whose_socket_end_is_closed_is_not_identified_by_its_pid() {
        let (mine, theirs) = UnixStream::pair().unwrap();
        let p = PeerProcess::of(&mine).expect("a live peer");
        assert_eq!(p.pid(), std::process::id() as i32);
        assert!(!p.exited());
        drop(theirs);
        assert!(matches!(
            PeerProcess::of(&mine),
            Err(TransportError::PeerLost(_))
        ));
    }
}
