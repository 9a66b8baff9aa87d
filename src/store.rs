//! `KVStore`: MXNet's API over every store type.

use crate::args::{group_outputs, group_values};
use crate::local::LocalStore;
use crate::{Key, Keys, KvError, NDArray, Outputs, Result, Values};

mod compress;
mod inflight;
#[path = "store/inspect.rs"]
mod inspect;
mod rows;

/// An updater: `(key, input, stored)`; it merges `input` (the sum of the pushed values) into
/// `stored`, in place. It must keep `stored`'s shape and dtype.
pub type Updater = Box<dyn FnMut(&Key, &NDArray, &mut NDArray) -> Result<()> + Send>;

/// A call in flight, from [`KVStore::push_async`], [`KVStore::pull_async`] or
/// [`KVStore::pushpull_async`]. [`KVStore::wait`] gives its result and its outputs back.
/// Dropping it unclaimed lets the store forget the result (and any error) once the call is over.
#[must_use = "a call's errors and outputs come back from KVStore::wait"]
#[derive(Debug)]
pub struct Pending(PendingInner);

#[derive(Debug)]
enum PendingInner {
    /// Done when it was started (a local store).
    Ready(Result<Vec<NDArray>>),
    Dist(crate::worker::Ticket),
}

/// The store types `create` knows.
pub const TYPES: [&str; 4] = ["local", "device", "dist_sync", "dist_async"];

enum Inner {
    Local(LocalStore),
    Dist(Box<crate::worker::DistWorker>),
}

/// Integer keys or string keys: a store takes one kind.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum KeyKind {
    Int,
    Str,
}

/// A key-value store with MXNet KVStore's semantics.
///
/// ```
/// use kvstore::{create, NDArray};
/// let mut kv = create("local").unwrap();
/// kv.init(3, &(NDArray::ones(&[2, 3]) * 2.0)).unwrap();
/// let mut a = NDArray::zeros(&[2, 3]);
/// kv.pull(3, &mut a).unwrap();
/// assert_eq!(a.to_string(), "[[2. 2. 2.]\n [2. 2. 2.]]");
/// ```
pub struct KVStore {
    kind: &'static str,
    key_kind: Option<KeyKind>,
    inner: Inner,
}

/// An error where an output is over lent memory that a clone shares
/// ([`NDArray::from_raw_parts`]): the pull would land in a copy, not in that memory.
fn in_place(pairs: &[(Key, crate::args::List<&mut NDArray>)]) -> Result<()> {
    pairs
        .iter()
        .flat_map(|(_, outs)| outs.iter())
        .try_for_each(|o| o.check_in_place())
}

/// Creates a store: `"local"`, `"device"`, `"dist_sync"` or `"dist_async"`.
///
/// For the `dist_*` types the process's role comes from its environment (`DMLC_ROLE` and the
/// rest, see [`crate::Config`]). In the server or scheduler role, `create` runs that role
/// until the job ends and then exits the process; only workers get a store back.
pub fn create(name: &str) -> Result<KVStore> {
    let Some(kind) = TYPES.iter().copied().find(|t| *t == name) else {
        return Err(KvError::UnknownType {
            name: name.to_string(),
            valid: TYPES.join(", "),
        });
    };
    let inner = match kind {
        "local" => Inner::Local(LocalStore::new(false)),
        "device" => Inner::Local(LocalStore::new(true)),
        _ => Inner::Dist(Box::new(crate::roles::start_worker_or_run_role(
            kind == "dist_sync",
        )?)),
    };
    Ok(KVStore {
        kind,
        key_kind: None,
        inner,
    })
}

