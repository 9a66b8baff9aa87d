//! A single-producer single-consumer ring of fixed-size slots in a segment.
//!
//! Layout at `base`: the producer's index (`head`, a u64 on its own cache line), the consumer's
//! index (`tail`, likewise), then `cap` slots of [`STRIDE`] bytes, each a sequence word and
//! [`SLOT`] bytes of data, starting on a cache line. The producer writes a slot's data, then
//! publishes it with a release store of its sequence word (its index plus one) and advances
//! `head`; the consumer polls the sequence word of the slot at `tail` with an acquire load, so
//! that the line it polls is the line the message starts in, reads the slot, then frees it
//! with a release store of `tail`.
//!
//! The producer keeps its own copy of `tail`, as it last read it, and reads the consumer's
//! cache line again only when its copy says the ring is full. Every index read from the
//! segment is checked against the ring's size, and a slot is taken only when its sequence
//! word is exactly the one due (the peer may write anything there).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::{Segment, ShmError};

/// Bytes of data per slot.
pub const SLOT: usize = 256;
/// Bytes a slot takes: its sequence word, its data, and what rounds it up to whole cache lines.
const STRIDE: usize = SLOT + 64;
/// Where a slot's data starts, after its sequence word.
const DATA: usize = 8;
const HEAD: usize = 0;
const TAIL: usize = 64;
const SLOTS: usize = 128;

/// One direction of a channel: one process produces, the other consumes.
pub struct Ring {
    seg: Arc<Segment>,
    base: usize,
    cap: u64,
    /// The producer's copy of `tail`, as it last read it: this process's own memory, not the
    /// segment's.
    seen: AtomicU64,
}

impl Ring {
    /// The most slots a ring has (a peer's claim beyond it is refused).
    pub const MAX_SLOTS: u64 = 1 << 20;

    /// Bytes a ring of `cap` slots takes; `None` beyond [`Ring::MAX_SLOTS`].
    pub fn bytes_needed(cap: u64) -> Option<usize> {
        (cap <= Self::MAX_SLOTS).then(|| SLOTS + cap as usize * STRIDE)
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

    /// Where slot `index` lies (in bounds: `cap` slots lie after the indices, checked in
    /// `new`).
    fn slot(&self, index: u64) -> usize {
        self.base + SLOTS + (index % self.cap) as usize * STRIDE
    }

    /// Consumer: `tail`, if the slot at `tail` is published (its sequence word is `tail + 1`).
    fn due(&self) -> Result<Option<u64>, ShmError> {
        // This side's own index: only it writes the line (a peer's write makes the slots it
        // names look unpublished, or hands over what the peer wrote: its own loss).
        let tail = self.index(TAIL, Ordering::Relaxed)?;
        // Acquire: the slot's data was written before its sequence word.
        let seq = self
            .seg
            .atomic_u64(self.slot(tail))?
            .load(Ordering::Acquire);
        Ok((seq == tail.wrapping_add(1)).then_some(tail))
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
        let at = self.slot(head);
        self.seg.write(at + DATA, data)?;
        let next = head.wrapping_add(1);
        self.seg.atomic_u64(at)?.store(next, Ordering::Release);
        self.seg
            .atomic_u64(self.base + HEAD)?
            .store(next, Ordering::Relaxed);
        Ok(true)
    }

    /// Consumer: takes the oldest slot into `out`; `Ok(false)` if the ring is empty.
    pub fn try_pop(&self, out: &mut [u8; SLOT]) -> Result<bool, ShmError> {
        let Some(tail) = self.due()? else {
            return Ok(false);
        };
        self.seg.read(self.slot(tail) + DATA, out)?;
        self.seg
            .atomic_u64(self.base + TAIL)?
            .store(tail.wrapping_add(1), Ordering::Release);
        Ok(true)
    }

    /// Whether a push would find no room (for the producer: only the consumer frees slots, so
    /// room seen here stays until the producer pushes). Indices that do not fit the ring are
    /// not "full": a producer told so would wait for room that never comes, where its push
    /// says at once that the ring is corrupt.
    pub fn is_full(&self) -> bool {
        self.producer().is_ok_and(|(_, n)| n == self.cap)
    }

    /// Whether nothing is waiting (for the consumer).
    pub fn is_empty(&self) -> bool {
        self.due().map(|d| d.is_none()).unwrap_or(false)
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
    fn garbage_indices_and_sequence_words_are_refused_or_never_taken() {
        let seg = Arc::new(Segment::create("ring", 4096 * 2).unwrap());
        let r = Ring::new(seg.clone(), 0, 4).unwrap();
        let mut out = [0u8; SLOT];
        // Garbage in the producer's index: the consumer sees nothing published; the producer
        // refuses its index.
        seg.atomic_u64(HEAD).unwrap().store(100, Ordering::SeqCst);
        assert!(!r.try_pop(&mut out).unwrap());
        assert!(matches!(r.try_push(&[1]), Err(ShmError::Corrupt(_))));
        seg.atomic_u64(HEAD).unwrap().store(0, Ordering::SeqCst);
        // A slot's sequence word that is not the one due is not a message.
        for bad in [0u64, 2, 5, u64::MAX] {
            seg.atomic_u64(SLOTS).unwrap().store(bad, Ordering::SeqCst);
            assert!(r.is_empty() && !r.try_pop(&mut out).unwrap(), "{bad}");
        }
        assert!(r.try_push(&[7]).unwrap());
        assert!(r.try_pop(&mut out).unwrap());
        assert_eq!(out[0], 7);
        assert!(Ring::new(seg, 0, 1000).is_err(), "does not fit");
    }

    #[test]
    fn the_producer_reads_the_consumers_index_only_when_its_copy_runs_out() {
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
        // Not a full ring to wait on (no room would ever come): a push says why.
        assert!(!tx.is_full(), "a ring it cannot read is not full");
        // The consumer, at that garbage index, finds no slot due there.
        assert!(rx.is_empty());
        seg.atomic_u64(TAIL).unwrap().store(0, Ordering::SeqCst);
        for i in 1..5u8 {
            assert!(rx.try_pop(&mut out).unwrap());
            assert_eq!(out[0], i);
        }
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
