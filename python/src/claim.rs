//! A value one call uses at a time (the store): claimed by a load and a store where the GIL
//! keeps claims apart, so that a small call runs no locked instruction, which would wait for
//! the previous call's copy to drain from the store buffer (a tenth of the call). Without a GIL
//! (a free-threaded interpreter) a claim is a compare-and-swap.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};

use pyo3::prelude::*;

/// Whether the GIL serialises code that holds a `Python` token: set at import, where a
/// free-threaded interpreter says it runs without one (it can turn a GIL on later, never off).
static GIL_SERIALIZES: AtomicBool = AtomicBool::new(false);

/// Reads, once, whether this interpreter has a GIL.
pub(crate) fn check_gil(py: Python<'_>) -> PyResult<()> {
    let sys = py.import("sys")?;
    let gil = match sys.getattr("_is_gil_enabled") {
        Ok(f) => f.call0()?.extract::<bool>()?,
        Err(_) => true,
    };
    GIL_SERIALIZES.store(gil, Ordering::Relaxed);
    Ok(())
}

/// A value, whether a call has claimed it, and the threads waiting for it: registered, and
/// woken when a claim is released.
pub(crate) struct Claimable<T> {
    busy: AtomicBool,
    /// The thread that holds the claim ([`this_thread`]), 0 while none does.
    owner: AtomicUsize,
    waiters: AtomicUsize,
    gate: Mutex<()>,
    released: Condvar,
    value: UnsafeCell<T>,
}

// SAFETY: the value is reached only through a `Claim`, of which at most one exists at a time
// (see `try_claim`), so threads use it one after another; it moves between them (Send).
unsafe impl<T: Send> Sync for Claimable<T> {}

/// The use of a claimed value, released when dropped. Sent and shared as a `&mut T` would be
/// (shared only where `T` is `Sync`).
pub(crate) struct Claim<'a, T> {
    cell: &'a Claimable<T>,
    _use: std::marker::PhantomData<&'a mut T>,
}

impl<T> Claimable<T> {
    pub(crate) fn new(value: T) -> Self {
        Claimable {
            busy: AtomicBool::new(false),
            owner: AtomicUsize::new(0),
            waiters: AtomicUsize::new(0),
            gate: Mutex::new(()),
            released: Condvar::new(),
            value: UnsafeCell::new(value),
        }
    }

    /// Claims the value, or `None` while another claim holds it. The `Python` token says this
    /// thread holds the GIL, so where the GIL serialises such code, no other claim can come
    /// between the load and the store.
    pub(crate) fn try_claim(&self, _py: Python<'_>) -> Option<Claim<'_, T>> {
        if GIL_SERIALIZES.load(Ordering::Relaxed) {
            if self.busy.load(Ordering::Acquire) {
                return None;
            }
            self.busy.store(true, Ordering::Relaxed);
        } else if self
            .busy
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            return None;
        }
        self.owner.store(this_thread(), Ordering::Relaxed);
        Some(Claim {
            cell: self,
            _use: std::marker::PhantomData,
        })
    }

    /// Whether a claim made on this thread holds the value: a call made from within that
    /// claim's call (a signal handler run by its interrupt check, a finalizer) would wait for
    /// itself.
    pub(crate) fn held_here(&self) -> bool {
        self.owner.load(Ordering::Relaxed) == this_thread()
    }

    /// Waits without the GIL until a claim is released, or at most `most`; then the caller
    /// tries to claim again. Waiters register with the GIL held, and claims are released with
    /// it held, so a release sees every waiter that came before it; a waiter checks the claim
    /// again under the gate the release notifies under, so none sleeps through a release.
    /// (`most` bounds what a free-threaded interpreter could miss.)
    pub(crate) fn wait_released(&self, py: Python<'_>, most: std::time::Duration) {
        self.waiters.fetch_add(1, Ordering::SeqCst);
        let (gate, released, busy) = (&self.gate, &self.released, &self.busy);
        py.detach(|| {
            let gate = gate.lock().unwrap_or_else(|p| p.into_inner());
            if busy.load(Ordering::Acquire) {
                drop(released.wait_timeout(gate, most));
            }
        });
        self.waiters.fetch_sub(1, Ordering::SeqCst);
    }

    /// The value, through exclusive access to the whole.
    pub(crate) fn get_mut(&mut self) -> &mut T {
        self.value.get_mut()
    }
}

impl<T> std::ops::Deref for Claim<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: this claim is the only one (`try_claim`), and the value is reached only
        // through a claim.
        unsafe { &*self.cell.value.get() }
    }
}

impl<T> std::ops::DerefMut for Claim<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as in `deref`; `&mut self` makes this the only borrow through the claim.
        unsafe { &mut *self.cell.value.get() }
    }
}

impl<T> Drop for Claim<'_, T> {
    fn drop(&mut self) {
        // No owner before not busy: a thread that looks never takes another's claim for its own.
        self.cell.owner.store(0, Ordering::Relaxed);
        // Release: the next claim (its acquiring load) sees what this one did.
        self.cell.busy.store(false, Ordering::Release);
        if self.cell.waiters.load(Ordering::Relaxed) != 0 {
            let _gate = self.cell.gate.lock().unwrap_or_else(|p| p.into_inner());
            self.cell.released.notify_all();
        }
    }
}

/// A number for this thread, unique among the living ones (the address of a thread-local):
/// never 0.
fn this_thread() -> usize {
    thread_local! {
        static ME: u8 = const { 0 };
    }
    ME.with(|m| m as *const u8 as usize)
}
