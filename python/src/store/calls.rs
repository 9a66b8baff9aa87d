//! How the `KVStore` class makes its calls: the store claimed for one call at a time, without
//! the GIL where a call may wait or copy much; the common call (one key, one numpy array)
//! through reused shells; lists of arrays through lent arrays.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;

use kvstore::{Key, Keys, NDArray, Outputs};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

use super::pushes::array_like;
use super::{KVStore, Pushes, State, ASYNC_BYTES, FORKS, SIGNAL};
use crate::args::{plan_outputs, KeyArg};
use crate::arrays::Lent;
use crate::claim::{Claim, Claimable};
use crate::shell::lend_into;
use crate::{to_py, updater};

/// Calls moving more bytes than this release the GIL before they start.
const DETACH_BYTES: usize = 1 << 18;

/// How long a distributed store's push or pull (of at most `DETACH_BYTES`) waits with the GIL
/// before it lets go of it: most answer sooner (a few microseconds over shared memory), and
/// letting go and taking it back would cost as much as the rest of the Python layer. Other
/// threads wait no longer for it than for a numpy operation of that length.
const HOLD_GIL_FOR: std::time::Duration = std::time::Duration::from_micros(20);

/// How a call treats the GIL.
#[derive(Clone, Copy)]
pub(super) enum Gil {
    Keep,
    Release,
    /// Kept while the call waits less than `HOLD_GIL_FOR`, then released.
    KeepThenRelease,
}

