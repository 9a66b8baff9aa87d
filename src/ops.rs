//! Aggregation kernels: memory-bound loops written so the compiler vectorises them.
//!
//! Summing a list of N values reads each input exactly once and writes the output once per
//! block: the output is processed in blocks small enough to stay in L1 while every input adds
//! its block to it.

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

/// `dst[i] += alpha * src[i]`.
#[inline]
pub fn axpy_into<T: Element>(dst: &mut [T], alpha: f64, src: &[T]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = d.axpy(alpha, *s);
    }
}

/// `dst = sum(srcs)`, element-wise; every source must be as long as `dst`.
///
/// An empty list zeroes nothing and leaves `dst` as it is.
pub fn sum_into<T: Element>(dst: &mut [T], srcs: &[&[T]]) {
    let Some((first, rest)) = srcs.split_first() else {
        return;
    };
    let n = dst.len();
    let mut start = 0;
    while start < n {
        let end = (start + BLOCK).min(n);
        let out = &mut dst[start..end];
        out.copy_from_slice(&first[start..end]);
        for src in rest {
            add_into(out, &src[start..end]);
        }
        start = end;
    }
}

/// The same sum as [`sum_into`] over byte views of elements of type `T`.
pub fn sum_bytes_into<T: Element>(dst: &mut [u8], srcs: &[&[u8]]) {
    let typed: Vec<&[T]> = srcs
        .iter()
        .map(|s| bytemuck::cast_slice::<u8, T>(s))
        .collect();
    sum_into::<T>(bytemuck::cast_slice_mut(dst), &typed);
}

/// `dst += src` over byte views of elements of type `T`.
pub fn add_bytes_into<T: Element>(dst: &mut [u8], src: &[u8]) {
    add_into::<T>(bytemuck::cast_slice_mut(dst), bytemuck::cast_slice(src));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocked_sum_matches_naive_sum_across_block_edges() {
        for n in [0, 1, 7, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 5] {
            let a: Vec<f32> = (0..n).map(|i| i as f32).collect();
            let b: Vec<f32> = (0..n).map(|i| (i * 2) as f32).collect();
            let c: Vec<f32> = (0..n).map(|i| 0.5 + i as f32).collect();
            let mut out = vec![-1.0f32; n];
            sum_into(&mut out, &[&a, &b, &c]);
            for i in 0..n {
                assert_eq!(out[i], a[i] + b[i] + c[i]);
            }
        }
    }

    #[test]
    fn single_source_is_a_copy() {
        let a = vec![3i64, -4, 5];
        let mut out = vec![0i64; 3];
        sum_into(&mut out, &[&a]);
        assert_eq!(out, a);
    }
}