impl KVStore {
    /// The store type, as given to [`create`].
    pub fn type_name(&self) -> &'static str {
        self.kind
    }

    /// MXNet's name for [`KVStore::type_name`].
    pub fn r#type(&self) -> &'static str {
        self.kind
    }

    /// The shape and dtype stored under `key`, or [`KvError::UnknownKey`].
    pub fn key_info(&self, key: impl Into<Key>) -> Result<(Vec<usize>, crate::DType)> {
        let key = key.into();
        match &self.inner {
            Inner::Local(s) => s.meta(&key),
            Inner::Dist(d) => d.meta(&key),
        }
    }

    /// The next call, with MXNet's `priority`: among requests waiting for their links, those
    /// of a call with a larger priority are sent first (never before a request queued earlier
    /// for the same key). Calls without it have priority 0.
    ///
    /// ```
    /// use kvstore::{create, NDArray};
    /// let mut kv = create("local").unwrap();
    /// kv.init(3, &NDArray::zeros(&[2])).unwrap();
    /// kv.with_priority(-1).push(3, &NDArray::ones(&[2])).unwrap();
    /// ```
    pub fn with_priority(&mut self, priority: i32) -> crate::Prioritized<'_> {
        crate::Prioritized::new(self, priority)
    }

    pub(crate) fn set_priority(&mut self, priority: i32) {
        if let Inner::Dist(d) = &mut self.inner {
            d.priority = priority;
        }
    }

    /// Sets a check that a distributed store's waiting calls ask about every 50 ms: when it
    /// returns `true` (the user pressed Ctrl-C, say), every call in flight fails with
    /// [`KvError::Interrupted`] and the store refuses further calls, its grants revoked as after
    /// any failure. Local stores never wait, and ignore it.
    pub fn set_interrupt_check(&mut self, f: impl FnMut() -> bool + Send + 'static) {
        if let Inner::Dist(d) = &mut self.inner {
            d.set_interrupt(Box::new(f));
        }
    }

    /// Sets how a distributed store's call waits once it has waited `after` without its
    /// answer: the rest of the wait runs inside `wrap`, which calls what it is given (a
    /// wrapper that does not leaves the call to wait on without it). A binding to an
    /// interpreter lets go of the interpreter's lock there, so that a call that answers within
    /// `after` (a small push over shared memory) never pays for it. Local stores never wait,
    /// and ignore it.
    ///
    /// ```
    /// use std::time::Duration;
    /// let mut kv = kvstore::create("local").unwrap();
    /// kv.set_slow_wait(Duration::from_micros(20), |rest| rest());
    /// ```
    pub fn set_slow_wait(
        &mut self,
        after: std::time::Duration,
        wrap: impl FnMut(&mut (dyn FnMut() + Send)) + Send + 'static,
    ) {
        if let Inner::Dist(d) = &mut self.inner {
            d.set_slow_wait(crate::worker::SlowWait {
                after,
                wrap: Box::new(wrap),
            });
        }
    }

    /// MXNet's `broadcast`: initialises `keys` with `values` (in a distributed store, rank 0's
    /// are stored) and pulls the stored values into `outs`.
    pub fn broadcast<'a, 'b>(
        &mut self,
        keys: impl Into<Keys>,
        values: impl Into<Values<'a>>,
        outs: impl Into<Outputs<'b>>,
    ) -> Result<()> {
        let (keys, values, outs) = (keys.into(), values.into(), outs.into());
        // The outputs are checked against the values first: a refused call stores nothing.
        let pairs = group_values(keys.clone(), values)?;
        let mut out_pairs = group_outputs(keys, outs)?;
        for (k, outs) in &out_pairs {
            let Some((_, vs)) = pairs.iter().find(|(p, _)| p == k) else {
                return Err(KvError::UnknownKey(k.clone()));
            };
            for o in outs {
                crate::local::check_like(k, vs[0], o)?;
                o.check_in_place()?;
            }
        }
        let kind = self.check_keys(pairs.iter().map(|(k, _)| k))?;
        let r = match &mut self.inner {
            Inner::Local(s) => s.init(&pairs),
            Inner::Dist(d) => d.init(&pairs),
        };
        self.keep_kind(kind, pairs.iter().map(|(k, _)| k), &r);
        r?;
        match &mut self.inner {
            Inner::Local(s) => s.pull(&mut out_pairs),
            Inner::Dist(d) => d.pull(&mut out_pairs),
        }
    }

    /// Pulls `key`'s value into a slice of its element type, as long as the value (in
    /// row-major order).
    ///
    /// ```
    /// use kvstore::{create, NDArray};
    /// let mut kv = create("local").unwrap();
    /// kv.init("w", &(NDArray::ones(&[2, 2]) * 3)).unwrap();
    /// let mut out = [0.0f32; 4];
    /// kv.pull_into("w", &mut out).unwrap();
    /// assert_eq!(out, [3.0; 4]);
    /// ```
    pub fn pull_into<T: crate::Element>(
        &mut self,
        key: impl Into<Key>,
        out: &mut [T],
    ) -> Result<()> {
        let key = key.into();
        let (shape, dtype) = self.key_info(&key)?;
        if dtype != T::DTYPE {
            return Err(KvError::DTypeMismatch {
                key,
                expected: dtype,
                got: T::DTYPE,
            });
        }
        if shape.iter().product::<usize>() != out.len() {
            return Err(KvError::ShapeMismatch {
                key,
                expected: shape,
                got: vec![out.len()],
            });
        }
        if let Inner::Dist(_) = self.inner {
            // A failed distributed call may keep its output's storage past the call, which a
            // borrowed slice cannot outlive: pull into the store's memory and copy.
            let mut a = NDArray::zeros_dtype(&shape, dtype);
            self.pull(key, &mut a)?;
            out.copy_from_slice(a.as_slice::<T>()?);
            return Ok(());
        }
        let ptr = out.as_mut_ptr().cast::<u8>();
        // SAFETY: the slice is valid, aligned for `T` (the dtype) and borrowed mutably for the
        // whole call, and holds exactly the value's bytes; a local store writes its outputs
        // during the call only and keeps no clone of them, so the array dies with the call.
        let mut a = unsafe { NDArray::from_raw_parts(ptr, &shape, dtype, Box::new(())) }?;
        self.pull(key, &mut a)
    }

    /// Writes the built-in optimizer's state (momentum, moments, step counts) to `path`
    /// (MXNet's `save_optimizer_states`). For a distributed store the state is the servers':
    /// each sends its part to this worker, which writes them to one file (MXNet refuses this).
    /// Call it on one worker; no barrier is implied.
    pub fn save_optimizer_states(&mut self, path: impl AsRef<std::path::Path>) -> Result<()> {
        self.save_states(path.as_ref(), false)
    }

    /// [`KVStore::save_optimizer_states`] with the optimizer itself (MXNet's
    /// `dump_optimizer=True`): loading the file replaces the store's optimizer, its kind and
    /// parameters, with the saved one.
    pub fn save_optimizer_and_states(&mut self, path: impl AsRef<std::path::Path>) -> Result<()> {
        self.save_states(path.as_ref(), true)
    }

    fn save_states(&mut self, path: &std::path::Path, dump: bool) -> Result<()> {
        let bytes = match &mut self.inner {
            Inner::Local(s) if dump => s.optimizer()?.save_states_and_optimizer(),
            Inner::Local(s) => s.optimizer()?.save_states(),
            Inner::Dist(d) => d.save_states(dump)?,
        };
        std::fs::write(path, bytes)?;
        Ok(())
    }

    /// Restores what [`KVStore::save_optimizer_states`] wrote into the built-in optimizer
    /// (MXNet's `load_optimizer_states`): it must be of the same kind, and for a distributed
    /// store the job must have as many servers and the same keys. Call it on one worker.
    /// The update counts (each key's, Adam's step) stay the store's, as MXNet keeps them on
    /// its optimizer. What [`KVStore::save_optimizer_and_states`] wrote replaces the optimizer
    /// and its counts too: then `true`.
    pub fn load_optimizer_states(&mut self, path: impl AsRef<std::path::Path>) -> Result<bool> {
        let bytes = std::fs::read(path)?;
        match &mut self.inner {
            Inner::Local(s) => s.optimizer()?.load_states(&bytes),
            Inner::Dist(d) => d.load_states(&bytes),
        }
    }

    /// This worker's rank (0 for local stores).
    pub fn rank(&self) -> usize {
        match &self.inner {
            Inner::Local(_) => 0,
            Inner::Dist(d) => d.rank(),
        }
    }

    /// The number of workers (1 for local stores).
    pub fn num_workers(&self) -> usize {
        match &self.inner {
            Inner::Local(_) => 1,
            Inner::Dist(d) => d.num_workers(),
        }
    }

    /// A zeroed array for pushing and pulling. In a distributed store with servers on this
    /// host its pages are in shared memory: pushing it copies nothing, and a pull into it is the
    /// server's one copy. Elsewhere it is an ordinary array.
    pub fn alloc(&mut self, shape: &[usize], dtype: crate::DType) -> Result<NDArray> {
        match &mut self.inner {
            Inner::Local(_) => NDArray::try_zeros_dtype(shape, dtype),
            Inner::Dist(d) => d.alloc(shape, dtype),
        }
    }

    /// [`KVStore::alloc`] on `device`, page-locked for GPUs' copies where CUDA can (MXNet's
    /// `cpu_pinned` memory). On a CPU: `alloc`'s memory, pinned. On a GPU: a GPU array whose
    /// host copy, which transports move it through, is that memory: in a distributed store
    /// with servers on this host, shared-memory pages that a push sends in place after one
    /// copy from the GPU, and that a pull lands in before one copy to the GPU. A GPU that this
    /// process does not have is [`KvError::Device`].
    pub fn alloc_on(
        &mut self,
        shape: &[usize],
        dtype: crate::DType,
        device: crate::Device,
    ) -> Result<NDArray> {
        crate::gpu::check(device)?;
        let region = match &mut self.inner {
            Inner::Local(_) => None,
            Inner::Dist(d) => d.send_pages(crate::ndarray::checked_bytes(shape, dtype)?)?,
        };
        NDArray::zeros_staged(shape, dtype, region, device)
    }

    /// Waits until every worker has reached the barrier (returns at once for local stores).
    pub fn barrier(&mut self) -> Result<()> {
        match &mut self.inner {
            Inner::Local(_) => Ok(()),
            Inner::Dist(d) => d.barrier(),
        }
    }

    /// The kind of key (int or str) that `keys` are: an error where they mix kinds, with each
    /// other or with the keys the store holds. Nothing is recorded: only a call that stores
    /// keys ([`KVStore::init`], [`KVStore::broadcast`]) sets the store's kind
    /// ([`KVStore::keep_kind`]), so a refused call leaves the store as it was.
    fn check_keys<'a>(&self, keys: impl Iterator<Item = &'a Key>) -> Result<Option<KeyKind>> {
        let mut kind = self.key_kind;
        for k in keys {
            let this = match k {
                Key::Int(_) => KeyKind::Int,
                Key::Str(_) => KeyKind::Str,
            };
            match kind {
                None => kind = Some(this),
                Some(prev) if prev != this => return Err(KvError::MixedKeyTypes(k.clone())),
                Some(_) => {}
            }
        }
        Ok(kind)
    }

    /// After a call that stores `keys` (of `kind`): the store's keys are of that kind from now
    /// on, where the call succeeded or may have stored any of them before it failed (a local
    /// store knows; a distributed one's servers may hold some once its own checks passed).
    fn keep_kind<'a, R>(
        &mut self,
        kind: Option<KeyKind>,
        mut keys: impl Iterator<Item = &'a Key>,
        r: &Result<R>,
    ) {
        let stored = match r {
            Ok(_) => true,
            Err(KvError::DoubleInit(_) | KvError::Unsupported(_)) => false,
            Err(_) if matches!(self.inner, Inner::Dist(_)) => true,
            Err(_) => keys.any(|k| self.key_info(k.clone()).is_ok()),
        };
        if stored {
            self.key_kind = kind;
        }
    }

    /// Initialises keys: one value per key. A key is initialised once.
    pub fn init<'a>(&mut self, keys: impl Into<Keys>, values: impl Into<Values<'a>>) -> Result<()> {
        let pairs = group_values(keys.into(), values.into())?;
        let kind = self.check_keys(pairs.iter().map(|(k, _)| k))?;
        let r = match &mut self.inner {
            Inner::Local(s) => s.init(&pairs),
            Inner::Dist(d) => d.init(&pairs),
        };
        self.keep_kind(kind, pairs.iter().map(|(k, _)| k), &r);
        r
    }

    /// Pushes values: a list of values for a key is summed, then merged by the updater
    /// (ASSIGN unless one is set).
    pub fn push<'a>(&mut self, keys: impl Into<Keys>, values: impl Into<Values<'a>>) -> Result<()> {
        let pairs = group_values(keys.into(), values.into())?;
        self.check_keys(pairs.iter().map(|(k, _)| k))?;
        match &mut self.inner {
            Inner::Local(s) => s.push(&pairs),
            Inner::Dist(d) => d.push(&pairs),
        }
    }

    /// Copies the stored values into the outputs (one output, or each of a list of outputs).
    pub fn pull<'a>(&mut self, keys: impl Into<Keys>, outs: impl Into<Outputs<'a>>) -> Result<()> {
        let mut pairs = group_outputs(keys.into(), outs.into())?;
        self.check_keys(pairs.iter().map(|(k, _)| k))?;
        in_place(&pairs)?;
        match &mut self.inner {
            Inner::Local(s) => s.pull(&mut pairs),
            Inner::Dist(d) => d.pull(&mut pairs),
        }
    }

    /// Push, then pull into `outs`, in one round trip where the store is remote.
    pub fn pushpull<'a, 'b>(
        &mut self,
        keys: impl Into<Keys>,
        values: impl Into<Values<'a>>,
        outs: impl Into<Outputs<'b>>,
    ) -> Result<()> {
        let keys = keys.into();
        let pairs = group_values(keys.clone(), values.into())?;
        let mut out_pairs = group_outputs(keys, outs.into())?;
        self.check_keys(pairs.iter().map(|(k, _)| k))?;
        in_place(&out_pairs)?;
        match &mut self.inner {
            Inner::Local(s) => {
                // Validate the pull side before pushing, so a refused call changes nothing.
                for (k, outs) in &out_pairs {
                    let Some((_, vs)) = pairs.iter().find(|(p, _)| p == k) else {
                        return Err(KvError::UnknownKey(k.clone()));
                    };
                    for o in outs {
                        crate::local::check_like(k, vs[0], o)?;
                    }
                }
                s.push(&pairs)?;
                s.pull(&mut out_pairs)
            }
            Inner::Dist(d) => d.pushpull(&pairs, &mut out_pairs),
        }
    }

    /// Replaces the updater. In a distributed store closures cannot travel to the servers:
    /// register the updater with [`crate::register_updater`] and select it with
    /// [`KVStore::set_server_updater`].
    pub fn set_updater<F>(&mut self, f: F) -> Result<()>
    where
        F: FnMut(&Key, &NDArray, &mut NDArray) -> Result<()> + Send + 'static,
    {
        match &mut self.inner {
            Inner::Local(s) => {
                s.set_updater(Box::new(f));
                Ok(())
            }
            Inner::Dist(_) => Err(KvError::Unsupported(
                "a closure cannot be sent to the servers: register it with \
                 kvstore::register_updater(name, ..) and call set_server_updater(name)"
                    .into(),
            )),
        }
    }

    /// Runs a built-in optimizer as the updater (on the servers for distributed stores),
    /// with its per-key multipliers if it has some ([`crate::Multiplied`]).
    pub fn set_optimizer(&mut self, opt: impl Into<crate::Multiplied>) -> Result<()> {
        let opt = opt.into();
        opt.check_new()?;
        match &mut self.inner {
            Inner::Local(s) => {
                s.set_optimizer(opt);
                Ok(())
            }
            Inner::Dist(d) => d.set_optimizer(&opt),
        }
    }

    /// Changes the parameters of the built-in optimizer a local store runs (a new learning
    /// rate, say), and its multipliers (an [`crate::Optimizer`] has none: they go), keeping
    /// its state (momentum, moments, step counts), as MXNet's local store sees changes to the
    /// optimizer object it was given. A distributed store's servers keep
    /// what [`KVStore::set_optimizer`] sent them (as MXNet's do): an error there, and where
    /// the store runs no built-in optimizer or another kind.
    ///
    /// ```
    /// use kvstore::{create, NDArray, Optimizer};
    /// let mut kv = create("local").unwrap();
    /// kv.init(0, &NDArray::ones(&[2])).unwrap();
    /// kv.set_optimizer(Optimizer::sgd(0.5)).unwrap();
    /// kv.update_optimizer(Optimizer::sgd(0.25)).unwrap();
    /// kv.push(0, &NDArray::ones(&[2])).unwrap();
    /// let mut w = NDArray::zeros(&[2]);
    /// kv.pull(0, &mut w).unwrap();
    /// assert_eq!(w.to_vec::<f32>().unwrap(), [0.75, 0.75]);
    /// ```
    pub fn update_optimizer(&mut self, opt: impl Into<crate::Multiplied>) -> Result<()> {
        let opt = opt.into();
        opt.check()?;
        match &mut self.inner {
            Inner::Local(s) => s.optimizer()?.retune(opt),
            Inner::Dist(_) => Err(KvError::Unsupported(
                "a distributed store's optimizer runs on the servers, which keep what \
                 set_optimizer sent them"
                    .into(),
            )),
        }
    }

    /// The most updates any key has had from the optimizer a local store runs (MXNet's
    /// `Optimizer.num_update`, what its scheduler is given), counted from its
    /// `begin_num_update`. An error where the store runs no built-in optimizer, and in a
    /// distributed store, whose servers each count their own.
    pub fn optimizer_num_update(&self) -> Result<u64> {
        match &self.inner {
            Inner::Local(s) => Ok(s.optimizer()?.num_update()),
            Inner::Dist(_) => Err(KvError::Unsupported(
                "a distributed store's servers count their optimizer's updates".into(),
            )),
        }
    }

    /// Selects, by name, an updater registered with [`crate::register_updater`]; in a distributed
    /// store it runs on the servers.
    pub fn set_server_updater(&mut self, name: &str) -> Result<()> {
        match &mut self.inner {
            Inner::Local(s) => {
                let u = crate::registry::lookup(name)?;
                s.set_updater(Box::new(move |k, i, st| u(k, i, st)));
                Ok(())
            }
            Inner::Dist(d) => d.set_server_updater(name),
        }
    }
}
