//! `row_sparse_pull`: rows of stored values into numpy arrays (MXNet's row-sparse result made
//! dense: the rows asked for, zero elsewhere).

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyString};

use super::KVStore;
use crate::args::{check_outputs, is_list, keys, per_key};

/// One list of row ids: a 1-D array or a sequence of ints, none negative.
fn ids_of(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        return Err(PyTypeError::new_err(
            "row_ids must be integers, not a string",
        ));
    }
    let ids: Vec<i64> = obj.extract().map_err(|_| {
        PyTypeError::new_err("row_ids must be a 1-D array or a sequence of integers")
    })?;
    ids.into_iter()
        .map(|i| {
            u64::try_from(i).map_err(|_| PyValueError::new_err(format!("row id {i} is negative")))
        })
        .collect()
}

/// The row ids of each of `outputs` outputs: one list for all (bare, or alone in a list, as
/// MXNet takes it), or a list of lists, one each.
fn row_lists(row_ids: &Bound<'_, PyAny>, outputs: usize) -> PyResult<Vec<Vec<u64>>> {
    let nested = is_list(row_ids)
        && row_ids
            .try_iter()?
            .next()
            .transpose()?
            .is_some_and(|first| {
                !first.is_instance_of::<pyo3::types::PyInt>()
                    && first.hasattr("__len__").unwrap_or(false)
            });
    if !nested {
        let ids = ids_of(row_ids)?;
        return Ok(vec![ids; outputs]);
    }
    let mut lists = row_ids
        .try_iter()?
        .map(|l| ids_of(&l?))
        .collect::<PyResult<Vec<_>>>()?;
    // One list of them for several outputs serves each (MXNet's `single_rowid`).
    if lists.len() == 1 && outputs > 1 {
        lists = vec![lists.remove(0); outputs];
    }
    if lists.len() != outputs {
        return Err(PyValueError::new_err(format!(
            "{} lists of row ids for {outputs} outputs",
            lists.len()
        )));
    }
    Ok(lists)
}

impl KVStore {
    pub(super) fn rows(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        priority: i32,
        row_ids: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let k = keys(key)?;
        let mut outs = per_key(&k, out, true, "out")?;
        check_outputs(&outs)?;
        let lists = row_lists(row_ids, outs.iter().map(Vec::len).sum())?;
        let mut jobs = Vec::with_capacity(lists.len());
        let mut lists = lists.into_iter();
        for (key, list) in k.keys.iter().zip(outs.iter_mut()) {
            for o in list {
                jobs.push((key.clone(), &mut o.array, lists.next().unwrap_or_default()));
            }
        }
        let bytes = jobs.iter().map(|(_, a, _)| a.nbytes()).sum();
        self.call(py, bytes, move |kv| {
            // Every output and list of ids is checked before the first is written.
            for (key, a, ids) in &jobs {
                kv.check_rows(key.clone(), a, ids)?;
            }
            for (key, a, ids) in jobs {
                kv.with_priority(priority).row_sparse_pull(key, a, &ids)?;
            }
            Ok(())
        })
    }
}
