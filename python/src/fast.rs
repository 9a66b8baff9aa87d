//! The common calls' own entry points: `push(key, value)`, `pull(key, out=o)` (or
//! `pull(key, o)`) and `pushpull(key, value)` (in place), `pushpull(key, value, out=o)` (or
//! `pushpull(key, value, o)`), with no other argument, read straight from the interpreter's
//! argument vector instead of through PyO3's general argument parser, which costs as much as
//! the rest of the layer at 4 KiB (its keyword names compared as strings on every call). Any
//! other form of the call goes to the method PyO3 made, unchanged: its parsing, its errors, its
//! defaults.
//!
//! They run the same `KVStore::push`, `pull` and `pushpull` as PyO3's methods; only the reading
//! of the arguments differs. They enter through PyO3's own trampoline (the interpreter held,
//! panics caught, errors raised), as every PyO3 method does.

use std::ffi::{c_char, CString};
use std::sync::OnceLock;

use pyo3::ffi;
use pyo3::impl_::trampoline::get_trampoline_function;
use pyo3::prelude::*;
use pyo3::types::{PyString, PyTuple, PyType};
use pyo3::Borrowed;

use crate::store::KVStore;

/// The methods PyO3 made, which the uncommon forms of each call go to.
static GENERAL: OnceLock<[Py<PyAny>; 3]> = OnceLock::new();
const PUSH: usize = 0;
const PULL: usize = 1;
const PUSHPULL: usize = 2;

/// The interned keyword `out`: a caller's `out=` is this very object (names in code are
/// interned), so it is recognised by address.
static OUT: OnceLock<Py<PyString>> = OnceLock::new();

/// Puts the entry points on the class, in place of PyO3's `push`, `pull` and `pushpull`, which stay
/// behind them for the other forms of the calls. Their docstrings and signatures are PyO3's.
pub(crate) fn install(cls: &Bound<'_, PyType>) -> PyResult<()> {
    let py = cls.py();
    let general = [
        cls.getattr("push")?.unbind(),
        cls.getattr("pull")?.unbind(),
        cls.getattr("pushpull")?.unbind(),
    ];
    OUT.get_or_init(|| PyString::intern(py, "out").unbind());
    let entries: [(&str, ffi::PyCFunctionFastWithKeywords); 3] = [
        (
            "push",
            get_trampoline_function!(fastcall_cfunction_with_keywords, push),
        ),
        (
            "pull",
            get_trampoline_function!(fastcall_cfunction_with_keywords, pull),
        ),
        (
            "pushpull",
            get_trampoline_function!(fastcall_cfunction_with_keywords, pushpull),
        ),
    ];
    for ((name, f), g) in entries.into_iter().zip(&general) {
        let g = g.bind(py);
        let doc = match (g.getattr("__text_signature__"), g.getattr("__doc__")) {
            (Ok(sig), Ok(doc)) if !sig.is_none() => {
                format!(
                    "{name}{}\n--\n\n{}",
                    sig,
                    doc.extract::<String>().unwrap_or_default()
                )
            }
            (_, Ok(doc)) => doc.extract::<String>().unwrap_or_default(),
            _ => String::new(),
        };
        let def = Box::leak(Box::new(ffi::PyMethodDef {
            ml_name: leak(name)?,
            ml_meth: ffi::PyMethodDefPointer {
                PyCFunctionFastWithKeywords: f,
            },
            ml_flags: ffi::METH_FASTCALL | ffi::METH_KEYWORDS,
            ml_doc: leak(&doc)?,
        }));
        // SAFETY: `cls` is a live type object and `def` lives for the rest of the process (it
        // is leaked), as a method descriptor's definition must.
        let descr = unsafe {
            Bound::from_owned_ptr_or_err(py, ffi::PyDescr_NewMethod(cls.as_type_ptr(), def))?
        };
        cls.setattr(name, descr)?;
    }
    GENERAL
        .set(general)
        .map_err(|_| pyo3::exceptions::PyRuntimeError::new_err("the module was loaded twice"))
}

