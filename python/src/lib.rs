//! `kvstore._native`: MXNet's KVStore API for Python, on numpy arrays, over the kvstore crate.
//! The Python package (`kvstore/`) re-exports it and adds the optimizer classes.

mod args;
mod arrays;
mod claim;
mod fast;
mod optimizer;
mod runner;
mod shell;
mod store;
mod updater;

use kvstore::KvError;
use pyo3::exceptions::{PyKeyError, PyRuntimeError, PySystemExit, PyTypeError, PyValueError};
use pyo3::prelude::*;

pyo3::create_exception!(
    kvstore,
    KVStoreError,
    PyRuntimeError,
    "A kvstore call failed (the base of kvstore's own errors)."
);
pyo3::create_exception!(
    kvstore,
    PeerLost,
    KVStoreError,
    "A peer of a distributed job (server, scheduler or worker) died or left: the store is \
     unusable."
);
pyo3::create_exception!(
    kvstore,
    Timeout,
    KVStoreError,
    "A distributed call waited longer than the job's timeout (KVSTORE_TIMEOUT): the store is \
     unusable."
);

pyo3::create_exception!(
    kvstore,
    DTypeMismatch,
    PyValueError,
    "A value or an output whose dtype is not its key's, where it cannot be converted (an \
     object numpy cannot read as an array); numpy arrays are converted, as MXNet converts."
);

pyo3::create_exception!(
    kvstore,
    UnsupportedDType,
    PyTypeError,
    "An array of a dtype the store does not keep (complex, int8, bool, another byte order...): \
     a TypeError where nothing converts it (an init, a complex value); a push or pull of a key \
     converts real numbers and bools into the key's dtype, as MXNet converts them."
);

/// A kvstore error as the Python exception it is: KeyError, ValueError, TypeError, or one of
/// kvstore's own. An exception that a Python updater raised is raised as itself.
pub(crate) fn to_py(e: KvError) -> PyErr {
    if let KvError::Updater { .. } = e {
        if let Some(raised) = updater::take_raised() {
            return raised;
        }
    }
    let text = e.to_string();
    match e {
        KvError::UnknownKey(_) => PyKeyError::new_err(text),
        KvError::DTypeMismatch { .. } => DTypeMismatch::new_err(text),
        KvError::ShapeMismatch { .. }
        | KvError::LengthMismatch { .. }
        | KvError::EmptyValues(_)
        | KvError::BadShape { .. }
        | KvError::TooLarge { .. }
        | KvError::DoubleInit(_)
        | KvError::UnknownType { .. }
        | KvError::Incompatible(_) => PyValueError::new_err(text),
        KvError::MixedKeyTypes(_) | KvError::WrongElementType { .. } => PyTypeError::new_err(text),
        KvError::PeerLost(_) | KvError::Aborted(_) => PeerLost::new_err(text),
        KvError::Timeout { .. } => Timeout::new_err(text),
        KvError::Interrupted(_) => match store::take_signal() {
            Some(signal) => signal,
            None => KVStoreError::new_err(text),
        },
        KvError::Io(_) => pyo3::exceptions::PyOSError::new_err(text),
        _ => KVStoreError::new_err(text),
    }
}

/// MXNet's store names, and the kvstore type each is.
const NAMES: [(&str, &str); 10] = [
    ("local", "local"),
    ("device", "device"),
    ("nccl", "device"),
    ("local_allreduce_cpu", "local"),
    ("local_allreduce_device", "device"),
    ("local_update_cpu", "local"),
    ("dist_sync", "dist_sync"),
    ("dist_async", "dist_async"),
    ("dist_device_sync", "dist_sync"),
    ("dist_sync_device", "dist_sync"),
];

/// The kvstore type of an MXNet store name (lower case): one of MXNet's names, or as MXNet's
/// `KVStore::Create` reads any other, by what it contains: "dist" a distributed store (async
/// with "_async"), "nccl" or "device" one that sums on the device, "local" a local one. `None`
/// for a name with none of them, which MXNet would make a local store of (a typo, most
/// likely).
fn kind_of(name: &str) -> Option<&'static str> {
    if let Some(&(_, kind)) = NAMES.iter().find(|(n, _)| *n == name) {
        return Some(kind);
    }
    let has = |s: &str| name.contains(s);
    match () {
        _ if has("dist") && has("_async") => Some("dist_async"),
        _ if has("dist") => Some("dist_sync"),
        _ if has("nccl") || has("device") => Some("device"),
        _ if has("local") => Some("local"),
        _ => None,
    }
}

