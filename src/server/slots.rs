//! A server's receive slots: the protocol of pushes put straight into place, with no I/O.
//!
//! The slots are a pool of buffers shared by all workers. The first push of a key slice by a
//! worker arrives as a message; the reply to it gives the worker a credit for a free buffer of
//! the slice's size (made, if none is free and the budget has room), granted to that worker:
//! one credit, good for one put. The worker's next push of the slice is a put into that
//! buffer, whose immediate is the request id; the server sums it where it lies on arrival, so
//! the buffer goes back to the pool at once, and the reply to that push carries a new credit,
//! for whichever buffer of the size is free then (each worker is granted a buffer once, the
//! first time it is credited with it). A put without a credit, of the wrong length, or into a
//! buffer credited to another worker breaks the protocol and closes the link.
//!
//! Memory is bounded: the buffers together stay within the budget, however many workers push.
//! A buffer is reserved only from the reply that credits it until its put arrives, so workers
//! taking turns share buffers; while every buffer is credited, a push without a credit goes as
//! a message (the link's receive buffer), as the first one did. Buffers belong to one medium
//! (`Domain`: memory registered with one backend) and are shared within it.
//!
//! `S` is a buffer's memory and `G` a grant of it, as the loop makes them; this module only
//! keeps them.

use rustc_hash::FxHashMap;

use crate::protocol::{flags, status, Msg, Op, IMM_FOLLOWS};
use crate::server::state::PeerId;

/// The medium a buffer's memory is registered with; buffers are shared within one.
pub(crate) type Domain = u8;

/// The key slice a credit is for: the header of a push of it.
#[derive(Clone)]
struct Slice {
    tmpl: Msg,
    bytes: usize,
}

/// The worker holding a buffer's credit.
struct Hold {
    peer: PeerId,
    slice: Slice,
    /// Its put arrived, and a pushpull's message (this request id) is still to come.
    filled: Option<u64>,
}

struct Buf<S, G> {
    mem: S,
    bytes: usize,
    domain: Domain,
    /// Its grant to each worker it was ever credited to: grant number, grant.
    grants: FxHashMap<PeerId, (u64, G)>,
    hold: Option<Hold>,
}

/// What a put into a slot means.
pub(crate) enum PutAction {
    /// A push: handle this request, its data in the slot.
    Push(Msg),
    /// A pushpull's data: its message follows.
    Wait,
}

/// Whether a reply carries a credit, and what the loop must do for it.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Credit<S, G> {
    /// No credit.
    None,
    /// A buffer this worker was granted before: the credit is this grant.
    Granted(G),
    /// A free buffer (reserved now) not yet granted to this worker: grant it
    /// ([`Slots::granted`]) or let it go ([`Slots::not_granted`]).
    Grant(usize, S),
    /// The budget has room (counted from now) for a new buffer of this many bytes: make it
    /// ([`Slots::made`]) or give the bytes back ([`Slots::not_made`]).
    Make(usize),
}

/// What a lost worker leaves: memory out of the pool, and grants to revoke.
pub(crate) struct Dropped<S, G> {
    pub(crate) mems: Vec<S>,
    pub(crate) grants: Vec<(PeerId, G)>,
}

/// The receive slots of one server.
pub(crate) struct Slots<S, G> {
    budget: usize,
    used: usize,
    bufs: Vec<Option<Buf<S, G>>>,
    /// Free buffers by medium and size.
    free: FxHashMap<(Domain, usize), Vec<usize>>,
    /// The buffer whose credit a worker holds, by (peer, key, slice start).
    held: FxHashMap<(PeerId, u64, u64), usize>,
    /// By (peer, grant number).
    by_grant: FxHashMap<(PeerId, u64), usize>,
    /// Pushes whose reply may carry a credit: (peer, request id) to their slice.
    pending: FxHashMap<(PeerId, u64), Slice>,
    /// The credit a [`Credit::Make`] is for.
    making: Option<(PeerId, Slice)>,
}

impl<S: Clone, G: Clone> Slots<S, G> {
    /// Slots of at most `budget` bytes in all.
    pub(crate) fn new(budget: usize) -> Slots<S, G> {
        Slots {
            budget,
            used: 0,
            bufs: Vec::new(),
            free: FxHashMap::default(),
            held: FxHashMap::default(),
            by_grant: FxHashMap::default(),
            pending: FxHashMap::default(),
            making: None,
        }
    }

    /// Bytes held in buffers.
    #[cfg(test)]
    pub(crate) fn used(&self) -> usize {
        self.used
    }

