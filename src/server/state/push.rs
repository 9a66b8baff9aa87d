//! A push's value taken into its key's round (dist_sync) or applied at once (dist_async):
//! summed where it lies where it can be, a round's first push kept until the next.

use super::{apply, unpin, Deferred, Held, Input, Kept, ServerState};
use crate::protocol::{status, Msg, Op};
use crate::server::state::{new_array, Payload, PeerId};
use crate::NDArray;

impl ServerState {
    /// Takes worker `worker`'s push of `m` (checked against its key here).
    pub(super) fn push_value(&mut self, peer: PeerId, worker: usize, m: &Msg, payload: Input<'_>) {
        if let Err((code, text)) = self.check_slot(m) {
            return self.err(peer, m, code, text);
        }
        if worker >= self.num_workers {
            return self.err(peer, m, status::FAILED, format!("no worker {worker}"));
        }
        let key = m.key;
        if !self.sync {
            let Some(slot) = self.slots.get_mut(&key) else {
                return;
            };
            // An updater gets an array of this process, never a view of a peer's pages.
            let owned;
            let input: &NDArray = match payload {
                Input::Owned(a) => a,
                Input::Peer(p, _) => match p.to_array() {
                    Ok(a) => {
                        owned = a;
                        &owned
                    }
                    Err(e) => return self.err(peer, m, status::FAILED, e.to_string()),
                },
            };
            let res =
                unpin(&mut slot.stored, &mut slot.spare, true, &mut self.alloc).and_then(|()| {
                    apply(
                        &mut self.updater,
                        false,
                        key,
                        input,
                        &mut slot.stored,
                        &mut slot.lost,
                    )
                });
            self.metrics.pushes += 1;
            self.metrics.round(res.is_ok());
            self.metrics.bytes_in += m.data_bytes().unwrap_or(0);
            let value = slot.stored.clone();
            return match res {
                Ok(()) if m.op == Op::PushPull => self.ok(peer, m, Payload::Array(value)),
                Ok(()) => self.ok(peer, m, Payload::None),
                Err(e) => self.err(peer, m, status::FAILED, e.to_string()),
            };
        }
        let Some(slot) = self.slots.get_mut(&key) else {
            return;
        };
        // A round that waits on a worker gone from the job never completes: refused at once,
        // naming it (the round's earlier pushes failed when it went).
        let waits_on_gone = self.gone.iter().find(|(g, _)| !slot.pushed[*g]);
        if let Some((g, why)) = waits_on_gone {
            let text = format!("the round of key {key} cannot complete: worker {g} {why}");
            return self.err(peer, m, status::PEER_LOST, text);
        }
        if slot.pushed[worker] {
            if slot.next.iter().any(|d| d.worker == worker) {
                let text = format!(
                    "worker {worker} pushed key {key} a third time before its round completed: \
                     wait for the first"
                );
                return self.err(peer, m, status::NOT_TAKEN, text);
            }
            return match payload.take(&mut self.alloc) {
                Ok(value) => slot.next.push(Deferred {
                    worker,
                    held: Held { peer, req: *m },
                    value,
                }),
                Err(e) => self.err(peer, m, status::NOT_TAKEN, e.to_string()),
            };
        }
        slot.pushed[worker] = true;
        slot.count += 1;
        // Shapes and dtypes were checked against the slot, so these cannot fail but for a
        // payload region the pool refused, which fails the request.
        let keep_first = self.num_workers > 1;
        // A round's first push in the worker's own pages: held there by its backend, where it
        // can be, until the next push is summed with it (as one in a receive slot is kept).
        let held = match &payload {
            Input::Peer(p, None) if keep_first && slot.count == 1 => Kept::held(p, peer, worker),
            _ => None,
        };
        // The kept push summed with this one, let go of once the slot is no longer in use.
        let mut summed = None;
        let res = match &mut slot.merge {
            // The round's second push, its first kept in a slot: one pass sums both.
            Some(merge) if slot.count > 1 && slot.first.is_some() => {
                match unpin(merge, &mut slot.spare, false, &mut self.alloc) {
                    // The kept push is let go of only once it is summed: a failed sum leaves
                    // it kept, and counted, for the round's next push.
                    Ok(()) => match slot.first.as_ref().map(|k| k.sum_with(&payload, merge)) {
                        Some(Ok(())) => {
                            summed = slot.first.take();
                            Ok(())
                        }
                        Some(Err(e)) => Err(e),
                        None => Ok(()),
                    },
                    Err(e) => Err(e),
                }
            }
            Some(merge) if slot.count > 1 => unpin(merge, &mut slot.spare, true, &mut self.alloc)
                .and_then(|()| payload.add_into(merge)),
            // The round's first push: a received buffer becomes the merge buffer (no copy), and
            // the connection receives into the old merge buffer next time; data in a receive
            // slot stays there until the next push (when more are due); a peer's other pages
            // are read where they lie into the merge buffer (the worker reuses them).
            Some(merge) => match payload {
                Input::Owned(a) => {
                    std::mem::swap(merge, a);
                    Ok(())
                }
                Input::Peer(p, Some(id)) if keep_first => {
                    slot.first = Some(Kept::of(p, id));
                    self.kept = Some(id);
                    Ok(())
                }
                Input::Peer(..) if held.is_some() => {
                    slot.first = held;
                    Ok(())
                }
                Input::Peer(p, _) => unpin(merge, &mut slot.spare, false, &mut self.alloc)
                    .and_then(|()| p.copy_into(merge)),
            },
            // The first round: a received buffer becomes the merge buffer; a peer's pages are
            // kept (as above) or copied into a new one.
            None => match payload {
                Input::Owned(_) => payload.take(&mut self.alloc).map(|a| slot.merge = Some(a)),
                Input::Peer(p, Some(id)) if keep_first => {
                    slot.merge = Some(new_array(&mut self.alloc, &[m.len as usize], m.dtype));
                    slot.first = Some(Kept::of(p, id));
                    self.kept = Some(id);
                    Ok(())
                }
                Input::Peer(..) if held.is_some() => {
                    slot.merge = Some(new_array(&mut self.alloc, &[m.len as usize], m.dtype));
                    slot.first = held;
                    Ok(())
                }
                Input::Peer(p, _) => {
                    let mut a = new_array(&mut self.alloc, &[m.len as usize], m.dtype);
                    p.copy_into(&mut a).map(|()| slot.merge = Some(a))
                }
            },
        };
        if let Err(e) = res {
            slot.pushed[worker] = false;
            slot.count -= 1;
            return self.err(peer, m, status::NOT_TAKEN, e.to_string());
        }
        slot.held.push(Held { peer, req: *m });
        let complete = slot.count == self.num_workers;
        self.metrics.pushes += 1;
        self.metrics.bytes_in += m.data_bytes().unwrap_or(0);
        if let Some(k) = summed {
            self.release_kept(k);
        }
        if complete {
            self.complete_round(key);
        }
    }
}
