//! The `KVStore` class: MXNet 1.9's Python `KVStore`, on the kvstore crate's store.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use kvstore::{Key, NDArray};
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;

use crate::args::{keys, per_key};
use crate::claim::Claimable;
use crate::shell::{lend_into, Shell};
use crate::updater;

mod bench;
mod calls;
mod convert;
mod given;
mod pushes;
mod rows;
use calls::read_lines;
use pushes::{Pushes, ASYNC_BYTES};

/// How many times this process is a child made by fork, counted by a `pthread_atfork` handler
/// (a store remembers the count it was made in: reading the pid on every call is a system
/// call).
static FORKS: AtomicU64 = AtomicU64::new(0);

extern "C" fn forked() {
    FORKS.fetch_add(1, Ordering::Relaxed);
}

/// Counts forks from now on (once, when the module loads).
pub(crate) fn watch_forks() {
    // SAFETY: registers a handler that only increments an atomic, which is safe in a child
    // after fork.
    unsafe { libc::pthread_atfork(None, None, Some(forked)) };
}

/// The signal (KeyboardInterrupt) that interrupted a distributed call, with the thread whose
/// wait caught it (the main thread: only it runs signal handlers), raised by that call.
static SIGNAL: Mutex<Option<(std::thread::ThreadId, PyErr)>> = Mutex::new(None);

/// The signal this thread's wait caught, if any: another thread's call, failed by the same
/// interruption, does not take it.
pub(crate) fn take_signal() -> Option<PyErr> {
    let mut s = SIGNAL.lock().ok()?;
    let mine = s
        .as_ref()
        .is_some_and(|(t, _)| *t == std::thread::current().id());
    mine.then(|| s.take().map(|(_, e)| e)).flatten()
}

/// The store, and the shells its one-array calls lend numpy arrays through (a value's, an
/// output's).
struct State {
    kv: Option<kvstore::KVStore>,
    shells: [Option<Shell>; 2],
    /// The last one-array call's key and, where it is an `int` or a `str`, its object (held,
    /// so that its address names it: those are immutable): a loop over the same keys reads
    /// each once.
    last_key: Option<(Option<Py<PyAny>>, Key)>,
    /// A distributed store's pushes in flight (`pushes`).
    pushes: Pushes,
    /// Each key's result array for a one-array pushpull in place (`one_pushpull`), kept
    /// for the store's life as `pushes` keeps its staging arrays (at most 1 MiB each).
    results: rustc_hash::FxHashMap<Key, NDArray>,
    /// Why the store was ended, where a call panicked (`calls::fence`).
    closed: Option<String>,
}

/// A key-value store with MXNet's KVStore API (create one with `kvstore.create`).
///
/// Calls from several threads are serialised; a blocking call releases the GIL, and Ctrl-C
/// interrupts it (the store then refuses further calls). A child made by `fork` cannot use
/// its parent's store.
#[pyclass(module = "kvstore", frozen, weakref)]
pub(crate) struct KVStore {
    inner: Claimable<State>,
    name: String,
    pid: u32,
    forks: u64,
    rank: usize,
    num_workers: usize,
    dist: bool,
    /// The `kvstore.optimizer` object a local store runs (`set_optimizer`): a change to its
    /// parameters is applied to the store's (`_retune_optimizer`), as in MXNet.
    optimizer: std::sync::Mutex<Option<Py<PyAny>>>,
    /// A local store's Python updater (`_set_updater`), whose `get_states` and `set_states`
    /// save and load its state where it has them, as in MXNet.
    updater: std::sync::Mutex<Option<Py<PyAny>>>,
}

#[pymethods]
impl KVStore {
    /// The store's type, as given to create.
    #[getter(r#type)]
    fn type_(&self) -> &str {
        &self.name
    }

    /// This worker's rank (0 in a local store).
    #[getter]
    fn rank(&self) -> usize {
        self.rank
    }

    /// The number of workers (1 in a local store).
    #[getter]
    fn num_workers(&self) -> usize {
        self.num_workers
    }

    fn __repr__(&self) -> String {
        format!(
            "<kvstore.KVStore type={:?} rank={} num_workers={}>",
            self.name, self.rank, self.num_workers
        )
    }

    /// Initialises keys with values (one per key); in a distributed store rank 0's values
    /// are stored, and every worker waits for them.
    fn init(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        value: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let k = keys(key)?;
        let vals = per_key(&k, value, false, "value")?;
        self.init_given(py, k, &vals)
    }

