//! MXNet's arguments: a key or a list of keys; per key one array or a list of arrays.

use kvstore::Key;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyInt, PyList, PyString, PyTuple};

use crate::arrays::{lend, Lent};

/// Keys, and whether they were given as a list.
pub(crate) struct KeyArg {
    pub(crate) keys: Vec<Key>,
    pub(crate) list: bool,
}

pub(crate) fn is_list(obj: &Bound<'_, PyAny>) -> bool {
    obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>()
}

pub(crate) fn key(obj: &Bound<'_, PyAny>) -> PyResult<Key> {
    if let Ok(i) = obj.cast_exact::<PyInt>() {
        return match i.extract::<i64>() {
            Ok(i) => Ok(Key::Int(i)),
            Err(_) => Err(too_large(i)),
        };
    }
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(Key::Str(s.to_str()?.to_string()));
    }
    if obj.is_instance_of::<pyo3::types::PyBool>() {
        return Err(PyTypeError::new_err("a key is an int or a str, not a bool"));
    }
    obj.extract::<i64>()
        .map(Key::Int)
        .map_err(|e| not_a_key(obj, e))
}

/// The error of a key that is no int or str, or an int (an `__index__`: numpy's, an
/// `IntEnum`'s) beyond 64 bits.
#[cold]
#[inline(never)]
fn not_a_key(obj: &Bound<'_, PyAny>, e: PyErr) -> PyErr {
    if e.is_instance_of::<pyo3::exceptions::PyOverflowError>(obj.py()) {
        let shown = obj
            .str()
            .map_or_else(|_| "?".to_string(), |s| s.to_string());
        return pyo3::exceptions::PyOverflowError::new_err(format!(
            "an int key is from -2**63 to 2**63 - 1, not {shown}"
        ));
    }
    let t = obj
        .get_type()
        .name()
        .map_or_else(|_| "?".to_string(), |n| n.to_string());
    PyTypeError::new_err(format!("a key is an int or a str, not {t}"))
}

/// The error of an int key beyond 64 bits: out of line, so that the common call's code is
/// what it was without it (a small call's cost is its code's size, see README).
#[cold]
#[inline(never)]
fn too_large(i: &Bound<'_, PyInt>) -> PyErr {
    pyo3::exceptions::PyOverflowError::new_err(format!(
        "an int key is from -2**63 to 2**63 - 1, not {i}"
    ))
}

/// An int or str key, or a list (or tuple) of them.
pub(crate) fn keys(obj: &Bound<'_, PyAny>) -> PyResult<KeyArg> {
    if is_list(obj) {
        let keys = obj.try_iter()?.map(|k| key(&k?)).collect::<PyResult<_>>()?;
        Ok(KeyArg { keys, list: true })
    } else {
        Ok(KeyArg {
            keys: vec![key(obj)?],
            list: false,
        })
    }
}

