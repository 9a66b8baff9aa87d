//! A server's receive slots: the protocol of pushes put straight into place, with no I/O.
//!
//! The first push of a key slice by a worker arrives as a message. If the slot budget allows,
//! the server then makes that worker a slot for the slice (registered memory of the slice's
//! size, granted to the worker), and the reply to the push carries the grant: one credit, good
//! for one put. The worker's next push of the slice is a put into the slot, whose immediate is
//! the request id; the server sums it where it lies on arrival (the slot is free again at
//! once), and the reply to that push carries the credit back. A put without a credit, of the
//! wrong length, or into another worker's slot breaks the protocol and closes the link.
//!
//! Memory is bounded: the slots of all workers together stay within the budget; a push that
//! finds no room goes on as a message (the link's receive buffer), as the first one did.
//! `S` is the slot's memory and grant, as the loop holds them; this module only keeps it.

use rustc_hash::FxHashMap;

use crate::protocol::{flags, Msg, Op, IMM_FOLLOWS};
use crate::server::state::PeerId;

/// One slot: a key slice of one worker.
struct Slot<S> {
    /// The header of the push that made it: key, slice, dtype, shape.
    tmpl: Msg,
    bytes: usize,
    mem: S,
    /// The worker holds the credit: it may put once.
    credit_out: bool,
    /// A put whose message is still to come (a pushpull's): its request id.
    filled: Option<u64>,
}

/// What a put into a slot means.
pub(crate) enum PutAction {
    /// A push: handle this request, its data in the slot.
    Push(Msg),
    /// A pushpull's data: its message follows.
    Wait,
}

/// The receive slots of one server.
pub(crate) struct Slots<S> {
    budget: usize,
    used: usize,
    /// By peer and grant number (each medium numbers its grants).
    slots: FxHashMap<(PeerId, u64), Slot<S>>,
    /// (peer, key, slice start) to grant number.
    by_slice: FxHashMap<(PeerId, u64, u64), u64>,
    /// Pushes whose reply is to carry their slot's credit: (peer, request id) to grant number.
    pending: FxHashMap<(PeerId, u64), u64>,
}

impl<S> Slots<S> {
    /// Slots of at most `budget` bytes in all.
    pub(crate) fn new(budget: usize) -> Slots<S> {
        Slots {
            budget,
            used: 0,
            slots: FxHashMap::default(),
            by_slice: FxHashMap::default(),
            pending: FxHashMap::default(),
        }
    }

    /// Bytes held in slots.
    #[cfg(test)]
    pub(crate) fn used(&self) -> usize {
        self.used
    }

    /// A push message `m` arrived from `peer`: whether to make it a slot now (none exists for
    /// the slice and the budget has room; the bytes are counted from now). Either way its reply
    /// carries the slice's credit, if the worker does not hold it.
    pub(crate) fn on_push(&mut self, peer: PeerId, m: &Msg) -> Option<usize> {
        if !matches!(m.op, Op::Push | Op::PushPull) {
            return None;
        }
        if let Some(&id) = self.by_slice.get(&(peer, m.key, m.start)) {
            self.pending.insert((peer, m.req_id), id);
            return None;
        }
        let bytes = m.data_bytes()? as usize;
        if bytes == 0 || self.used.checked_add(bytes)? > self.budget {
            return None;
        }
        self.used += bytes;
        Some(bytes)
    }

    /// The slot that [`Slots::on_push`] asked for: `id` is its grant's number.
    pub(crate) fn add(&mut self, peer: PeerId, m: &Msg, id: u64, mem: S) {
        let bytes = m.data_bytes().unwrap_or(0) as usize;
        let mut tmpl = *m;
        tmpl.op = Op::Push;
        tmpl.flags = 0;
        self.by_slice.insert((peer, m.key, m.start), id);
        self.pending.insert((peer, m.req_id), id);
        self.slots.insert(
            (peer, id),
            Slot {
                tmpl,
                bytes,
                mem,
                credit_out: false,
                filled: None,
            },
        );
    }

    /// [`Slots::on_push`] said yes, but the slot could not be made: its bytes are free again.
    pub(crate) fn not_made(&mut self, bytes: usize) {
        self.used = self.used.saturating_sub(bytes);
    }

