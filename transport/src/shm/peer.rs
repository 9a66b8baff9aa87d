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
        Ok(PeerProcess {
            pid: cred.pid.as_raw_nonzero().get(),
            pidfd,
        })
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
    /// socket named (`process_vm_writev`: one copy, by the kernel, which checks the address).
    ///
    /// # Safety
    /// `src` is valid for reads of `len` bytes for the call.
    pub unsafe fn write(&self, addr: u64, src: *const u8, len: usize) -> std::io::Result<()> {
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
