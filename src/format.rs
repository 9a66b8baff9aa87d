//! numpy-style printing of arrays: `[[2. 2. 2.]\n [2. 2. 2.]]`.

use crate::dtype::with_dtype;
use crate::{DType, Element, NDArray};

/// Above this many elements, print only the edges of each dimension (numpy's threshold).
const THRESHOLD: usize = 1000;
/// Elements shown at each edge when summarising (numpy's edgeitems).
const EDGE: usize = 3;

/// One element, formatted alone (before alignment).
/// Text cut to at most `max` bytes, at a character boundary (an error message is shown whole
/// up to the limit, never split inside a character).
pub(crate) fn cut_text(t: &[u8], max: usize) -> &[u8] {
    if t.len() <= max {
        return t;
    }
    let mut end = max;
    // A UTF-8 continuation byte is 10xxxxxx: back up to the start of its character.
    while end > 0 && t[end] & 0xc0 == 0x80 {
        end -= 1;
    }
    &t[..end]
}

/// Whether the decimal text `s` reads back as `v` in `dtype`'s precision.
fn reads_back(s: &str, v: f64, dtype: DType) -> bool {
    let Ok(x) = s.parse::<f64>() else {
        return false;
    };
    match dtype {
        DType::F64 => x == v,
        DType::F16 => half::f16::from_f64(x) == half::f16::from_f64(v),
        DType::BF16 => half::bf16::from_f64(x) == half::bf16::from_f64(v),
        _ => x as f32 == v as f32,
    }
}

/// numpy's `precision`: at most this many digits after the point (or in a mantissa).
const PRECISION: usize = 8;

