//! Aggregation kernels: memory-bound loops written so the compiler vectorises them.
//!
//! Summing a list of N values reads each input exactly once: up to four inputs in one fused
//! pass that writes the output once; more in blocks small enough to stay in L1.

use crate::Element;

/// Elements per block of the blocked sum (16 KiB of f32: the output block stays in L1).
const BLOCK: usize = 4096;

/// `dst[i] += src[i]`.
#[inline]
pub fn add_into<T: Element>(dst: &mut [T], src: &[T]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = d.add(*s);
    }
}

/// `dst[i] += src[i]`, where `src` is memory another process may write (a peer's pages): each
/// element is read exactly once, through the pointer, and no slice of it is ever formed.
///
/// # Safety
/// `src` must be valid for reads of `dst.len()` elements, aligned for `T`, and must not
/// overlap `dst`. (`T` is plain numbers: whatever bits a racing writer leaves are a value.)
#[inline]
pub unsafe fn add_from_raw<T: Element>(dst: &mut [T], src: *const T) {
    for (i, d) in dst.iter_mut().enumerate() {
        // SAFETY: `i < dst.len()`, and the caller vouches for `dst.len()` readable elements.
        *d = d.add(unsafe { src.add(i).read() });
    }
}

/// `dst[i] = a[i] + b[i]`, where `a` and `b` may be memory another process writes: each
/// element read once, through the pointers.
///
/// # Safety
/// `a` and `b` must be valid for reads of `dst.len()` elements, aligned for `T`, and must not
/// overlap `dst`.
#[inline]
pub unsafe fn sum2_from_raw<T: Element>(dst: &mut [T], a: *const T, b: *const T) {
    for (i, d) in dst.iter_mut().enumerate() {
        // SAFETY: `i < dst.len()`, and the caller vouches for `dst.len()` readable elements
        // at both.
        *d = unsafe { a.add(i).read().add(b.add(i).read()) };
    }
}

/// `dst[i] += alpha * src[i]`.
#[inline]
pub fn axpy_into<T: Element>(dst: &mut [T], alpha: f64, src: &[T]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = d.axpy(alpha, *s);
    }
}

/// `dst = a + b (+ c (+ d))`, or `dst += a (+ b (+ c))`, in one pass: every input is read once
/// and `dst` written once. Additions go left to right, so results do not depend on grouping.
#[inline(always)]
fn fused<T: Element>(dst: &mut [T], acc: bool, srcs: &[&[T]]) {
    let n = dst.len();
    match (acc, srcs) {
        (false, [a]) => kvstore_transport::copy::copy(
            bytemuck::cast_slice_mut(dst),
            bytemuck::cast_slice(&a[..n]),
        ),
        (false, [a, b]) => {
            let (a, b) = (&a[..n], &b[..n]);
            for i in 0..n {
                dst[i] = a[i].add(b[i]);
            }
        }
        (false, [a, b, c]) => {
            let (a, b, c) = (&a[..n], &b[..n], &c[..n]);
            for i in 0..n {
                dst[i] = a[i].add(b[i]).add(c[i]);
            }
        }
        (false, [a, b, c, d]) => {
            let (a, b, c, d) = (&a[..n], &b[..n], &c[..n], &d[..n]);
            for i in 0..n {
                dst[i] = a[i].add(b[i]).add(c[i]).add(d[i]);
            }
        }
        (true, [a]) => add_into(dst, a),
        (true, [a, b]) => {
            let (a, b) = (&a[..n], &b[..n]);
            for i in 0..n {
                dst[i] = dst[i].add(a[i]).add(b[i]);
            }
        }
        (true, [a, b, c]) => {
            let (a, b, c) = (&a[..n], &b[..n], &c[..n]);
            for i in 0..n {
                dst[i] = dst[i].add(a[i]).add(b[i]).add(c[i]);
            }
        }
        _ => {}
    }
}

/// `dst = sum(srcs)`, element-wise; every source must be as long as `dst`.
///
/// Up to four sources are summed in one fused pass. With more, the output is processed in
/// L1-sized blocks: the first four sources set a block, the rest add to it three at a time.
/// An empty list leaves `dst` as it is.
pub fn sum_into<T: Element>(dst: &mut [T], srcs: &[&[T]]) {
    if srcs.is_empty() {
        return;
    }
    if srcs.len() <= 4 {
        fused(dst, false, srcs);
        return;
    }
    let n = dst.len();
    let mut start = 0;
    let mut block: Vec<&[T]> = Vec::with_capacity(4);
    while start < n {
        let end = (start + BLOCK).min(n);
        block.clear();
        block.extend(srcs[..4].iter().map(|s| &s[start..end]));
        fused(&mut dst[start..end], false, &block);
        for group in srcs[4..].chunks(3) {
            block.clear();
            block.extend(group.iter().map(|s| &s[start..end]));
            fused(&mut dst[start..end], true, &block);
        }
        start = end;
    }
}

