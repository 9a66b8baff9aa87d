//! MXNet's 2-bit gradient compression (`set_gradient_compression({'type': '2bit', ...})`).
//!
//! A pushed gradient `g` is added to a residual `r` that the pushing side keeps per key (per
//! value, in a `device` store); each element of `r` then sends one of three values: `+t` where
//! `r >= t` (and `r -= t`), `-t` where `r <= -t` (and `r += t`), else `0` (and `r` keeps it).
//! What was not sent is sent later, once it has grown past the threshold `t`.
//!
//! Packed as MXNet packs it: 2 bits per element, 4 elements per byte, the first element in the
//! byte's two high bits; `11` is `+t`, `10` is `-t`, anything else `0`. The packed form of `n`
//! elements is `ceil(n / 16)` 32-bit words (`4 * ceil(n / 16)` bytes), 1/16 of the value.

use crate::{DType, KvError, Result};

/// A compression a store applies to its pushes: MXNet 1.9's only one, 2-bit with a threshold.
///
/// ```
/// use kvstore::Compression;
/// let c = Compression::two_bit(0.5).unwrap();
/// assert_eq!(c.threshold(), 0.5);
/// assert!(Compression::two_bit(0.0).is_err());
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Compression {
    threshold: f32,
}

/// MXNet's default threshold.
pub const DEFAULT_THRESHOLD: f32 = 0.5;

/// Elements per 32-bit word of the packed form.
const PER_WORD: usize = 16;

impl Compression {
    /// 2-bit compression with `threshold`, which must be finite and above 0.
    pub fn two_bit(threshold: f32) -> Result<Compression> {
        if !(threshold.is_finite() && threshold > 0.0) {
            return Err(KvError::Unsupported(format!(
                "threshold must be a finite number greater than 0 for 2bit compression, \
                 not {threshold}"
            )));
        }
        Ok(Compression { threshold })
    }

    /// MXNet's parameters, as its Python dict gives them: `type` (required; only `"2bit"`)
    /// and `threshold` (default 0.5). Another key is refused rather than ignored (MXNet
    /// ignores it), so that a misspelt `threshold` is not silently 0.5.
    ///
    /// ```
    /// use kvstore::Compression;
    /// let c = Compression::from_params(&[("type", "2bit"), ("threshold", "0.25")]).unwrap();
    /// assert_eq!(c.threshold(), 0.25);
    /// assert!(Compression::from_params(&[("type", "1bit")]).is_err());
    /// ```
    pub fn from_params(params: &[(&str, &str)]) -> Result<Compression> {
        let mut kind = None;
        let mut threshold = DEFAULT_THRESHOLD;
        for (k, v) in params {
            match *k {
                "type" => kind = Some(*v),
                "threshold" => {
                    threshold = v.trim().parse::<f32>().map_err(|_| {
                        KvError::Unsupported(format!(
                            "gradient compression threshold {v:?} is not a number"
                        ))
                    })?
                }
                other => {
                    return Err(KvError::Unsupported(format!(
                        "unknown gradient compression parameter {other:?} (known: type, \
                         threshold)"
                    )))
                }
            }
        }
        match kind {
            Some("2bit") => Compression::two_bit(threshold),
            Some(other) => Err(KvError::Unsupported(format!(
                "unknown type for gradient compression {other:?} (known: 2bit)"
            ))),
            None => Err(KvError::Unsupported(
                "gradient compression parameters need a 'type' (2bit)".into(),
            )),
        }
    }

    /// The threshold `t`: what an element sends is `+t`, `-t` or `0`.
    pub fn threshold(self) -> f32 {
        self.threshold
    }

    /// Bytes of the packed form of `n` elements.
    pub fn packed_bytes(n: u64) -> u64 {
        n.div_ceil(PER_WORD as u64) * 4
    }

    /// Checks that values of `dtype` can be compressed (float32 only, as in MXNet).
    pub(crate) fn check_dtype(key: &crate::Key, dtype: DType) -> Result<()> {
        if dtype != DType::F32 {
            return Err(KvError::Unsupported(format!(
                "gradient compression takes float32 values; key {key} holds {dtype}"
            )));
        }
        Ok(())
    }