/// A float as numpy writes it (`floatmode='maxprec'`): the fewest significant digits that
/// read back as the same value in the array's own precision (float16's 0.1 is `0.1`, not
/// float32's `0.099975586`), at most [`PRECISION`] after the point, trailing zeros trimmed.
/// Scientific: the mantissa and the exponent as parts, to be padded (`fill_scientific`).
fn format_elem(v: f64, dtype: DType, scientific: bool) -> String {
    if !dtype.is_float() {
        return format!("{}", v as i64);
    }
    if v.is_nan() {
        return "nan".into();
    }
    if v.is_infinite() {
        return if v > 0.0 { "inf".into() } else { "-inf".into() };
    }
    let digits = (1..=17)
        .find(|&d| reads_back(&format!("{:.*e}", d - 1, v), v, dtype))
        .unwrap_or(17);
    // The exponent of the shortest digits (those capped at PRECISION may round up a power).
    let shortest = format!("{:.*e}", digits - 1, v);
    let exp: i32 = (shortest.split_once('e')).map_or(0, |(_, e)| e.parse().unwrap_or(0));
    let sci = format!("{:.*e}", (digits - 1).min(PRECISION), v);
    let (mant, sci_exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let trimmed = |t: &str| -> String {
        match t.split_once('.') {
            Some((i, f)) => format!("{i}.{}", f.trim_end_matches('0')),
            None => format!("{t}."),
        }
    };
    if scientific {
        // Rust writes 1.5e-5; numpy writes 1.5e-05.
        let e: i32 = sci_exp.parse().unwrap_or(0);
        let sign = if e < 0 { '-' } else { '+' };
        format!("{}e{sign}{:02}", trimmed(mant), e.unsigned_abs())
    } else {
        let frac = (digits as i32 - 1 - exp).clamp(0, PRECISION as i32) as usize;
        trimmed(&format!("{v:.frac$}"))
    }
}

/// numpy's scientific cells: every mantissa with as many digits after the point as the
/// longest (zeros added), every exponent with as many digits as the longest.
fn fill_scientific(cells: &mut [String]) {
    let parts = |c: &str| -> Option<(String, String, String)> {
        let (mant, exp) = c.split_once('e')?;
        let (i, f) = mant.split_once('.')?;
        Some((i.to_string(), f.to_string(), exp.to_string()))
    };
    let all: Vec<_> = cells.iter().map(|c| parts(c)).collect();
    let frac = all.iter().flatten().map(|p| p.1.len()).max().unwrap_or(0);
    let exp = all
        .iter()
        .flatten()
        .map(|p| p.2.len() - 1)
        .max()
        .unwrap_or(2);
    for (c, p) in cells.iter_mut().zip(all) {
        if let Some((i, f, e)) = p {
            let (sign, d) = e.split_at(1);
            *c = format!("{i}.{f:0<frac$}e{sign}{d:0>exp$}");
        }
    }
}

/// Pads formatted floats so their decimal points line up and all have one width.
fn align(cells: &mut [String], is_float: bool) {
    if is_float {
        let split = |c: &String| -> (usize, usize) {
            match c.find('.') {
                Some(p) => (p, c.len() - p),
                None => (c.len(), 0),
            }
        };
        // Widths of the finite cells; nan and inf (no point) fit in their whole width, which
        // grows on the left where they are longer, as numpy's.
        let (mut wi, mut wf, mut other) = (0, 0, 0);
        for c in cells.iter() {
            match c.contains('.') {
                true => {
                    let (i, f) = split(c);
                    wi = wi.max(i);
                    wf = wf.max(f);
                }
                false => other = other.max(c.len()),
            }
        }
        wi = wi.max(other.saturating_sub(wf));
        for c in cells.iter_mut() {
            *c = if c.contains('.') {
                let (i, f) = split(c);
                format!("{}{}{}", " ".repeat(wi - i), c, " ".repeat(wf - f))
            } else {
                format!("{c:>w$}", w = wi + wf)
            };
        }
    } else {
        let w = cells.iter().map(String::len).max().unwrap_or(0);
        for c in cells.iter_mut() {
            *c = format!("{c:>w$}");
        }
    }
}

/// Indices shown along a dimension of length `n`: all, or the edges with `None` for "...".
fn shown(n: usize, summarise: bool) -> Vec<Option<usize>> {
    if summarise && n > 2 * EDGE {
        (0..EDGE)
            .map(Some)
            .chain(std::iter::once(None))
            .chain((n - EDGE..n).map(Some))
            .collect()
    } else {
        (0..n).map(Some).collect()
    }
}

fn collect(shape: &[usize], base: usize, summarise: bool, flat: &mut Vec<usize>) {
    match shape.split_first() {
        None => flat.push(base),
        Some((&n, rest)) => {
            let stride: usize = rest.iter().product();
            for i in shown(n, summarise).into_iter().flatten() {
                collect(rest, base + i * stride, summarise, flat);
            }
        }
    }
}

fn render(
    shape: &[usize],
    depth: usize,
    summarise: bool,
    cells: &mut std::slice::Iter<'_, String>,
    out: &mut String,
) {
    let Some((&n, rest)) = shape.split_first() else {
        out.push_str(cells.next().map(String::as_str).unwrap_or(""));
        return;
    };
    out.push('[');
    let sep = if rest.is_empty() {
        " ".to_string()
    } else {
        format!("{}{}", "\n".repeat(rest.len()), " ".repeat(depth + 1))
    };
    for (j, idx) in shown(n, summarise).into_iter().enumerate() {
        if j > 0 {
            out.push_str(&sep);
        }
        match idx {
            Some(_) => render(rest, depth + 1, summarise, cells, out),
            None => out.push_str("..."),
        }
    }
    out.push(']');
}

fn values<T: Element>(a: &NDArray, idx: &[usize]) -> Vec<f64> {
    let s: &[T] = bytemuck::cast_slice(a.as_bytes());
    idx.iter().map(|&i| s[i].to_f64()).collect()
}

/// The numpy-style text of an array.
pub fn format_array(a: &NDArray) -> String {
    if a.size() == 0 && !a.shape().is_empty() {
        // As numpy prints one, whatever its shape (a dimension of 2^61 beside a 0 included:
        // nothing is walked).
        return "[]".into();
    }
    let summarise = a.size() > THRESHOLD;
    let mut idx = Vec::new();
    collect(a.shape(), 0, summarise, &mut idx);
    let vals = with_dtype!(a.dtype(), T => values::<T>(a, &idx));
    let finite = vals.iter().filter(|v| v.is_finite()).map(|v| v.abs());
    let (mut max, mut min_nz) = (0.0f64, f64::INFINITY);
    for v in finite {
        max = max.max(v);
        if v > 0.0 {
            min_nz = min_nz.min(v);
        }
    }
    // numpy's rule: large, small, or far apart.
    let scientific = a.dtype().is_float() && (max >= 1e8 || min_nz < 1e-4 || (max / min_nz) > 1e3);
    let mut cells: Vec<String> = vals
        .iter()
        .map(|&v| format_elem(v, a.dtype(), scientific))
        .collect();
    if scientific {
        fill_scientific(&mut cells);
    }
    align(&mut cells, a.dtype().is_float());
    let mut out = String::new();
    render(a.shape(), 0, summarise, &mut cells.iter(), &mut out);
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn text_is_cut_at_a_character_boundary() {
        let t = "ab\u{e9}\u{e9}".as_bytes(); // a b é é: 6 bytes
        assert_eq!(super::cut_text(t, 10), t);
        assert_eq!(super::cut_text(t, 3), b"ab");
        assert_eq!(super::cut_text(t, 4), "ab\u{e9}".as_bytes());
        assert_eq!(super::cut_text(t, 0), b"");
    }

    use crate::{DType, NDArray};

    #[test]
    fn matches_numpy_for_the_tutorial_values() {
        assert_eq!(
            (NDArray::ones(&[2, 3]) * 2.0).to_string(),
            "[[2. 2. 2.]\n [2. 2. 2.]]"
        );
        assert_eq!(
            NDArray::full(&[2, 3], -0.3).to_string(),
            "[[-0.3 -0.3 -0.3]\n [-0.3 -0.3 -0.3]]"
        );
        assert_eq!(
            NDArray::full(&[2, 3], 11.0).to_string(),
            "[[11. 11. 11.]\n [11. 11. 11.]]"
        );
    }

    #[test]
    fn aligns_like_numpy() {
        let a = NDArray::from_vec(&[3], vec![1.5f32, 2.0, -10.25]).unwrap();
        assert_eq!(a.to_string(), "[  1.5    2.   -10.25]");
        let i = NDArray::from_vec(&[3], vec![1i32, 10, -5]).unwrap();
        assert_eq!(i.to_string(), "[ 1 10 -5]");
        let s = NDArray::from_vec(&[2], vec![1e9f64, 1.0]).unwrap();
        assert_eq!(s.to_string(), "[1.e+09 1.e+00]");
    }

    /// As numpy 2 prints them (`print(np.array(...))`).
    #[test]
    fn precision_and_notation_as_numpys() {
        let f64s = |v: Vec<f64>| NDArray::from_vec(&[v.len()], v).unwrap().to_string();
        let f32s = |v: Vec<f32>| NDArray::from_vec(&[v.len()], v).unwrap().to_string();
        // At most 8 digits after the point.
        assert_eq!(f64s(vec![0.1 + 0.2]), "[0.3]");
        assert_eq!(f64s(vec![1.0 / 3.0, 2.0]), "[0.33333333 2.        ]");
        assert_eq!(f32s(vec![0.123_456_79]), "[0.12345679]");
        // A float16's own shortest digits.
        assert_eq!(
            NDArray::full_dtype(&[2], 0.1, DType::F16).to_string(),
            "[0.1 0.1]"
        );
        // Far apart (more than 1000 times): scientific, mantissas and exponents padded.
        assert_eq!(f32s(vec![1.0, 2000.0]), "[1.e+00 2.e+03]");
        assert_eq!(f64s(vec![1.5e-5, 1e-5]), "[1.5e-05 1.0e-05]");
        assert_eq!(f64s(vec![1e100, 1.0]), "[1.e+100 1.e+000]");
        assert_eq!(f64s(vec![1.0, 1000.0]), "[   1. 1000.]");
        assert_eq!(f64s(vec![123456.789]), "[123456.789]");
        assert_eq!(f32s(vec![0.001_234_568]), "[0.00123457]");
        assert_eq!(f64s(vec![-1.5e-5, 2e-7]), "[-1.5e-05  2.0e-07]");
        assert_eq!(f64s(vec![999.9999999]), "[999.9999999]");
        assert_eq!(f64s(vec![99.999999999]), "[100.]");
        assert_eq!(f64s(vec![1.5, f64::NAN]), "[1.5 nan]");
        assert_eq!(f64s(vec![10.25, f64::INFINITY]), "[10.25   inf]");
        assert_eq!(f64s(vec![1.0, f64::NAN]), "[ 1. nan]");
        assert_eq!(f64s(vec![1e-5, f64::NAN]), "[1.e-05    nan]");
        assert_eq!(f64s(vec![f64::NAN]), "[nan]");
    }

    #[test]
    fn higher_dimensions_scalars_and_empty() {
        let a = NDArray::zeros_dtype(&[2, 1, 2], DType::U8);
        assert_eq!(a.to_string(), "[[[0 0]]\n\n [[0 0]]]");
        assert_eq!(NDArray::full(&[], 3.0).to_string(), "3.");
        assert_eq!(NDArray::zeros(&[0]).to_string(), "[]");
        assert_eq!(NDArray::zeros(&[2, 0]).to_string(), "[]");
        // (Before, the walk made room for each index of the large dimension: a panic.)
        assert_eq!(NDArray::zeros(&[1 << 61, 0]).to_string(), "[]");
    }

    #[test]
    fn large_arrays_are_summarised() {
        let a = NDArray::from_vec(&[2000], (0..2000).collect::<Vec<i64>>()).unwrap();
        assert_eq!(a.to_string(), "[   0    1    2 ... 1997 1998 1999]");
    }
}
