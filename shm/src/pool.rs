//! Pages handed out in contiguous runs, tracked by a bitmap in the segment.
//!
//! One process allocates (it alone sets bits); any process frees (clears bits) — with atomic
//! read-modify-writes, so an allocation and a concurrent free of other pages never lose each
//! other's update. A region is valid only while all its pages' bits are set: descriptors naming
//! anything else are refused.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::{Segment, ShmError};

/// A run of bytes in the pool, by offset in the segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    /// Offset of the first byte in the segment.
    pub offset: usize,
    /// Length in bytes.
    pub len: usize,
}

/// A page pool inside a segment.
pub struct Pool {
    seg: Arc<Segment>,
    bitmap: usize,
    pages: usize,
    npages: usize,
    page: usize,
}

impl Pool {
    /// Bytes a pool of `npages` pages of `page` bytes takes (bitmap rounded up to a page);
    /// `None` if that overflows (the numbers may come from a peer).
    pub fn bytes_needed(npages: usize, page: usize) -> Option<usize> {
        if page == 0 {
            return None;
        }
        let bitmap = npages.div_ceil(64).checked_mul(8)?;
        bitmap
            .div_ceil(page)
            .checked_mul(page)?
            .checked_add(npages.checked_mul(page)?)
    }

    /// The largest page a pool takes (a peer's claim beyond it is refused).
    pub const MAX_PAGE: usize = 1 << 30;
    /// The smallest (a span is checked page by page: tiny pages would make that slow).
    pub const MIN_PAGE: usize = 4096;

    /// The pool at `base` (page-aligned) of `seg`.
    pub fn new(
        seg: Arc<Segment>,
        base: usize,
        npages: usize,
        page: usize,
    ) -> Result<Pool, ShmError> {
        if !(Self::MIN_PAGE..=Self::MAX_PAGE).contains(&page)
            || !page.is_power_of_two()
            || base % page != 0 && base % 4096 != 0
        {
            return Err(ShmError::OutOfBounds(format!("page size {page} at {base}")));
        }
        if npages == 0
            || Self::bytes_needed(npages, page)
                .and_then(|n| base.checked_add(n))
                .is_none_or(|e| e > seg.len())
        {
            return Err(ShmError::OutOfBounds(format!(
                "pool of {npages} pages at {base}"
            )));
        }
        // Cannot overflow: `bytes_needed` was checked above.
        let bitmap_bytes = npages.div_ceil(64) * 8;
        Ok(Pool {
            seg,
            bitmap: base,
            pages: base + bitmap_bytes.div_ceil(page) * page,
            npages,
            page,
        })
    }

    /// Page size in bytes.
    pub fn page_size(&self) -> usize {
        self.page
    }

    /// Bytes the pool holds.
    pub fn capacity(&self) -> usize {
        self.npages * self.page
    }

    fn word(&self, i: usize) -> Result<&std::sync::atomic::AtomicU64, ShmError> {
        self.seg.atomic_u64(self.bitmap + i * 8)
    }

    /// The bitmap word `i`, read (a peer's pool is mapped read-only).
    fn load(&self, i: usize) -> Result<u64, ShmError> {
        self.seg.load_u64(self.bitmap + i * 8, Ordering::Acquire)
    }

    fn is_set(&self, p: usize) -> Result<bool, ShmError> {
        Ok(self.load(p / 64)? & (1 << (p % 64)) != 0)
    }

    /// Allocates a contiguous region of `len` bytes (at least one page), first fit from the
    /// start of the pool, so recently freed (warm, already faulted-in) pages are reused first.
    /// Only one process may allocate from a pool.
    pub fn alloc(&self, len: usize) -> Result<Region, ShmError> {
        let n = len.max(1).div_ceil(self.page);
        if n > self.npages {
            return Err(ShmError::Exhausted(len));
        }
        // Scan a word (64 pages) at a time; `run` counts free pages ending just before `p`.
        let (mut p, mut run) = (0usize, 0usize);
        while p < self.npages {
            let word = self.load(p / 64)?;
            if p % 64 == 0 && p + 64 <= self.npages && (word == 0 || word == u64::MAX) {
                if word == u64::MAX {
                    run = 0;
                    p += 64;
                    continue;
                }
                if run + 64 >= n {
                    // The free run began `run` pages before this all-free word.
                    return self.take(p - run, n, len);
                }
                run += 64;
                p += 64;
                continue;
            }
            if word & (1 << (p % 64)) != 0 {
                run = 0;
            } else {
                run += 1;
                if run == n {
                    return self.take(p + 1 - n, n, len);
                }
            }
            p += 1;
        }
        Err(ShmError::Exhausted(len))
    }