    /// Adds `grad` to `residual` (as long) and packs what is sent into `out`
    /// ([`Compression::packed_bytes`] of `grad.len()`), taking it from the residual: what a
    /// compressed push does.
    ///
    /// ```
    /// use kvstore::Compression;
    /// let c = Compression::two_bit(0.5).unwrap();
    /// let (mut residual, mut packed) = ([0.1f32, 0.0], [0u8; 4]);
    /// c.quantize(&[0.4, -0.7], &mut residual, &mut packed).unwrap();
    /// assert_eq!(packed, [0b1110_0000, 0, 0, 0]); // +t, -t
    /// let mut sent = [0.0f32; 2];
    /// c.dequantize(&packed, &mut sent).unwrap();
    /// assert_eq!(sent, [0.5, -0.5]);
    /// ```
    pub fn quantize(self, grad: &[f32], residual: &mut [f32], out: &mut [u8]) -> Result<()> {
        if grad.len() != residual.len() || out.len() as u64 != Self::packed_bytes(grad.len() as u64)
        {
            return Err(KvError::Incompatible(format!(
                "quantize: {} elements, a residual of {} and {} packed bytes",
                grad.len(),
                residual.len(),
                out.len()
            )));
        }
        out.fill(0);
        // Whole words of 16 elements without branches (the compiler vectorises it), then the
        // rest; both give the same bits (`v - 0.0` is `v`).
        let whole = grad.len() / PER_WORD * PER_WORD;
        let (g, g_rest) = grad.split_at(whole);
        let (r, r_rest) = residual.split_at_mut(whole);
        let (o, o_rest) = out.split_at_mut(whole / 4);
        for ((g, r), o) in g
            .chunks_exact(PER_WORD)
            .zip(r.chunks_exact_mut(PER_WORD))
            .zip(o.chunks_exact_mut(4))
        {
            self.quantize_word(g, r, o);
        }
        for ((g4, r4), byte) in g_rest
            .chunks(4)
            .zip(r_rest.chunks_mut(4))
            .zip(o_rest.iter_mut())
        {
            let mut codes = [0u8; 4];
            for ((g, r), c) in g4.iter().zip(r4.iter_mut()).zip(codes.iter_mut()) {
                *c = self.quantize_one(*g, r);
            }
            *byte = codes[0] << 6 | codes[1] << 4 | codes[2] << 2 | codes[3];
        }
        Ok(())
    }

    /// One element: its code (`11`, `10` or `00`), its residual updated.
    #[inline(always)]
    fn quantize_one(self, g: f32, r: &mut f32) -> u8 {
        let t = self.threshold;
        let v = *r + g;
        let (pos, neg) = (v >= t, v <= -t);
        let sent = if pos {
            t
        } else if neg {
            -t
        } else {
            0.0
        };
        *r = v - sent;
        ((pos as u8) * 0b11) | ((neg as u8) * 0b10)
    }

    /// 16 elements into one 32-bit word (4 bytes).
    #[inline(always)]
    fn quantize_word(self, g: &[f32], r: &mut [f32], out: &mut [u8]) {
        // Codes in 32-bit lanes, as wide as the values: the loop vectorises whole.
        let mut codes = [0u32; PER_WORD];
        for ((g, r), c) in g.iter().zip(r.iter_mut()).zip(codes.iter_mut()) {
            *c = self.quantize_one(*g, r) as u32;
        }
        for (o, c) in out.iter_mut().zip(codes.chunks_exact(4)) {
            *o = ((c[0] << 6) | (c[1] << 4) | (c[2] << 2) | c[3]) as u8;
        }
    }

    /// The value `packed` stands for, into `out` (its length: elements): what a server does
    /// with a compressed push. `packed` may be any bytes at all (a peer's): every pattern is
    /// a value, and only its first [`Compression::packed_bytes`] of `out.len()` bytes are read.
    pub fn dequantize(self, packed: &[u8], out: &mut [f32]) -> Result<()> {
        self.unpack(packed, out, |o, v| o.copy_from_slice(v))
    }

    /// `out += ` the value `packed` stands for ([`Compression::dequantize`]), in one pass:
    /// what a sum of compressed values does.
    pub(crate) fn dequantize_add(self, packed: &[u8], out: &mut [f32]) -> Result<()> {
        self.unpack(packed, out, |o, v| {
            o.iter_mut().zip(v).for_each(|(o, v)| *o += v);
        })
    }

    /// Hands `put` each run of (at most) 4 elements of `out` with the values `packed` gives
    /// them.
    #[inline(always)]
    fn unpack(
        self,
        packed: &[u8],
        out: &mut [f32],
        put: impl Fn(&mut [f32], &[f32]),
    ) -> Result<()> {
        let need = Self::packed_bytes(out.len() as u64);
        if (packed.len() as u64) < need {
            return Err(KvError::Protocol(format!(
                "{} packed bytes for {} elements, which need {need}",
                packed.len(),
                out.len()
            )));
        }
        let t = self.threshold;
        let code = [0.0, 0.0, -t, t];
        let of = |byte: u8| -> [f32; 4] {
            [6, 4, 2, 0].map(|shift| code[((byte >> shift) & 0b11) as usize])
        };
        let whole = out.len() / 4 * 4;
        let (o, rest) = out.split_at_mut(whole);
        if o.len() >= 4096 {
            // Large values: the four elements of every byte value, looked up whole.
            let table: Vec<[f32; 4]> = (0..=255).map(of).collect();
            for (o4, &byte) in o.chunks_exact_mut(4).zip(packed) {
                put(o4, &table[byte as usize]);
            }
        } else {
            for (o4, &byte) in o.chunks_exact_mut(4).zip(packed) {
                put(o4, &of(byte));
            }
        }
        if let Some(&byte) = packed.get(whole / 4).filter(|_| !rest.is_empty()) {
            put(rest, &of(byte)[..rest.len()]);
        }
        Ok(())
    }

    /// The threshold as a header carries it.
    pub(crate) fn to_wire(self) -> u32 {
        self.threshold.to_bits()
    }

