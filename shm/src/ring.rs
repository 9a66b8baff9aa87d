//! A single-producer single-consumer ring of fixed-size slots in a segment.
//!
//! Layout at `base`: the producer's index (`head`, a u64 on its own cache line), the consumer's
//! index (`tail`, likewise), then `cap` slots of [`SLOT`] bytes. The producer writes a slot, then
//! publishes it with a release store of `head`; the consumer sees it with an acquire load, reads
//! it, then frees it with a release store of `tail`.
//!
//! Each side keeps its own copy of the other side's index, as it last read it, and reads the
//! other side's cache line again only when its copy says the ring is full (the producer) or
//! empty (the consumer): a push does not fetch the line the consumer last wrote, and a pop of
//! slots already seen published does not fetch the producer's. Every index read from the
//! segment is checked against the ring's size (the peer may write anything there).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::{Segment, ShmError};

/// Bytes per slot.
pub const SLOT: usize = 256;
const HEAD: usize = 0;
const TAIL: usize = 64;
const SLOTS: usize = 128;

/// One direction of a channel: one process produces, the other consumes.
pub struct Ring {
    seg: Arc<Segment>,
    base: usize,
    cap: u64,
    /// The other side's index as this side last read it (the producer's copy of `tail`, the
    /// consumer's of `head`): this process's own memory, not the segment's.
    seen: AtomicU64,
}

impl Ring {
    /// The most slots a ring has (a peer's claim beyond it is refused).
    pub const MAX_SLOTS: u64 = 1 << 20;

    /// Bytes a ring of `cap` slots takes; `None` beyond [`Ring::MAX_SLOTS`].
    pub fn bytes_needed(cap: u64) -> Option<usize> {
        (cap <= Self::MAX_SLOTS).then(|| SLOTS + cap as usize * SLOT)
    }

    /// The ring at `base` of `seg`, with `cap` slots (indices start at zero in a fresh segment).
    pub fn new(seg: Arc<Segment>, base: usize, cap: u64) -> Result<Ring, ShmError> {
        if cap == 0
            || base % 64 != 0
            || Self::bytes_needed(cap)
                .and_then(|n| base.checked_add(n))
                .is_none_or(|e| e > seg.len())
        {
            return Err(ShmError::OutOfBounds(format!(
                "ring of {cap} slots at {base}"
            )));
        }
        Ok(Ring {
            seg,
            base,
            cap,
            seen: AtomicU64::new(0),
        })
    }

    fn index(&self, at: usize, order: Ordering) -> Result<u64, ShmError> {
        Ok(self.seg.atomic_u64(self.base + at)?.load(order))
    }

    /// Slots in use between `head` and `tail`, refused if more than the ring has.
    fn used(&self, head: u64, tail: u64) -> Result<u64, ShmError> {
        let n = head.wrapping_sub(tail);
        if n > self.cap {
            return Err(ShmError::Corrupt(format!(
                "ring indices {head}/{tail} for {} slots",
                self.cap
            )));
        }
        Ok(n)
    }

    /// Producer: `head` and the slots in use, reading `tail` from the segment only when the
    /// copy of it says the ring is full (or does not fit `head`: a fresh copy, or a peer that
    /// wrote `head`).
    fn producer(&self) -> Result<(u64, u64), ShmError> {
        // This side's own index: only it writes the line (a peer's write is caught below).
        let head = self.index(HEAD, Ordering::Relaxed)?;
        let seen = self.seen.load(Ordering::Relaxed);
        if head.wrapping_sub(seen) < self.cap {
            return Ok((head, head.wrapping_sub(seen)));
        }
        // Acquire: the consumer is done with the slots it freed before this store.
        let tail = self.index(TAIL, Ordering::Acquire)?;
        self.seen.store(tail, Ordering::Relaxed);
        Ok((head, self.used(head, tail)?))
    }