    fn take(&self, start: usize, n: usize, len: usize) -> Result<Region, ShmError> {
        let mut q = start;
        while q < start + n {
            let (w, mask, next) = word_span(start, n, q);
            let before = self.word(w)?.fetch_or(mask, Ordering::AcqRel);
            if before & mask != 0 {
                // Only this process sets bits, so a set bit here means the bitmap was changed
                // behind the allocator's back: undo what this call set (this word's new bits,
                // the earlier words' whole spans) and refuse.
                self.word(w)?.fetch_and(!(mask & !before), Ordering::AcqRel);
                if q > start {
                    self.set_bits(start, q - start, false)?;
                }
                return Err(ShmError::Corrupt(
                    "pool bitmap changed during allocation".into(),
                ));
            }
            q = next;
        }
        Ok(Region {
            offset: self.pages + start * self.page,
            len,
        })
    }

    /// Sets or clears the bits of pages `p..p+n`; returns whether every bit had the opposite
    /// value before.
    fn set_bits(&self, p: usize, n: usize, set: bool) -> Result<bool, ShmError> {
        let mut all = true;
        let mut q = p;
        while q < p + n {
            let (w, mask, next) = word_span(p, n, q);
            let before = if set {
                self.word(w)?.fetch_or(mask, Ordering::AcqRel)
            } else {
                self.word(w)?.fetch_and(!mask, Ordering::AcqRel)
            };
            let had = before & mask;
            all &= if set { had == 0 } else { had == mask };
            q = next;
        }
        Ok(all)
    }

    /// Whether every page of `p..p+n` is allocated: a word of the bitmap at a time.
    fn all_set(&self, p: usize, n: usize) -> Result<bool, ShmError> {
        let mut q = p;
        while q < p + n {
            let (w, mask, next) = word_span(p, n, q);
            if self.load(w)? & mask != mask {
                return Ok(false);
            }
            q = next;
        }
        Ok(true)
    }

    /// The pages of a region, if it lies inside the pool on page boundaries.
    fn pages_of(&self, r: Region) -> Result<(usize, usize), ShmError> {
        let bad =
            || ShmError::OutOfBounds(format!("region {}+{} outside the pool", r.offset, r.len));
        let rel = r.offset.checked_sub(self.pages).ok_or_else(bad)?;
        if rel % self.page != 0 {
            return Err(bad());
        }
        let p = rel / self.page;
        let n = r.len.max(1).div_ceil(self.page);
        if p.checked_add(n).is_none_or(|e| e > self.npages) {
            return Err(bad());
        }
        Ok((p, n))
    }

    /// Checks that a region (from a peer's descriptor) is inside the pool and allocated.
    pub fn check(&self, r: Region) -> Result<(), ShmError> {
        let (p, n) = self.pages_of(r)?;
        if !self.all_set(p, n)? {
            return Err(ShmError::NotAllocated {
                offset: r.offset,
                len: r.len,
            });
        }
        Ok(())
    }

    /// Checks that `len` bytes at `offset` (anywhere, not only on page boundaries) lie inside
    /// the pool, on allocated pages: a part of a region, named by a peer.
    pub fn check_span(&self, offset: usize, len: usize) -> Result<(), ShmError> {
        let bad = || ShmError::OutOfBounds(format!("bytes {offset}+{len} outside the pool"));
        let rel = offset.checked_sub(self.pages).ok_or_else(bad)?;
        let end = rel.checked_add(len.max(1)).ok_or_else(bad)?;
        let (p, q) = (rel / self.page, (end - 1) / self.page);
        if q >= self.npages {
            return Err(bad());
        }
        if !self.all_set(p, q + 1 - p)? {
            return Err(ShmError::NotAllocated { offset, len });
        }
        Ok(())
    }

    /// Frees a region (from any process). Freeing pages that are not allocated is refused.
    pub fn free(&self, r: Region) -> Result<(), ShmError> {
        let (p, n) = self.pages_of(r)?;
        self.check(r)?;
        if !self.set_bits(p, n, false)? {
            return Err(ShmError::NotAllocated {
                offset: r.offset,
                len: r.len,
            });
        }
        Ok(())
    }

    /// Pages not allocated.
    pub fn free_pages(&self) -> usize {
        (0..self.npages)
            .filter(|&p| !self.is_set(p).unwrap_or(true))
            .count()
    }
}

