//! [`Prioritized`]: a store's next call with MXNet's `priority`.

use crate::{KVStore, Keys, NDArray, Outputs, Pending, Result, Values};

/// A [`KVStore`] whose next call has a priority ([`KVStore::with_priority`]).
pub struct Prioritized<'s> {
    kv: &'s mut KVStore,
    priority: i32,
}

impl<'s> Prioritized<'s> {
    pub(crate) fn new(kv: &'s mut KVStore, priority: i32) -> Self {
        Prioritized { kv, priority }
    }

    fn call<R>(self, f: impl FnOnce(&mut KVStore) -> R) -> R {
        self.kv.set_priority(self.priority);
        let r = f(self.kv);
        self.kv.set_priority(0);
        r
    }

    /// [`KVStore::push`] with this priority.
    pub fn push<'a>(self, keys: impl Into<Keys>, values: impl Into<Values<'a>>) -> Result<()> {
        self.call(|kv| kv.push(keys, values))
    }

    /// [`KVStore::pull`] with this priority.
    pub fn pull<'a>(self, keys: impl Into<Keys>, outs: impl Into<Outputs<'a>>) -> Result<()> {
        self.call(|kv| kv.pull(keys, outs))
    }

    /// [`KVStore::row_sparse_pull`] with this priority.
    pub fn row_sparse_pull(
        self,
        key: impl Into<crate::Key>,
        out: &mut NDArray,
        row_ids: &[u64],
    ) -> Result<()> {
        self.call(|kv| kv.row_sparse_pull(key, out, row_ids))
    }

    /// [`KVStore::pull_into`] with this priority.
    pub fn pull_into<T: crate::Element>(
        self,
        key: impl Into<crate::Key>,
        out: &mut [T],
    ) -> Result<()> {
        self.call(|kv| kv.pull_into(key, out))
    }

    /// [`KVStore::pushpull`] with this priority.
    pub fn pushpull<'a, 'b>(
        self,
        keys: impl Into<Keys>,
        values: impl Into<Values<'a>>,
        outs: impl Into<Outputs<'b>>,
    ) -> Result<()> {
        self.call(|kv| kv.pushpull(keys, values, outs))
    }

    /// [`KVStore::broadcast`] with this priority.
    pub fn broadcast<'a, 'b>(
        self,
        keys: impl Into<Keys>,
        values: impl Into<Values<'a>>,
        outs: impl Into<Outputs<'b>>,
    ) -> Result<()> {
        self.call(|kv| kv.broadcast(keys, values, outs))
    }

    /// [`KVStore::push_async`] with this priority.
    pub fn push_async<'a>(
        self,
        keys: impl Into<Keys>,
        values: impl Into<Values<'a>>,
    ) -> Result<Pending> {
        self.call(|kv| kv.push_async(keys, values))
    }

    /// [`KVStore::pull_async`] with this priority.
    pub fn pull_async(self, keys: impl Into<Keys>, outs: Vec<NDArray>) -> Result<Pending> {
        self.call(|kv| kv.pull_async(keys, outs))
    }

    /// [`KVStore::pushpull_async`] with this priority.
    pub fn pushpull_async<'a>(
        self,
        keys: impl Into<Keys>,
        values: impl Into<Values<'a>>,
        outs: Vec<NDArray>,
    ) -> Result<Pending> {
        self.call(|kv| kv.pushpull_async(keys, values, outs))
    }
}