    /// A reply goes to `peer`: the slot whose credit it carries (its flag is then set), if any.
    pub(crate) fn on_reply(&mut self, peer: PeerId, reply: &mut Msg) -> Option<&S> {
        let id = self.pending.remove(&(peer, reply.req_id))?;
        let slot = self.slots.get_mut(&(peer, id))?;
        if reply.status != crate::protocol::status::OK || slot.credit_out {
            return None;
        }
        slot.credit_out = true;
        reply.flags |= flags::SLOT;
        Some(&slot.mem)
    }

    /// `peer` put `len` bytes at `offset` into the slot granted as `grant`, with `imm`.
    pub(crate) fn on_put(
        &mut self,
        peer: PeerId,
        grant: u64,
        offset: usize,
        len: usize,
        imm: u32,
    ) -> Result<(PutAction, &S), String> {
        let Some(slot) = self.slots.get_mut(&(peer, grant)) else {
            return Err(format!(
                "a put into grant {grant}, which is no slot of this worker"
            ));
        };
        if !slot.credit_out {
            return Err(format!("a put into slot {grant} without its credit"));
        }
        if offset != 0 || len != slot.bytes {
            return Err(format!(
                "a put of {len} bytes at {offset} into a slot of {}",
                slot.bytes
            ));
        }
        slot.credit_out = false;
        let req_id = (imm & !IMM_FOLLOWS) as u64;
        if imm & IMM_FOLLOWS != 0 {
            slot.filled = Some(req_id);
            return Ok((PutAction::Wait, &slot.mem));
        }
        let mut m = slot.tmpl;
        m.req_id = req_id;
        self.pending.insert((peer, req_id), grant);
        Ok((PutAction::Push(m), &slot.mem))
    }

    /// A pushpull message with [`flags::SLOT`]: its data, put before it, is in this slot.
    pub(crate) fn on_slot_msg(&mut self, peer: PeerId, m: &Msg) -> Result<&S, String> {
        let id = self.by_slice.get(&(peer, m.key, m.start)).copied();
        let Some((id, slot)) = id.and_then(|id| Some((id, self.slots.get_mut(&(peer, id))?)))
        else {
            return Err(format!("key {} has no slot for this worker", m.key));
        };
        if slot.filled != Some(m.req_id) || m.op != Op::PushPull {
            return Err(format!(
                "a {:?} message for slot {id}, whose put did not come before it",
                m.op
            ));
        }
        if m.total != slot.tmpl.total || m.len != slot.tmpl.len || m.dtype != slot.tmpl.dtype {
            return Err(format!("a message for slot {id} names another slice"));
        }
        slot.filled = None;
        self.pending.insert((peer, m.req_id), id);
        Ok(&slot.mem)
    }