    /// Pushes values: a list of values for one key is summed, then merged into the stored value
    /// by the updater (ASSIGN unless one is set). A larger priority is sent first. In a
    /// distributed store, a push of one array of at most 1 MiB returns once the array is
    /// copied, before the servers answer (as MXNet's push returns at once): its error, if it
    /// fails, is raised by the next call that waits for it (the key's next push, a pull of the
    /// key, or any other call); a pull of the key sees it. A value of another dtype than its
    /// key's is converted (a copy), as MXNet converts it.
    #[pyo3(signature = (key, value, priority = 0))]
    pub(crate) fn push(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        value: &Bound<'_, PyAny>,
        priority: i32,
    ) -> PyResult<()> {
        match self.push_given(py, key, value, priority) {
            Err(e) => self.push_converted(py, e, key, value, priority),
            ok => ok,
        }
    }

    /// Pulls the stored values into `out` (an array, or a list: one per device, or one per
    /// key), writing the arrays in place. An output of another dtype than its key's gets the
    /// value cast into it, as in MXNet.
    /// `ignore_sparse` is taken as MXNet takes it (any object, by its truth) and changes
    /// nothing: arrays here are dense.
    #[pyo3(
        signature = (key, out = None, priority = 0, ignore_sparse = None),
        text_signature = "($self, /, key, out=None, priority=0, ignore_sparse=True)"
    )]
    pub(crate) fn pull(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        out: Option<&Bound<'_, PyAny>>,
        priority: i32,
        ignore_sparse: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let _ = ignore_sparse;
        match self.pull_given(py, key, out, priority) {
            Err(e) => self.pull_converted(py, e, key, out, priority),
            ok => ok,
        }
    }

    /// Pulls only the rows `row_ids` (along the first dimension) of each key's value into
    /// `out`, which has the value's shape: those rows get the stored rows, the others zero
    /// (MXNet's row-sparse result, made dense). `row_ids` is one 1-D integer array (or list)
    /// for every output, or a list of them, one per output; ids may repeat and come in any
    /// order. In a distributed store only those rows travel.
    #[pyo3(signature = (key, out = None, priority = 0, row_ids = None))]
    fn row_sparse_pull(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        out: Option<&Bound<'_, PyAny>>,
        priority: i32,
        row_ids: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let out = out.ok_or_else(|| {
            PyValueError::new_err("row_sparse_pull needs out= (the arrays to fill)")
        })?;
        let ids = row_ids.ok_or_else(|| {
            PyValueError::new_err("row_sparse_pull needs row_ids= (the rows to pull)")
        })?;
        let r = self.rows(py, key, out, priority, ids);
        self.converted(py, r, key, None, Some(out), |a| {
            self.rows(py, key, a.out.as_ref().unwrap_or(out), priority, ids)
        })
    }

    /// Pushes, then pulls the result into `out`; with no `out`, into the values themselves.
    /// Values and outputs of another dtype than their key's are converted, as in `push` and
    /// `pull`.
    #[pyo3(signature = (key, value, out = None, priority = 0))]
    pub(crate) fn pushpull(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        value: &Bound<'_, PyAny>,
        out: Option<&Bound<'_, PyAny>>,
        priority: i32,
    ) -> PyResult<()> {
        match self.pushpull_given(py, key, value, out, priority) {
            Err(e) => self.pushpull_converted(py, e, key, value, out, priority),
            ok => ok,
        }
    }

    /// Initialises keys with values (rank 0's, in a distributed store) and pulls them into
    /// `out`.
    #[pyo3(signature = (key, value, out, priority = 0))]
    fn broadcast(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        value: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        priority: i32,
    ) -> PyResult<()> {
        // The outputs are checked against the values first, as the Rust `broadcast` checks
        // them: a refused call stores nothing. An output of another dtype is converted by the
        // pull, as a pull's is; one whose dtype cannot be lent is checked by its shape alone.
        let k = keys(key)?;
        let vals = per_key(&k, value, false, "value")?;
        let shapes =
            crate::args::per_key_with(&k, out, "out", |o, name| {
                match crate::arrays::lend(o, true, name) {
                    Ok(lent) => Ok(lent.array.shape().to_vec()),
                    Err(e) if e.is_instance_of::<crate::UnsupportedDType>(py) => {
                        o.getattr("shape")?.extract::<Vec<usize>>()
                    }
                    Err(e) => Err(e),
                }
            })?;
        for ((key, list), vs) in k.keys.iter().zip(&shapes).zip(&vals) {
            let want = vs[0].array.shape();
            if let Some(got) = list.iter().find(|s| s.as_slice() != want) {
                return Err(PyValueError::new_err(format!(
                    "key {key}: out has shape {got:?}, the value {want:?}; nothing was \
                     initialised"
                )));
            }
        }
        self.init_given(py, k, &vals)?;
        drop(vals);
        self.pull(py, key, Some(out), priority, None)
    }

    /// Runs a built-in optimizer (`kvstore.optimizer.SGD`, `NAG`, `Adam`, `AdaGrad`,
    /// `RMSProp`, `AdaDelta`, `Adamax`, `Signum`, `Ftrl`, `FTML`, `Nadam`) as the updater; in a distributed
    /// store it runs on the servers. An optimizer of your own (a subclass that defines
    /// `update`) runs in Python, as `_set_updater(get_updater(optimizer))` would run it.
    /// A local store runs the object itself: a change to its parameters afterwards
    /// (`set_learning_rate`, say) applies from the next update on, with the state kept.
    fn set_optimizer(slf: &Bound<'_, Self>, optimizer: &Bound<'_, PyAny>) -> PyResult<()> {
        let me = slf.get();
        // An optimizer of your own (it defines `update`): run in Python, as an updater.
        if optimizer.hasattr("_custom")? && optimizer.call_method0("_custom")?.is_truthy()? {
            let up = slf
                .py()
                .import("kvstore.optimizer")?
                .call_method1("get_updater", (optimizer,))?;
            return me._set_updater(slf.py(), &up);
        }
        let opt = crate::optimizer::of(optimizer)?;
        let runs = optimizer.clone().unbind();
        // As in `_set_updater`: said while the store is claimed.
        let replaced = me.control(slf.py(), 0, move |kv| {
            kv.set_optimizer(opt)?;
            Ok((!me.dist).then(|| me.replace_runs(Some(runs), Some(None))))
        })?;
        drop(replaced);
        if !me.dist {
            optimizer.call_method1("_attached_to", (slf,))?;
        }
        Ok(())
    }

    /// Applies `optimizer`'s parameters to the store's optimizer, keeping its state, where
    /// the store runs that object (its `set_optimizer` was given it last).
    fn _retune_optimizer(&self, py: Python<'_>, optimizer: &Bound<'_, PyAny>) -> PyResult<()> {
        let runs = self.runs().as_ref().is_some_and(|o| o.is(optimizer));
        if !runs {
            return Ok(());
        }
        let opt = crate::optimizer::of(optimizer)?;
        // Asked again while the store is claimed: reading the optimizer's parameters ran
        // Python, where another thread may have set another (which the store would retune).
        let object = optimizer.as_ptr() as usize;
        self.control(py, 0, move |kv| {
            match self.runs().as_ref().map(|o| o.as_ptr() as usize) == Some(object) {
                true => kv.update_optimizer(opt),
                false => Ok(()),
            }
        })
    }

    /// The most updates any key has had from `optimizer`, where this local store runs it (for
    /// the optimizer's `num_update`); 0 where it runs another (or none, or loaded another
    /// with saved states), and in a distributed store.
    fn _optimizer_num_update(&self, py: Python<'_>, optimizer: &Bound<'_, PyAny>) -> PyResult<u64> {
        let runs = self.runs().as_ref().is_some_and(|o| o.is(optimizer));
        if self.dist || !runs {
            return Ok(0);
        }
        self.control(py, 0, |kv| Ok(kv.optimizer_num_update().unwrap_or(0)))
    }

    /// Compresses pushes of float32 values to 2 bits an element, the rest kept for later
    /// pushes (MXNet's set_gradient_compression: {'type': '2bit', 'threshold': 0.5}). For
    /// stores whose MXNet name has 'device' or 'dist' (dist ones before the first init); the
    /// others ('local', 'nccl') refuse it, as MXNet's do.
    fn set_gradient_compression(
        &self,
        py: Python<'_>,
        compression_params: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let c = crate::args::compression(compression_params)?;
        if !(self.name.contains("device") || self.name.contains("dist")) {
            return Err(crate::KVStoreError::new_err(format!(
                "gradient compression is not supported for a {} store (as in MXNet)",
                self.name
            )));
        }
        self.control(py, 0, move |kv| kv.set_gradient_compression(c))
    }

    /// MXNet's `KVStoreBase.OPTIMIZER`, the capability `is_capable` names.
    #[classattr]
    const OPTIMIZER: &'static str = "optimizer";

    /// Sets the updater, `updater(key, input, stored)`, which merges `input` into `stored` (numpy
    /// views of the store's memory) in place. In a distributed store it is pickled (by value,
    /// with cloudpickle) and runs on the servers: unlike MXNet, which ignores a worker's
    /// updater there.
    fn _set_updater(&self, py: Python<'_>, updater: &Bound<'_, PyAny>) -> PyResult<()> {
        if !updater.is_callable() {
            return Err(PyTypeError::new_err("the updater must be callable"));
        }
        if self.dist {
            let name = updater::ship(updater)?;
            return self.control(py, 0, move |kv| kv.set_server_updater(&name));
        }
        let f = updater.clone().unbind();
        let kept = updater.clone().unbind();
        let me = self.address();
        // What the store runs is said while the store is claimed, so that a set_optimizer on
        // another thread cannot come between.
        let replaced = self.control(py, 0, move |kv| {
            kv.set_updater(move |k: &Key, i: &NDArray, s: &mut NDArray| {
                updater::run_for(me, &f, k, i, s)
            })?;
            Ok(self.replace_runs(None, Some(Some(kept))))
        })?;
        drop(replaced);
        Ok(())
    }

    /// Waits until every worker reaches the barrier.
    fn _barrier(&self, py: Python<'_>) -> PyResult<()> {
        self.control(py, 0, |kv| kv.barrier())
    }

    /// Waits until every worker reaches the barrier (as `_barrier`).
    fn barrier(&self, py: Python<'_>) -> PyResult<()> {
        self._barrier(py)
    }

    /// Saves the built-in optimizer's state to a file (in a distributed store, the servers';
    /// call it on one worker), or a local store's updater's (its `get_states`, as MXNet's);
    /// with `dump_optimizer`, the optimizer too.
    /// `dump_optimizer` is any object, taken by its truth (as MXNet's).
    #[pyo3(
        signature = (fname, dump_optimizer = None),
        text_signature = "($self, /, fname, dump_optimizer=False)"
    )]
    fn save_optimizer_states(
        &self,
        py: Python<'_>,
        fname: std::path::PathBuf,
        dump_optimizer: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let dump_optimizer = match dump_optimizer {
            Some(d) => d.is_truthy()?,
            None => false,
        };
        // The lock is let go before any Python runs (another thread may want it meanwhile).
        let updater = self.python_updater().as_ref().map(|u| u.clone_ref(py));
        if let Some(u) = updater {
            self.control(py, 0, |_| Ok(()))?; // a closed or inherited store refuses it
            if crate::runner::save_through(u.bind(py), &fname, dump_optimizer)? {
                return Ok(());
            }
        }
        // A file is written, perhaps a large one, perhaps slowly: without the GIL, as any
        // call that may take long (a size above any threshold says so).
        self.control(py, usize::MAX, move |kv| match dump_optimizer {
            true => kv.save_optimizer_and_states(&fname),
            false => kv.save_optimizer_states(&fname),
        })
    }

    /// Loads the built-in optimizer's state from a file `save_optimizer_states` wrote; one
    /// saved with `dump_optimizer` replaces the optimizer too, and the store no longer runs
    /// the object `set_optimizer` was given (as in MXNet).
    fn load_optimizer_states(&self, py: Python<'_>, fname: std::path::PathBuf) -> PyResult<()> {
        let updater = self.python_updater().as_ref().map(|u| u.clone_ref(py));
        if let Some(u) = updater {
            self.control(py, 0, |_| Ok(()))?; // a closed or inherited store refuses it
            if crate::runner::load_through(u.bind(py), &fname)? {
                return Ok(());
            }
        }
        if self.control(py, usize::MAX, move |kv| kv.load_optimizer_states(&fname))? {
            drop(self.replace_runs(None, None));
        }
        Ok(())
    }

    /// What this store counted (its calls, and per server, transport and range of keys its
    /// requests, pushes, pulls, bytes and call latencies), as a dict; empty counts for a local
    /// store.
    fn metrics<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let json = self.control(py, 0, |kv| Ok(kv.metrics().to_json()))?;
        py.import("json")?.call_method1("loads", (json,))
    }

    /// Which server holds which slice of each key, as text (a line per key); empty for a
    /// local store.
    fn placement_map(&self, py: Python<'_>) -> PyResult<String> {
        self.control(py, 0, |kv| Ok(kv.placement_map()))
    }

    /// For the test suite: starts a pull of `key` into the numpy array `out` and, while it is
    /// in flight, panics, as a bug in a call would (see `calls::fence`).
    fn _panic_in_a_call(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        self.panic_in_a_call(py, key, out)
    }

    /// Does nothing: the cost of an empty method call, the reference of `benches/layer_cost.py`.
    fn _nop(&self) {}

    /// The same push + pull loop in Rust, for `benches/layer_cost.py`: `iters` pushes of
    /// `value` to `key` and pulls into `out`, over copies in the store's own arrays or, `lent`,
    /// over the arrays' own memory as a Rust caller lends it; with `read`, each pull is
    /// followed by a read of what it brought (one load per cache line, as a training step's
    /// compute reads its weights); with `touch`, each push and each pull is followed by a
    /// write to each 64-byte line of that many bytes of other memory (what an interpreter
    /// running between calls does to the caches, `benches/cache_sensitivity.py`). The seconds
    /// it took.
    #[pyo3(signature = (key, value, out, iters, lent = false, read = false, touch = 0))]
    #[allow(clippy::too_many_arguments)]
    fn _rust_push_pull_loop(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        value: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        iters: usize,
        lent: bool,
        read: bool,
        touch: usize,
    ) -> PyResult<f64> {
        self.rust_loop(py, key, value, out, iters, (lent, read, touch))
    }

    /// The Python loop's calls made from Rust, for `benches/layer_cost.py`: `iters` calls of
    /// this class's own `push` and `pull` on `key`, `value` and `out`, all the layer does but
    /// the interpreter's part (its bytecode, the call, the arguments' parsing). The seconds it
    /// took.
    fn _binding_push_pull_loop(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        value: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        iters: usize,
    ) -> PyResult<f64> {
        let t = std::time::Instant::now();
        for _ in 0..iters {
            self.push(py, key, value, 0)?;
            self.pull(py, key, Some(out), 0, None)?;
        }
        Ok(t.elapsed().as_secs_f64())
    }

    /// Reads `out` as `_rust_push_pull_loop` reads what a pull brought, for the Python loop of
    /// `benches/layer_cost.py` that does the same.
    /// (Lent as a pushed value is, at the cost of a claim beyond the empty call's.)
    fn _read(&self, py: Python<'_>, out: &Bound<'_, PyAny>) -> PyResult<()> {
        let mut g = self
            .inner
            .try_claim(py)
            .ok_or_else(|| PyRuntimeError::new_err("the store is busy"))?;
        let mut lent = lend_into(&mut g.shells[0], out, false)
            .ok_or_else(|| PyTypeError::new_err("_read takes a C-contiguous numpy array"))?;
        if let Some(a) = lent.array() {
            read_lines(a.as_bytes());
        }
        Ok(())
    }

    /// Whether the store can do `capability`: 'optimizer' (run an optimizer in the store).
    fn is_capable(&self, capability: &str) -> PyResult<bool> {
        match capability.to_ascii_lowercase().as_str() {
            "optimizer" => Ok(true),
            other => Err(PyValueError::new_err(format!(
                "unknown capability {other:?}"
            ))),
        }
    }
}

