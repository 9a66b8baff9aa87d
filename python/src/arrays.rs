//! Python objects as kvstore arrays, with no copy: numpy arrays read from their own fields and
//! held by a reference, anything else with the buffer protocol by a buffer export
//! (`__array_interface__` and DLPack objects through numpy), held alive by the array for as
//! long as the store uses it.

use std::ffi::c_int;
use std::sync::Mutex;

use kvstore::{DType, NDArray};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::{ffi, intern};

/// numpy, imported once.
pub(crate) fn numpy(py: Python<'_>) -> PyResult<&Bound<'_, PyModule>> {
    static NUMPY: PyOnceLock<Py<PyModule>> = PyOnceLock::new();
    NUMPY
        .get_or_try_init(py, || py.import("numpy").map(Bound::unbind))
        .map(|m| m.bind(py))
}

/// A buffer export, released (with the GIL) when the last array over it is dropped.
struct Export {
    view: ffi::Py_buffer,
    filled: bool,
}

// SAFETY: the export's fields are only read (by `borrow`, with the GIL) and it is released
// with the GIL held (`Drop`); the memory it names is used under `NDArray::from_raw_parts`'s
// contract, which the store keeps.
unsafe impl Send for Export {}
// SAFETY: as above; shared access reads nothing.
unsafe impl Sync for Export {}

impl Drop for Export {
    fn drop(&mut self) {
        if self.filled {
            Python::attach(|_| {
                // SAFETY: the view was filled by a successful `PyObject_GetBuffer` and is
                // released once, here, with the GIL held.
                unsafe { ffi::PyBuffer_Release(&mut self.view) }
            });
        }
    }
}

/// An array over a Python object's memory, and where that memory is.
pub(crate) struct Lent {
    pub(crate) array: NDArray,
    pub(crate) addr: usize,
    pub(crate) len: usize,
}

impl Lent {
    /// Whether two arrays share any byte.
    pub(crate) fn overlaps(&self, other: &Lent) -> bool {
        self.len > 0
            && other.len > 0
            && self.addr < other.addr + other.len
            && other.addr < self.addr + self.len
    }

    /// Copies `src` (of the same length) into the lent memory, which was lent writable.
    pub(crate) fn fill_from(&self, src: &NDArray) {
        let b = src.as_bytes();
        if b.len() == self.len && b.as_ptr() as usize != self.addr {
            // SAFETY: the memory was lent writable (outputs, and values of a pushpull in
            // place, are lent so) and its holder lives in `self.array`; `src` is the store's
            // own memory, apart from it; no call uses either now.
            unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), self.addr as *mut u8, b.len()) }
        }
    }

    /// Whether two arrays are the same memory, exactly.
    pub(crate) fn same(&self, other: &Lent) -> bool {
        self.addr == other.addr && self.len == other.len
    }
}

/// The dtype a buffer format names, for the dtypes the store has.
fn dtype_of(format: &str, itemsize: usize) -> Option<DType> {
    let code = format.trim_start_matches(['@', '=', '<']);
    if code.starts_with(['>', '!']) {
        return None;
    }
    match (code, itemsize) {
        ("f", 4) => Some(DType::F32),
        ("d", 8) => Some(DType::F64),
        ("e", 2) => Some(DType::F16),
        ("i" | "l" | "q", 4) => Some(DType::I32),
        ("i" | "l" | "q", 8) => Some(DType::I64),
        ("B", 1) => Some(DType::U8),
        _ => None,
    }
}

/// numpy's name for a dtype.
pub(crate) fn numpy_name(d: DType) -> &'static str {
    match d {
        DType::F32 => "float32",
        DType::F64 => "float64",
        DType::F16 => "float16",
        DType::I32 => "int32",
        DType::I64 => "int64",
        DType::U8 => "uint8",
        _ => "bfloat16",
    }
}

