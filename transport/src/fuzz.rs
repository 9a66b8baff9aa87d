//! Entry points for the fuzzers (`tests/fuzz`, afl.rs) and for the regression tests that replay
//! what they found (feature `fuzzing`, off for every user): each takes arbitrary bytes through
//! the code that reads what a peer sends, and must never panic, hang or allocate what the
//! bytes merely claim.

use std::collections::VecDeque;

use rustc_hash::FxHashMap;

use crate::frame::{FrameHeader, HEADER_LEN};
use crate::tcp::link::{Rx, Sink};
use crate::tcp::FrameReader;
use crate::{Completion, PeerId};

/// A TCP peer's bytes: the frame header alone, then the stream through the TCP backend's own
/// frame reader and sink (messages, puts into grants it never gave), in pieces of every size
/// the bytes' first byte picks.
pub fn frames(data: &[u8]) {
    if let Some(h) = data.first_chunk::<HEADER_LEN>() {
        if let Ok(d) = FrameHeader::decode(h, 1 << 20) {
            assert_eq!(FrameHeader::decode(&d.encode(), 1 << 20).ok(), Some(d));
        }
    }
    let step = data.first().map_or(1, |&b| b as usize % 61 + 1);
    let mut reader = FrameReader::new(1 << 20);
    let mut rx = Rx::default();
    let grants = FxHashMap::default();
    let mut got = 0usize;
    let mut on = |c: Completion<'_>| {
        if let Completion::Recv { body, data, .. } = c {
            got += body.len() + data.map_or(0, |d| d.len());
        }
    };
    let mut n = 0;
    let mut sink = Sink {
        peer: PeerId(0),
        rx: &mut rx,
        grants: &grants,
        next_grant: 1,
        on: &mut on,
        n: &mut n,
        budget: usize::MAX,
        admit: None,
    };
    let mut stream = Pieces {
        data,
        at: 0,
        step,
        blocked: VecDeque::new(),
    };
    // Reads until the stream ends or a frame is refused.
    while reader.read_from(&mut stream, &mut sink).is_ok() {
        if stream.at >= data.len() {
            break;
        }
    }
    assert!(got <= data.len(), "delivered more than came");
}

/// A stream of `data` in pieces of `step` bytes, would-block between them.
struct Pieces<'a> {
    data: &'a [u8],
    at: usize,
    step: usize,
    blocked: VecDeque<()>,
}

impl std::io::Read for Pieces<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.blocked.pop_front().is_some() {
            return Err(std::io::ErrorKind::WouldBlock.into());
        }
        self.blocked.push_back(());
        let n = self.step.min(buf.len()).min(self.data.len() - self.at);
        buf[..n].copy_from_slice(&self.data[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

/// A shared-memory peer's bytes: a ring slot's descriptor, the socket hello, and a channel
/// segment whose header, ring indices and pool sizes are the bytes.
pub fn shm(data: &[u8]) {
    crate::shm::link::fuzz(data);
    let Ok(seg) = kvstore_shm::Segment::create("fuzz", 64 * 1024) else {
        return;
    };
    let _ = seg.write(0, &data[..data.len().min(64 * 1024)]);
    let Ok(fd) = seg.fd().try_clone_to_owned() else {
        return;
    };
    let Ok(seg) = kvstore_shm::Segment::from_fd(fd) else {
        return;
    };
    if let Ok(ch) = kvstore_shm::Channel::attach(seg) {
        let mut slot = [0u8; kvstore_shm::SLOT];
        for _ in 0..64 {
            if !matches!(ch.try_recv(&mut slot), Ok(true)) {
                break;
            }
        }
    }
}