/// create(name='local')
/// --
///
/// Creates a KVStore, as MXNet's `mx.kv.create` (the name in any case): 'local' and 'device'
/// (one process, with MXNet's aliases 'local_allreduce_cpu', 'local_allreduce_device',
/// 'local_update_cpu' and 'nccl'), or 'dist_sync' and 'dist_async' (alias
/// 'dist_device_sync', 'dist_sync_device') in a job started by kvrun. In a job's server and
/// scheduler processes, create runs that role until the job ends and then raises SystemExit
/// with the role's exit code, as MXNet's server role runs inside the user's script. Other
/// names are read as MXNet reads them, by what they contain: 'dist' (sync unless '_async'),
/// 'nccl' or 'device', 'local'. A name with none of them is a ValueError (MXNet makes a local
/// store of it).
#[pyfunction]
#[pyo3(signature = (name = "local"))]
fn create(py: Python<'_>, name: &str) -> PyResult<store::KVStore> {
    let name = name.to_ascii_lowercase();
    let Some(kind) = kind_of(&name) else {
        let valid: Vec<&str> = NAMES.iter().map(|(n, _)| *n).collect();
        let why = match name.as_str() {
            "horovod" => " (Horovod's store needs Horovod; kvrun starts a dist_sync job)",
            _ => "",
        };
        return Err(PyValueError::new_err(format!(
            "unknown KVStore type {name:?}{why}: it names none of dist, nccl, device and \
             local; valid types are: {}",
            valid.join(", ")
        )));
    };
    if kind.starts_with("dist") {
        let sync = kind == "dist_sync";
        let role = interruptible(py, move || kvstore::run_role(sync)).inspect_err(|_| {
            // The interpreter ends with the interrupt; the role's thread, left to end by
            // itself, must not call into it meanwhile.
            updater::stop_role_calls(py)
        })?;
        match role {
            Ok(None) => {}
            Ok(Some(_)) => return Err(PySystemExit::new_err(0)),
            Err(e) => {
                eprintln!("kvstore: {e}");
                return Err(PySystemExit::new_err(1));
            }
        }
    }
    let kv = match kind.starts_with("dist") {
        true => interruptible(py, move || kvstore::create(kind))?,
        false => kvstore::create(kind),
    };
    Ok(store::KVStore::new(kv.map_err(to_py)?, &name))
}

/// Runs `f` (a dist store's rendezvous, or a server's whole job) on a thread of its own while
/// this one looks for signals every 50 ms, the GIL let go between looks: Ctrl-C raises
/// `KeyboardInterrupt` at once, where `f` itself would be heard only at its timeout. An
/// interrupted `f` is left to end by itself (its waits are bounded).
fn interruptible<R: Send + 'static>(
    py: Python<'_>,
    f: impl FnOnce() -> R + Send + 'static,
) -> PyResult<R> {
    use std::sync::mpsc::RecvTimeoutError;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("kvstore-join".into())
        .spawn(move || {
            let _ = tx.send(f());
        })
        .map_err(|e| PyRuntimeError::new_err(format!("cannot start a thread: {e}")))?;
    let mut rx = rx;
    loop {
        let (got, back) = py.detach(move || {
            let got = rx.recv_timeout(std::time::Duration::from_millis(50));
            (got, rx)
        });
        rx = back;
        match got {
            Ok(r) => return Ok(r),
            Err(RecvTimeoutError::Timeout) => py.check_signals()?,
            Err(RecvTimeoutError::Disconnected) => {
                return Err(PyRuntimeError::new_err(
                    "joining the job ended without an answer (its thread failed)",
                ))
            }
        }
    }
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    updater::register();
    store::watch_forks();
    claim::check_gil(m.py())?;
    m.add_function(wrap_pyfunction!(create, m)?)?;
    m.add_class::<store::KVStore>()?;
    fast::install(&m.py().get_type::<store::KVStore>())?;
    m.add_class::<arrays::Memory>()?;
    m.add_class::<runner::OptimizerRunner>()?;
    let py = m.py();
    m.add("KVStoreError", py.get_type::<KVStoreError>())?;
    m.add("PeerLost", py.get_type::<PeerLost>())?;
    m.add("Timeout", py.get_type::<Timeout>())?;
    m.add("DTypeMismatch", py.get_type::<DTypeMismatch>())?;
    m.add("UnsupportedDType", py.get_type::<UnsupportedDType>())?;
    Ok(())
}