/// Takes a buffer export of `obj` with `flags`, or `None` where it gives none.
fn export_with(obj: &Bound<'_, PyAny>, flags: c_int) -> Option<Box<Export>> {
    // Boxed before it is filled: an exporter may point the view's fields into the view.
    let mut e = Box::new(Export {
        view: ffi::Py_buffer::new(),
        filled: false,
    });
    // SAFETY: `obj` is a live object (the GIL is held, as its `Bound` proves) and `view`
    // points to writable memory of the right type.
    let rc = unsafe { ffi::PyObject_GetBuffer(obj.as_ptr(), &mut e.view, flags) };
    if rc == 0 {
        e.filled = true;
        Some(e)
    } else {
        // SAFETY: the GIL is held; the failed call set an exception, which is not wanted.
        unsafe { ffi::PyErr_Clear() };
        None
    }
}

/// The error of a DLPack output that numpy imported read-only: numpy before 2.2.5 imports
/// every DLPack object so, and later ones those whose producer says it is read-only or
/// exports the unversioned capsule. Other errors pass as they are.
#[cold]
#[inline(never)]
fn read_only_dlpack(py: Python<'_>, e: PyErr, what: &str) -> PyErr {
    if !e.is_instance_of::<PyValueError>(py) || !e.to_string().contains("read-only") {
        return e;
    }
    PyValueError::new_err(format!(
        "{what} is read-only as numpy imports it from DLPack (numpy before 2.2.5 imports every \
         DLPack object read-only; later ones a producer's read-only or unversioned export): \
         a pull writes its output in place, so pass an array over the same memory (for a \
         torch tensor, its .numpy())"
    ))
}

/// A C-contiguous export of `obj` with its shape and format (no strides: the exporter
/// refuses what is not contiguous, and skips computing them), writable if asked.
fn export(obj: &Bound<'_, PyAny>, writable: bool) -> Option<Box<Export>> {
    let flags = ffi::PyBUF_ND | ffi::PyBUF_FORMAT;
    export_with(
        obj,
        if writable {
            flags | ffi::PyBUF_WRITABLE
        } else {
            flags
        },
    )
}

/// Whether an export's memory is C-contiguous.
fn contiguous(e: &Export) -> bool {
    // SAFETY: the view was filled by `PyObject_GetBuffer` and is live.
    unsafe { ffi::PyBuffer_IsContiguous(&e.view, b'C' as std::ffi::c_char) == 1 }
}

