//! Incremental frame reading from a non-blocking stream.

use std::io::{self, Read};

use crate::frame::{FrameHeader, HEADER_LEN};
use crate::TransportError;

/// The receiver of frames: it is told of each header, names the buffer the payload goes to,
/// and is told when the frame is complete.
pub trait FrameSink {
    /// A header has arrived. An error closes the connection.
    fn on_header(&mut self, h: &FrameHeader) -> Result<(), TransportError>;
    /// Where the payload bytes of frame `h` from `got` on go: a buffer of at least 1 and at
    /// most `want` bytes (`want` is what is left, or what has arrived), filled from its start.
    /// A sink grows its buffer as the bytes arrive ([`grow_into`]), so that a header's claim
    /// alone commits no memory. An error (the bytes so far are refused) closes the connection.
    fn payload_dest(
        &mut self,
        h: &FrameHeader,
        got: usize,
        want: usize,
    ) -> Result<&mut [u8], TransportError>;
    /// The frame is complete. An error closes the connection.
    fn on_frame(&mut self, h: &FrameHeader) -> Result<(), TransportError>;
    /// Whether to take another frame now. `false` pauses the reader at a frame boundary
    /// (backpressure): `read_from` returns `Ok(())`, keeps what it has buffered, and goes on
    /// from there on its next call.
    fn wants_more(&self) -> bool {
        true
    }
}

/// Staging buffer size: small frames are parsed out of it, several per `read`.
const STAGE: usize = 64 * 1024;

/// For a sink that collects a payload in a `Vec`: room for payload bytes `got..got + want`,
/// the vector grown only as far as the bytes that arrived justify (by as much again as has
/// arrived, at least 64 KiB), so a frame that claims a gigabyte and sends nothing costs
/// nothing. The vector must be empty at the frame's start; at its end it holds the payload.
pub fn grow_into(buf: &mut Vec<u8>, got: usize, want: usize) -> &mut [u8] {
    let end = got + want.min(got.max(STAGE)).max(1);
    if buf.len() < end {
        buf.resize(end, 0);
    }
    &mut buf[got..end]
}

/// A sink that keeps whole frames (header and payload) as they complete, a frame at a time
/// (its owner acts on each before the next is read): for links of few, small control frames.
#[derive(Default)]
pub struct FrameQueue {
    buf: Vec<u8>,
    frames: std::collections::VecDeque<(FrameHeader, Vec<u8>)>,
}

impl FrameQueue {
    /// The oldest frame not yet taken.
    pub fn pop(&mut self) -> Option<(FrameHeader, Vec<u8>)> {
        self.frames.pop_front()
    }
}

impl FrameSink for FrameQueue {
    fn on_header(&mut self, _h: &FrameHeader) -> Result<(), TransportError> {
        self.buf.clear();
        Ok(())
    }
    fn payload_dest(
        &mut self,
        _h: &FrameHeader,
        got: usize,
        want: usize,
    ) -> Result<&mut [u8], TransportError> {
        Ok(grow_into(&mut self.buf, got, want))
    }
    fn on_frame(&mut self, h: &FrameHeader) -> Result<(), TransportError> {
        self.frames.push_back((*h, std::mem::take(&mut self.buf)));
        Ok(())
    }
    fn wants_more(&self) -> bool {
        self.frames.is_empty()
    }
}

/// Reads frames from a stream as bytes arrive.
///
/// Headers and small payloads are read through a 64 KiB staging buffer (many frames per system
/// call); the rest of a large payload is read straight into its destination.
///
/// ```
/// use kvstore_transport::tcp::{FrameReader, FrameSink};
/// use kvstore_transport::{FrameHeader, TransportError, META_LEN};
///
/// struct Collect(Vec<Vec<u8>>, Vec<u8>);
/// impl FrameSink for Collect {
///     fn on_header(&mut self, _: &FrameHeader) -> Result<(), TransportError> {
///         self.1.clear();
///         Ok(())
///     }
///     fn payload_dest(&mut self, _: &FrameHeader, got: usize, want: usize)
///         -> Result<&mut [u8], TransportError> {
///         Ok(kvstore_transport::tcp::grow_into(&mut self.1, got, want))
///     }
///     fn on_frame(&mut self, _: &FrameHeader) -> Result<(), TransportError> {
///         self.0.push(std::mem::take(&mut self.1));
///         Ok(())
///     }
/// }
/// let mut wire = FrameHeader::new([0; META_LEN], 3).encode().to_vec();
/// wire.extend_from_slice(b"abc");
/// let mut sink = Collect(vec![], vec![]);
/// let mut r = FrameReader::new(1 << 20);
/// let err = r.read_from(&mut &wire[..], &mut sink).unwrap_err(); // EOF after the frame
/// assert_eq!(sink.0, vec![b"abc".to_vec()]);
/// assert!(matches!(err, TransportError::Closed));
/// ```
pub struct FrameReader {
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    cur: Option<FrameHeader>,
    got: usize,
    max_payload: u64,
}

