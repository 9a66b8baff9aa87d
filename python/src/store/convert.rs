//! A call refused because an array's dtype is not its key's, made again with the arrays
//! converted, as MXNet converts them (`kvstore/_convert.py`). The store checks every array
//! before it does anything, so a refused call changed nothing; the common call, whose dtypes
//! agree, pays nothing for this.

use pyo3::prelude::*;

use super::KVStore;
use crate::args::keys;
use crate::{DTypeMismatch, UnsupportedDType};

/// What a refused call takes again: its values and its outputs, either converted.
pub(super) struct Again<'py> {
    pub(super) value: Option<Bound<'py, PyAny>>,
    pub(super) out: Option<Bound<'py, PyAny>>,
}

impl KVStore {
    /// `r`, or where it is a dtype refusal that conversion mends, the result of `again` with
    /// `value` and `out` converted (`None`: the call has none). `out` gets the results, cast
    /// into its dtype, once `again` succeeded.
    pub(super) fn converted<'py>(
        &self,
        py: Python<'py>,
        r: PyResult<()>,
        key: &Bound<'py, PyAny>,
        value: Option<&Bound<'py, PyAny>>,
        out: Option<&Bound<'py, PyAny>>,
        again: impl FnOnce(Again<'py>) -> PyResult<()>,
    ) -> PyResult<()> {
        let refused = match r {
            Err(e)
                if e.is_instance_of::<DTypeMismatch>(py)
                    || e.is_instance_of::<UnsupportedDType>(py) =>
            {
                e
            }
            r => return r,
        };
        let k = keys(key)?;
        // A key the store does not know is a KeyError, before any dtype.
        let names: Vec<&'static str> = self.call(py, 0, move |kv| {
            k.keys
                .iter()
                .map(|k| kv.key_info(k).map(|(_, d)| crate::arrays::numpy_name(d)))
                .collect()
        })?;
        let helper = py.import("kvstore._convert")?;
        let mut changed = false;
        let value = match value {
            Some(v) => match helper.call_method1("values", (key, v, names.clone()))? {
                c if c.is_none() => Some(v.clone()),
                c => {
                    changed = true;
                    Some(c)
                }
            },
            None => None,
        };
        let (out, backs) = match out {
            Some(o) => match helper.call_method1("outputs", (key, o, names))? {
                c if c.is_none() => (Some(o.clone()), None),
                c => {
                    changed = true;
                    (Some(c.get_item(0)?), Some(c.get_item(1)?))
                }
            },
            None => (None, None),
        };
        if !changed {
            // Nothing numpy can convert (another kind of object): the refusal stands.
            return Err(refused);
        }
        again(Again { value, out })?;
        if let Some(b) = backs {
            helper.call_method1("copy_back", (b,))?;
        }
        Ok(())
    }

    // The calls' refusals, taken out of line: the common call's code stays as it was (its
    // size, not its time, is what a small call's cost grows with).

    #[cold]
    #[inline(never)]
    pub(super) fn push_converted(
        &self,
        py: Python<'_>,
        e: PyErr,
        key: &Bound<'_, PyAny>,
        value: &Bound<'_, PyAny>,
        priority: i32,
    ) -> PyResult<()> {
        self.converted(py, Err(e), key, Some(value), None, |a| {
            self.push_given(py, key, a.value.as_ref().unwrap_or(value), priority)
        })
    }

    #[cold]
    #[inline(never)]
    pub(super) fn pull_converted(
        &self,
        py: Python<'_>,
        e: PyErr,
        key: &Bound<'_, PyAny>,
        out: Option<&Bound<'_, PyAny>>,
        priority: i32,
    ) -> PyResult<()> {
        self.converted(py, Err(e), key, None, out, |a| {
            self.pull_given(py, key, a.out.as_ref().or(out), priority)
        })
    }

    #[cold]
    #[inline(never)]
    pub(super) fn pushpull_converted(
        &self,
        py: Python<'_>,
        e: PyErr,
        key: &Bound<'_, PyAny>,
        value: &Bound<'_, PyAny>,
        out: Option<&Bound<'_, PyAny>>,
        priority: i32,
    ) -> PyResult<()> {
        // In place, the values are the outputs too.
        self.converted(
            py,
            Err(e),
            key,
            Some(value),
            Some(out.unwrap_or(value)),
            |a| {
                let v = a.value.as_ref().unwrap_or(value);
                self.pushpull_given(py, key, v, a.out.as_ref().or(out), priority)
            },
        )
    }
}
