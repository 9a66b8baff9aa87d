//! A distributed store's push of one array returns before the servers answer, as MXNet's
//! engine runs a push: its bytes are copied into an array of the key's own (so the caller may
//! change its array at once), the push is started, and its result is taken by the next call
//! that needs it: the key's next push, a pull of the key (after the pull), or any other call
//! (before it). A pull of the key sees the push: the servers answer a worker's pull after its
//! own push of that key.

use kvstore::{Key, NDArray, Pending};
use rustc_hash::FxHashMap;

/// Pushes of one array at most this large return before the servers answer; larger ones wait
/// (a staging copy per key costs their size in memory, and their transfer outlasts the wait).
pub(crate) const ASYNC_BYTES: usize = 1 << 20;

/// The pushes in flight, one per key at most, and each key's staging array.
#[derive(Default)]
pub(crate) struct Pushes {
    inflight: FxHashMap<Key, Pending>,
    staging: FxHashMap<Key, NDArray>,
}

impl Pushes {
    /// Waits for `key`'s push in flight, if there is one: its error, if it failed.
    pub(crate) fn settle(&mut self, kv: &mut kvstore::KVStore, key: &Key) -> kvstore::Result<()> {
        if self.inflight.is_empty() {
            return Ok(());
        }
        match self.inflight.remove(key) {
            Some(p) => kv.wait(p).map(drop),
            None => Ok(()),
        }
    }

    /// Waits for every push in flight: the first error, if one failed.
    pub(crate) fn settle_all(&mut self, kv: &mut kvstore::KVStore) -> kvstore::Result<()> {
        if self.inflight.is_empty() {
            return Ok(());
        }
        let mut first = Ok(());
        for (_, p) in self.inflight.drain() {
            if let (Err(e), true) = (kv.wait(p), first.is_ok()) {
                first = Err(e);
            }
        }
        first
    }

    /// Starts a push of a copy of `value` to `key`, after the key's push before it is over
    /// (its error, if it failed: this push is not started then).
    pub(crate) fn start(
        &mut self,
        kv: &mut kvstore::KVStore,
        key: &Key,
        value: &NDArray,
        priority: i32,
    ) -> kvstore::Result<()> {
        self.settle(kv, key)?;
        let s = array_like(&mut self.staging, key, value);
        // The previous push of the key is over, so no call holds this array: no copy on write.
        s.as_bytes_mut().copy_from_slice(value.as_bytes());
        let p = kv.with_priority(priority).push_async(key.clone(), &*s)?;
        self.inflight.insert(key.clone(), p);
        Ok(())
    }
}

/// `key`'s array in `arrays`, of `like`'s shape and dtype: the one kept since an earlier call,
/// or a new one (zeroed) in its place.
pub(crate) fn array_like<'m>(
    arrays: &'m mut FxHashMap<Key, NDArray>,
    key: &Key,
    like: &NDArray,
) -> &'m mut NDArray {
    let a = arrays
        .entry(key.clone())
        .or_insert_with(|| NDArray::zeros_dtype(like.shape(), like.dtype()));
    if a.shape() != like.shape() || a.dtype() != like.dtype() {
        *a = NDArray::zeros_dtype(like.shape(), like.dtype());
    }
    a
}