fn read_some(r: &mut impl Read, into: &mut [u8]) -> io::Result<usize> {
    loop {
        match r.read(into) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            other => return other,
        }
    }
}

impl FrameReader {
    /// A reader that refuses payloads over `max_payload` bytes.
    pub fn new(max_payload: u64) -> Self {
        FrameReader {
            buf: vec![0u8; STAGE].into_boxed_slice(),
            start: 0,
            end: 0,
            cur: None,
            got: 0,
            max_payload,
        }
    }

    /// Refuses payloads over `max_payload` bytes from now on.
    pub fn set_max_payload(&mut self, max_payload: u64) {
        self.max_payload = max_payload;
    }

    /// Whether the reader is between frames (nothing partial buffered).
    pub fn is_idle(&self) -> bool {
        self.cur.is_none() && self.start == self.end
    }

    /// Reads and delivers frames until the stream would block.
    ///
    /// Returns `Ok(())` on `WouldBlock`; [`TransportError::Closed`] on a clean end of stream
    /// between frames, [`TransportError::Truncated`] on an end inside a frame, and any error of
    /// the sink or of validation. After an error the connection must be closed.
    pub fn read_from(
        &mut self,
        r: &mut impl Read,
        sink: &mut impl FrameSink,
    ) -> Result<(), TransportError> {
        loop {
            match self.cur {
                None if !sink.wants_more() => return Ok(()),
                None => {
                    if self.end - self.start >= HEADER_LEN {
                        let mut hb = [0u8; HEADER_LEN];
                        hb.copy_from_slice(&self.buf[self.start..self.start + HEADER_LEN]);
                        self.start += HEADER_LEN;
                        let h = FrameHeader::decode(&hb, self.max_payload)?;
                        sink.on_header(&h)?;
                        if h.payload_len == 0 {
                            sink.on_frame(&h)?;
                        } else {
                            self.cur = Some(h);
                            self.got = 0;
                        }
                        continue;
                    }
                    // Keep the partial header at the front, then fill the rest.
                    self.buf.copy_within(self.start..self.end, 0);
                    self.end -= self.start;
                    self.start = 0;
                    match read_some(r, &mut self.buf[self.end..]) {
                        Ok(0) if self.end == 0 => return Err(TransportError::Closed),
                        Ok(0) => {
                            return Err(TransportError::Truncated {
                                got: self.end,
                                want: HEADER_LEN,
                            })
                        }
                        Ok(n) => self.end += n,
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                        Err(e) => return Err(e.into()),
                    }
                }
                Some(h) => {
                    let len = h.payload_len as usize;
                    let staged = (self.end - self.start).min(len - self.got);
                    if staged > 0 {
                        let dest = sink.payload_dest(&h, self.got, staged)?;
                        let take = dest.len().min(staged);
                        if take == 0 {
                            return Err(TransportError::Refused("no room for a payload".into()));
                        }
                        crate::copy::copy(
                            &mut dest[..take],
                            &self.buf[self.start..self.start + take],
                        );
                        self.start += take;
                        self.got += take;
                    }
                    if self.got == len {
                        self.cur = None;
                        sink.on_frame(&h)?;
                        continue;
                    }
                    if self.start < self.end {
                        continue;
                    }
                    // The staging buffer is empty here.
                    self.start = 0;
                    self.end = 0;
                    let res = if len - self.got >= STAGE / 2 {
                        match sink.payload_dest(&h, self.got, len - self.got) {
                            Ok([]) => {
                                return Err(TransportError::Refused("no room for a payload".into()))
                            }
                            Ok(dest) => read_some(r, dest).map(|n| (n, true)),
                            Err(e) => return Err(e),
                        }
                    } else {
                        read_some(r, &mut self.buf).map(|n| (n, false))
                    };
                    match res {
                        Ok((0, _)) => {
                            return Err(TransportError::Truncated {
                                got: HEADER_LEN + self.got,
                                want: HEADER_LEN + len,
                            })
                        }
                        Ok((n, true)) => self.got += n,
                        Ok((n, false)) => self.end = n,
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                        Err(e) => return Err(e.into()),
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::META_LEN;

    /// A stream that yields its bytes a few at a time, with WouldBlock between chunks.
    struct Trickle {
        data: Vec<u8>,
        pos: usize,
        chunk: usize,
        blocked: bool,
    }
    impl Read for Trickle {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            if self.blocked {
                self.blocked = false;
                return Err(io::ErrorKind::WouldBlock.into());
            }
            self.blocked = true;
            let n = self.chunk.min(buf.len()).min(self.data.len() - self.pos);
            buf[..n].copy_from_slice(&self.data[self.pos..self.pos + n]);
            self.pos += n;
            Ok(n)
        }
    }

    #[derive(Default)]
    struct Collect {
        frames: Vec<(u8, Vec<u8>)>,
        cur: Vec<u8>,
    }
    impl FrameSink for Collect {
        fn on_header(&mut self, h: &FrameHeader) -> Result<(), TransportError> {
            if h.meta[0] == 0xff {
                return Err(TransportError::Refused("tag ff".into()));
            }
            self.cur.clear();
            Ok(())
        }
        fn payload_dest(
            &mut self,
            _: &FrameHeader,
            got: usize,
            want: usize,
        ) -> Result<&mut [u8], TransportError> {
            Ok(grow_into(&mut self.cur, got, want))
        }
        fn on_frame(&mut self, h: &FrameHeader) -> Result<(), TransportError> {
            self.frames.push((h.meta[0], std::mem::take(&mut self.cur)));
            Ok(())
        }
    }

    fn frame(tag: u8, payload: &[u8]) -> Vec<u8> {
        let mut meta = [0u8; META_LEN];
        meta[0] = tag;
        let mut v = FrameHeader::new(meta, payload.len() as u64)
            .encode()
            .to_vec();
        v.extend_from_slice(payload);
        v
    }

    fn run(data: Vec<u8>, chunk: usize) -> (Collect, TransportError) {
        let mut t = Trickle {
            data,
            pos: 0,
            chunk,
            blocked: false,
        };
        let mut r = FrameReader::new(1 << 24);
        let mut sink = Collect::default();
        loop {
            if let Err(e) = r.read_from(&mut t, &mut sink) {
                return (sink, e);
            }
        }
    }

    #[test]
    fn frames_survive_any_chunking() {
        let big: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let mut wire = frame(1, b"hello");
        wire.extend(frame(2, b""));
        wire.extend(frame(3, &big));
        wire.extend(frame(4, b"x"));
        for chunk in [1, 7, 128, 129, 4096, 1 << 20] {
            let (sink, end) = run(wire.clone(), chunk);
            assert!(matches!(end, TransportError::Closed), "{chunk}: {end}");
            let tags: Vec<u8> = sink.frames.iter().map(|f| f.0).collect();
            assert_eq!(tags, vec![1, 2, 3, 4]);
            assert_eq!(sink.frames[0].1, b"hello");
            assert_eq!(sink.frames[2].1, big);
        }
    }

    #[test]
    fn truncation_is_reported() {
        let mut wire = frame(1, b"abcdef");
        wire.truncate(HEADER_LEN + 3);
        let (sink, end) = run(wire, 5);
        assert!(sink.frames.is_empty());
        assert!(matches!(end, TransportError::Truncated { .. }), "{end}");
        let (_, end) = run(frame(1, b"")[..50].to_vec(), 1000);
        assert!(
            matches!(end, TransportError::Truncated { got: 50, .. }),
            "{end}"
        );
    }

    #[test]
    fn sink_refusal_and_garbage_stop_the_reader() {
        let (_, end) = run(frame(0xff, b"zz"), 1000);
        assert!(matches!(end, TransportError::Refused(_)));
        let (_, end) = run(vec![0x55; 300], 1000);
        assert!(matches!(end, TransportError::BadMagic(_)));
    }
}