    /// A push message `m` arrived from `peer`: its reply may carry a credit for its slice.
    pub(crate) fn on_push(&mut self, peer: PeerId, m: &Msg) {
        if !matches!(m.op, Op::Push | Op::PushPull) {
            return;
        }
        let Some(bytes) = m.data_bytes().and_then(|b| usize::try_from(b).ok()) else {
            return;
        };
        let mut tmpl = *m;
        tmpl.op = Op::Push;
        // A packed push's slot holds its packed form: the pushes put there are packed alike.
        tmpl.flags &= flags::PACKED;
        self.pending.insert((peer, m.req_id), Slice { tmpl, bytes });
    }

    /// A reply goes to `peer` over `domain`: whether it carries a credit for the next push of
    /// its request's slice (the worker does not hold one, and a buffer is free or can be made).
    pub(crate) fn credit(&mut self, peer: PeerId, domain: Domain, reply: &Msg) -> Credit<S, G> {
        let Some(slice) = self.pending.remove(&(peer, reply.req_id)) else {
            return Credit::None;
        };
        let (key, start) = (slice.tmpl.key, slice.tmpl.start);
        if reply.status != status::OK
            || slice.bytes == 0
            || self.held.contains_key(&(peer, key, start))
        {
            return Credit::None;
        }
        let bytes = slice.bytes;
        if let Some(id) = self.free.get_mut(&(domain, bytes)).and_then(Vec::pop) {
            self.hold(id, peer, slice);
            let Some(b) = self.bufs[id].as_ref() else {
                return Credit::None;
            };
            return match b.grants.get(&peer) {
                Some((_, g)) => Credit::Granted(g.clone()),
                None => Credit::Grant(id, b.mem.clone()),
            };
        }
        if self.used.checked_add(bytes).is_none_or(|u| u > self.budget) {
            return Credit::None;
        }
        self.used += bytes;
        self.making = Some((peer, slice));
        Credit::Make(bytes)
    }

    /// The buffer [`Credit::Make`] asked for, `mem` of `bytes` over `domain`: it is reserved for
    /// that credit, to be granted ([`Slots::granted`]). Returns its number.
    pub(crate) fn made(&mut self, mem: S, domain: Domain, bytes: usize) -> usize {
        let b = Buf {
            mem,
            bytes,
            domain,
            grants: FxHashMap::default(),
            hold: None,
        };
        let id = match self.bufs.iter().position(Option::is_none) {
            Some(i) => {
                self.bufs[i] = Some(b);
                i
            }
            None => {
                self.bufs.push(Some(b));
                self.bufs.len() - 1
            }
        };
        match self.making.take() {
            Some((peer, slice)) => self.hold(id, peer, slice),
            None => self.release(id),
        }
        id
    }

    /// [`Credit::Make`] was answered, but the buffer could not be made: its bytes are free.
    pub(crate) fn not_made(&mut self, bytes: usize) {
        self.used = self.used.saturating_sub(bytes);
        self.making = None;
    }

    /// Buffer `id` is granted to `peer` as grant number `grant`.
    pub(crate) fn granted(&mut self, peer: PeerId, id: usize, grant: u64, g: G) {
        if let Some(b) = self.bufs.get_mut(id).and_then(Option::as_mut) {
            b.grants.insert(peer, (grant, g));
            self.by_grant.insert((peer, grant), id);
        }
    }

    /// Buffer `id` could not be granted: it is free again, and the reply carries no credit.
    pub(crate) fn not_granted(&mut self, id: usize) {
        self.release(id);
    }

    fn hold(&mut self, id: usize, peer: PeerId, slice: Slice) {
        if let Some(b) = self.bufs.get_mut(id).and_then(Option::as_mut) {
            self.held
                .insert((peer, slice.tmpl.key, slice.tmpl.start), id);
            b.hold = Some(Hold {
                peer,
                slice,
                filled: None,
            });
        }
    }

    /// Buffer `id` is consumed (or was never credited): back to the pool.
    fn release(&mut self, id: usize) {
        self.consume(id);
        self.give_back(id);
    }

    /// Buffer `id`'s credit is used up: no worker holds it, and it is not in the pool until
    /// [`Slots::give_back`] (its data is still being read).
    fn consume(&mut self, id: usize) {
        let Some(b) = self.bufs.get_mut(id).and_then(Option::as_mut) else {
            return;
        };
        if let Some(h) = b.hold.take() {
            self.held
                .remove(&(h.peer, h.slice.tmpl.key, h.slice.tmpl.start));
        }
    }

    /// A consumed buffer's data was read (summed, copied, or kept by the state machine until
    /// its round completed): back to the pool.
    pub(crate) fn give_back(&mut self, id: usize) {
        if let Some(b) = self.bufs.get(id).and_then(Option::as_ref) {
            if b.hold.is_none() {
                let free = self.free.entry((b.domain, b.bytes)).or_default();
                if !free.contains(&id) {
                    free.push(id);
                }
            }
        }
    }