/// One array or a list of arrays, each made by `leaf` (its object and its name).
fn arrays<T>(
    obj: &Bound<'_, PyAny>,
    what: &str,
    leaf: &impl Fn(&Bound<'_, PyAny>, &str) -> PyResult<T>,
) -> PyResult<Vec<T>> {
    if is_list(obj) {
        let mut out = Vec::new();
        for (i, a) in obj.try_iter()?.enumerate() {
            let a = a?;
            if is_list(&a) {
                return Err(PyTypeError::new_err(format!(
                    "{what}[{i}] is a list; a single key takes an array or a list of arrays"
                )));
            }
            out.push(leaf(&a, &format!("{what}[{i}]"))?);
        }
        if out.is_empty() {
            return Err(PyValueError::new_err(format!("{what} is an empty list")));
        }
        Ok(out)
    } else {
        Ok(vec![leaf(obj, what)?])
    }
}

/// The arrays of each key, as MXNet pairs them: a single key takes an array or a list (one
/// per device); a list of keys takes a list with, per key, an array or a list of arrays.
/// Out of line: the calls of one array, the common ones, never come here, and their code stays
/// small without it (a small call's cost is its code's size, see README).
#[inline(never)]
pub(crate) fn per_key(
    keys: &KeyArg,
    obj: &Bound<'_, PyAny>,
    writable: bool,
    what: &str,
) -> PyResult<Vec<Vec<Lent>>> {
    per_key_with(keys, obj, what, |a, name| lend(a, writable, name))
}

/// [`per_key`]'s pairing, each array made by `leaf` (its object and its name).
pub(crate) fn per_key_with<T>(
    keys: &KeyArg,
    obj: &Bound<'_, PyAny>,
    what: &str,
    leaf: impl Fn(&Bound<'_, PyAny>, &str) -> PyResult<T>,
) -> PyResult<Vec<Vec<T>>> {
    if !keys.list {
        return Ok(vec![arrays(obj, what, &leaf)?]);
    }
    if !is_list(obj) {
        if keys.keys.len() == 1 {
            return Ok(vec![arrays(obj, what, &leaf)?]);
        }
        return Err(PyValueError::new_err(format!(
            "{} keys but one {what}: give a list with one entry per key",
            keys.keys.len()
        )));
    }
    let items: Vec<Bound<'_, PyAny>> = obj.try_iter()?.collect::<PyResult<_>>()?;
    if items.len() != keys.keys.len() {
        return Err(PyValueError::new_err(format!(
            "{} keys but {} {what}s",
            keys.keys.len(),
            items.len()
        )));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, it)| arrays(it, &format!("{what}[{i}]"), &leaf))
        .collect()
}

/// How a list of outputs may be written by one call: each key's distinct outputs (the same
/// array twice in one key's list is written once), and whether keys share an output (the
/// calls then go key by key, so that the last key's value is what it holds, as in MXNet).
/// Outputs that overlap without being the same array are refused.
pub(crate) fn plan_outputs(outs: &mut [Vec<Lent>]) -> PyResult<bool> {
    for list in outs.iter_mut() {
        let mut kept: Vec<Lent> = Vec::with_capacity(list.len());
        for o in list.drain(..) {
            if !kept.iter().any(|k| k.same(&o)) {
                kept.push(o);
            }
        }
        *list = kept;
    }
    check_outputs(outs)
}

/// Refuses outputs (per key) that overlap without being the same array; whether two keys
/// share one.
pub(crate) fn check_outputs(outs: &[Vec<Lent>]) -> PyResult<bool> {
    for list in outs {
        for (i, a) in list.iter().enumerate() {
            if list[i + 1..].iter().any(|b| !a.same(b) && a.overlaps(b)) {
                return Err(PyValueError::new_err(
                    "two outputs of one key overlap without being the same array",
                ));
            }
        }
    }
    let mut shared = false;
    for (i, a) in outs.iter().enumerate() {
        for b in &outs[i + 1..] {
            for x in a {
                for y in b {
                    if x.same(y) {
                        shared = true;
                    } else if x.overlaps(y) {
                        return Err(PyValueError::new_err(
                            "outputs of two keys overlap without being the same array",
                        ));
                    }
                }
            }
        }
    }
    Ok(shared)
}

/// MXNet's `compression_params`: a dict of `type` and `threshold`, each value taken as its
/// `str()` (as MXNet passes them on). Not a dict: TypeError; a bad parameter: ValueError.
pub(crate) fn compression(params: &Bound<'_, PyAny>) -> PyResult<kvstore::Compression> {
    let dict = params.cast::<pyo3::types::PyDict>().map_err(|_| {
        PyTypeError::new_err(
            "compression_params must be a dict, such as {'type': '2bit', 'threshold': 0.5}",
        )
    })?;
    let mut pairs = Vec::with_capacity(dict.len());
    for (k, v) in dict.iter() {
        let k: String = k
            .extract()
            .map_err(|_| PyTypeError::new_err("compression_params' keys are str"))?;
        pairs.push((k, v.str()?.to_str()?.to_string()));
    }
    let refs: Vec<(&str, &str)> = pairs
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    kvstore::Compression::from_params(&refs).map_err(|e| PyValueError::new_err(e.to_string()))
}