    /// Consumer: `tail` and the slots published, reading `head` from the segment only when
    /// the copy of it says the ring is empty (or does not fit `tail`).
    fn consumer(&self) -> Result<(u64, u64), ShmError> {
        let tail = self.index(TAIL, Ordering::Relaxed)?;
        let seen = self.seen.load(Ordering::Relaxed);
        let n = seen.wrapping_sub(tail);
        if n != 0 && n <= self.cap {
            // Slots the producer published by the head this side saw (read with acquire).
            return Ok((tail, n));
        }
        // Acquire: the slots before `head` were written before its store.
        let head = self.index(HEAD, Ordering::Acquire)?;
        self.seen.store(head, Ordering::Relaxed);
        Ok((tail, self.used(head, tail)?))
    }

    /// Producer: appends a slot (`data` at most [`SLOT`] bytes); `Ok(false)` if the ring is full.
    pub fn try_push(&self, data: &[u8]) -> Result<bool, ShmError> {
        if data.len() > SLOT {
            return Err(ShmError::OutOfBounds(format!(
                "{} bytes for a slot of {SLOT}",
                data.len()
            )));
        }
        let (head, used) = self.producer()?;
        if used == self.cap {
            return Ok(false);
        }
        // In bounds: `cap` slots lie after the indices (checked in `new`).
        let at = self.base + SLOTS + (head % self.cap) as usize * SLOT;
        self.seg.write(at, data)?;
        self.seg
            .atomic_u64(self.base + HEAD)?
            .store(head.wrapping_add(1), Ordering::Release);
        Ok(true)
    }

    /// Consumer: takes the oldest slot into `out`; `Ok(false)` if the ring is empty.
    pub fn try_pop(&self, out: &mut [u8; SLOT]) -> Result<bool, ShmError> {
        let (tail, n) = self.consumer()?;
        if n == 0 {
            return Ok(false);
        }
        let at = self.base + SLOTS + (tail % self.cap) as usize * SLOT;
        self.seg.read(at, out)?;
        self.seg
            .atomic_u64(self.base + TAIL)?
            .store(tail.wrapping_add(1), Ordering::Release);
        Ok(true)
    }

    /// Whether a push would find no room (for the producer: only the consumer frees slots, so
    /// room seen here stays until the producer pushes).
    pub fn is_full(&self) -> bool {
        self.producer().map(|(_, n)| n == self.cap).unwrap_or(true)
    }