thread_local! {
    /// Whether this thread's call holds the GIL that the store's slow wait may let go of.
    static HOLDING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Marks this thread's call as holding the GIL (`Gil::KeepThenRelease`) while it lives; then
/// puts back what was there (a signal's handler, run by a call's check, may call a store).
pub(super) struct Holding(bool);

impl Holding {
    pub(super) fn start() -> Holding {
        Holding(HOLDING.replace(true))
    }
}

impl Drop for Holding {
    fn drop(&mut self) {
        HOLDING.set(self.0);
    }
}

/// The rest of a wait that took long (`kvstore::KVStore::set_slow_wait`): without the GIL, if
/// the call held it.
fn slow_wait(rest: &mut (dyn FnMut() + Send)) {
    if !HOLDING.replace(false) {
        return rest();
    }
    Python::attach(|py| py.detach(rest));
    HOLDING.set(true);
}

/// Runs `f` as `gil` says: with the GIL inline (the common small call stays compact), the
/// others out of line.
#[inline(always)]
fn with_gil<R: Send>(py: Python<'_>, gil: Gil, f: impl FnOnce() -> R + Send) -> R {
    match gil {
        Gil::Keep => f(),
        Gil::Release => released(py, f),
        Gil::KeepThenRelease => held_then_released(f),
    }
}

#[inline(never)]
fn released<R: Send>(py: Python<'_>, f: impl FnOnce() -> R + Send) -> R {
    py.detach(f)
}

#[inline(never)]
fn held_then_released<R>(f: impl FnOnce() -> R) -> R {
    let _h = Holding::start();
    f()
}

impl KVStore {
    pub(crate) fn new(mut kv: kvstore::KVStore, name: &str) -> KVStore {
        let dist = kv.type_name().starts_with("dist");
        if dist {
            kv.set_interrupt_check(|| {
                Python::attach(|py| match py.check_signals() {
                    Ok(()) => false,
                    Err(e) => {
                        // What it replaces is let go of after the lock, as in `replace_runs`.
                        let caught = (std::thread::current().id(), e);
                        let old = SIGNAL.lock().ok().and_then(|mut s| s.replace(caught));
                        drop(old);
                        true
                    }
                })
            });
            kv.set_slow_wait(HOLD_GIL_FOR, slow_wait);
        }
        KVStore {
            rank: kv.rank(),
            num_workers: kv.num_workers(),
            inner: Claimable::new(State {
                kv: Some(kv),
                shells: [None, None],
                last_key: None,
                pushes: Default::default(),
                results: Default::default(),
                closed: None,
            }),
            name: name.to_string(),
            pid: std::process::id(),
            forks: FORKS.load(Ordering::Relaxed),
            dist,
            optimizer: std::sync::Mutex::new(None),
            updater: std::sync::Mutex::new(None),
        }
    }

    /// Runs a push, pull or pushpull moving `bytes` on the store, locked for the call: without
    /// the GIL where it may copy much or wait long, or where another thread holds the store (it
    /// may need the GIL to finish).
    pub(super) fn call<R: Send>(
        &self,
        py: Python<'_>,
        bytes: usize,
        f: impl FnOnce(&mut kvstore::KVStore) -> kvstore::Result<R> + Send,
    ) -> PyResult<R> {
        self.claimed(py, self.gil(bytes), f)
    }

    /// Runs any other call on the store (init, a barrier, an optimizer's setting) moving
    /// `bytes` as `call` does, without the GIL in a distributed store: it may wait on other
    /// workers.
    pub(super) fn control<R: Send>(
        &self,
        py: Python<'_>,
        bytes: usize,
        f: impl FnOnce(&mut kvstore::KVStore) -> kvstore::Result<R> + Send,
    ) -> PyResult<R> {
        let gil = match self.gil(bytes) {
            Gil::KeepThenRelease => Gil::Release,
            g => g,
        };
        self.claimed(py, gil, f)
    }

    fn claimed<R: Send>(
        &self,
        py: Python<'_>,
        gil: Gil,
        f: impl FnOnce(&mut kvstore::KVStore) -> kvstore::Result<R> + Send,
    ) -> PyResult<R> {
        if FORKS.load(Ordering::Relaxed) != self.forks {
            return Err(PyRuntimeError::new_err(format!(
                "this KVStore was created in process {}; a child made by fork cannot use its \
                 parent's store (create one in the child)",
                self.pid
            )));
        }
        // Every other call comes after the pushes in flight, and says if one failed.
        let run = |g: &mut State| match g.kv.as_mut() {
            Some(kv) => g
                .pushes
                .settle_all(kv)
                .and_then(|()| f(kv))
                .map_err(|e| Some(Ok(e))),
            None => Err(None),
        };
        let mut g = match self.inner.try_claim(py) {
            Some(g) => g,
            None => self.wait(py)?,
        };
        let r = catch_unwind(AssertUnwindSafe(|| with_gil(py, gil, || run(&mut g))));
        let r = r.unwrap_or_else(|panic| Err(Some(Err(fence(&mut g, panic)))));
        let closed = g.closed.clone();
        drop(g);
        r.map_err(|e| match e {
            Some(Ok(e)) => to_py(e),
            Some(Err(e)) => e,
            None => PyRuntimeError::new_err(match closed {
                Some(why) => format!("this KVStore is closed: {why}"),
                None => "this KVStore is closed".into(),
            }),
        })
    }

    /// How a push, pull or pushpull moving `bytes` treats the GIL: large copies release it; a
    /// distributed store's calls release it once they wait long (on the network, on other
    /// workers).
    #[inline(always)]
    pub(super) fn gil(&self, bytes: usize) -> Gil {
        match (bytes > DETACH_BYTES, self.dist) {
            (true, _) => Gil::Release,
            (false, true) => Gil::KeepThenRelease,
            (false, false) => Gil::Keep,
        }
    }

    /// The `kvstore.optimizer` object this local store runs, if any (see `optimizer`).
    pub(super) fn runs(&self) -> std::sync::MutexGuard<'_, Option<Py<PyAny>>> {
        self.optimizer.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A local store's Python updater, if any (see `updater`).
    pub(super) fn python_updater(&self) -> std::sync::MutexGuard<'_, Option<Py<PyAny>>> {
        self.updater.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Replaces what `runs` holds, and `python_updater` where `updater` is given, returning
    /// what they held for the caller to let go of once the store is released: letting go of
    /// a Python object can run Python code (its `__del__`, a weak reference's callback) that
    /// calls this store, or hands the GIL to a thread that does.
    #[must_use = "what was replaced is let go of after the store is released"]
    pub(super) fn replace_runs(
        &self,
        runs: Option<Py<PyAny>>,
        updater: Option<Option<Py<PyAny>>>,
    ) -> Replaced {
        (
            std::mem::replace(&mut *self.runs(), runs),
            updater.map(|u| std::mem::replace(&mut *self.python_updater(), u)),
        )
    }

    /// Where this store lives: what names it to its updater's calls.
    pub(super) fn address(&self) -> usize {
        self as *const KVStore as usize
    }

    /// The store, once the thread using it lets it go, waited for without the GIL (that
    /// thread may need it to finish) and woken by its release. An error where this thread
    /// holds it (an updater calling its own store would wait for itself), and where a signal's
    /// handler raises (Ctrl-C) meanwhile.
    fn wait(&self, py: Python<'_>) -> PyResult<Claim<'_, State>> {
        loop {
            if updater::running_for(self.address()) {
                return Err(PyRuntimeError::new_err(
                    "this KVStore is in the middle of a call on this thread: an updater \
                     cannot call the store that runs it",
                ));
            }
            if self.inner.held_here() {
                return Err(PyRuntimeError::new_err(
                    "this KVStore is in the middle of a call on this thread: a signal handler \
                     or a finalizer that runs during it cannot call the same store",
                ));
            }
            self.inner
                .wait_released(py, std::time::Duration::from_millis(1));
            py.check_signals()?;
            if let Some(g) = self.inner.try_claim(py) {
                return Ok(g);
            }
        }
    }

    /// The common call, a push or pull of one numpy array, with the array lent through a
    /// reused shell: it allocates nothing. Without the GIL where it may wait or copy much, as
    /// `call`. `None` where it does not apply (not a plain numpy array, a store another thread
    /// holds, a forked child), and the general path makes the call.
    pub(super) fn one_array(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        obj: &Bound<'_, PyAny>,
        writable: bool,
        f: impl FnOnce(&mut kvstore::KVStore, &mut Pushes, &Key, &mut NDArray) -> kvstore::Result<()>
            + Send,
    ) -> Option<PyResult<()>> {
        self.one_key(py, key, |one| {
            let mut lent = lend_into(&mut one.shells[usize::from(writable)], obj, writable)?;
            let a = lent.array()?;
            let r = with_gil(py, self.gil(a.nbytes()), || {
                f(one.kv, one.pushes, one.key, a)
            });
            Some(r.map_err(to_py))
        })
    }

    /// The common pushpull: one key, one numpy array, and one numpy output or none (in
    /// place), lent through the shells as `one_array` lends. Where the output shares memory
    /// with the value (in place), the result lands in an array of the key's own first and is
    /// copied into the output once the call is over: a call never writes what it reads. `None`
    /// where it does not apply, as `one_array`; also for a shared output over `ASYNC_BYTES`
    /// (whose result array would stay as large), which the general path makes.
    pub(super) fn one_pushpull(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        value: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        priority: i32,
    ) -> Option<PyResult<()>> {
        self.one_key(py, key, |one| {
            let [s0, s1] = one.shells;
            let mut lv = lend_into(s0, value, false)?;
            let mut lo = lend_into(s1, out, true)?;
            let (v, o) = (lv.array()?, lo.array()?);
            let (vb, ob) = (v.as_bytes().as_ptr_range(), o.as_bytes().as_ptr_range());
            let shared = vb.start < ob.end && ob.start < vb.end;
            if shared && o.nbytes() > ASYNC_BYTES {
                return None;
            }
            let One {
                kv,
                pushes,
                results,
                key,
                ..
            } = one;
            let r = with_gil(py, self.gil(v.nbytes() + o.nbytes()), || {
                // The key's push in flight first (a second push of a key in one round is
                // refused in `dist_sync`); its error, if it failed.
                pushes.settle(kv, key)?;
                let call = kv.with_priority(priority);
                if !shared {
                    return call.pushpull(key, &*v, &mut *o);
                }
                let t = array_like(results, key, o);
                call.pushpull(key, &*v, &mut *t)
                    .and_then(|()| o.copy_from(t))
            });
            Some(r.map_err(to_py))
        })
    }

    /// Runs `f` on the store, claimed, and the key `key` names, for the one-array calls;
    /// `None` where the store cannot be had at once (another thread holds it, a forked child,
    /// a closed store), and the general path makes the call.
    fn one_key(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        f: impl FnOnce(One<'_>) -> Option<PyResult<()>>,
    ) -> Option<PyResult<()>> {
        if FORKS.load(Ordering::Relaxed) != self.forks {
            return None;
        }
        let mut g = self.inner.try_claim(py)?;
        let State {
            kv,
            shells,
            last_key,
            pushes,
            results,
            ..
        } = &mut *g;
        let kv = kv.as_mut()?;
        let key = match read_key(last_key, key)? {
            Ok(k) => k,
            Err(e) => return Some(Err(e)),
        };
        let one = One {
            kv,
            shells,
            pushes,
            results,
            key,
        };
        catch_unwind(AssertUnwindSafe(|| f(one))).unwrap_or_else(|p| Some(Err(fence(&mut g, p))))
    }

    /// `_panic_in_a_call`: a pull of `key` into `out` started, then a panic in the call.
    pub(super) fn panic_in_a_call(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let r = self.one_key(py, key, |one| {
            let out = match crate::arrays::lend(out, true, "out") {
                Ok(l) => l,
                Err(e) => return Some(Err(e)),
            };
            let pending = one.kv.pull_async(one.key.clone(), vec![out.array]);
            panic!(
                "_panic_in_a_call, as asked (a pull in flight: {})",
                pending.is_ok()
            );
        });
        r.unwrap_or_else(|| Err(PyRuntimeError::new_err("the store is busy or closed")))
    }

    /// Pulls into lent outputs, key by key where keys share an output (the last key's value is
    /// what it holds then, as in MXNet).
    pub(super) fn pull_into(
        &self,
        py: Python<'_>,
        k: KeyArg,
        outs: &mut [Vec<Lent>],
        priority: i32,
    ) -> PyResult<()> {
        let shared = plan_outputs(outs)?;
        let n = nbytes(outs);
        if shared {
            for (key, list) in k.keys.into_iter().zip(outs.iter_mut()) {
                let o: Vec<&mut NDArray> = list.iter_mut().map(|x| &mut x.array).collect();
                self.call(py, n, move |kv| {
                    kv.with_priority(priority)
                        .pull(Keys::One(key), Outputs::List(o))
                })?;
            }
            return Ok(());
        }
        let o = refs_mut(outs);
        self.call(py, n, move |kv| {
            kv.with_priority(priority)
                .pull(Keys::Many(k.keys), Outputs::Nested(o))
        })
    }
}

/// The claimed store's parts a one-array call uses, and its key.
struct One<'a> {
    kv: &'a mut kvstore::KVStore,
    shells: &'a mut [Option<crate::shell::Shell>; 2],
    pushes: &'a mut Pushes,
    results: &'a mut rustc_hash::FxHashMap<Key, NDArray>,
    key: &'a Key,
}

/// A call that panicked (a bug in kvstore or in this binding) leaves the store in a state no
/// one can vouch for: it is ended, its calls in flight failed and the grants of their outputs
/// revoked while the arrays they write are still the call's ([`kvstore::KVStore::abort`]),
/// and every later call is refused, saying why. What it raises is the panic, as PyO3 raises
/// any (`pyo3_runtime.PanicException`).
#[cold]
#[inline(never)]
fn fence(state: &mut State, panic: Box<dyn std::any::Any + Send>) -> PyErr {
    let what = match (panic.downcast_ref::<&str>(), panic.downcast_ref::<String>()) {
        (Some(s), _) => s.to_string(),
        (_, Some(s)) => s.clone(),
        _ => "(no message)".into(),
    };
    let why = format!("a call panicked, a bug in kvstore (please report it): {what}");
    state.pushes = Default::default();
    if let Some(kv) = state.kv.take() {
        // Dropped once its calls are failed (a worker says goodbye); a second panic meanwhile
        // leaves it as it is, never touched again (its memory not freed).
        let mut kv = std::mem::ManuallyDrop::new(kv);
        if catch_unwind(AssertUnwindSafe(|| kv.abort(&why))).is_ok() {
            let kv = std::mem::ManuallyDrop::into_inner(kv);
            let _ = catch_unwind(AssertUnwindSafe(move || drop(kv)));
        }
    }
    state.closed = Some(why.clone());
    pyo3::panic::PanicException::new_err(why)
}

/// The key `key` names, read once for a loop over the same key object where that is an `int`
/// or a `str` (immutable: `last_key` holds the last one); any other key object (a numpy
/// integer, which may be a 0-d array changed in place) is read at every call. `None` where
/// none is held after all.
fn read_key<'k>(
    last_key: &'k mut Option<(Option<Py<PyAny>>, Key)>,
    key: &Bound<'_, PyAny>,
) -> Option<PyResult<&'k Key>> {
    if !matches!(last_key, Some((Some(o), _)) if o.as_ptr() == key.as_ptr()) {
        let immutable = key.is_exact_instance_of::<pyo3::types::PyInt>()
            || key.is_exact_instance_of::<pyo3::types::PyString>();
        match crate::args::key(key) {
            Ok(k) => *last_key = Some((immutable.then(|| key.clone().unbind()), k)),
            Err(e) => return Some(Err(e)),
        }
    }
    last_key.as_ref().map(|(_, k)| Ok(k))
}

