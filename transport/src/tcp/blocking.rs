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

/// Fills `buf` from `s`, waiting until `deadline` at most (forever with `None`).
/// [`TransportError::Closed`] if the stream ends before the first byte of a frame
/// (`frame_started` false), [`TransportError::Truncated`] if it ends later.
pub fn read_exact_until(
    s: &mut TcpStream,
    buf: &mut [u8],
    deadline: Option<Instant>,
    frame_started: bool,
) -> Result<(), TransportError> {
    let mut got = 0;
    while got < buf.len() {
        if let Some(d) = deadline {
            let left = d.saturating_duration_since(Instant::now());
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
            Ok(n) => got += n,
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

/// Reads one frame, waiting until `deadline` at most (forever with `None`); payloads over
/// `max_payload` bytes are refused.
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
}