/// `obj` as an array over its own memory: for reading (a pushed value) or, `writable`, for
/// writing (a pull's output).
pub(crate) fn lend(obj: &Bound<'_, PyAny>, writable: bool, what: &str) -> PyResult<Lent> {
    if let Ok(a) = obj.cast::<numpy::PyUntypedArray>() {
        if let Some(lent) = lend_numpy(a, writable, what) {
            return lent;
        }
    }
    let py = obj.py();
    let e = export(obj, writable);
    if e.is_none() {
        // Why not: an export with strides says whether the object has the buffer protocol at
        // all, and then what is wrong with it.
        if let Some(any) = export_with(obj, ffi::PyBUF_RECORDS_RO) {
            if !contiguous(&any) {
                if !writable {
                    // A value is only read: a contiguous copy of it goes in its place, as
                    // MXNet's arrays are always contiguous (a transpose or a column slice is
                    // a copy there). An output is written in place, so it cannot be one.
                    drop(any);
                    return lend(&aligned_copy(obj)?, writable, what);
                }
                return Err(PyValueError::new_err(format!(
                    "{what} is not C-contiguous: the store writes it in place \
                     (np.ascontiguousarray makes a contiguous copy)"
                )));
            }
            if writable {
                return Err(PyValueError::new_err(format!(
                    "{what} is read-only: a pull writes its output in place"
                )));
            }
        } else {
            // DLPack and `__array_interface__` objects become numpy arrays over the same
            // memory.
            let np = numpy(py)?;
            let converted = if obj.hasattr(intern!(py, "__dlpack__"))? {
                Some(np.call_method1(intern!(py, "from_dlpack"), (obj,)))
            } else if obj.hasattr(intern!(py, "__array_interface__"))? {
                Some(np.call_method1(intern!(py, "asarray"), (obj,)))
            } else {
                None
            };
            // What numpy cannot take over the same memory (a datetime64 array, which has no
            // buffer export and no DLPack dtype; another device's memory) is the store's
            // refusal, as any dtype it does not keep.
            let converted = converted.transpose().map_err(|e| {
                if e.is_instance_of::<pyo3::exceptions::PyBufferError>(py) {
                    crate::UnsupportedDType::new_err(format!(
                        "{what} is in a dtype or memory the store cannot take ({}); the \
                         store keeps float32, float64, float16, int32, int64 and uint8 in \
                         host memory",
                        e.value(py)
                    ))
                } else {
                    e
                }
            })?;
            if let Some(c) = converted {
                let dlpack = obj.hasattr(intern!(py, "__dlpack__"))?;
                return lend(&c, writable, what).map_err(|e| match dlpack && writable {
                    true => read_only_dlpack(py, e, what),
                    false => e,
                });
            }
        }
    }
    let Some(e) = e else {
        return Err(PyTypeError::new_err(format!(
            "{what} must be a numpy array (or support the buffer protocol, \
             __array_interface__ or DLPack), not {}",
            obj.get_type().name()?
        )));
    };
    if !contiguous(&e) {
        return Err(PyValueError::new_err(format!(
            "{what} is not C-contiguous: the store reads and writes arrays in place"
        )));
    }
    let v = &e.view;
    let format: &str = if v.format.is_null() {
        "B"
    } else {
        // SAFETY: a non-null format is a NUL-terminated string owned by the export, which
        // lives to the end of this function at least.
        unsafe { std::ffi::CStr::from_ptr(v.format) }
            .to_str()
            .unwrap_or("?")
    };
    let itemsize = usize::try_from(v.itemsize).unwrap_or(0);
    let Some(dtype) = dtype_of(format, itemsize) else {
        return Err(crate::UnsupportedDType::new_err(format!(
            "{what} has an unsupported dtype (buffer format {format:?}, {itemsize} bytes); \
             the store keeps float32, float64, float16, int32, int64 and uint8 (a push or pull of a \
             key converts real numbers and bools into the key's dtype)"
        )));
    };
    let ndim = usize::try_from(v.ndim).unwrap_or(0);
    let dims: &[isize] = if ndim == 0 || v.shape.is_null() {
        &[]
    } else {
        // SAFETY: with PyBUF_STRIDES the export fills `shape` with `ndim` entries, which live
        // as long as the export.
        unsafe { std::slice::from_raw_parts(v.shape, ndim) }
    };
    // Most arrays have few dimensions: their shape is converted on the stack.
    let mut small = [0usize; 8];
    let large: Vec<usize>;
    let shape: &[usize] = if dims.len() <= small.len() {
        for (d, &n) in small.iter_mut().zip(dims) {
            *d = usize::try_from(n).unwrap_or(0);
        }
        &small[..dims.len()]
    } else {
        large = dims
            .iter()
            .map(|&n| usize::try_from(n).unwrap_or(0))
            .collect();
        &large
    };
    let len = usize::try_from(v.len).unwrap_or(0);
    let claimed = shape
        .iter()
        .try_fold(itemsize, |acc, &n| acc.checked_mul(n));
    if claimed != Some(len) {
        return Err(PyValueError::new_err(format!(
            "{what}: its buffer's shape {shape:?} of {itemsize}-byte items does not fill its \
             {len} bytes"
        )));
    }
    let addr = v.buf as usize;
    if !writable && !addr.is_multiple_of(dtype.size().max(1)) {
        // A value that is not aligned for its dtype (a view at an odd offset of a byte
        // buffer) is read from an aligned copy, as a non-contiguous one is.
        drop(e);
        return lend(&aligned_copy(obj)?, writable, what);
    }
    let ptr = v.buf.cast::<u8>();
    // SAFETY: the export names `len` bytes at `ptr`, C-contiguous, of `shape` and `dtype`,
    // valid while the export is held, which the array's owner does; the buffer protocol
    // keeps the object from resizing meanwhile. The store reads them (a value) or writes
    // them in place during a call, and a peer never writes them (lent memory is written by
    // this process only), so nothing lands in them after a call returns.
    let array = unsafe { NDArray::from_raw_parts(ptr, shape, dtype, e) }
        .map_err(|err| PyValueError::new_err(format!("{what}: {err}")))?;
    Ok(Lent { array, addr, len })
}