/// `dst = sum(srcs)` in the order of MXNet's CPU reduce (`CommCPU`, which its `local` and
/// `dist_sync` stores sum with): the first source, then each next four summed among
/// themselves first, `dst + (((a + b) + c) + d)`. Floats round so differently from a sum left
/// to right (in float16, 2048 + 1 + 1 is 2050 so, and 2048 left to right).
pub fn sum_into_grouped<T: Element>(dst: &mut [T], srcs: &[&[T]]) {
    let Some((first, rest)) = srcs.split_first() else {
        return;
    };
    let n = dst.len();
    let mut start = 0;
    while start < n {
        let end = (start + BLOCK).min(n);
        let out = &mut dst[start..end];
        out.copy_from_slice(&first[start..end]);
        for g in rest.chunks(4) {
            let at = |k: usize| &g[k][start..end];
            match g.len() {
                1 => add_into(out, at(0)),
                2 => {
                    let (a, b) = (at(0), at(1));
                    for i in 0..out.len() {
                        out[i] = out[i].add(a[i].add(b[i]));
                    }
                }
                3 => {
                    let (a, b, c) = (at(0), at(1), at(2));
                    for i in 0..out.len() {
                        out[i] = out[i].add(a[i].add(b[i]).add(c[i]));
                    }
                }
                _ => {
                    let (a, b, c, d) = (at(0), at(1), at(2), at(3));
                    for i in 0..out.len() {
                        out[i] = out[i].add(a[i].add(b[i]).add(c[i]).add(d[i]));
                    }
                }
            }
        }
        start = end;
    }
}

/// The same sum as [`sum_into_grouped`] (`grouped`) or [`sum_into`] over byte views of
/// elements of type `T`.
pub fn sum_bytes_into<T: Element>(dst: &mut [u8], srcs: &[&[u8]], grouped: bool) {
    let typed: Vec<&[T]> = srcs
        .iter()
        .map(|s| bytemuck::cast_slice::<u8, T>(s))
        .collect();
    let dst = bytemuck::cast_slice_mut(dst);
    match grouped {
        true => sum_into_grouped::<T>(dst, &typed),
        false => sum_into::<T>(dst, &typed),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `count` sources of `n` f32s, each different, fractions that round in a sum.
    fn sources(n: usize, count: usize) -> Vec<Vec<f32>> {
        (0..count)
            .map(|k| {
                (0..n)
                    .map(|i| ((i * (k + 1)) % 97) as f32 * 0.25 + 0.1)
                    .collect()
            })
            .collect()
    }

    #[test]
    fn every_count_of_sources_matches_a_left_to_right_sum() {
        for n in [0, 1, 7, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 5] {
            for count in 1..=11 {
                let srcs = sources(n, count);
                let refs: Vec<&[f32]> = srcs.iter().map(|v| v.as_slice()).collect();
                let mut out = vec![-1.0f32; n];
                sum_into(&mut out, &refs);
                for i in 0..n {
                    let mut want = srcs[0][i];
                    for s in &srcs[1..] {
                        want += s[i];
                    }
                    assert_eq!(out[i], want, "n {n} count {count} i {i}");
                }
            }
        }
    }

    #[test]
    fn the_grouped_sum_is_mxnets_cpu_order() {
        for n in [0, 1, 7, BLOCK + 3] {
            for count in 1..=11 {
                let srcs = sources(n, count);
                let refs: Vec<&[f32]> = srcs.iter().map(|v| v.as_slice()).collect();
                let mut out = vec![-1.0f32; n];
                sum_into_grouped(&mut out, &refs);
                for i in 0..n {
                    let mut want = srcs[0][i];
                    for g in srcs[1..].chunks(4) {
                        let mut part = g[0][i];
                        for s in &g[1..] {
                            part += s[i];
                        }
                        want += part;
                    }
                    assert_eq!(
                        out[i].to_bits(),
                        want.to_bits(),
                        "n {n} count {count} i {i}"
                    );
                }
            }
        }
        // Where the orders part: float16's 2048 + 1 + 1.
        let h = |v: f32| half::f16::from_f32(v);
        let (a, one) = ([h(2048.0)], [h(1.0)]);
        let mut out = [h(0.0)];
        sum_into_grouped(&mut out, &[&a, &one, &one]);
        assert_eq!(out[0].to_f32(), 2050.0);
        sum_into(&mut out, &[&a, &one, &one]);
        assert_eq!(out[0].to_f32(), 2048.0);
    }

    #[test]
    fn single_source_is_a_copy() {
        let a = vec![3i64, -4, 5];
        let mut out = vec![0i64; 3];
        sum_into(&mut out, &[&a]);
        assert_eq!(out, a);
    }
}