fn leak(s: &str) -> PyResult<*const c_char> {
    let c = CString::new(s).map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))?;
    Ok(Box::leak(c.into_boxed_c_str()).as_ptr())
}

/// `push(key, value)`; any other form goes to PyO3's method.
///
/// # Safety
/// Called by the interpreter (through the trampoline) with its arguments: `slf` an instance
/// of the class (the method descriptor checked it), `args` `nargs` positional arguments
/// followed by one value per name in `kwnames` (a tuple, or null).
unsafe fn push(
    py: Python<'_>,
    slf: *mut ffi::PyObject,
    args: *const *mut ffi::PyObject,
    nargs: ffi::Py_ssize_t,
    kwnames: *mut ffi::PyObject,
) -> PyResult<*mut ffi::PyObject> {
    // SAFETY: the interpreter's arguments, as they came.
    let Some(None) = (unsafe { plain(py, args, nargs, kwnames, 2) }) else {
        // SAFETY: the interpreter's arguments, passed on as they came.
        return unsafe { general(py, PUSH, slf, args, nargs, kwnames) };
    };
    // SAFETY: the interpreter holds these for the call; `plain` found two arguments.
    let (store, key, value) = unsafe { (borrowed(py, slf), arg(py, args, 0), arg(py, args, 1)) };
    store.cast::<KVStore>()?.get().push(py, &key, &value, 0)?;
    Ok(py.None().into_ptr())
}

/// `pull(key, out=o)` and `pull(key, o)`; any other form goes to PyO3's method.
///
/// # Safety
/// As [`push`].
unsafe fn pull(
    py: Python<'_>,
    slf: *mut ffi::PyObject,
    args: *const *mut ffi::PyObject,
    nargs: ffi::Py_ssize_t,
    kwnames: *mut ffi::PyObject,
) -> PyResult<*mut ffi::PyObject> {
    // SAFETY: the interpreter's arguments, as they came.
    let Some(Some(out)) = (unsafe { plain(py, args, nargs, kwnames, 1) }) else {
        // SAFETY: as in `push`.
        return unsafe { general(py, PULL, slf, args, nargs, kwnames) };
    };
    // SAFETY: the interpreter holds these for the call; `plain` found the key first.
    let (store, key) = unsafe { (borrowed(py, slf), arg(py, args, 0)) };
    // An `out` of None is PyO3's `None`, as its method reads it.
    let out = (!out.is_none()).then_some(out);
    let store = store.cast::<KVStore>()?;
    store.get().pull(py, &key, out.as_deref(), 0, None)?;
    Ok(py.None().into_ptr())
}

/// `pushpull(key, value)` (in place), `pushpull(key, value, out=o)` and
/// `pushpull(key, value, o)`; any other form goes to PyO3's method.
///
/// # Safety
/// As [`push`].
unsafe fn pushpull(
    py: Python<'_>,
    slf: *mut ffi::PyObject,
    args: *const *mut ffi::PyObject,
    nargs: ffi::Py_ssize_t,
    kwnames: *mut ffi::PyObject,
) -> PyResult<*mut ffi::PyObject> {
    // SAFETY: the interpreter's arguments, as they came.
    let Some(out) = (unsafe { plain(py, args, nargs, kwnames, 2) }) else {
        // SAFETY: as in `push`.
        return unsafe { general(py, PUSHPULL, slf, args, nargs, kwnames) };
    };
    // SAFETY: the interpreter holds these for the call; `plain` found the key and the value.
    let (store, key, value) = unsafe { (borrowed(py, slf), arg(py, args, 0), arg(py, args, 1)) };
    // An `out` of None is in place, as PyO3's method reads it.
    let out = out.filter(|o| !o.is_none());
    let store = store.cast::<KVStore>()?;
    store.get().pushpull(py, &key, &value, out.as_deref(), 0)?;
    Ok(py.None().into_ptr())
}