/// A C-contiguous, aligned copy of `obj` (numpy's `require`), for a value whose layout the
/// store cannot read in place.
fn aligned_copy<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let py = obj.py();
    let c = numpy(py)?.call_method1(intern!(py, "require"), (obj, py.None(), "CA"))?;
    if c.is(obj) {
        // numpy found nothing to change: what the store refused is not the layout.
        return Err(PyValueError::new_err(
            "an array numpy calls contiguous and aligned was refused as neither",
        ));
    }
    Ok(c)
}

/// A numpy array held alive (a strong reference, dropped with the GIL): what keeps its
/// memory in place while the store uses it, as a buffer export would (numpy refuses to resize
/// an array while references to it beyond its owner's are held, and an export is one).
struct Held(Option<Py<PyAny>>);

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(a) = self.0.take() {
            Python::attach(|_| drop(a));
        }
    }
}

/// Where a C-contiguous, aligned numpy array of a dtype the store has, in native byte order
/// (and writable if asked), keeps its elements, and their shape and dtype, read from the
/// array's own fields: no buffer export, whose format string numpy builds anew each time.
/// `None` for anything else, which goes through the export and its error messages.
fn numpy_parts<'a>(
    a: &'a Bound<'_, numpy::PyUntypedArray>,
    writable: bool,
) -> Option<(*mut u8, &'a [usize], DType)> {
    use numpy::PyUntypedArrayMethods;
    let p = a.as_array_ptr();
    // SAFETY: `a` is a live numpy array (the type check passed, and the GIL is held), so `p`
    // points to its object, whose fields numpy keeps valid while the array lives.
    let (data, flags) = unsafe { ((*p).fields.data, (*p).fields.flags) };
    if !lendable(flags, writable) {
        return None;
    }
    let dtype = dtype_of_descr(&numpy::PyUntypedArrayMethods::dtype(a))?;
    Some((data.cast::<u8>(), a.shape(), dtype))
}

/// Whether numpy's flags say an array is C-contiguous and aligned (and writable, if asked,
/// and not a view numpy warns about writing).
pub(crate) fn lendable(flags: std::ffi::c_int, writable: bool) -> bool {
    use numpy::npyffi;
    let need = npyffi::NPY_ARRAY_C_CONTIGUOUS
        | npyffi::NPY_ARRAY_ALIGNED
        | if writable {
            npyffi::NPY_ARRAY_WRITEABLE
        } else {
            0
        };
    // numpy's NPY_ARRAY_WARN_ON_WRITE (1 << 31).
    let warn_on_write = std::ffi::c_int::MIN;
    flags & need == need && !(writable && flags & warn_on_write != 0)
}

/// The store's dtype for a numpy dtype in native byte order, if it has one.
pub(crate) fn dtype_of_descr(descr: &Bound<'_, numpy::PyArrayDescr>) -> Option<DType> {
    use numpy::npyffi::NPY_TYPES;
    use numpy::PyArrayDescrMethods;
    if descr.is_native_byteorder() == Some(false) {
        return None;
    }
    let num = descr.num();
    let is = |t: NPY_TYPES| num == t as std::ffi::c_int;
    let dtype = if is(NPY_TYPES::NPY_FLOAT) {
        DType::F32
    } else if is(NPY_TYPES::NPY_DOUBLE) {
        DType::F64
    } else if is(NPY_TYPES::NPY_HALF) {
        DType::F16
    } else if is(NPY_TYPES::NPY_UBYTE) {
        DType::U8
    } else if is(NPY_TYPES::NPY_INT) || is(NPY_TYPES::NPY_LONG) || is(NPY_TYPES::NPY_LONGLONG) {
        match descr.itemsize() {
            4 => DType::I32,
            8 => DType::I64,
            _ => return None,
        }
    } else {
        return None;
    };
    (descr.itemsize() == dtype.size()).then_some(dtype)
}

