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
    // Shortest representation that round-trips in the array's own precision, as numpy does.
    let s = match dtype {
        DType::F64 => {
            if scientific {
                format!("{v:e}")
            } else {
                format!("{v}")
            }
        }
        _ => {
            let f = v as f32;
            if scientific {
                format!("{f:e}")
            } else {
                format!("{f}")
            }
        }
    };
    if scientific {
        // Rust writes 1e8 / 1.5e-5; numpy writes 1.e+08 / 1.5e-05.
        let (mant, exp) = s.split_once('e').unwrap_or((&s, "0"));
        let mant = if mant.contains('.') {
            mant.to_string()
        } else {
            format!("{mant}.")
        };
        let (sign, digits) = match exp.strip_prefix('-') {
            Some(d) => ('-', d),
            None => ('+', exp),
        };
        format!("{mant}e{sign}{digits:0>2}")
    } else if s.contains('.') {
        s
    } else {
        format!("{s}.")
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
        let (mut wi, mut wf) = (0, 0);
        for c in cells.iter() {
            let (i, f) = split(c);
            wi = wi.max(i);
            wf = wf.max(f);
        }
        for c in cells.iter_mut() {
            let (i, f) = split(c);
            *c = format!("{}{}{}", " ".repeat(wi - i), c, " ".repeat(wf - f));
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
    let scientific = a.dtype().is_float() && (max >= 1e8 || min_nz < 1e-4);
    let mut cells: Vec<String> = vals
        .iter()
        .map(|&v| format_elem(v, a.dtype(), scientific))
        .collect();
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

    #[test]
    fn higher_dimensions_scalars_and_empty() {
        let a = NDArray::zeros_dtype(&[2, 1, 2], DType::U8);
        assert_eq!(a.to_string(), "[[[0 0]]\n\n [[0 0]]]");
        assert_eq!(NDArray::full(&[], 3.0).to_string(), "3.");
        assert_eq!(NDArray::zeros(&[0]).to_string(), "[]");
    }

    #[test]
    fn large_arrays_are_summarised() {
        let a = NDArray::from_vec(&[2000], (0..2000).collect::<Vec<i64>>()).unwrap();
        assert_eq!(a.to_string(), "[   0    1    2 ... 1997 1998 1999]");
    }
}
