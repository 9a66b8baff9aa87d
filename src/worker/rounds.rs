//! `dist_sync` rounds of keys sliced over several servers. A server holds a worker's second
//! push of a key before the first one's round is in, and refuses a third; each server decides
//! for its own slice, and one may have completed a round that another still waits on. So:
//!
//! - a push of a sliced key that would be the worker's third in flight is refused here, before
//!   any slice is sent (no server can then refuse one of its slices for that reason, and the
//!   store stays usable);
//! - a push of a sliced key that a server refused for its slice, while the others may have
//!   taken theirs into their rounds, breaks the store: the key's slices may be a round apart
//!   from then on, every later pull would put rounds together, and nothing undoes it.
//!
//! Keys on one server are left as they were: a refusal there is the whole push's, and the
//! store goes on. In `dist_async` there are no rounds to hold a push for.

use rustc_hash::FxHashMap;

use super::Calls;
use crate::protocol::{status, Op};
use crate::worker::Requests;
use crate::KvError;

/// The pushes of a sliced key a worker may have in flight in `dist_sync`, at each slice: one
/// in the servers' round, and one they hold for the next.
const IN_FLIGHT: u32 = 2;

/// Whether request `i` of a call (`reqs`) pushes a slice of a sliced key (a key's slices are
/// consecutive requests of its call).
fn sliced_push(reqs: &Requests, i: usize) -> bool {
    let Some(r) = reqs.get(i).map(|r| &r.msg) else {
        return false;
    };
    matches!(r.op, Op::Push | Op::PushPull)
        && [i.checked_sub(1), Some(i + 1)]
            .into_iter()
            .flatten()
            .any(|j| reqs.get(j).is_some_and(|o| o.msg.key == r.key))
}

/// A counted push of slice `start` of `key` was answered, or its call ended without the answer.
pub(super) fn uncount(in_flight: &mut FxHashMap<(u64, u64), u32>, key: u64, start: u64) {
    if let Some(n) = in_flight.get_mut(&(key, start)) {
        *n = n.saturating_sub(1);
        if *n == 0 {
            in_flight.remove(&(key, start));
        }
    }
}

impl<G> Calls<G> {
    /// Whether the servers run `dist_sync` rounds (the store's type says; `false` until set).
    pub(crate) fn set_sync(&mut self, sync: bool) {
        self.sync = sync;
    }

    /// The error of a push of `key` to its slices starting at `starts` where one of them would
    /// be the worker's third push of that slice in flight (`dist_sync`). Asked before a
    /// compressed push is packed too, so that a refused one leaves its residual alone.
    pub(crate) fn third_push(
        &self,
        key: u64,
        mut starts: impl Iterator<Item = u64>,
    ) -> Option<KvError> {
        if !self.sync || self.sliced_in_flight.is_empty() {
            return None;
        }
        let full = |s| (self.sliced_in_flight.get(&(key, s))).is_some_and(|&n| n >= IN_FLIGHT);
        starts.any(full).then(|| {
            KvError::Unsupported(format!(
                "key {key} is sliced over the servers and pushed twice already before its \
                 round completed: a third push is refused (wait for the first)"
            ))
        })
    }

    /// [`Calls::third_push`] of every sliced key a call (`reqs`) pushes.
    pub(super) fn third_push_of(&self, reqs: &Requests) -> Option<KvError> {
        if !self.sync || reqs.len() < 2 || self.sliced_in_flight.is_empty() {
            return None;
        }
        (0..reqs.len())
            .filter(|&i| sliced_push(reqs, i))
            .find_map(|i| self.third_push(reqs[i].msg.key, std::iter::once(reqs[i].msg.start)))
    }

    /// Counts request `i` of a call that started (`reqs`) where it pushes a slice of a sliced
    /// key (`dist_sync`): whether it counted, to be let go of once answered.
    pub(super) fn count_slice(&mut self, reqs: &Requests, i: usize) -> bool {
        if !self.sync || reqs.len() < 2 || !sliced_push(reqs, i) {
            return false;
        }
        let m = &reqs[i].msg;
        *self.sliced_in_flight.entry((m.key, m.start)).or_default() += 1;
        true
    }
}

/// Request `i` of a call (`reqs`) was answered by `server` with `st` (`why`): the error that
/// makes the store unusable where a server refused a slice of a sliced push before taking it
/// into its round ([`status::NOT_TAKEN`], `dist_sync`), or failed its round for a worker gone
/// ([`status::PEER_LOST`]: a round another server may complete with the gone worker's push),
/// since the others may have taken theirs. Any other error of a slice (an updater's, after
/// the round) leaves the rounds in step.
pub(super) fn refused_slice(
    sync: bool,
    reqs: &Requests,
    i: usize,
    (server, st): (usize, u16),
    why: &KvError,
) -> Option<KvError> {
    let apart = matches!(st, status::NOT_TAKEN | status::PEER_LOST);
    (sync && apart && sliced_push(reqs, i)).then(|| {
        KvError::Aborted(format!(
            "server {server} refused its slice of a push of key {} ({why}), which the other \
             servers may have taken into their rounds: the key's slices may be a round apart, \
             so this store is unusable",
            reqs[i].msg.key
        ))
    })
}
