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

use smallvec::SmallVec;

use super::Calls;
use crate::protocol::Op;
use crate::worker::Requests;
use crate::KvError;

/// The pushes of a sliced key a worker may have in flight in `dist_sync`: one in the servers'
/// round, and one they hold for the next.
const IN_FLIGHT: u32 = 2;

/// The keys that `reqs` push to more than one server, each once (a key's slices are
/// consecutive requests of its call).
fn sliced_pushes(reqs: &Requests) -> SmallVec<[u64; 2]> {
    let mut keys = SmallVec::new();
    for w in reqs.windows(2) {
        let (a, b) = (&w[0].msg, &w[1].msg);
        if a.key == b.key && matches!(a.op, Op::Push | Op::PushPull) && keys.last() != Some(&a.key)
        {
            keys.push(a.key);
        }
    }
    keys
}

impl<G> Calls<G> {
    /// Whether the servers run `dist_sync` rounds (the store's type says; `false` until set).
    pub(crate) fn set_sync(&mut self, sync: bool) {
        self.sync = sync;
    }

    /// The error of a call (`reqs`) with a push of a sliced key that would be the worker's
    /// third of that key in flight.
    pub(super) fn third_push(&self, reqs: &Requests) -> Option<KvError> {
        if !self.sync || reqs.len() < 2 {
            return None;
        }
        let key = sliced_pushes(reqs).into_iter().find(|k| {
            self.sliced_in_flight
                .get(k)
                .is_some_and(|&n| n >= IN_FLIGHT)
        })?;
        Some(KvError::Unsupported(format!(
            "key {key} is sliced over the servers and pushed twice already before its round \
             completed: a third push is refused (wait for the first)"
        )))
    }

    /// Counts the pushes of sliced keys of a call (`reqs`) that started, or (`started`
    /// false) ended.
    pub(super) fn count_sliced(&mut self, reqs: &Requests, started: bool) {
        if !self.sync || reqs.len() < 2 {
            return;
        }
        for k in sliced_pushes(reqs) {
            let n = self.sliced_in_flight.entry(k).or_default();
            if started {
                *n += 1;
            } else {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    self.sliced_in_flight.remove(&k);
                }
            }
        }
    }
}

/// Request `i` of a call (`reqs`) was refused by `server` (`why`): the error that makes the
/// store unusable where it is a slice of a push of a sliced key in `dist_sync` (`sync`).
pub(super) fn refused_slice(
    sync: bool,
    reqs: &Requests,
    i: usize,
    server: usize,
    why: &KvError,
) -> Option<KvError> {
    let r = &reqs.get(i)?.msg;
    let sliced = [i.checked_sub(1), Some(i + 1)]
        .into_iter()
        .flatten()
        .any(|j| reqs.get(j).is_some_and(|o| o.msg.key == r.key));
    (sync && sliced && matches!(r.op, Op::Push | Op::PushPull)).then(|| {
        KvError::Aborted(format!(
            "server {server} refused its slice of a push of key {} ({why}), which the other \
             servers may have taken into their rounds: the key's slices may be a round apart, \
             so this store is unusable",
            r.key
        ))
    })
}
