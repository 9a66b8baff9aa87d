//! A single-producer single-consumer ring of fixed-size slots in a segment.
//!
//! Layout at `base`: the producer's index (`head`, a u64 on its own cache line), the consumer's
//! index (`tail`, likewise), then `cap` slots of [`SLOT`] bytes. The producer writes a slot, then
//! publishes it with a release store of `head`; the consumer sees it with an acquire load, reads
//! it, then frees it with a release store of `tail`.

use std::sync::atomic::Ordering;
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
        Ok(Ring { seg, base, cap })
    }

    fn indices(&self) -> Result<(u64, u64), ShmError> {
        let head = self
            .seg
            .atomic_u64(self.base + HEAD)?
            .load(Ordering::Acquire);
        let tail = self
            .seg
            .atomic_u64(self.base + TAIL)?
            .load(Ordering::Acquire);
        if head.wrapping_sub(tail) > self.cap {
            return Err(ShmError::Corrupt(format!(
                "ring indices {head}/{tail} for {} slots",
                self.cap
            )));
        }
        Ok((head, tail))
    }

    /// Producer: appends a slot (`data` at most [`SLOT`] bytes); `Ok(false)` if the ring is full.
    pub fn try_push(&self, data: &[u8]) -> Result<bool, ShmError> {
        if data.len() > SLOT {
            return Err(ShmError::OutOfBounds(format!(
                "{} bytes for a slot of {SLOT}",
                data.len()
            )));
        }
        let (head, tail) = self.indices()?;
        if head.wrapping_sub(tail) == self.cap {
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
        let (head, tail) = self.indices()?;
        if head == tail {
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
        self.indices()
            .map(|(h, t)| h.wrapping_sub(t) == self.cap)
            .unwrap_or(true)
    }

    /// Whether nothing is waiting (for the consumer).
    pub fn is_empty(&self) -> bool {
        self.indices().map(|(h, t)| h == t).unwrap_or(false)
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
