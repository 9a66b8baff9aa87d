//! The order of a worker's queued requests: MXNet's priorities, within what one key's
//! operations allow.

use std::collections::VecDeque;

use crate::worker::calls::{Action, CallId};

/// Where a request of `call` goes in the queue of requests waiting for their links: after
/// every request of the same or a higher priority, and never before a request for the same
/// key slice on the same server (a pull must see the push queued before it, whatever their
/// priorities, as MXNet's engine orders operations on one key).
pub(crate) fn queue_place<G>(
    queue: &VecDeque<Action<G>>,
    order: impl Fn(CallId, usize) -> Option<(i32, usize, u64)>,
    call: CallId,
    req: usize,
) -> usize {
    let Some((p, server, key)) = order(call, req) else {
        return queue.len();
    };
    let mut at = queue.len();
    while at > 0 {
        let Action::Send {
            call: c, req: r, ..
        } = &queue[at - 1]
        else {
            break;
        };
        match order(*c, *r) {
            Some((q, s, k)) if q < p && (s, k) != (server, key) => at -= 1,
            Some(_) => break,
            None => at -= 1,
        }
    }
    at
}

#[cfg(test)]
mod tests {
    use super::*;

    fn send(call: u64) -> Action<()> {
        Action::Send {
            call: CallId(call),
            req: 0,
            token: 0,
        }
    }

    /// Calls 1.. with (priority, server, key).
    fn order(
        table: &[(i32, usize, u64)],
    ) -> impl Fn(CallId, usize) -> Option<(i32, usize, u64)> + '_ {
        move |c, _| table.get(c.0 as usize - 1).copied()
    }

    fn calls(q: &VecDeque<Action<()>>) -> Vec<u64> {
        q.iter()
            .map(|a| match a {
                Action::Send { call, .. } => call.0,
                Action::Release { .. } => 0,
            })
            .collect()
    }

    #[test]
    fn higher_priority_goes_first_and_equal_ones_keep_their_order() {
        let t = [
            (0, 0, 1),
            (0, 0, 2),
            (5, 0, 3),
            (5, 1, 4),
            (-1, 0, 5),
            (9, 1, 6),
        ];
        let mut q = VecDeque::new();
        for c in 1..=6 {
            let at = queue_place(&q, order(&t), CallId(c), 0);
            q.insert(at, send(c));
        }
        assert_eq!(calls(&q), [6, 3, 4, 1, 2, 5]);
    }

    #[test]
    fn a_request_never_overtakes_one_for_the_same_key_slice() {
        // Call 3 (priority 9) is for key 1 on server 0, as call 1 is: it may pass call 2 only.
        let t = [(0, 0, 1), (0, 0, 2), (9, 0, 1)];
        let mut q = VecDeque::new();
        for c in 1..=3 {
            let at = queue_place(&q, order(&t), CallId(c), 0);
            q.insert(at, send(c));
        }
        assert_eq!(calls(&q), [1, 3, 2]);
        // The same key on another server is another slice.
        let t = [(0, 1, 1), (9, 0, 1)];
        let mut q = VecDeque::new();
        for c in 1..=2 {
            let at = queue_place(&q, order(&t), CallId(c), 0);
            q.insert(at, send(c));
        }
        assert_eq!(calls(&q), [2, 1]);
    }
}
