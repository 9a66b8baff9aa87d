//! The other process of a shared-memory channel: who it is (from the kernel, held by a
//! pidfd) and its pages, which are read only by copy or in-place sum, never as a slice.

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;

use kvstore_shm::Segment;

use super::shm::shm;
use crate::{DType, Element, KvError, NDArray, Result};

/// The process at the other end of a Unix socket, as the kernel reports it (`SO_PEERCRED`),
/// held by a pidfd so that a reused pid is never mistaken for it. A peer of another user is
/// refused: shared memory and cross-memory writes are for the job's own processes.
pub(crate) struct PeerProcess {
    pub pid: i32,
    pidfd: OwnedFd,
}

impl PeerProcess {
    pub fn of(sock: &UnixStream) -> Result<PeerProcess> {
        let cred = rustix::net::sockopt::socket_peercred(sock).map_err(std::io::Error::from)?;
        if cred.uid != rustix::process::geteuid() {
            return Err(KvError::Protocol(format!(
                "refused a shared-memory peer of another user (uid {})",
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

    /// Writes `data` at `addr` in this process, if it is still the process the socket named.
    pub fn write(&self, addr: u64, data: &[u8]) -> std::io::Result<()> {
        if self.exited() {
            return Err(std::io::Error::other("the peer process has exited"));
        }
        cma_write(self.pid, addr, data)
    }
}

/// Writes `data` at `addr` in process `pid` (`process_vm_writev`, "cross-memory attach"):
/// one copy, made by the kernel, straight into the other process's memory.
fn cma_write(pid: i32, addr: u64, data: &[u8]) -> std::io::Result<()> {
    let mut done = 0usize;
    while done < data.len() {
        let local = libc::iovec {
            iov_base: data[done..].as_ptr() as *mut libc::c_void,
            iov_len: data.len() - done,
        };
        let remote = libc::iovec {
            iov_base: (addr as usize + done) as *mut libc::c_void,
            iov_len: data.len() - done,
        };
        // SAFETY: `local` describes bytes of this process that `data` borrows for the whole
        // call (the kernel only reads them); `remote` names memory of another process, which
        // the kernel checks (EFAULT) and which cannot alias this process's memory. Only
        // initialised `iovec`s are passed, one of each.
        let n = unsafe { libc::process_vm_writev(pid, &local, 1, &remote, 1, 0) };
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

/// A payload in a peer's pool pages. The peer can write those pages at any time (it should not
/// while it waits for the answer, but nothing here can enforce that), so they are never viewed
/// as a slice: they are read once, element by element, into this process's own memory.
pub struct PeerPages {
    pub(crate) seg: Arc<Segment>,
    pub(crate) offset: usize,
    /// Elements of `dtype`.
    pub(crate) len: usize,
    pub(crate) dtype: DType,
}

impl PeerPages {
    fn nbytes(&self) -> usize {
        self.len * self.dtype.size()
    }

    /// The bytes, copied (control payloads: names, optimizer parameters).
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let mut v = vec![0u8; self.nbytes()];
        self.seg.read(self.offset, &mut v).map_err(shm)?;
        Ok(v)
    }

    /// Copies the elements into `dst` (same length and dtype).
    pub fn copy_into(&self, dst: &mut NDArray) -> Result<()> {
        self.check_like(dst)?;
        self.seg.read(self.offset, dst.as_bytes_mut()).map_err(shm)
    }

    /// The elements in a new array of this process.
    pub fn to_array(&self) -> Result<NDArray> {
        let mut a = NDArray::zeros_dtype(&[self.len], self.dtype);
        self.copy_into(&mut a)?;
        Ok(a)
    }

    /// `dst += self`, reading each element once where it lies (no copy).
    pub fn add_into(&self, dst: &mut NDArray) -> Result<()> {
        self.check_like(dst)?;
        let p = self.seg.ptr(self.offset, self.nbytes()).map_err(shm)?;
        crate::dtype::with_dtype!(self.dtype, T => add_peer::<T>(dst, p))
    }

    fn check_like(&self, dst: &NDArray) -> Result<()> {
        if dst.dtype() != self.dtype || dst.size() != self.len {
            return Err(KvError::Protocol(format!(
                "{} {} elements do not fit {} {} elements",
                self.len,
                self.dtype,
                dst.size(),
                dst.dtype()
            )));
        }
        Ok(())
    }
}

fn add_peer<T: Element>(dst: &mut NDArray, p: *const u8) -> Result<()> {
    if (p as usize) % std::mem::align_of::<T>() != 0 {
        return Err(KvError::Protocol("a misaligned payload region".into()));
    }
    let d: &mut [T] = bytemuck::cast_slice_mut(dst.as_bytes_mut());
    // SAFETY: `p` addresses `d.len()` elements inside the peer's mapped pool (checked by
    // `Segment::ptr` against the mapping, and by the pool against its pages), is aligned for
    // `T` (checked above), and cannot overlap `d`, which is this process's own heap memory
    // (a merge buffer). The mapping lives while `self.seg` does, which outlives the call.
    unsafe { crate::ops::add_from_raw(d, p as *const T) };
    Ok(())
}