/// A numpy array [`numpy_parts`] takes, lent by a reference held for as long as the store
/// uses it; `None` for anything else.
fn lend_numpy(
    a: &Bound<'_, numpy::PyUntypedArray>,
    writable: bool,
    what: &str,
) -> Option<PyResult<Lent>> {
    let (data, shape, dtype) = numpy_parts(a, writable)?;
    let len = shape.iter().product::<usize>() * dtype.size();
    let held = Box::new(Held(Some(a.clone().into_any().unbind())));
    // SAFETY: numpy's fields say `data` holds `shape`'s elements of `dtype`, C-contiguous and
    // aligned (writable when asked), and the array is held alive, unresized, until the NDArray
    // drops `held`. The store reads them (a value) or writes them in place during a call, and a
    // peer never writes them (lent memory is written by this process only), so nothing lands
    // in them after a call returns.
    let array = unsafe { NDArray::from_raw_parts(data, shape, dtype, held) };
    Some(
        array
            .map(|array| Lent {
                array,
                addr: data as usize,
                len,
            })
            .map_err(|err| PyValueError::new_err(format!("{what}: {err}"))),
    )
}

/// Memory of the store lent to Python for the length of an updater's call, as the buffer
/// numpy views. If a view outlives the call, the memory stays with it (`keep`), and the store
/// goes on with a copy.
#[pyclass(frozen, module = "kvstore")]
pub(crate) struct Memory {
    ptr: usize,
    len: isize,
    readonly: bool,
    pub(crate) keep: Mutex<Option<NDArray>>,
}

impl Memory {
    pub(crate) fn new(ptr: *const u8, len: usize, readonly: bool) -> Memory {
        Memory {
            ptr: ptr as usize,
            len: isize::try_from(len).unwrap_or(isize::MAX),
            readonly,
            keep: Mutex::new(None),
        }
    }
}

#[pymethods]
impl Memory {
    /// # Safety
    /// Called by Python with a view to fill.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let m = slf.get();
        if m.readonly && flags & ffi::PyBUF_WRITABLE != 0 {
            return Err(pyo3::exceptions::PyBufferError::new_err(
                "the updater's input is read-only",
            ));
        }
        // SAFETY: Python passes a view to fill; every field is set, `obj` holds a reference
        // to this object (so the memory, kept by the store during the call and by `keep`
        // after it, outlives the view), and `shape` points into this frozen object.
        unsafe {
            (*view).obj = slf.clone().into_any().into_ptr();
            (*view).buf = m.ptr as *mut std::ffi::c_void;
            (*view).len = m.len;
            (*view).readonly = c_int::from(m.readonly);
            (*view).itemsize = 1;
            (*view).format = if flags & ffi::PyBUF_FORMAT != 0 {
                c"B".as_ptr().cast_mut()
            } else {
                std::ptr::null_mut()
            };
            (*view).ndim = 1;
            (*view).shape = if flags & ffi::PyBUF_ND != 0 {
                (&m.len as *const isize).cast_mut()
            } else {
                std::ptr::null_mut()
            };
            (*view).strides = std::ptr::null_mut();
            (*view).suboffsets = std::ptr::null_mut();
            (*view).internal = std::ptr::null_mut();
        }
        Ok(())
    }

    /// # Safety
    /// Called by Python when a view is released; nothing was allocated for it.
    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}
}
