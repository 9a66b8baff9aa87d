//! Blocking frame I/O with deadlines, for control-plane connections.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use crate::frame::{FrameHeader, HEADER_LEN};
use crate::TransportError;

/// Writes one frame (header and payload) in one vectored write where possible.
pub fn write_frame(
    s: &mut impl Write,
    h: &FrameHeader,
    payload: &[u8],
) -> Result<(), TransportError> {
    let hb = h.encode();
    let mut buf = Vec::with_capacity(HEADER_LEN + payload.len());
    buf.extend_from_slice(&hb);
    buf.extend_from_slice(payload);
    s.write_all(&buf)?;
    s.flush()?;
    Ok(())
}

/// How long a frame whose first byte came may take to come whole, past the reader's own
/// deadline: a reader that gave up in the middle would leave the stream out of step (the next
/// read would take the rest of this frame for a header).
pub const FRAME_GRACE: Duration = Duration::from_secs(10);

/// Fills `buf` from `s`, waiting until `deadline` at most (forever with `None`), or, once any
/// byte of the frame has come (`frame_started`, or a byte read here), until the later of
/// `deadline` and `started + FRAME_GRACE`. [`TransportError::Timeout`]: nothing of the frame
/// came, and the stream can be read again; [`TransportError::Closed`] if the stream ends
/// before the first byte of a frame, [`TransportError::Truncated`] if it ends later, and
/// [`TransportError::PeerLost`] if the frame stops coming in the middle (the stream is then
/// out of step and must be dropped).
pub fn read_exact_until(
    s: &mut TcpStream,
    buf: &mut [u8],
    deadline: Option<Instant>,
    frame_started: bool,
) -> Result<(), TransportError> {
    let mut started = frame_started.then(Instant::now);
    let mut got = 0;
    while got < buf.len() {
        let until = match (deadline, started) {
            (Some(d), Some(t)) => Some(d.max(t + FRAME_GRACE)),
            (d, _) => d,
        };
        if let Some(d) = until {
            let left = d.saturating_duration_since(Instant::now());
            if left.is_zero() && started.is_some() {
                return Err(TransportError::PeerLost(format!(
                    "the peer stopped in the middle of a frame ({got} of {} bytes)",
                    buf.len()
                )));
            }
            if left.is_zero() {
                return Err(TransportError::Timeout("waiting for the peer".into()));
            }
            s.set_read_timeout(Some(left.max(Duration::from_millis(1))))?;
        } else {
            s.set_read_timeout(None)?;
        }
        match s.read(&mut buf[got..]) {
            Ok(0) if got == 0 && !frame_started => return Err(TransportError::Closed),
            Ok(0) => {
                return Err(TransportError::Truncated {
                    got,
                    want: buf.len(),
                })
            }
            Ok(n) => {
                got += n;
                started.get_or_insert_with(Instant::now);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Reads one frame, waiting until `deadline` at most (forever with `None`; once its first
/// byte came, as [`read_exact_until`] says); payloads over `max_payload` bytes are refused.
pub fn read_frame(
    s: &mut TcpStream,
    max_payload: u64,
    deadline: Option<Instant>,
) -> Result<(FrameHeader, Vec<u8>), TransportError> {
    let mut hb = [0u8; HEADER_LEN];
    read_exact_until(s, &mut hb, deadline, false)?;
    let h = FrameHeader::decode(&hb, max_payload)?;
    let mut payload = vec![0u8; h.payload_len as usize];
    read_exact_until(s, &mut payload, deadline, true)?;
    Ok((h, payload))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::META_LEN;
    use std::net::TcpListener;

    #[test]
    fn frames_cross_a_socket_and_reads_time_out() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            write_frame(&mut s, &FrameHeader::new([3; META_LEN], 4), b"ping").unwrap();
            // Then stay silent until the peer gives up.
            let mut b = [0u8; 1];
            let _ = s.read(&mut b);
        });
        let mut c = crate::tcp::connect_retry(addr, Duration::from_secs(5)).unwrap();
        let (h, p) =
            read_frame(&mut c, 100, Some(Instant::now() + Duration::from_secs(5))).unwrap();
        assert_eq!(h.meta[0], 3);
        assert_eq!(p, b"ping");
        let e = read_frame(
            &mut c,
            100,
            Some(Instant::now() + Duration::from_millis(50)),
        )
        .unwrap_err();
        assert!(matches!(e, TransportError::Timeout(_)), "{e}");
        drop(c);
        t.join().unwrap();
    }

    /// A frame that began before the reader's deadline and ends after it is read whole, so
    /// the next frame is read in step; before, the reader gave up with the header half read
    /// and took the rest of it for the next header.
    #[test]
    fn a_frame_begun_before_the_deadline_is_read_whole() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let f = |m: u8, p: &[u8]| {
                let mut b = FrameHeader::new([m; META_LEN], p.len() as u64)
                    .encode()
                    .to_vec();
                b.extend_from_slice(p);
                b
            };
            let first = f(5, b"half");
            s.write_all(&first[..10]).unwrap();
            std::thread::sleep(Duration::from_millis(300));
            s.write_all(&first[10..]).unwrap();
            s.write_all(&f(6, b"next")).unwrap();
            let mut b = [0u8; 1];
            let _ = s.read(&mut b);
        });
        let mut c = crate::tcp::connect_retry(addr, Duration::from_secs(5)).unwrap();
        let soon = || Some(Instant::now() + Duration::from_millis(100));
        let (h, p) = read_frame(&mut c, 100, soon()).unwrap();
        assert_eq!((h.meta[0], &p[..]), (5, &b"half"[..]));
        let (h, p) =
            read_frame(&mut c, 100, Some(Instant::now() + Duration::from_secs(5))).unwrap();
        assert_eq!((h.meta[0], &p[..]), (6, &b"next"[..]));
        drop(c);
        t.join().unwrap();
    }
}