/// The common form of a call: `lead` positional arguments, then the output or nothing (by
/// position, or as `out=` alone). `None` for any other form; else the output, if one came.
///
/// # Safety
/// As [`push`]: the interpreter's arguments.
unsafe fn plain<'a, 'py>(
    py: Python<'py>,
    args: *const *mut ffi::PyObject,
    nargs: ffi::Py_ssize_t,
    kwnames: *mut ffi::PyObject,
    lead: ffi::Py_ssize_t,
) -> Option<Option<Borrowed<'a, 'py, PyAny>>> {
    let with_out = match kwnames.is_null() {
        true if nargs == lead => false,
        true if nargs == lead + 1 => true,
        // SAFETY: a non-null `kwnames` is the call's tuple of keyword names.
        false if nargs == lead && unsafe { only_out(py, kwnames) } => true,
        _ => return None,
    };
    // SAFETY: the output follows the `lead` arguments (positional, or the one keyword's value).
    Some(with_out.then(|| unsafe { arg(py, args, lead as usize) }))
}

/// The call's argument `i`, which the interpreter holds for the call.
///
/// # Safety
/// `args` has more than `i` arguments.
unsafe fn arg<'a, 'py>(
    py: Python<'py>,
    args: *const *mut ffi::PyObject,
    i: usize,
) -> Borrowed<'a, 'py, PyAny> {
    // SAFETY: the caller's promise.
    unsafe { borrowed(py, *args.add(i)) }
}

/// Whether the call's keyword names are exactly `out`, the interned name.
///
/// # Safety
/// `kwnames` is a tuple the interpreter holds for the call.
unsafe fn only_out(py: Python<'_>, kwnames: *mut ffi::PyObject) -> bool {
    // SAFETY: the interpreter holds the tuple for the call.
    let names = unsafe { borrowed(py, kwnames) };
    let Ok(names) = names.cast::<PyTuple>() else {
        return false;
    };
    match (names.len(), OUT.get()) {
        (1, Some(out)) => names
            .get_borrowed_item(0)
            .is_ok_and(|n| n.as_ptr() == out.as_ptr()),
        _ => false,
    }
}

/// A reference the interpreter holds for the call, borrowed for it.
///
/// # Safety
/// `p` is a live object, held for longer than `'a`.
unsafe fn borrowed<'a, 'py>(py: Python<'py>, p: *mut ffi::PyObject) -> Borrowed<'a, 'py, PyAny> {
    // SAFETY: `p` is live for `'a` (the caller's promise).
    unsafe { Borrowed::from_ptr(py, p) }
}

/// The call, made by PyO3's method with the same arguments.
///
/// # Safety
/// As [`push`].
unsafe fn general(
    py: Python<'_>,
    which: usize,
    slf: *mut ffi::PyObject,
    args: *const *mut ffi::PyObject,
    nargs: ffi::Py_ssize_t,
    kwnames: *mut ffi::PyObject,
) -> PyResult<*mut ffi::PyObject> {
    let Some(general) = GENERAL.get() else {
        return Err(pyo3::exceptions::PyRuntimeError::new_err(
            "kvstore is not initialised",
        ));
    };
    // SAFETY: a non-null `kwnames` is a tuple (the interpreter's promise).
    let nkw = match kwnames.is_null() {
        true => 0,
        false => unsafe { ffi::PyTuple_GET_SIZE(kwnames) },
    };
    let total = usize::try_from(nargs + nkw).unwrap_or(0);
    // `self` first, then the positional arguments and the keywords' values as they came.
    let mut all = Vec::with_capacity(total + 1);
    all.push(slf);
    // SAFETY: `args` has `nargs` positional arguments and then one value per keyword name.
    all.extend((0..total).map(|i| unsafe { *args.add(i) }));
    // SAFETY: `all` holds live references for the call; `kwnames` is the interpreter's.
    let r = unsafe {
        ffi::PyObject_Vectorcall(
            general[which].as_ptr(),
            all.as_ptr(),
            (nargs + 1) as usize,
            kwnames,
        )
    };
    // SAFETY: a new reference, or null with the error set.
    unsafe { Bound::from_owned_ptr_or_err(py, r) }.map(Bound::into_ptr)
}