/// Of the pages `p..p+n`, the part in the bitmap word holding page `q`: the word, its mask,
/// and the first page after it.
fn word_span(p: usize, n: usize, q: usize) -> (usize, u64, usize) {
    let w = q / 64;
    let lo = q % 64;
    let hi = (p + n - w * 64).min(64);
    let mask = if hi - lo == 64 {
        u64::MAX
    } else {
        ((1u64 << (hi - lo)) - 1) << lo
    };
    (w, mask, w * 64 + hi)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(npages: usize) -> Pool {
        let seg = Arc::new(
            Segment::create("pool", Pool::bytes_needed(npages, 4096).unwrap() + 4096).unwrap(),
        );
        Pool::new(seg, 4096, npages, 4096).unwrap()
    }

    #[test]
    fn claims_that_overflow_or_do_not_fit_are_refused() {
        let seg = Arc::new(Segment::create("pool", 4096 * 8).unwrap());
        // 2^34 pages of 1 GiB: 2^64 bytes, which would wrap to 0 unchecked.
        assert!(Pool::new(seg.clone(), 4096, 1 << 34, 1 << 30).is_err());
        assert!(Pool::new(seg.clone(), 4096, usize::MAX, 4096).is_err());
        assert!(Pool::new(seg.clone(), 4096, 4, 1).is_err(), "a 1-byte page");
        assert!(
            Pool::new(seg.clone(), 4096, 4, 64).is_err(),
            "pages below 4 KiB"
        );
        assert!(Pool::new(seg.clone(), 4096, 0, 4096).is_err(), "no pages");
        assert!(
            Pool::new(seg.clone(), 4096, 100, 4096).is_err(),
            "does not fit"
        );
        assert!(Pool::new(seg, 4096, 4, 4096).is_ok());
    }

    #[test]
    fn an_allocation_that_meets_a_bit_set_behind_its_back_undoes_what_it_set() {
        let p = pool(256);
        // Page 100 (word 1) marked used by someone else, between the search and the take.
        p.word(1).unwrap().fetch_or(1 << 36, Ordering::AcqRel);
        assert!(matches!(
            p.take(0, 160, 160 * 4096),
            Err(ShmError::Corrupt(_))
        ));
        assert_eq!(p.load(0).unwrap(), 0, "word 0 given back");
        assert_eq!(p.load(1).unwrap(), 1 << 36, "only the other's bit left");
        assert_eq!(p.load(2).unwrap(), 0);
        // The pool still allocates around it.
        let r = p.alloc(64 * 4096).unwrap();
        assert_eq!(r.offset, p.pages);
    }

    #[test]
    fn a_span_inside_allocated_pages_passes_and_others_do_not() {
        let p = pool(8);
        let a = p.alloc(2 * 4096).unwrap();
        p.check_span(a.offset + 100, 8000).unwrap();
        assert!(
            p.check_span(a.offset + 100, 8100).is_err(),
            "into a free page"
        );
        assert!(p.check_span(a.offset - 1, 2).is_err(), "before the pages");
        assert!(
            p.check_span(a.offset + 8 * 4096, 1).is_err(),
            "past the pool"
        );
        assert!(p.check_span(usize::MAX - 2, 10).is_err(), "overflow");
    }

    #[test]
    fn contiguous_runs_are_allocated_freed_and_reused() {
        let p = pool(200);
        let a = p.alloc(3 * 4096).unwrap();
        let b = p.alloc(1).unwrap();
        let c = p.alloc(70 * 4096 + 5).unwrap();
        assert_eq!(p.free_pages(), 200 - 3 - 1 - 71);
        assert_eq!(b.offset, a.offset + 3 * 4096);
        p.check(c).unwrap();
        p.free(a).unwrap();
        assert!(
            matches!(p.free(a), Err(ShmError::NotAllocated { .. })),
            "double free"
        );
        assert!(
            matches!(p.check(a), Err(ShmError::NotAllocated { .. })),
            "freed page"
        );
        p.free(b).unwrap();
        p.free(c).unwrap();
        assert_eq!(p.free_pages(), 200);
        assert!(matches!(p.alloc(201 * 4096), Err(ShmError::Exhausted(_))));
        let all = p.alloc(200 * 4096).unwrap();
        assert!(p.alloc(1).is_err());
        p.free(all).unwrap();
    }

    #[test]
    fn descriptors_outside_the_pool_are_refused() {
        let p = pool(10);
        let r = p.alloc(4096).unwrap();
        for bad in [
            Region { offset: 0, len: 10 },
            Region {
                offset: r.offset + 1,
                len: 10,
            },
            Region {
                offset: r.offset,
                len: 11 * 4096,
            },
            Region {
                offset: usize::MAX - 10,
                len: 100,
            },
        ] {
            assert!(p.check(bad).is_err(), "{bad:?}");
            assert!(p.free(bad).is_err(), "{bad:?}");
        }
        assert_eq!(p.free_pages(), 9, "refusals changed nothing");
    }

    #[test]
    fn allocation_and_concurrent_frees_from_another_thread_keep_the_bitmap_consistent() {
        let seg = Arc::new(
            Segment::create("pool", Pool::bytes_needed(256, 4096).unwrap() + 4096).unwrap(),
        );
        let owner = Pool::new(seg.clone(), 4096, 256, 4096).unwrap();
        let other = Pool::new(seg, 4096, 256, 4096).unwrap();
        let (tx, rx) = std::sync::mpsc::sync_channel::<Region>(64);
        let freer = std::thread::spawn(move || {
            for r in rx {
                other.free(r).unwrap();
            }
        });
        for i in 0..20_000usize {
            let r = loop {
                match owner.alloc((i % 5 + 1) * 4096) {
                    Ok(r) => break r,
                    Err(ShmError::Exhausted(_)) => std::thread::yield_now(),
                    Err(e) => panic!("{e}"),
                }
            };
            tx.send(r).unwrap();
        }
        drop(tx);
        freer.join().unwrap();
        assert_eq!(owner.free_pages(), 256);
    }
}
