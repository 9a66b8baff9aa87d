//! The engine of `kvstore.optimizer.Updater` (MXNet's `get_updater`): a built-in optimizer run
//! in this process on numpy arrays, by the same `OptimizerUpdater` a store runs, its state kept
//! per key.

use std::sync::Mutex;

use kvstore::{KvError, OptimizerUpdater};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::arrays::lend;
use crate::to_py;

/// A runner's error as its Python exception. Its own refusals (`KvError::Updater`) are not a
/// Python updater's exception: the one kept for a store's call is left where it is.
fn err(e: KvError) -> PyErr {
    match e {
        KvError::Updater { .. } => crate::KVStoreError::new_err(e.to_string()),
        e => to_py(e),
    }
}

/// A built-in optimizer and its per-key state, updating numpy arrays in place.
#[pyclass(module = "kvstore._native", frozen)]
pub(crate) struct OptimizerRunner {
    inner: Mutex<OptimizerUpdater>,
}

impl OptimizerRunner {
    fn with<T>(&self, f: impl FnOnce(&mut OptimizerUpdater) -> T) -> PyResult<T> {
        // A thread that panicked while holding it may have left a step half made: refused.
        let mut g = self
            .inner
            .lock()
            .map_err(|_| PyRuntimeError::new_err("the updater was poisoned"))?;
        Ok(f(&mut g))
    }
}

#[pymethods]
impl OptimizerRunner {
    /// A runner of the optimizer a `kvstore.optimizer` object describes, with fresh state.
    #[new]
    fn new(optimizer: &Bound<'_, PyAny>) -> PyResult<Self> {
        let opt = crate::optimizer::of(optimizer)?;
        opt.check_new().map_err(err)?;
        Ok(OptimizerRunner {
            inner: Mutex::new(OptimizerUpdater::new(opt)),
        })
    }

    /// A runner of saved states that carry their optimizer (`save_states(True)`).
    #[staticmethod]
    fn from_states(states: &[u8]) -> PyResult<Self> {
        let mut u = OptimizerUpdater::new(kvstore::Optimizer::sgd(0.0));
        if !u.load_states(states).map_err(err)? {
            return Err(PyValueError::new_err(
                "the states do not carry their optimizer (save them with dump_optimizer)",
            ));
        }
        Ok(OptimizerRunner {
            inner: Mutex::new(u),
        })
    }

    /// One step of key `key` on `weight` (a writable, C-contiguous array, changed in place)
    /// with gradient `grad` (of its shape and dtype, apart from it).
    fn update(
        &self,
        key: &Bound<'_, PyAny>,
        grad: &Bound<'_, PyAny>,
        weight: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let key = crate::args::key(key)?;
        let g = lend(grad, false, "grad")?;
        let mut w = lend(weight, true, "weight")?;
        if g.overlaps(&w) {
            return Err(PyValueError::new_err(
                "the gradient and the weight share memory",
            ));
        }
        self.with(|u| u.update(&key, &g.array, &mut w.array))?
            .map_err(err)
    }

    /// Runs `optimizer` from the next update on, the state kept (an error, nothing changed,
    /// where it is another kind).
    fn retune(&self, optimizer: &Bound<'_, PyAny>) -> PyResult<()> {
        let opt = crate::optimizer::of(optimizer)?;
        opt.check().map_err(err)?;
        self.with(|u| u.retune(opt))?.map_err(err)
    }

    /// The most updates any key has had (MXNet's `num_update`).
    fn num_update(&self) -> PyResult<u64> {
        self.with(|u| u.num_update())
    }

    /// The state as bytes (kvstore's saved-states format), with the optimizer where `dump`.
    fn save_states<'py>(&self, py: Python<'py>, dump: bool) -> PyResult<Bound<'py, PyBytes>> {
        let bytes = self.with(|u| match dump {
            true => u.save_states_and_optimizer(),
            false => u.save_states(),
        })?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// Replaces the state with saved bytes; `True` where they carried the optimizer, which
    /// then replaced this one.
    fn load_states(&self, states: &[u8]) -> PyResult<bool> {
        self.with(|u| u.load_states(states))?.map_err(err)
    }
}

/// MXNet's `save_optimizer_states` for a local store whose updater has `get_states` (a
/// `kvstore.optimizer.Updater`, say): its state written to `path`; `false` where it has none.
pub(crate) fn save_through(
    updater: &Bound<'_, PyAny>,
    path: &std::path::Path,
    dump: bool,
) -> PyResult<bool> {
    if !updater.hasattr(pyo3::intern!(updater.py(), "get_states"))? {
        return Ok(false);
    }
    let states = updater.call_method1("get_states", (dump,))?;
    let bytes: Vec<u8> = states.extract()?;
    // The file is written without the GIL, as the store's own states are.
    updater
        .py()
        .detach(|| std::fs::write(path, bytes))
        .map_err(|e| pyo3::exceptions::PyOSError::new_err(e.to_string()))?;
    Ok(true)
}

/// MXNet's `load_optimizer_states` for a local store whose updater has `set_states`; `false`
/// where it has none.
pub(crate) fn load_through(updater: &Bound<'_, PyAny>, path: &std::path::Path) -> PyResult<bool> {
    if !updater.hasattr(pyo3::intern!(updater.py(), "set_states"))? {
        return Ok(false);
    }
    let bytes = (updater.py())
        .detach(|| std::fs::read(path))
        .map_err(|e| pyo3::exceptions::PyOSError::new_err(e.to_string()))?;
    updater.call_method1("set_states", (PyBytes::new(updater.py(), &bytes),))?;
    Ok(true)
}
