//! Python updaters, `update(key, input, stored)`, on numpy views of the store's memory: in a
//! local store, and on the servers of a distributed one (shipped pickled, by value).

use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvstore::{DType, Key, KvError, NDArray, SharedUpdater};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyTuple};
use pyo3::{intern, IntoPyObjectExt};

use crate::arrays::{numpy, numpy_name, Memory};

/// The scheme of updaters shipped to servers: `python:<hex of the pickled function>`.
pub(crate) const SCHEME: &str = "python";

/// The largest pickled updater: its hex name must fit a control message (60 KiB).
const MAX_PICKLE: usize = 28 * 1024;

thread_local! {
    /// The exception an updater raised in this thread, re-raised as itself by the call that
    /// ran the updater.
    static RAISED: RefCell<Option<PyErr>> = const { RefCell::new(None) };
    /// The store (its address) whose call runs an updater in this thread now, if any.
    static RUNNING_FOR: Cell<usize> = const { Cell::new(0) };
}

/// Whether this thread is running an updater for the store at `store`: a call it makes to
/// that store would wait for the call that runs it.
pub(crate) fn running_for(store: usize) -> bool {
    RUNNING_FOR.with(|r| r.get() == store)
}

/// [`run`], for the store at `store` (a local store's updater).
pub(crate) fn run_for(
    store: usize,
    f: &Py<PyAny>,
    key: &Key,
    input: &NDArray,
    stored: &mut NDArray,
) -> kvstore::Result<()> {
    let outer = RUNNING_FOR.with(|r| r.replace(store));
    let result = run(f, key, input, stored);
    RUNNING_FOR.with(|r| r.set(outer));
    result
}

/// The exception the last updater run in this thread raised, if any (taken).
pub(crate) fn take_raised() -> Option<PyErr> {
    RAISED.with(|r| r.borrow_mut().take())
}

/// A key as Python sees it.
pub(crate) fn key_object(py: Python<'_>, key: &Key) -> PyResult<Py<PyAny>> {
    match key {
        Key::Int(i) => i.into_py_any(py),
        Key::Str(s) => s.into_py_any(py),
    }
}

/// A numpy array of `shape` and `dtype` over `mem`.
fn view<'py>(
    mem: &Bound<'py, Memory>,
    shape: &[usize],
    dtype: DType,
) -> PyResult<Bound<'py, PyAny>> {
    let py = mem.py();
    let kw = PyDict::new(py);
    kw.set_item(intern!(py, "dtype"), numpy_name(dtype))?;
    let flat = numpy(py)?.call_method(intern!(py, "frombuffer"), (mem,), Some(&kw))?;
    flat.call_method1(intern!(py, "reshape"), (PyTuple::new(py, shape)?,))
}

/// Runs `f(key, input, stored)` with numpy views: `stored` is written in place. A view kept
/// past the call keeps its memory, and the store goes on with a copy of it.
pub(crate) fn apply(
    py: Python<'_>,
    f: &Bound<'_, PyAny>,
    key: &Key,
    input: &NDArray,
    stored: &mut NDArray,
) -> PyResult<()> {
    let in_mem = Bound::new(
        py,
        Memory::new(input.as_bytes().as_ptr(), input.nbytes(), true),
    )?;
    let (shape, dtype, nbytes) = (stored.shape().to_vec(), stored.dtype(), stored.nbytes());
    let st_ptr = stored.as_bytes_mut().as_mut_ptr();
    let st_mem = Bound::new(py, Memory::new(st_ptr, nbytes, false))?;
    let result = (|| {
        let a = view(&in_mem, input.shape(), input.dtype())?;
        let b = view(&st_mem, &shape, dtype)?;
        f.call1((key_object(py, key)?, a, b)).map(drop)
    })();
    // SAFETY: the GIL is held and the object is live.
    if unsafe { pyo3::ffi::Py_REFCNT(in_mem.as_ptr()) } > 1 {
        if let Ok(mut k) = in_mem.get().keep.lock() {
            *k = Some(input.clone());
        }
    }
    // SAFETY: as above.
    if unsafe { pyo3::ffi::Py_REFCNT(st_mem.as_ptr()) } > 1 {
        // The view's memory is held first, so that a copy that fails (out of memory) leaves
        // the view over memory it keeps, not over the store's, which may be freed later.
        if let Ok(mut k) = st_mem.get().keep.lock() {
            *k = Some(stored.clone());
        }
        let copy = NDArray::from_bytes(&shape, dtype, stored.as_bytes())
            .and_then(|c| c.on(stored.device()))
            .map_err(|e| match e {
                kvstore::KvError::TooLarge { .. } => {
                    pyo3::exceptions::PyMemoryError::new_err(e.to_string())
                }
                e => pyo3::exceptions::PyValueError::new_err(e.to_string()),
            })?;
        *stored = copy;
    }
    result
}

/// Runs a Python updater for the store; an exception becomes the store's error, and is kept
/// to be raised as itself by the call that ran it.
pub(crate) fn run(
    f: &Py<PyAny>,
    key: &Key,
    input: &NDArray,
    stored: &mut NDArray,
) -> kvstore::Result<()> {
    Python::attach(|py| attached(py, f, key, input, stored))
}

