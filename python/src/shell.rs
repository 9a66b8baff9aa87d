//! Reused arrays for the common call (one key, one numpy array): the array is lent through a
//! shell made once and pointed at each call's memory ([`NDArray::repoint`]), so a call
//! allocates nothing. A call that keeps a clone of the shell (a failed distributed call, an
//! updater that keeps its input) keeps the numpy array with it, and the next call makes a
//! new shell.

use std::ptr;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::Arc;

use kvstore::{DType, NDArray};
use pyo3::ffi;
use pyo3::prelude::*;

use crate::arrays::{dtype_of_descr, lendable};

/// The numpy array a shell lends: a strong reference, taken for the call. It keeps the array
/// alive and unresizable (numpy refuses to resize an array others reference) while the store
/// uses its memory, and past the call where a clone of the shell escaped it.
#[derive(Default)]
struct Slot(AtomicPtr<ffi::PyObject>);

impl Slot {
    /// Holds `obj` (or nothing) in place of what was held. Only the thread holding the store
    /// (whose state the shell is part of) calls it, so a load and a store do.
    fn hold(&self, _py: Python<'_>, obj: Option<&Bound<'_, PyAny>>) {
        let new = obj.map_or(ptr::null_mut(), |o| o.clone().into_ptr());
        let old = self.0.load(Ordering::Relaxed);
        self.0.store(new, Ordering::Relaxed);
        if !old.is_null() {
            // SAFETY: `old` is the strong reference an earlier `hold` took, released once,
            // here, with the GIL held (`_py`).
            unsafe { ffi::Py_DECREF(old) }
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let p = *self.0.get_mut();
        if !p.is_null() {
            // SAFETY: `p` is the strong reference `hold` took, released once, here, with the
            // GIL held.
            Python::attach(|_| unsafe { ffi::Py_DECREF(p) });
        }
    }
}

/// An array over lent memory with the reference that keeps the memory alive as its owner.
pub(crate) struct Shell {
    array: NDArray,
    slot: Arc<Slot>,
    /// The last array's dtype descriptor (held, so that its address names it) and the
    /// store's dtype for it: the next array with the same descriptor skips the checks.
    descr: Option<(Py<PyAny>, DType)>,
}

impl Shell {
    fn new() -> Option<Shell> {
        let slot = Arc::new(Slot::default());
        // SAFETY: an empty array names no memory.
        let array = unsafe {
            NDArray::from_raw_parts(ptr::null_mut(), &[0], DType::U8, Box::new(slot.clone()))
        }
        .ok()?;
        Some(Shell {
            array,
            slot,
            descr: None,
        })
    }
}

/// A numpy array lent through a shell for one call; when dropped, the shell lets the array go
/// and names no memory, or, where the call kept a clone of it, is given up to that clone
/// (which holds the array for as long as it lives).
pub(crate) struct LentShell<'s, 'py> {
    shell: &'s mut Option<Shell>,
    py: Python<'py>,
}

impl LentShell<'_, '_> {
    pub(crate) fn array(&mut self) -> Option<&mut NDArray> {
        self.shell.as_mut().map(|s| &mut s.array)
    }
}

impl Drop for LentShell<'_, '_> {
    fn drop(&mut self) {
        let Some(s) = self.shell.as_mut() else { return };
        // SAFETY: an empty array names no memory.
        if unsafe { s.array.repoint(ptr::null_mut(), &[0], DType::U8) }.is_ok() {
            s.slot.hold(self.py, None);
        } else {
            *self.shell = None;
        }
    }
}

/// Lends `obj` through `shell` (made on first use) when it is a numpy array the store takes
/// in place; `None` otherwise, and the caller lends it another way.
pub(crate) fn lend_into<'s, 'py>(
    shell: &'s mut Option<Shell>,
    obj: &Bound<'py, PyAny>,
    writable: bool,
) -> Option<LentShell<'s, 'py>> {
    use numpy::PyUntypedArrayMethods;
    let a = obj.cast::<numpy::PyUntypedArray>().ok()?;
    let p = a.as_array_ptr();
    // SAFETY: `a` is a live numpy array (the type check passed, and the GIL is held), so `p`
    // points to its object, whose fields numpy keeps valid while the array lives.
    let (data, flags, descr) = unsafe { ((*p).fields.data, (*p).fields.flags, (*p).fields.descr) };
    if !lendable(flags, writable) {
        return None;
    }
    if shell.is_none() {
        *shell = Shell::new();
    }
    let s = shell.as_mut()?;
    let dtype = match &s.descr {
        Some((d, t)) if d.as_ptr() == descr.cast() => *t,
        _ => {
            let d = PyUntypedArrayMethods::dtype(a);
            let t = dtype_of_descr(&d)?;
            s.descr = Some((d.into_any().unbind(), t));
            t
        }
    };
    let data = data.cast::<u8>();
    let shape = a.shape();
    // SAFETY: numpy's fields say `data` holds `shape`'s elements of `dtype`, C-contiguous and
    // aligned (writable when asked); the slot holds the array alive and unresized from here
    // until the shell lets it go or, where a clone escaped, until that clone is dropped. The
    // store reads it (a value) or writes it in place during the call only (lent memory is
    // written by this process only).
    if unsafe { s.array.repoint(data, shape, dtype) }.is_err() {
        // A clone a call kept shares the shell: a fresh one next time.
        *shell = None;
        return None;
    }
    s.slot.hold(obj.py(), Some(obj));
    Some(LentShell {
        shell,
        py: obj.py(),
    })
}
