//! What the verbs backend puts on the wire and in work requests: the 48-byte header every
//! SEND begins with, work request ids, and building requests and receives.

use std::ops::Range;

use rdma_sys as ffi;

use std::sync::Arc;

use super::setup::HEAD;
use super::verbs::{Mr, Pd, Srq, LOCAL};
use super::Peer;
use crate::{Mem, Storage, TransportError};

// Header kinds and flags.
pub(super) const MSG: u8 = 1;
pub(super) const PUT: u8 = 2;
pub(super) const RELEASE: u8 = 3;
pub(super) const REVOKE: u8 = 4;
pub(super) const REVOKED: u8 = 5;
/// The data follows the body in the buffer.
pub(super) const EAGER: u8 = 1;
/// The data is to be read from the sender (address, key and length in the header).
pub(super) const RNDV: u8 = 2;

/// Work request ids: the peer in the high half (sends), the kind and an index in the low half
/// (a receive's is its buffer: the queue pair it arrived on names the peer).
pub(super) const WR_RECV: u64 = 1 << 30;
pub(super) const WR_SEND: u64 = 2 << 30;
pub(super) const INDEX: u64 = (1 << 30) - 1;

/// Credits kept back from messages and puts, for control messages (releases, revokes).
pub(super) const RESERVE: u64 = 2;

#[derive(Clone, Copy, Default, Debug)]
pub(super) struct Head {
    pub(super) kind: u8,
    pub(super) flags: u8,
    pub(super) word: u32,
    pub(super) id: u64,
    pub(super) off: u64,
    pub(super) len: u64,
    pub(super) key: u32,
    pub(super) credits: u64,
}

impl Head {
    pub(super) fn encode(&self) -> [u8; HEAD] {
        let mut b = [0u8; HEAD];
        b[0] = self.kind;
        b[1] = self.flags;
        b[4..8].copy_from_slice(&self.word.to_le_bytes());
        b[8..16].copy_from_slice(&self.id.to_le_bytes());
        b[16..24].copy_from_slice(&self.off.to_le_bytes());
        b[24..32].copy_from_slice(&self.len.to_le_bytes());
        b[32..36].copy_from_slice(&self.key.to_le_bytes());
        b[40..48].copy_from_slice(&self.credits.to_le_bytes());
        b
    }

    pub(super) fn decode(b: &[u8]) -> Option<Head> {
        let u = |r: Range<usize>| Some(u64::from_le_bytes(b.get(r)?.try_into().ok()?));
        Some(Head {
            kind: *b.first()?,
            flags: *b.get(1)?,
            word: u32::from_le_bytes(b.get(4..8)?.try_into().ok()?),
            id: u(8..16)?,
            off: u(16..24)?,
            len: u(24..32)?,
            key: u32::from_le_bytes(b.get(32..36)?.try_into().ok()?),
            credits: u(40..48)?,
        })
    }
}

/// The count of buffers the peer posted again, as it last wrote it into our credit word.
pub(super) fn credit_word(p: &Peer) -> u64 {
    // SAFETY: the word is 8 bytes of 64-byte aligned memory that the peer holds alive; the peer
    // writes it only whole (one 8-byte RDMA write), and an atomic load reads it whole.
    unsafe {
        (*(p._credit.ptr() as *const std::sync::atomic::AtomicU64))
            .load(std::sync::atomic::Ordering::Acquire)
    }
}

/// The receive buffers of every peer, in one shared receive queue: chunks of `per` buffers,
/// one more whenever a new peer would take the credits beyond what there is (a peer's credits
/// are its share: the buffers posted are always at least the credits given out, so a sender
/// never meets a receiver that is not ready). A buffer goes back to the queue as soon as what
/// arrived in it was handled.
pub(super) struct Receives {
    pub(super) srq: Arc<Srq>,
    // Each registration holds its memory alive; the queue pairs and the queue go first.
    chunks: Vec<(Mr, Arc<Mem>)>,
    per: usize,
    size: usize,
}

impl Receives {
    pub(super) fn new(srq: Arc<Srq>, per: usize, size: usize) -> Receives {
        Receives {
            srq,
            chunks: Vec::new(),
            per,
            size,
        }
    }

    /// Buffers made so far.
    pub(super) fn count(&self) -> usize {
        self.chunks.len() * self.per
    }

    /// Bytes registered for them.
    pub(super) fn bytes(&self) -> usize {
        self.count() * self.size
    }