    /// Whether nothing is waiting (for the consumer).
    pub fn is_empty(&self) -> bool {
        self.consumer().map(|(_, n)| n == 0).unwrap_or(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fifo_wraps_and_reports_full_and_empty() {
        let seg = Arc::new(Segment::create("ring", 4096 * 4).unwrap());
        let r = Ring::new(seg, 0, 4).unwrap();
        let mut out = [0u8; SLOT];
        assert!(!r.try_pop(&mut out).unwrap());
        for round in 0..5u8 {
            for i in 0..4u8 {
                assert!(r.try_push(&[round, i]).unwrap());
            }
            assert!(!r.try_push(&[9]).unwrap(), "full");
            for i in 0..4u8 {
                assert!(r.try_pop(&mut out).unwrap());
                assert_eq!(&out[..2], &[round, i]);
            }
            assert!(r.is_empty());
        }
        assert!(r.try_push(&[0u8; SLOT + 1]).is_err());
    }

    #[test]
    fn garbage_indices_are_refused() {
        let seg = Arc::new(Segment::create("ring", 4096).unwrap());
        let r = Ring::new(seg.clone(), 0, 4).unwrap();
        seg.atomic_u64(0).unwrap().store(100, Ordering::SeqCst);
        let mut out = [0u8; SLOT];
        assert!(matches!(r.try_pop(&mut out), Err(ShmError::Corrupt(_))));
        assert!(Ring::new(seg, 0, 1000).is_err(), "does not fit");
    }

    #[test]
    fn each_side_reads_the_others_index_only_when_its_copy_runs_out() {
        let seg = Arc::new(Segment::create("ring", 4096 * 2).unwrap());
        let tx = Ring::new(seg.clone(), 0, 4).unwrap();
        let rx = Ring::new(seg.clone(), 0, 4).unwrap();
        let mut out = [0u8; SLOT];
        assert!(tx.try_push(&[1]).unwrap());
        // Garbage in the consumer's index: the producer's copy says there is room (3 slots),
        // so it pushes without reading it; once its copy says full, it reads it and refuses.
        seg.atomic_u64(TAIL)
            .unwrap()
            .store(1 << 40, Ordering::SeqCst);
        for i in 2..5u8 {
            assert!(tx.try_push(&[i]).unwrap());
        }
        assert!(matches!(tx.try_push(&[5]), Err(ShmError::Corrupt(_))));
        assert!(
            tx.is_full(),
            "a ring it cannot read is full to the producer"
        );
        seg.atomic_u64(TAIL).unwrap().store(0, Ordering::SeqCst);
        // The consumer reads `head` once (4 published) and pops them from its copy; garbage
        // written to `head` meanwhile is seen only when the copy runs out.
        assert!(rx.try_pop(&mut out).unwrap());
        assert_eq!(out[0], 1);
        seg.atomic_u64(HEAD)
            .unwrap()
            .store(1 << 40, Ordering::SeqCst);
        for i in 2..5u8 {
            assert!(rx.try_pop(&mut out).unwrap());
            assert_eq!(out[0], i);
        }
        assert!(matches!(rx.try_pop(&mut out), Err(ShmError::Corrupt(_))));
        assert!(
            !rx.is_empty(),
            "a ring it cannot read is not empty to the consumer"
        );
        // Sound indices again: both sides go on from what the segment says.
        seg.atomic_u64(HEAD).unwrap().store(4, Ordering::SeqCst);
        assert!(rx.is_empty());
        assert!(tx.try_push(&[6]).unwrap());
        assert!(rx.try_pop(&mut out).unwrap());
        assert_eq!(out[0], 6);
    }

    #[test]
    fn indices_wrap_at_the_top_of_u64_and_huge_rings_are_refused() {
        let seg = Arc::new(Segment::create("ring", 4096 * 2).unwrap());
        let r = Ring::new(seg.clone(), 0, 4).unwrap();
        let start = u64::MAX - 1;
        seg.atomic_u64(HEAD).unwrap().store(start, Ordering::SeqCst);
        seg.atomic_u64(TAIL).unwrap().store(start, Ordering::SeqCst);
        for i in 0..4u8 {
            assert!(r.try_push(&[i; 8]).unwrap());
        }
        assert!(r.is_full() && !r.try_push(&[9; 8]).unwrap());
        let mut out = [0u8; SLOT];
        for i in 0..4u8 {
            assert!(r.try_pop(&mut out).unwrap());
            assert_eq!(out[..8], [i; 8]);
        }
        assert!(r.is_empty());
        // A slot count whose size would overflow (a peer's claim) is refused, not wrapped.
        assert!(Ring::bytes_needed(1 << 56).is_none());
        assert!(Ring::new(seg, 0, 1 << 56).is_err());
    }

    #[test]
    fn two_threads_pass_a_million_slots_in_order() {
        let seg = Arc::new(Segment::create("ring", 4096 * 20).unwrap());
        let tx = Ring::new(seg.clone(), 0, 64).unwrap();
        let rx = Ring::new(seg, 0, 64).unwrap();
        let n = 200_000u64;
        let t = std::thread::spawn(move || {
            for i in 0..n {
                while !tx.try_push(&i.to_le_bytes()).unwrap() {
                    std::hint::spin_loop();
                }
            }
        });
        let mut out = [0u8; SLOT];
        for i in 0..n {
            while !rx.try_pop(&mut out).unwrap() {
                std::hint::spin_loop();
            }
            assert_eq!(u64::from_le_bytes(out[..8].try_into().unwrap()), i);
        }
        t.join().unwrap();
    }
}
