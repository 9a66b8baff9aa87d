//! Copies of bytes at the speed of memory, wherever the two ends lie.
//!
//! glibc's `memcpy` copies a block of more than 2 KiB with `rep movsb` on CPUs that have fast
//! short `rep movsb`, up to a threshold: on AMD's, the size of the core's L2 (512 KiB on Zen 3,
//! 1 MiB on Zen 4). There (measured on this project's AMD EPYC machines, glibc 2.36) it runs 15
//! to 30 times slower where the destination lies 1 to 63 bytes after the source modulo a 4 KiB
//! page: 64 KiB at 2.7-2.9 GB/s, against 48 GB/s a page apart. A numpy array of more than
//! 128 KiB starts 16 bytes into a page (malloc's header), and what the store copies into it
//! comes from pages (a pull's landing pages): every such copy of 2 KiB to 512 KiB was slow.
//! [`copy`] cuts those copies into pieces of 2 KiB, which glibc copies with vector loads and
//! stores at full speed; every other copy is one `memcpy`.

/// The pieces of a copy at a short distance: glibc's smallest `rep movsb` threshold (SSE2's),
/// under which it never uses `rep movsb`.
const PIECE: usize = 2048;

/// The largest copy cut into pieces: past the largest L2 of AMD's cores glibc copies without
/// `rep movsb` (a vector loop, or non-temporal stores that pieces would lose).
const MAX_PIECED: usize = 1 << 20;

/// Whether a copy of `n` bytes from `src` to `dst` is one that `rep movsb` copies slowly.
#[inline]
fn short_distance(dst: *const u8, src: *const u8, n: usize) -> bool {
    let d = (dst as usize).wrapping_sub(src as usize) & 4095;
    n > PIECE && n <= MAX_PIECED && (1..64).contains(&d)
}

/// Copies `src` into `dst`, as `dst.copy_from_slice(src)` (the lengths must be equal).
#[inline]
pub fn copy(dst: &mut [u8], src: &[u8]) {
    if dst.len() != src.len() {
        // copy_from_slice's own panic, naming both lengths.
        dst.copy_from_slice(src);
        return;
    }
    // Through the pointers: over two slices of a length known when compiling, LLVM merges
    // the pieces back into one `memcpy`.
    // SAFETY: `src` is valid for reads and `dst` for writes of `len` bytes; a `&mut` and a
    // `&` never overlap.
    unsafe { copy_nonoverlapping(src.as_ptr(), dst.as_mut_ptr(), src.len()) };
}

/// Copies `n` bytes from `src` to `dst`, as [`std::ptr::copy_nonoverlapping`].
///
/// # Safety
/// As [`std::ptr::copy_nonoverlapping`]: `src` valid for reads and `dst` for writes of `n`
/// bytes, the two not overlapping.
#[inline]
pub unsafe fn copy_nonoverlapping(src: *const u8, dst: *mut u8, n: usize) {
    if !short_distance(dst, src, n) {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, n) };
        return;
    }
    let mut at = 0;
    while at < n {
        let k = (n - at).min(PIECE);
        // SAFETY: `at + k <= n`: inside both ranges of the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(src.add(at), dst.add(at), k) };
        at += k;
    }
}

/// Copies `n` bytes from `src` to `dst`, which may overlap, as [`std::ptr::copy`]; apart, as
/// [`copy_nonoverlapping`].
///
/// # Safety
/// As [`std::ptr::copy`]: `src` valid for reads and `dst` for writes of `n` bytes.
#[inline]
pub unsafe fn copy_any(src: *const u8, dst: *mut u8, n: usize) {
    let (s, d) = (src as usize, dst as usize);
    if s.wrapping_add(n) <= d || d.wrapping_add(n) <= s {
        // SAFETY: the caller's contract, and the two ranges are apart (checked).
        unsafe { copy_nonoverlapping(src, dst, n) };
    } else {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::copy(src, dst, n) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The index of `v`'s first byte at a page, plus `extra`.
    fn paged(v: &[u8], extra: usize) -> usize {
        v.as_ptr().align_offset(4096) + extra
    }

    #[test]
    fn copies_are_exact_at_every_distance_and_length() {
        let mut src = vec![0u8; (3 << 20) + 8192];
        let s0 = paged(&src, 0);
        for (i, b) in src.iter_mut().enumerate() {
            *b = (i * 7 + i / 251) as u8;
        }
        let mut buf = vec![0u8; (3 << 20) + 16384];
        let b0 = paged(&buf, 4096);
        for len in [0, 1, 2047, 2048, 2049, 4096, 65536 + 5, 1 << 20, 3 << 20] {
            // Destinations 0, 1, 16, 63 (pieced where 2 KiB < len <= 1 MiB), 64, 100 and 4095
            // bytes past the source modulo a page.
            for shift in [0usize, 1, 16, 63, 64, 100, 4095] {
                assert_eq!(
                    short_distance(buf[b0 + shift..].as_ptr(), src[s0..].as_ptr(), len),
                    (1..64).contains(&shift) && len > PIECE && len <= MAX_PIECED
                );
                let s = &src[s0..s0 + len];
                buf.fill(0);
                copy(&mut buf[b0 + shift..b0 + shift + len], s);
                assert_eq!(
                    &buf[b0 + shift..b0 + shift + len],
                    s,
                    "len {len} shift {shift}"
                );
                assert!(buf[..b0 + shift].iter().all(|&b| b == 0));
                assert!(buf[b0 + shift + len..].iter().all(|&b| b == 0));
                buf.fill(0);
                // SAFETY: both ranges are inside their vectors, which do not overlap.
                unsafe { copy_nonoverlapping(s.as_ptr(), buf.as_mut_ptr().add(b0 + shift), len) };
                assert_eq!(
                    &buf[b0 + shift..b0 + shift + len],
                    s,
                    "len {len} shift {shift}"
                );
                assert!(buf[b0 + shift + len..].iter().all(|&b| b == 0));
            }
        }
    }

    #[test]
    fn overlapping_copies_are_memmoves() {
        let mut v: Vec<u8> = (0..10000u32).map(|i| i as u8).collect();
        let want: Vec<u8> = v[..6000].to_vec();
        // SAFETY: both ranges are inside `v`.
        unsafe { copy_any(v.as_ptr(), v.as_mut_ptr().add(16), 6000) };
        assert_eq!(&v[16..6016], &want[..]);
        // Apart, 16 bytes past modulo a page: the pieced copy.
        let apart: Vec<u8> = v[16..2516].to_vec();
        assert!(short_distance(v[4128..].as_ptr(), v[16..].as_ptr(), 2500));
        // SAFETY: both ranges are inside `v`, apart.
        unsafe { copy_any(v.as_ptr().add(16), v.as_mut_ptr().add(4128), 2500) };
        assert_eq!(&v[4128..6628], &apart[..]);
    }

    #[test]
    #[should_panic]
    fn lengths_that_differ_panic_as_copy_from_slice() {
        copy(&mut [0u8; 4], &[1u8; 5]);
    }
}
