//! An output queue of frames, flushed with vectored writes.

use std::collections::VecDeque;
use std::io::{self, IoSlice, Write};

use crate::frame::HEADER_LEN;

/// Most slices handed to one `writev`.
const MAX_IOV: usize = 1024;

/// What follows a queued frame's header: up to two parts (a body and data), resolved to bytes
/// only when written, so the queue can hold handles to memory it does not own. The parts must
/// not change length while queued.
pub trait Payload {
    /// The bytes after the header, in order.
    fn parts(&self) -> [&[u8]; 2];
}

impl Payload for () {
    fn parts(&self) -> [&[u8]; 2] {
        [&[], &[]]
    }
}

impl Payload for &[u8] {
    fn parts(&self) -> [&[u8]; 2] {
        [self, &[]]
    }
}

impl Payload for Vec<u8> {
    fn parts(&self) -> [&[u8]; 2] {
        [self, &[]]
    }
}

fn frame_len(p: &impl Payload) -> usize {
    let [a, b] = p.parts();
    HEADER_LEN + a.len() + b.len()
}

/// Frames waiting to be written: each an encoded header and a [`Payload`].
///
/// ```
/// use kvstore_transport::tcp::OutQueue;
/// use kvstore_transport::{FrameHeader, META_LEN};
/// let mut q: OutQueue<Vec<u8>> = OutQueue::new();
/// q.push(FrameHeader::new([0; META_LEN], 3).encode(), b"abc".to_vec());
/// assert_eq!(q.pending_bytes(), 128 + 3);
/// let mut out = Vec::new();
/// assert!(q.flush(&mut out).unwrap());
/// assert_eq!(out.len(), 128 + 3);
/// ```
pub struct OutQueue<P> {
    q: VecDeque<([u8; HEADER_LEN], P)>,
    /// Bytes of the front frame already written.
    off: usize,
    /// Bytes not yet written, kept as frames come and go.
    pending: usize,
}

impl<P: Payload> Default for OutQueue<P> {
    fn default() -> Self {
        Self::new()
    }
}

impl<P: Payload> OutQueue<P> {
    /// An empty queue.
    pub fn new() -> Self {
        OutQueue {
            q: VecDeque::new(),
            off: 0,
            pending: 0,
        }
    }

    /// Appends a frame.
    pub fn push(&mut self, header: [u8; HEADER_LEN], payload: P) {
        self.pending += frame_len(&payload);
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
    pub fn pending_bytes(&self) -> usize {
        self.pending
    }

    /// Takes every queued frame's payload out, unwritten.
    pub fn drain(&mut self) -> impl Iterator<Item = P> + '_ {
        self.off = 0;
        self.pending = 0;
        self.q.drain(..).map(|(_, p)| p)
    }

    /// Writes as much as the writer takes. Returns `Ok(true)` when the queue is empty,
    /// `Ok(false)` when the writer would block.
    pub fn flush<W: Write>(&mut self, w: &mut W) -> io::Result<bool> {
        self.flush_each(w, |_| {})
    }

    /// [`OutQueue::flush`], handing each completely written frame's payload to `done`.
    pub fn flush_each<W: Write>(&mut self, w: &mut W, mut done: impl FnMut(P)) -> io::Result<bool> {
        while !self.q.is_empty() {
            let res = {
                let mut iov = [IoSlice::new(&[]); MAX_IOV];
                let mut n = 0;
                let mut skip = self.off;
                for (h, p) in self.q.iter() {
                    if n + 3 > MAX_IOV {
                        break;
                    }
                    let [a, b] = p.parts();
                    for part in [&h[..], a, b] {
                        if skip >= part.len() {
                            skip -= part.len();
                            continue;
                        }
                        iov[n] = IoSlice::new(&part[skip..]);
                        skip = 0;
                        n += 1;
                    }
                }
                w.write_vectored(&iov[..n])
            };
            match res {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(mut written) => {
                    self.pending -= written.min(self.pending);
                    while written > 0 {
                        let Some((_, p)) = self.q.front() else { break };
                        let left = frame_len(p) - self.off;
                        if written >= left {
                            written -= left;
                            self.off = 0;
                            if let Some((_, p)) = self.q.pop_front() {
                                done(p);
                            }
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
            q.push(h, p.clone());
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
            while !q2.flush(&mut w).unwrap() {}
            assert_eq!(q2.pending_bytes(), 0);
            assert_eq!(w.out, expected, "cap {cap}");
            assert!(q2.is_empty());
        }
        assert_eq!(q.len(), 100);
        assert_eq!(q.pending_bytes(), expected.len());
        assert_eq!(q.drain().count(), 100);
        assert!(q.is_empty() && q.pending_bytes() == 0);
    }
}
