//! The calls as their arguments came: `push`, `pull` and `pushpull` of the class run these,
//! and make them again with converted arrays where one's dtype was refused (`convert`).

use kvstore::{Key, Keys, NDArray, Outputs, Values};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::calls::{nbytes, refs, refs_mut};
use super::pushes::{Pushes, ASYNC_BYTES};
use super::KVStore;
use crate::args::{check_outputs, is_list, keys, per_key, plan_outputs, KeyArg};
use crate::arrays::Lent;

impl KVStore {
    /// `init` of keys and values already read (`init`, and `broadcast` once it checked its
    /// outputs).
    pub(super) fn init_given(&self, py: Python<'_>, k: KeyArg, vals: &[Vec<Lent>]) -> PyResult<()> {
        let n = nbytes(vals);
        let r = refs(vals);
        self.control(py, n, move |kv| {
            kv.init(Keys::Many(k.keys), Values::Nested(r))
        })
    }

    pub(super) fn push_given(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        value: &Bound<'_, PyAny>,
        priority: i32,
    ) -> PyResult<()> {
        if !is_list(key) && !is_list(value) {
            // One key, one array: the common call, with nothing to group. In a distributed
            // store it returns once the array's bytes are copied (`pushes`).
            let dist = self.dist;
            let push = |kv: &mut kvstore::KVStore, p: &mut Pushes, k: &Key, v: &mut NDArray| {
                if dist && v.nbytes() <= ASYNC_BYTES {
                    return p.start(kv, k, v, priority);
                }
                p.settle(kv, k)?;
                kv.with_priority(priority).push(k, &*v)
            };
            if let Some(r) = self.one_array(py, key, value, false, push) {
                return r;
            }
            let key = crate::args::key(key)?;
            let v = crate::arrays::lend(value, false, "value")?;
            return self.call(py, v.len, move |kv| {
                kv.with_priority(priority).push(key, &v.array)
            });
        }
        let k = keys(key)?;
        let vals = per_key(&k, value, false, "value")?;
        let n = nbytes(&vals);
        let r = refs(&vals);
        self.call(py, n, move |kv| {
            kv.with_priority(priority)
                .push(Keys::Many(k.keys), Values::Nested(r))
        })
    }

    pub(super) fn pull_given(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        out: Option<&Bound<'_, PyAny>>,
        priority: i32,
    ) -> PyResult<()> {
        let out =
            out.ok_or_else(|| PyValueError::new_err("pull needs out= (the arrays to fill)"))?;
        if !is_list(key) && !is_list(out) {
            // The key's push in flight is over once the pull is (the servers answer it first);
            // where both failed, the push's error comes first (the pull's follows from it),
            // but for an interruption of the pull, which is raised as itself (Ctrl-C).
            let pull = |kv: &mut kvstore::KVStore, p: &mut Pushes, k: &Key, o: &mut NDArray| {
                let pulled = kv.with_priority(priority).pull(k, o);
                match (p.settle(kv, k), pulled) {
                    (_, Err(e @ kvstore::KvError::Interrupted(_))) => Err(e),
                    (settled, pulled) => settled.and(pulled),
                }
            };
            if let Some(r) = self.one_array(py, key, out, true, pull) {
                return r;
            }
            let key = crate::args::key(key)?;
            let mut o = crate::arrays::lend(out, true, "out")?;
            return self.call(py, o.len, move |kv| {
                kv.with_priority(priority).pull(key, &mut o.array)
            });
        }
        let k = keys(key)?;
        let mut outs = per_key(&k, out, true, "out")?;
        self.pull_into(py, k, &mut outs, priority)
    }

    pub(super) fn pushpull_given(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        value: &Bound<'_, PyAny>,
        out: Option<&Bound<'_, PyAny>>,
        priority: i32,
    ) -> PyResult<()> {
        if !is_list(key) && !is_list(value) && out.is_none_or(|o| !is_list(o)) {
            // One key, one array, one output or none: in place when none.
            if let Some(r) = self.one_pushpull(py, key, value, out.unwrap_or(value), priority) {
                return r;
            }
        }
        let k = keys(key)?;
        let in_place = out.is_none();
        let vals = per_key(&k, value, in_place, "value")?;
        let mut outs = match out {
            Some(o) => per_key(&k, o, true, "out")?,
            None => Vec::new(),
        };
        // In place, the values are the outputs.
        let shared = match in_place {
            true => check_outputs(&vals)?,
            false => plan_outputs(&mut outs)?,
        };
        let aliased = in_place
            || outs
                .iter()
                .flatten()
                .any(|o| vals.iter().flatten().any(|v| v.overlaps(o)));
        for (list, vs) in outs.iter().zip(&vals) {
            for o in list {
                let v = &vs[0].array;
                if o.array.shape() != v.shape() || o.array.dtype() != v.dtype() {
                    // A dtype alone is converted (`convert`), as MXNet converts it.
                    let e = match o.array.shape() == v.shape() {
                        true => crate::DTypeMismatch::new_err,
                        false => PyValueError::new_err,
                    };
                    return Err(e(format!(
                        "out has shape {:?} and dtype {}, its value {:?} and {}",
                        o.array.shape(),
                        o.array.dtype(),
                        v.shape(),
                        v.dtype()
                    )));
                }
            }
        }
        if aliased || shared {
            // The results land in the store's memory first, and are copied into the outputs
            // (or the values) once the call is over: a call never writes what it reads.
            // (Memory it cannot have is a MemoryError, as numpy's.)
            let mut tmp: Vec<NDArray> = vals
                .iter()
                .map(|l| NDArray::try_zeros_dtype(l[0].array.shape(), l[0].array.dtype()))
                .collect::<kvstore::Result<_>>()
                .map_err(|e| pyo3::exceptions::PyMemoryError::new_err(e.to_string()))?;
            let n = nbytes(&vals);
            let r = refs(&vals);
            let ks = k.keys.clone();
            let tmp_refs: Vec<Vec<&mut NDArray>> = tmp.iter_mut().map(|t| vec![t]).collect();
            self.call(py, n, move |kv| {
                kv.with_priority(priority).pushpull(
                    Keys::Many(ks),
                    Values::Nested(r),
                    Outputs::Nested(tmp_refs),
                )
            })?;
            let targets = if in_place { &vals } else { &outs };
            for (t, list) in tmp.iter().zip(targets) {
                for o in list {
                    o.fill_from(t);
                }
            }
            return Ok(());
        }
        let n = nbytes(&vals) + nbytes(&outs);
        let r = refs(&vals);
        let o = refs_mut(&mut outs);
        self.call(py, n, move |kv| {
            kv.with_priority(priority).pushpull(
                Keys::Many(k.keys),
                Values::Nested(r),
                Outputs::Nested(o),
            )
        })
    }
}
