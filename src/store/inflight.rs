//! Calls in flight: started at once, their results waited for.

use super::{Inner, KVStore, Pending, PendingInner};
use crate::args::{group_owned, group_values, Keys, List, Values};
use crate::{Key, KvError, NDArray, Result};

impl KVStore {
    /// Starts a push and returns without waiting for it (MXNet's engine runs pushes
    /// asynchronously). The values may be changed at once: a change makes a copy, and the
    /// call sends what was given. Calls reach the servers in the order they were started, and
    /// a pull of the key started after it sees it, waited for or not (in `dist_sync`, the
    /// server answers that pull once the push's round is in). In `dist_sync` a second push of
    /// the key before this one's round is in is held by the server for the next round; a
    /// third is refused: wait for this one first.
    ///
    /// ```
    /// use kvstore::{create, NDArray};
    /// let mut kv = create("local").unwrap();
    /// kv.init(3, &NDArray::zeros(&[2])).unwrap();
    /// let p = kv.push_async(3, &NDArray::ones(&[2])).unwrap();
    /// let q = kv.pull_async(3, vec![NDArray::zeros(&[2])]).unwrap();
    /// kv.wait(p).unwrap();
    /// let out = kv.wait(q).unwrap();
    /// assert_eq!(out[0].to_vec::<f32>().unwrap(), [1.0, 1.0]);
    /// ```
    pub fn push_async<'a>(
        &mut self,
        keys: impl Into<Keys>,
        values: impl Into<Values<'a>>,
    ) -> Result<Pending> {
        let pairs = group_values(keys.into(), values.into())?;
        self.check_keys(pairs.iter().map(|(k, _)| k))?;
        Ok(Pending(match &mut self.inner {
            Inner::Local(s) => PendingInner::Ready(s.push(&pairs).map(|()| Vec::new())),
            Inner::Dist(d) => PendingInner::Dist(d.push_async(&pairs)?),
        }))
    }

    /// Starts a pull of each key into its output (one per key). The call owns the outputs
    /// until [`KVStore::wait`] gives them back, filled: no one sees them half written.
    pub fn pull_async(&mut self, keys: impl Into<Keys>, outs: Vec<NDArray>) -> Result<Pending> {
        let pairs = group_owned(keys.into(), outs)?;
        self.check_keys(pairs.iter().map(|(k, _)| k))?;
        pairs.iter().try_for_each(|(_, o)| o.check_in_place())?;
        Ok(Pending(match &mut self.inner {
            Inner::Local(s) => {
                let mut pairs = pairs;
                let mut refs: Vec<(Key, List<&mut NDArray>)> = pairs
                    .iter_mut()
                    .map(|(k, o)| (k.clone(), smallvec::smallvec![o]))
                    .collect();
                let r = s.pull(&mut refs);
                drop(refs);
                PendingInner::Ready(r.map(|()| pairs.into_iter().map(|(_, o)| o).collect()))
            }
            Inner::Dist(d) => PendingInner::Dist(d.pull_async(pairs)?),
        }))
    }

    /// Starts a push of each key's values and a pull of the result into its output (one per
    /// key), as [`KVStore::push_async`] and [`KVStore::pull_async`].
    pub fn pushpull_async<'a>(
        &mut self,
        keys: impl Into<Keys>,
        values: impl Into<Values<'a>>,
        outs: Vec<NDArray>,
    ) -> Result<Pending> {
        let keys = keys.into();
        let given = match &keys {
            Keys::One(_) => 1,
            Keys::Many(ks) => ks.len(),
        };
        if outs.len() != given {
            return Err(KvError::LengthMismatch {
                keys: given,
                values: outs.len(),
            });
        }
        let pairs = group_values(keys, values.into())?;
        self.check_keys(pairs.iter().map(|(k, _)| k))?;
        if pairs.len() != given {
            // Its values are summed into one push, whose one result would go to one of its
            // outputs: refused, where `pushpull` pulls it into each.
            return Err(KvError::Unsupported(
                "pushpull_async takes each key once (pushpull takes a key twice)".into(),
            ));
        }
        outs.iter().try_for_each(NDArray::check_in_place)?;
        Ok(Pending(match &mut self.inner {
            Inner::Local(s) => {
                for ((k, vs), o) in pairs.iter().zip(&outs) {
                    crate::local::check_like(k, vs[0], o)?;
                }
                let mut outs = outs;
                let mut refs: Vec<(Key, List<&mut NDArray>)> = pairs
                    .iter()
                    .zip(outs.iter_mut())
                    .map(|((k, _), o)| (k.clone(), smallvec::smallvec![o]))
                    .collect();
                let r = s.push(&pairs).and_then(|()| s.pull(&mut refs));
                drop(refs);
                PendingInner::Ready(r.map(|()| outs))
            }
            Inner::Dist(d) => PendingInner::Dist(d.pushpull_async(&pairs, outs)?),
        }))
    }

    /// Waits for a call in flight; returns its outputs (one per key of a pull or pushpull,
    /// none for a push), filled. After a failed call its outputs are not given back.
    pub fn wait(&mut self, p: Pending) -> Result<Vec<NDArray>> {
        match (p.0, &mut self.inner) {
            (PendingInner::Ready(r), _) => r,
            (PendingInner::Dist(t), Inner::Dist(d)) => d.wait(t),
            (PendingInner::Dist(_), Inner::Local(_)) => Err(KvError::Unsupported(
                "this call was started by another store".into(),
            )),
        }
    }

    /// Waits until none of this store's calls is in flight (MXNet's `waitall`). Results of
    /// calls whose [`Pending`] is still held stay there for [`KVStore::wait`].
    pub fn wait_all(&mut self) -> Result<()> {
        match &mut self.inner {
            Inner::Local(_) => Ok(()),
            Inner::Dist(d) => d.wait_all(),
        }
    }

    /// Fails every call in flight at once, for a program that cannot go on with the store (a
    /// binding after a panic in a call, say): the grants of their outputs are revoked before
    /// this returns, so no answer lands in memory the program has back, and a distributed
    /// store refuses every later call, saying `why`. (A local store has no call in flight, and
    /// is unchanged.) Dropping the store instead would first wait for the calls in flight, up
    /// to their timeout; after this, dropping it says goodbye at once (the rounds that wait on
    /// this worker fail, naming it).
    pub fn abort(&mut self, why: &str) {
        if let Inner::Dist(d) = &mut self.inner {
            d.abort(why);
        }
    }
}