    /// Buffer `id`'s memory, if it exists.
    pub(crate) fn mem_of(&self, id: usize) -> Option<&S> {
        self.mem(id)
    }

    fn mem(&self, id: usize) -> Option<&S> {
        self.bufs.get(id)?.as_ref().map(|b| &b.mem)
    }

    /// `peer` put `len` bytes at `offset` into the buffer granted to it as `grant`, with `imm`.
    /// A push's buffer (its number comes back) is out of the pool until the caller gives it
    /// back ([`Slots::give_back`]), once its data was read.
    pub(crate) fn on_put(
        &mut self,
        peer: PeerId,
        grant: u64,
        offset: usize,
        len: usize,
        imm: u32,
    ) -> Result<(PutAction, usize, &S), String> {
        let Some(&id) = self.by_grant.get(&(peer, grant)) else {
            return Err(format!(
                "a put into grant {grant}, which is no slot granted to this worker"
            ));
        };
        let Some(b) = self.bufs.get_mut(id).and_then(Option::as_mut) else {
            return Err(format!("a put into slot {grant}, which is gone"));
        };
        let Some(h) = b
            .hold
            .as_mut()
            .filter(|h| h.peer == peer && h.filled.is_none())
        else {
            return Err(format!("a put into slot {grant} without its credit"));
        };
        if offset != 0 || len != b.bytes {
            return Err(format!(
                "a put of {len} bytes at {offset} into a slot of {}",
                b.bytes
            ));
        }
        let req_id = (imm & (IMM_FOLLOWS - 1)) as u64;
        let push = if imm & IMM_FOLLOWS != 0 {
            h.filled = Some(req_id);
            None
        } else {
            let mut m = h.slice.tmpl;
            m.req_id = req_id;
            Some((m, h.slice.clone()))
        };
        let action = match push {
            None => PutAction::Wait,
            Some((m, slice)) => {
                self.pending.insert((peer, req_id), slice);
                self.consume(id);
                PutAction::Push(m)
            }
        };
        let mem = self.mem(id).ok_or("a slot that is gone")?;
        Ok((action, id, mem))
    }

    /// A pushpull message with [`crate::protocol::flags::SLOT`]: its data, put before it, is in
    /// this buffer (number and memory), out of the pool until given back (as for
    /// [`Slots::on_put`]).
    pub(crate) fn on_slot_msg(&mut self, peer: PeerId, m: &Msg) -> Result<(usize, &S), String> {
        let Some(&id) = self.held.get(&(peer, m.key, m.start)) else {
            return Err(format!("key {} has no slot for this worker", m.key));
        };
        let Some(h) = self.bufs[id].as_ref().and_then(|b| b.hold.as_ref()) else {
            return Err(format!("key {} has no slot for this worker", m.key));
        };
        if h.filled != Some(m.req_id) || m.op != Op::PushPull {
            return Err(format!(
                "a {:?} message for slot {id}, whose put did not come before it",
                m.op
            ));
        }
        let t = &h.slice.tmpl;
        let packed = |m: &Msg| (m.flags & flags::PACKED, m.aux);
        if m.total != t.total || m.len != t.len || m.dtype != t.dtype || packed(m) != packed(t) {
            return Err(format!("a message for slot {id} names another slice"));
        }
        self.pending.insert((peer, m.req_id), h.slice.clone());
        self.consume(id);
        self.mem(id)
            .map(|mem| (id, mem))
            .ok_or_else(|| "a slot that is gone".into())
    }

    /// `peer` is gone: the buffers it held a credit for leave the pool (their memory, and every
    /// grant of them, for the loop to fence), and its grants of the others are to be revoked.
    pub(crate) fn drop_peer(&mut self, peer: PeerId) -> Dropped<S, G> {
        self.pending.retain(|(p, _), _| *p != peer);
        let mut out = Dropped {
            mems: Vec::new(),
            grants: Vec::new(),
        };
        for slot in self.bufs.iter_mut() {
            let Some(b) = slot else {
                continue;
            };
            if b.hold.as_ref().is_some_and(|h| h.peer == peer) {
                let Some(b) = slot.take() else {
                    continue;
                };
                self.used = self.used.saturating_sub(b.bytes);
                for (p, (grant, g)) in b.grants {
                    self.by_grant.remove(&(p, grant));
                    out.grants.push((p, g));
                }
                out.mems.push(b.mem);
            } else if let Some((grant, g)) = b.grants.remove(&peer) {
                self.by_grant.remove(&(peer, grant));
                out.grants.push((peer, g));
            }
        }
        self.held.retain(|(p, _, _), _| *p != peer);
        out
    }
}

#[cfg(test)]
#[path = "slots_tests.rs"]
mod tests;
