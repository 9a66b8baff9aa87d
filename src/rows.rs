//! Rows of a stored value, for MXNet's `row_sparse_pull` into dense outputs: the runs of
//! consecutive rows that a list of row ids names, checked against the value's shape.

use std::ops::Range;

use crate::{Key, KvError, NDArray, Result};

/// The rows of `shape` (along its first dimension) and the elements in each.
pub(crate) fn row_shape(key: &Key, shape: &[usize]) -> Result<(usize, usize)> {
    match shape.split_first() {
        // (A value of no elements may have other dimensions whose product overflows.)
        Some((&rows, rest)) => Ok((
            rows,
            rest.iter()
                .try_fold(1usize, |a, &d| a.checked_mul(d))
                .unwrap_or(0),
        )),
        None => Err(KvError::Incompatible(format!(
            "key {key}: a value of no dimensions has no rows to pull"
        ))),
    }
}

/// The runs of consecutive rows that `row_ids` names (in any order, repeats allowed), sorted;
/// an id that is not one of the `rows` rows is an error.
pub(crate) fn runs(key: &Key, row_ids: &[u64], rows: usize) -> Result<Vec<Range<usize>>> {
    let mut ids = row_ids.to_vec();
    ids.sort_unstable();
    ids.dedup();
    if let Some(&last) = ids.last() {
        if last >= rows as u64 {
            return Err(KvError::Incompatible(format!(
                "key {key}: row id {last} is out of range for its {rows} rows"
            )));
        }
    }
    let mut runs: Vec<Range<usize>> = Vec::new();
    for id in ids {
        let id = id as usize;
        match runs.last_mut() {
            Some(r) if r.end == id => r.end += 1,
            _ => runs.push(id..id + 1),
        }
    }
    Ok(runs)
}

/// A row pull writes host memory only (its rows are copied in by this process or put there).
pub(crate) fn check_host(key: &Key, out: &NDArray) -> Result<()> {
    if out.device().is_cpu() {
        return Ok(());
    }
    Err(KvError::Unsupported(format!(
        "key {key}: row_sparse_pull into {} memory is absent (pull into host memory)",
        out.device()
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_ids_become_sorted_runs_and_bad_ones_are_refused() {
        let k = Key::from(3);
        assert_eq!(
            runs(&k, &[5, 1, 2, 2, 9, 0], 10).unwrap(),
            [0..3, 5..6, 9..10]
        );
        assert_eq!(runs(&k, &[], 10).unwrap(), Vec::<Range<usize>>::new());
        assert!(matches!(runs(&k, &[10], 10), Err(KvError::Incompatible(_))));
        assert!(matches!(
            runs(&k, &[u64::MAX], 10),
            Err(KvError::Incompatible(_))
        ));
        assert_eq!(row_shape(&k, &[4, 2, 3]).unwrap(), (4, 6));
        assert_eq!(row_shape(&k, &[4]).unwrap(), (4, 1));
        assert!(row_shape(&k, &[]).is_err());
    }
}
