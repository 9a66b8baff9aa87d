//! The push + pull loop in Rust that `benches/layer_cost.py` measures the Python layer
//! against (`KVStore._rust_push_pull_loop`).

use kvstore::NDArray;
use pyo3::prelude::*;

use super::calls::{read_lines, touch_lines};
use super::pushes::{Pushes, ASYNC_BYTES};
use super::KVStore;
use crate::args::keys;
use crate::arrays::Lent;
use crate::to_py;

impl KVStore {
    /// `_rust_push_pull_loop`'s loop: `(lent, read, touch)` as it takes them.
    pub(super) fn rust_loop(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        value: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        iters: usize,
        (lent, read, touch): (bool, bool, usize),
    ) -> PyResult<f64> {
        let Some(k) = keys(key)?.keys.into_iter().next() else {
            return Err(pyo3::exceptions::PyValueError::new_err("no key"));
        };
        let arrays = |l: Lent| match lent {
            true => Ok(l.array),
            false => NDArray::from_bytes(l.array.shape(), l.array.dtype(), l.array.as_bytes()),
        };
        let v = arrays(crate::arrays::lend(value, false, "value")?).map_err(to_py)?;
        let mut o = arrays(crate::arrays::lend(out, true, "out")?).map_err(to_py)?;
        let mut other = vec![0u8; touch];
        // Python's push in a distributed store returns before the servers answer (`pushes`):
        // so does this loop's, of a copy of the lent memory as Python's, or of the store's own
        // array (a write to it would copy it); the pull, then the push's end.
        let early = self.dist && v.nbytes() <= ASYNC_BYTES;
        let mut pushes = Pushes::default();
        self.call(py, usize::MAX, move |kv| {
            let t = std::time::Instant::now();
            for _ in 0..iters {
                let mut pending = None;
                match (early, lent) {
                    (false, _) => kv.push(k.clone(), &v)?,
                    (true, true) => pushes.start(kv, &k, &v, 0)?,
                    (true, false) => pending = Some(kv.push_async(k.clone(), &v)?),
                }
                touch_lines(&mut other);
                kv.pull(k.clone(), &mut o)?;
                match pending {
                    Some(p) => drop(kv.wait(p)?),
                    None => pushes.settle(kv, &k)?,
                }
                touch_lines(&mut other);
                if read {
                    read_lines(o.as_bytes());
                }
            }
            Ok(t.elapsed().as_secs_f64())
        })
    }
}