/// [`run`], with the GIL.
fn attached(
    py: Python<'_>,
    f: &Py<PyAny>,
    key: &Key,
    input: &NDArray,
    stored: &mut NDArray,
) -> kvstore::Result<()> {
    apply(py, f.bind(py), key, input, stored).map_err(|e| {
        let reason = with_traceback(py, &e);
        // The exception it replaces is let go of after the borrow (its traceback's frames
        // can run Python code that fails an updater again on this thread).
        drop(RAISED.with(|r| r.replace(Some(e))));
        KvError::Updater {
            key: key.clone(),
            reason,
        }
    })
}

/// Whether Python called from a server role's thread is held off: this process's main
/// thread was interrupted, and the interpreter ends. A thread that takes the GIL while it
/// ends is ended by it (`pthread_exit`, which aborts a Rust thread, and the process with it).
static STOPPING: AtomicBool = AtomicBool::new(false);
/// Calls from a role's thread inside Python, or on their way in.
static INSIDE: AtomicUsize = AtomicUsize::new(0);
/// How long an interrupted main thread waits for a role's calls to leave Python.
const STOP_WAIT: Duration = Duration::from_secs(5);

/// Runs `f` with the GIL from a server role's thread (a shipped updater, its unpickling),
/// unless the process stops ([`stop_role_calls`]).
fn from_role<R>(f: impl FnOnce(Python<'_>) -> kvstore::Result<R>) -> kvstore::Result<R> {
    struct Leave;
    impl Drop for Leave {
        fn drop(&mut self) {
            INSIDE.fetch_sub(1, Ordering::SeqCst);
        }
    }
    INSIDE.fetch_add(1, Ordering::SeqCst);
    let _leave = Leave;
    // SeqCst, as `stop_role_calls`'s store and load: either this call sees the stop, or the
    // stop sees this call and waits for it.
    if STOPPING.load(Ordering::SeqCst) {
        return Err(KvError::Interrupted(
            "this process was interrupted: its Python code runs no more".into(),
        ));
    }
    Python::attach(f)
}

/// After the main thread was interrupted while this process runs a server's role: no call
/// from the role's thread enters Python any more, and those inside have left (waited for
/// with the GIL let go, for at most [`STOP_WAIT`]), so the interpreter may end.
pub(crate) fn stop_role_calls(py: Python<'_>) {
    STOPPING.store(true, Ordering::SeqCst);
    py.detach(|| {
        let t0 = Instant::now();
        while INSIDE.load(Ordering::SeqCst) != 0 && t0.elapsed() < STOP_WAIT {
            std::thread::sleep(Duration::from_millis(1));
        }
    });
}

/// Unpickles a shipped updater (on a worker, to check it, and on each server).
fn unpickle(bytes: &[u8]) -> kvstore::Result<SharedUpdater> {
    from_role(|py| {
        let f = py
            .import(intern!(py, "pickle"))
            .and_then(|p| p.call_method1(intern!(py, "loads"), (PyBytes::new(py, bytes),)))
            .map_err(|e| KvError::Unsupported(format!("the updater cannot be unpickled: {e}")))?;
        if !f.is_callable() {
            return Err(KvError::Unsupported(
                "the shipped updater is not callable".into(),
            ));
        }
        let f = f.unbind();
        Ok(Arc::new(move |k: &Key, i: &NDArray, s: &mut NDArray| {
            from_role(|py| attached(py, &f, k, i, s))
        }) as SharedUpdater)
    })
}

/// Lets `set_server_updater("python:<hex>")` make Python updaters, in every process.
pub(crate) fn register() {
    kvstore::register_updater_factory(SCHEME, unpickle);
}

/// The name under which a worker ships `f` to the servers: cloudpickle pickles functions by
/// value, so one defined in the script after `create` (which a server never reaches) works.
pub(crate) fn ship(f: &Bound<'_, PyAny>) -> PyResult<String> {
    let py = f.py();
    let bytes = py
        .import(intern!(py, "cloudpickle"))?
        .call_method1(intern!(py, "dumps"), (f,))?;
    let bytes: Vec<u8> = bytes.extract()?;
    if bytes.len() > MAX_PICKLE {
        return Err(pyo3::exceptions::PyValueError::new_err(format!(
            "the updater pickles to {} bytes, more than the {MAX_PICKLE} a server takes: \
             keep large data out of its closure (load it on the servers instead)",
            bytes.len()
        )));
    }
    let mut name = String::with_capacity(SCHEME.len() + 1 + 2 * bytes.len());
    name.push_str(SCHEME);
    name.push(':');
    for b in bytes {
        name.push_str(&format!("{b:02x}"));
    }
    Ok(name)
}

/// Most of a traceback kept in an updater's error (its last part: the frames nearest the
/// raise), so that a deep recursion's does not outgrow the message that carries it.
const TRACEBACK_KEPT: usize = 4096;

/// The exception as Python prints it: its traceback (the last [`TRACEBACK_KEPT`] bytes),
/// then its type and text.
fn with_traceback(py: Python<'_>, e: &PyErr) -> String {
    use pyo3::types::PyTracebackMethods;
    let Some(tb) = e.traceback(py).and_then(|t| t.format().ok()) else {
        return e.to_string();
    };
    let mut cut = tb.len().saturating_sub(TRACEBACK_KEPT);
    while !tb.is_char_boundary(cut) {
        cut += 1;
    }
    let elided = if cut > 0 { "...\n" } else { "" };
    format!("{elided}{}{e}", &tb[cut..])
}