/// One load per 64-byte line of `b`, kept from being optimised away.
pub(super) fn read_lines(b: &[u8]) {
    std::hint::black_box(b.iter().step_by(64).fold(0u8, |a, &x| a ^ x));
}

/// One write per 64-byte line of `b`, kept from being optimised away.
pub(super) fn touch_lines(b: &mut [u8]) {
    for x in b.iter_mut().step_by(64) {
        *x = x.wrapping_add(1);
    }
    std::hint::black_box(b);
}

pub(super) fn nbytes(lists: &[Vec<Lent>]) -> usize {
    lists.iter().flatten().map(|l| l.len).sum()
}

pub(super) fn refs(lists: &[Vec<Lent>]) -> Vec<Vec<&NDArray>> {
    lists
        .iter()
        .map(|l| l.iter().map(|x| &x.array).collect())
        .collect()
}

pub(super) fn refs_mut(lists: &mut [Vec<Lent>]) -> Vec<Vec<&mut NDArray>> {
    lists
        .iter_mut()
        .map(|l| l.iter_mut().map(|x| &mut x.array).collect())
        .collect()
}

/// What [`KVStore::replace_runs`] replaced, to be dropped with the GIL held and the store
/// released.
pub(super) type Replaced = (Option<Py<PyAny>>, Option<Option<Py<PyAny>>>);
