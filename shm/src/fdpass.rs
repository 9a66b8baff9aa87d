//! Passing descriptors between processes (`SCM_RIGHTS` over a Unix socket).

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;

use rustix::net::{
    recvmsg, sendmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

use crate::ShmError;

/// Most descriptors passed in one message.
const MAX_FDS: usize = 8;

/// Sends `data` (non-empty) and the descriptors `fds` in one message.
pub fn send_fds(sock: &UnixStream, data: &[u8], fds: &[BorrowedFd<'_>]) -> Result<(), ShmError> {
    if data.is_empty() || fds.len() > MAX_FDS {
        return Err(ShmError::OutOfBounds(
            "send_fds needs data and at most 8 descriptors".into(),
        ));
    }
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(ShmError::OutOfBounds("control buffer too small".into()));
    }
    let n = sendmsg(
        sock,
        &[IoSlice::new(data)],
        &mut control,
        SendFlags::empty(),
    )?;
    if n != data.len() {
        return Err(ShmError::Corrupt(format!(
            "sent {n} of {} bytes",
            data.len()
        )));
    }
    Ok(())
}

/// Receives one message into `buf` and the descriptors that came with it.
pub fn recv_fds(sock: &UnixStream, buf: &mut [u8]) -> Result<(usize, Vec<OwnedFd>), ShmError> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let msg = recvmsg(
        sock,
        &mut [IoSliceMut::new(buf)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    )?;
    let mut fds = Vec::new();
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(iter) = m {
            fds.extend(iter);
        }
    }
    if msg.bytes == 0 {
        return Err(ShmError::Io(std::io::ErrorKind::UnexpectedEof.into()));
    }
    Ok((msg.bytes, fds))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Segment;
    use std::os::fd::AsFd;

    #[test]
    fn a_segment_crosses_a_socket() {
        let (a, b) = UnixStream::pair().unwrap();
        let seg = Segment::create("pass", 4096).unwrap();
        seg.write(10, b"over there").unwrap();
        send_fds(&a, b"seg", &[seg.fd().as_fd()]).unwrap();
        let mut buf = [0u8; 16];
        let (n, mut fds) = recv_fds(&b, &mut buf).unwrap();
        assert_eq!(&buf[..n], b"seg");
        assert_eq!(fds.len(), 1);
        let other = Segment::from_fd(fds.remove(0)).unwrap();
        let mut out = [0u8; 10];
        other.read(10, &mut out).unwrap();
        assert_eq!(&out, b"over there");
    }
}
