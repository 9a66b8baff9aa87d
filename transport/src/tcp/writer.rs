//! An output queue of frames, flushed with vectored writes.

use std::collections::VecDeque;
use std::io::{self, IoSlice, Write};

use crate::frame::HEADER_LEN;

/// Most slices handed to one `writev`.
const MAX_IOV: usize = 64;

/// Frames waiting to be written: each an encoded header and a payload handle `P`, resolved to
/// bytes only when written (so the queue can hold references to buffers it does not own).
///
/// ```
/// use kvstore_transport::tcp::OutQueue;
/// use kvstore_transport::{FrameHeader, META_LEN};
/// let mut q: OutQueue<Vec<u8>> = OutQueue::new();
/// q.push(FrameHeader::new([0; META_LEN], 3).encode(), b"abc".to_vec());
/// let mut out = Vec::new();
/// assert!(q.flush(&mut out, |p| p.as_slice()).unwrap());
/// assert_eq!(out.len(), 128 + 3);
/// ```
pub struct OutQueue<P> {
    q: VecDeque<([u8; HEADER_LEN], P)>,
    /// Bytes of the front frame already written.
    off: usize,
}

impl<P> Default for OutQueue<P> {
    fn default() -> Self {
        Self::new()
    }
}

impl<P> OutQueue<P> {
    /// An empty queue.
    pub fn new() -> Self {
        OutQueue {
            q: VecDeque::new(),
            off: 0,
        }
    }

    /// Appends a frame.
    pub fn push(&mut self, header: [u8; HEADER_LEN], payload: P) {
        self.q.push_back((header, payload));
    }

    /// Whether every frame has been written.
    pub fn is_empty(&self) -> bool {
        self.q.is_empty()
    }

    /// The number of frames not yet completely written.
    pub fn len(&self) -> usize {
        self.q.len()
    }

    /// Bytes not yet written (headers and payloads).
    pub fn pending_bytes(&self, resolve: impl Fn(&P) -> &[u8]) -> usize {
        let all: usize = self
            .q
            .iter()
            .map(|(_, p)| HEADER_LEN + resolve(p).len())
            .sum();
        all - self.off
    }

    /// Drops every queued frame.
    pub fn clear(&mut self) {
        self.q.clear();
        self.off = 0;
    }

    /// Writes as much as the writer takes. Returns `Ok(true)` when the queue is empty,
    /// `Ok(false)` when the writer would block.
    pub fn flush<W: Write>(
        &mut self,
        w: &mut W,
        resolve: impl Fn(&P) -> &[u8],
    ) -> io::Result<bool> {
        while !self.q.is_empty() {
            let res = {
                let mut iov = [IoSlice::new(&[]); MAX_IOV];
                let mut n = 0;
                for (i, (h, p)) in self.q.iter().enumerate() {
                    if n + 2 > MAX_IOV {
                        break;
                    }
                    let payload = resolve(p);
                    let skip = if i == 0 { self.off } else { 0 };
                    if skip < HEADER_LEN {
                        iov[n] = IoSlice::new(&h[skip..]);
                        n += 1;
                        if !payload.is_empty() {
                            iov[n] = IoSlice::new(payload);
                            n += 1;
                        }
                    } else {
                        iov[n] = IoSlice::new(&payload[skip - HEADER_LEN..]);
                        n += 1;
                    }
                }
                w.write_vectored(&iov[..n])
            };
            match res {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(mut written) => {
                    while written > 0 {
                        let Some((_, p)) = self.q.front() else { break };
                        let total = HEADER_LEN + resolve(p).len();
                        let left = total - self.off;
                        if written >= left {
                            written -= left;
                            self.q.pop_front();
                            self.off = 0;
                        } else {
                            self.off += written;
                            written = 0;
                        }
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) => return Err(e),
            }
        }
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{FrameHeader, META_LEN};

    /// A writer that takes at most `cap` bytes per call and blocks every other call.
    struct Slow {
        out: Vec<u8>,
        cap: usize,
        block: bool,
    }
    impl Write for Slow {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.block = !self.block;
            if self.block {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            let n = buf.len().min(self.cap);
            self.out.extend_from_slice(&buf[..n]);
            Ok(n)
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn partial_writes_resume_where_they_stopped() {
        let payloads: Vec<Vec<u8>> = (0..100).map(|i| vec![i as u8; i * 37]).collect();
        let mut expected = Vec::new();
        let mut q = OutQueue::new();
        for (i, p) in payloads.iter().enumerate() {
            let h = FrameHeader::new([i as u8; META_LEN], p.len() as u64).encode();
            expected.extend_from_slice(&h);
            expected.extend_from_slice(p);
            q.push(h, i);
        }
        for cap in [1, 100, 129, 5000] {
            let mut q2 = OutQueue::new();
            for (i, p) in payloads.iter().enumerate() {
                q2.push(
                    FrameHeader::new([i as u8; META_LEN], p.len() as u64).encode(),
                    p.as_slice(),
                );
            }
            let mut w = Slow {
                out: vec![],
                cap,
                block: false,
            };
            while !q2.flush(&mut w, |p| *p).unwrap() {}
            assert_eq!(w.out, expected, "cap {cap}");
            assert!(q2.is_empty());
        }
        assert_eq!(q.len(), 100);
        q.clear();
        assert!(q.is_empty());
    }
}