    /// The compression a header's word names, if it is a valid threshold.
    pub(crate) fn from_wire(word: u32) -> Option<Compression> {
        Compression::two_bit(f32::from_bits(word)).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rule element by element, written apart from the packing (MXNet's nightly test
    /// checks against the same kind of reference).
    fn reference(g: &[f32], r: &mut [f32], t: f32) -> Vec<f32> {
        g.iter()
            .zip(r.iter_mut())
            .map(|(g, r)| {
                *r += g;
                if *r >= t {
                    *r -= t;
                    t
                } else if *r <= -t {
                    *r += t;
                    -t
                } else {
                    0.0
                }
            })
            .collect()
    }

    fn round_trip(c: Compression, g: &[f32], r: &mut [f32]) -> (Vec<u8>, Vec<f32>) {
        let mut packed = vec![0xAA; Compression::packed_bytes(g.len() as u64) as usize];
        c.quantize(g, r, &mut packed).unwrap();
        let mut out = vec![f32::NAN; g.len()];
        c.dequantize(&packed, &mut out).unwrap();
        (packed, out)
    }

    #[test]
    fn the_bit_layout_is_mxnets() {
        let c = Compression::two_bit(0.5).unwrap();
        // +t, -t, 0, +t | -t: element 0 in the top bits of byte 0.
        let g = [0.7, -0.5, 0.49, 0.5, -2.0];
        let mut r = [0.0; 5];
        let (packed, out) = round_trip(c, &g, &mut r);
        assert_eq!(packed, [0b1110_0011, 0b1000_0000, 0, 0]);
        assert_eq!(out, [0.5, -0.5, 0.0, 0.5, -0.5]);
        let want = [0.7 - 0.5, 0.0, 0.49, 0.0, -1.5];
        for (a, b) in r.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{r:?}");
        }
    }

    #[test]
    fn the_residual_carries_what_was_not_sent() {
        // MXNet's nightly sequence at t = 0.5: 0.4 sends 0, then 0.1 sends t, 0.2 sends 0,
        // 0.3 sends t.
        let c = Compression::two_bit(0.5).unwrap();
        let mut r = [0.0f32; 3];
        let sent: Vec<f32> = [0.4, 0.1, 0.2, 0.3]
            .iter()
            .map(|g| round_trip(c, &[*g; 3], &mut r).1[0])
            .collect();
        assert_eq!(sent, [0.0, 0.5, 0.0, 0.5]);
    }

    #[test]
    fn random_values_match_the_rule_element_by_element() {
        let mut s = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 * 2.4 - 1.2
        };
        for n in [1usize, 3, 4, 15, 16, 17, 33, 1000, 5003] {
            let c = Compression::two_bit(0.3).unwrap();
            let (mut r, mut r_ref) = (vec![0.0f32; n], vec![0.0f32; n]);
            for _ in 0..5 {
                let g: Vec<f32> = (0..n).map(|_| next()).collect();
                let (packed, out) = round_trip(c, &g, &mut r);
                assert_eq!(packed.len(), n.div_ceil(16) * 4);
                assert_eq!(out, reference(&g, &mut r_ref, 0.3));
                assert_eq!(r, r_ref);
                let mut acc = vec![1.0f32; n];
                c.dequantize_add(&packed, &mut acc).unwrap();
                assert!(acc.iter().zip(&out).all(|(a, o)| *a == 1.0 + o));
            }
        }
    }

    #[test]
    fn any_packed_bytes_are_a_value_and_short_ones_an_error() {
        let c = Compression::two_bit(2.0).unwrap();
        let mut out = [9.0f32; 8];
        // `01` is 0, as in MXNet.
        c.dequantize(&[0b0111_1000, 0xff, 0, 0], &mut out).unwrap();
        assert_eq!(out, [0.0, 2.0, -2.0, 0.0, 2.0, 2.0, 2.0, 2.0]);
        assert!(c.dequantize(&[0; 3], &mut [0.0; 1]).is_err());
    }

    #[test]
    fn parameters_as_mxnet_takes_them() {
        assert_eq!(
            Compression::from_params(&[("type", "2bit")])
                .unwrap()
                .threshold(),
            0.5
        );
        for bad in [
            vec![("threshold", "0.5")],
            vec![("type", "1bit")],
            vec![("type", "2bit"), ("threshold", "0")],
            vec![("type", "2bit"), ("threshold", "-1")],
            vec![("type", "2bit"), ("threshold", "nan")],
            vec![("type", "2bit"), ("threshold", "inf")],
            vec![("type", "2bit"), ("threshold", "x")],
            vec![("type", "2bit"), ("threshhold", "0.5")],
        ] {
            assert!(Compression::from_params(&bad).is_err(), "{bad:?}");
        }
        let c = Compression::two_bit(1e-7).unwrap();
        assert_eq!(Compression::from_wire(c.to_wire()), Some(c));
        assert_eq!(Compression::from_wire(0), None);
        assert_eq!(Compression::from_wire(f32::NAN.to_bits()), None);
    }
}
