//! A sync round's end: the summed push applied once, the held pushes and the pulls behind
//! them answered, and the pushes held for the next round starting it.

use super::{apply, rows, unpin, Input, Payload, ServerState, Updater};
use crate::protocol::{status, Op};

impl ServerState {
    /// Every worker has pushed `key`: apply the summed push once and answer every held push.
    pub(super) fn complete_round(&mut self, key: u64) {
        let Some(slot) = self.slots.get_mut(&key) else {
            return;
        };
        // Logged under the state machine's target (`KVSTORE_LOG` filters name it).
        let n = slot.count;
        tracing::debug!(target: "kvstore::server::state", "key {key}: round of {n} pushes complete");
        self.metrics.waited += slot.count.saturating_sub(1) as u64;
        let res = match (&mut self.updater, &mut slot.merge) {
            // ASSIGN: the round's sum becomes the stored value; swap the buffers, copy nothing.
            (Updater::Assign, Some(merge)) => {
                std::mem::swap(&mut slot.stored, merge);
                Ok(())
            }
            (up, Some(merge)) => unpin(&mut slot.stored, &mut slot.spare, true, &mut self.alloc)
                .and_then(|()| apply(up, true, key, merge, &mut slot.stored, &mut slot.lost)),
            (_, None) => Ok(()),
        };
        self.metrics.round(res.is_ok());
        slot.count = 0;
        slot.pushed.iter_mut().for_each(|p| *p = false);
        let held = std::mem::take(&mut slot.held);
        let behind = std::mem::take(&mut slot.behind);
        let (value, start, lost) = (slot.stored.clone(), slot.start, slot.lost.clone());
        for h in held {
            match &res {
                Ok(()) if h.req.op == Op::PushPull => {
                    self.ok(h.peer, &h.req, Payload::Array(value.clone()))
                }
                Ok(()) => self.ok(h.peer, &h.req, Payload::None),
                Err(e) => self.err(h.peer, &h.req, status::FAILED, e.to_string()),
            }
        }
        // The pulls behind a push get the value, as a pull now would (the stored one, where
        // the update failed: the push's own answer says so).
        for h in behind {
            let answer = match &lost {
                Some(why) => Err(format!("key {key}: {why}, so its value is lost")),
                None => rows::pulled(&value, start, &h.req),
            };
            match answer {
                Ok(p) => self.ok(h.peer, &h.req, p),
                Err(e) => self.err(h.peer, &h.req, status::FAILED, e),
            }
        }
        // The pushes held for this next round start it, the pulls after them behind them.
        let Some(slot) = self.slots.get_mut(&key) else {
            return;
        };
        let next = std::mem::take(&mut slot.next);
        slot.behind = std::mem::take(&mut slot.behind_next);
        for mut d in next {
            let input = Input::Owned(&mut d.value);
            self.push_value(d.held.peer, d.worker, &d.held.req, input);
        }
        // A key whose value is lost starts no round: the pulls that came behind its refused
        // pushes would wait for one for good.
        let Some(slot) = self.slots.get_mut(&key) else {
            return;
        };
        if let Some(why) = slot.lost.clone() {
            for h in std::mem::take(&mut slot.behind) {
                let text = format!("key {key}: {why}, so its value is lost");
                self.err(h.peer, &h.req, status::FAILED, text);
            }
        } else if slot.count == 0 {
            // Every push held for this round was refused (it would wait on a worker gone from
            // the job): no round started, so the pulls behind them get the stored value, as a
            // pull now would, and as when a round fails (`fail_rounds`).
            let (value, start) = (slot.stored.clone(), slot.start);
            for h in std::mem::take(&mut slot.behind) {
                match rows::pulled(&value, start, &h.req) {
                    Ok(p) => self.ok(h.peer, &h.req, p),
                    Err(e) => self.err(h.peer, &h.req, status::FAILED, e),
                }
            }
        }
    }
}