impl Drop for KVStore {
    fn drop(&mut self) {
        let inner = self.inner.get_mut();
        if FORKS.load(Ordering::Relaxed) != self.forks {
            // A forked child must not speak on its parent's links (a distributed store's
            // destructor says goodbye to the servers and the scheduler).
            if let Some(kv) = inner.kv.take() {
                std::mem::forget(kv);
            }
        } else if let Some(kv) = inner.kv.as_mut() {
            // The pushes no call waited for are carried out; one that failed is said. The
            // GIL, which a destructor holds, is let go if that takes long (a server that does
            // not answer), as a call's wait lets it go: other threads run meanwhile.
            let _holding = calls::Holding::start();
            if let Err(e) = inner.pushes.settle_all(kv) {
                eprintln!("kvstore: a push that no later call waited for failed: {e}");
            }
            // A destructor cannot raise: a signal that interrupted the wait (Ctrl-C) is
            // delivered again, for the interpreter to raise once the destructor is over, and
            // is not left for a later call to raise.
            if let Some(signal) = take_signal() {
                Python::attach(|py| {
                    if signal.is_instance_of::<pyo3::exceptions::PyKeyboardInterrupt>(py) {
                        // SAFETY: the GIL is held; the call only sets the interpreter's
                        // pending-SIGINT flag.
                        unsafe { pyo3::ffi::PyErr_SetInterrupt() };
                    } else {
                        signal.write_unraisable(py, None);
                    }
                });
            }
        }
    }
}