    /// `peer` is gone: its slots, for the loop to fence and free.
    pub(crate) fn drop_peer(&mut self, peer: PeerId) -> Vec<S> {
        self.pending.retain(|(p, _), _| *p != peer);
        self.by_slice.retain(|(p, _, _), _| *p != peer);
        let ids: Vec<(PeerId, u64)> = self
            .slots
            .keys()
            .filter(|(p, _)| *p == peer)
            .copied()
            .collect();
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            if let Some(s) = self.slots.remove(&id) {
                self.used = self.used.saturating_sub(s.bytes);
                out.push(s.mem);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{slot_imm, status};
    use crate::DType;

    fn push(op: Op, key: u64, len: u64, req: u64) -> Msg {
        let mut m = Msg::new(op);
        m.key = key;
        m.dtype = DType::F32;
        m.total = len;
        m.len = len;
        m.req_id = req;
        m
    }

    fn reply(m: &Msg, status: u16) -> Msg {
        let mut r = *m;
        r.op = Op::Reply;
        r.status = status;
        r
    }

    #[test]
    fn a_first_push_makes_a_slot_whose_credit_goes_with_the_reply_and_comes_back_with_the_next() {
        let mut s: Slots<&str> = Slots::new(1000);
        let m = push(Op::Push, 7, 10, 1);
        assert_eq!(s.on_push(3, &m), Some(40));
        s.add(3, &m, 99, "slot");
        assert_eq!(s.used(), 40);
        // A put before the worker has the credit breaks the protocol.
        assert!(s.on_put(3, 99, 0, 40, slot_imm(2, false)).is_err());
        let mut r = reply(&m, status::OK);
        assert_eq!(s.on_reply(3, &mut r), Some(&"slot"));
        assert_eq!(r.flags, flags::SLOT);
        // The put is a push with the header of the first one and the request id of the imm.
        match s.on_put(3, 99, 0, 40, slot_imm(2, false)) {
            Ok((PutAction::Push(p), mem)) => {
                assert_eq!((p.op, p.key, p.len, p.req_id), (Op::Push, 7, 10, 2));
                assert_eq!(*mem, "slot");
            }
            _ => panic!("a push"),
        }
        // The credit is spent: a second put is refused; the reply gives it back.
        assert!(s.on_put(3, 99, 0, 40, slot_imm(3, false)).is_err());
        let mut r2 = reply(&push(Op::Push, 7, 10, 2), status::OK);
        assert!(s.on_reply(3, &mut r2).is_some());
        assert!(s.on_put(3, 99, 0, 40, slot_imm(3, false)).is_ok());
    }

    #[test]
    fn the_budget_bounds_slots_over_all_workers_and_frees_those_of_a_lost_one() {
        let mut s: Slots<u8> = Slots::new(100);
        let m = push(Op::Push, 1, 10, 1);
        for w in 0..2 {
            assert_eq!(s.on_push(w, &m), Some(40));
            s.add(w, &m, w as u64 + 1, 0);
        }
        // A third worker finds no room: its pushes go on as messages, without a credit.
        assert_eq!(s.on_push(2, &m), None);
        let mut r = reply(&m, status::OK);
        assert!(s.on_reply(2, &mut r).is_none());
        assert_eq!(r.flags, 0);
        assert_eq!(s.drop_peer(0).len(), 1);
        assert_eq!(s.used(), 40);
        assert_eq!(s.on_push(2, &m), Some(40));
        // A failed push gets no credit.
        s.add(2, &m, 9, 0);
        let mut r = reply(&m, status::FAILED);
        assert!(s.on_reply(2, &mut r).is_none());
    }

    #[test]
    fn slots_of_two_workers_with_the_same_grant_number_stay_apart() {
        // Each medium numbers its grants: a TCP worker's slot and a shared-memory worker's
        // slot may both be grant 1.
        let mut s: Slots<&str> = Slots::new(1000);
        let m = push(Op::Push, 7, 10, 1);
        s.on_push(0, &m);
        s.add(0, &m, 1, "tcp");
        s.on_push(1 << 32, &m);
        s.add(1 << 32, &m, 1, "shm");
        assert_eq!(s.on_reply(0, &mut reply(&m, status::OK)), Some(&"tcp"));
        assert_eq!(
            s.on_reply(1 << 32, &mut reply(&m, status::OK)),
            Some(&"shm")
        );
        assert!(matches!(s.on_put(0, 1, 0, 40, 2), Ok((_, &"tcp"))));
        assert!(matches!(s.on_put(1 << 32, 1, 0, 40, 2), Ok((_, &"shm"))));
    }

    #[test]
    fn a_pushpull_put_waits_for_its_message_and_bad_puts_are_refused() {
        let mut s: Slots<u8> = Slots::new(1000);
        let m = push(Op::PushPull, 5, 4, 1);
        s.on_push(0, &m);
        s.add(0, &m, 50, 1);
        s.on_reply(0, &mut reply(&m, status::OK));
        // Another worker cannot put into it; a wrong length or offset is refused.
        assert!(s.on_put(1, 50, 0, 16, slot_imm(2, true)).is_err());
        assert!(s.on_put(0, 50, 0, 15, slot_imm(2, true)).is_err());
        assert!(s.on_put(0, 50, 4, 16, slot_imm(2, true)).is_err());
        assert!(matches!(
            s.on_put(0, 50, 0, 16, slot_imm(2, true)),
            Ok((PutAction::Wait, _))
        ));
        let mut msg = push(Op::PushPull, 5, 4, 3);
        msg.flags = flags::SLOT;
        assert!(s.on_slot_msg(0, &msg).is_err(), "another request id");
        msg.req_id = 2;
        assert!(s.on_slot_msg(0, &msg).is_ok());
        assert!(s.on_slot_msg(0, &msg).is_err(), "the slot was consumed");
    }
}
