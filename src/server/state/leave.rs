//! Workers and connections leaving, and the server failing: what happens to the requests
//! held for a round.

use super::{PeerId, ServerState};
use crate::protocol::status;

impl ServerState {
    /// Worker `rank` left the job (`why`: "disconnected", "finished"). Whether the job goes
    /// on is the scheduler's to say (a clean exit is no failure); here, every sync round it has
    /// not pushed cannot complete, so its held pushes fail now, naming it, and so will any
    /// later sync push, and the pulls held behind them get the stored value. Other pulls, and
    /// async pushes, are served as before.
    pub fn worker_gone(&mut self, rank: usize, why: &str) {
        if rank >= self.num_workers || self.gone.iter().any(|(g, _)| *g == rank) {
            return;
        }
        self.gone.push((rank, why.to_string()));
        if self.sync {
            self.fail_rounds(rank, why, true);
        }
    }

    /// Worker `rank` said goodbye and left: a round whose first push is still held in its
    /// pages fails (its push never finished, and its process may reuse them); other rounds
    /// are as they were.
    pub fn worker_left(&mut self, rank: usize) {
        if rank < self.num_workers && self.sync {
            self.fail_rounds(
                rank,
                "left the job before its push of the round finished",
                false,
            );
        }
    }

    /// Fails the sync rounds that wait on worker `rank` (`unpushed`: those it has not pushed)
    /// or hold its first push in its pages; the pulls behind them get the stored value.
    fn fail_rounds(&mut self, rank: usize, why: &str, unpushed: bool) {
        let mut failed = Vec::new();
        let mut served = Vec::new();
        let mut kept = Vec::new();
        for (key, slot) in self.slots.iter_mut() {
            // Also a round whose first push it made is held in its pages: a process whose link
            // closed may reuse them (it was not done with them before), so it cannot count.
            let its_held = slot.first.as_ref().is_some_and(|k| k.held_from(rank));
            if slot.count > 0 && ((unpushed && !slot.pushed[rank]) || its_held) {
                slot.count = 0;
                slot.pushed.iter_mut().for_each(|p| *p = false);
                kept.extend(slot.first.take());
                failed.extend(slot.held.drain(..).map(|h| (*key, h)));
                failed.extend(slot.next.drain(..).map(|d| (*key, d.held)));
                slot.behind.append(&mut slot.behind_next);
                // The pulls behind the failed pushes get the stored value (or the run of it they
                // name), as they would now.
                let value = slot.stored.clone();
                let start = slot.start;
                served.extend(slot.behind.drain(..).map(|h| {
                    let answer = super::rows::pulled(&value, start, &h.req);
                    (h, answer)
                }));
            }
        }
        for k in kept {
            self.release_kept(k);
        }
        for (key, h) in failed {
            let text = format!("the round of key {key} cannot complete: worker {rank} {why}");
            self.err(h.peer, &h.req, status::PEER_LOST, text);
        }
        for (h, answer) in served {
            match answer {
                Ok(p) => self.ok(h.peer, &h.req, p),
                Err(e) => self.err(h.peer, &h.req, status::FAILED, e),
            }
        }
    }

    /// Stops serving: answers every held request with `reason`, and every later one too.
    pub fn fail(&mut self, reason: &str) {
        if self.failed.is_none() {
            self.failed = Some(reason.to_string());
        }
        let mut held = Vec::new();
        let mut kept = Vec::new();
        for slot in self.slots.values_mut() {
            held.append(&mut slot.held);
            held.append(&mut slot.behind);
            held.extend(slot.next.drain(..).map(|d| d.held));
            held.append(&mut slot.behind_next);
            slot.count = 0;
            slot.pushed.iter_mut().for_each(|p| *p = false);
            kept.extend(slot.first.take());
        }
        for k in kept {
            self.release_kept(k);
        }
        for h in held {
            self.err(h.peer, &h.req, status::PEER_LOST, reason.to_string());
        }
    }

    /// Drops what is addressed to a closed connection.
    pub fn forget_peer(&mut self, peer: PeerId) {
        self.outbox.retain(|o| o.to != peer);
        for slot in self.slots.values_mut() {
            slot.behind.retain(|h| h.peer != peer);
            slot.behind_next.retain(|h| h.peer != peer);
            slot.next.retain(|d| d.held.peer != peer);
        }
        self.snapshots.remove(&peer);
    }
}