    /// Makes and posts buffers until there are at least `n` (within the queue's depth).
    pub(super) fn grow(&mut self, pd: &Arc<Pd>, n: usize) -> Result<(), TransportError> {
        while self.count() < n {
            if self.count() + self.per > self.srq.depth as usize {
                return Err(TransportError::Refused(format!(
                    "the shared receive queue holds {} buffers, and {n} are needed",
                    self.srq.depth
                )));
            }
            let mem = Mem::zeroed(self.per * self.size);
            let s: Arc<dyn Storage> = mem.clone();
            let mr = Mr::new(pd, &s, 0, mem.len(), LOCAL)?;
            self.chunks.push((mr, mem));
            let first = self.count() - self.per;
            for i in first..self.count() {
                self.post(i as u32)?;
            }
        }
        Ok(())
    }

    /// Where buffer `i` begins.
    pub(super) fn ptr(&self, i: u32) -> *const u8 {
        let (c, j) = (i as usize / self.per, i as usize % self.per);
        // SAFETY: `i` names a buffer made by `grow` (the completion that returned it came
        // from the queue it was posted to), which lies inside its chunk.
        unsafe { self.chunks[c].1.ptr().add(j * self.size) }
    }

    /// Posts buffer `i` to the queue again.
    pub(super) fn post(&self, i: u32) -> Result<(), TransportError> {
        let (c, j) = (i as usize / self.per, i as usize % self.per);
        let Some((mr, _)) = self.chunks.get(c) else {
            return Err(TransportError::Refused(format!("no receive buffer {i}")));
        };
        let mut sge = ffi::ibv_sge {
            addr: mr.addr + (j * self.size) as u64,
            length: self.size as u32,
            lkey: mr.lkey,
        };
        let mut wr = ffi::ibv_recv_wr {
            wr_id: WR_RECV | i as u64,
            next: std::ptr::null_mut(),
            sg_list: &mut sge,
            num_sge: 1,
        };
        // SAFETY: the buffer lies in a registration this pool holds (and drops after the
        // queue); nothing reads it until this request completes.
        unsafe { self.srq.post_recv(&mut wr) }
    }
}

/// One work request being built: its gather entry and an inline payload live beside it.
/// Nothing points into it until it is posted: [`Wr::link`] sets the pointers then, while the
/// chain holding it stays put (no allocation per request).
pub(super) struct Wr {
    pub(super) wr: ffi::ibv_send_wr,
    sge: ffi::ibv_sge,
    inline: Option<[u8; INLINE]>,
}

/// The most inline bytes a queue pair is asked for (a header, a short body and small data):
/// the post copies them into the queue, so the message needs no send buffer and the device no
/// DMA read. The device may give less; a QP that cannot have this many gets [`HEAD`].
pub(super) const INLINE: usize = 256;

impl Wr {
    /// Points the request at its own gather entry (and that at its inline bytes), and at
    /// `next`: right before the post, with the request where it will stay until then.
    pub(super) fn link(&mut self, next: *mut ffi::ibv_send_wr) {
        if let Some(b) = &self.inline {
            self.sge.addr = b.as_ptr() as u64;
        }
        self.wr.sg_list = &mut self.sge;
        self.wr.next = next;
    }
}

/// A request whose payload (at most [`INLINE`] bytes) is copied into the queue by the post;
/// `fill` writes the payload and says how long it is.
pub(super) fn wr_inline_with(opcode: u32, fill: impl FnOnce(&mut [u8; INLINE]) -> usize) -> Wr {
    let mut b = [0u8; INLINE];
    let n = fill(&mut b).min(INLINE);
    let mut w = wr(
        opcode,
        ffi::ibv_sge {
            addr: 0,
            length: n as u32,
            lkey: 0,
        },
        ffi::ibv_send_flags::IBV_SEND_INLINE.0,
    );
    w.inline = Some(b);
    w
}

/// A request whose payload (at most [`INLINE`] bytes) is copied into the queue by the post.
pub(super) fn wr_inline(opcode: u32, payload: &[u8]) -> Wr {
    wr_inline_with(opcode, |b| {
        let n = payload.len().min(INLINE);
        b[..n].copy_from_slice(&payload[..n]);
        n
    })
}

pub(super) fn wr(opcode: u32, sge: ffi::ibv_sge, flags: u32) -> Wr {
    // SAFETY: a plain C struct, all zeroes valid.
    let mut w: ffi::ibv_send_wr = unsafe { std::mem::zeroed() };
    w.opcode = opcode;
    w.send_flags = flags;
    w.num_sge = if sge.length == 0 { 0 } else { 1 };
    Wr {
        wr: w,
        sge,
        inline: None,
    }
}
