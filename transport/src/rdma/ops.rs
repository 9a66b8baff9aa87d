//! The verbs backend's operations: the interface's calls.

use std::ops::Range;
use std::os::fd::BorrowedFd;
use std::sync::Arc;

use rdma_sys as ffi;

use super::setup::HEAD;
use super::verbs::{Mr, LOCAL, REMOTE_WRITE};
use super::wire::{wr, Head, EAGER, MSG, PUT, REVOKE, RNDV};
use super::{Grant, Inbound, RdmaBackend, KIND_RDMA, SLOTS, SLOT_SHIFT};
use crate::backend::Place;
use crate::{
    Access, Backend, Completion, Mem, PeerId, Region, RemoteRegion, Sent, Storage, Token,
    TransportError,
};

impl Backend for RdmaBackend {
    fn name(&self) -> &'static str {
        "rdma"
    }

    fn id(&self) -> u64 {
        self.id
    }

    fn max_body(&self) -> usize {
        self.cfg.buffer - HEAD
    }

    fn register(&mut self, mem: Arc<dyn Storage>) -> Result<Region, TransportError> {
        let r = Region::new(self.id, mem, Place::Local);
        if !r.is_empty() {
            // (Empty memory is never read or written: nothing to register, and its address
            // may be no memory at all, which the device refuses.)
            self.mr_of(&r)?;
        }
        Ok(r)
    }

    /// New memory registered for sends and puts; what peers may write is granted range by
    /// range, whatever the access asked for.
    fn alloc(&mut self, len: usize, _access: Access) -> Result<Region, TransportError> {
        self.register(Mem::zeroed_or_refused(len)?)
    }

    unsafe fn grant(
        &mut self,
        peer: PeerId,
        r: &Region,
        range: Range<usize>,
    ) -> Result<RemoteRegion, TransportError> {
        r.check_owner(self.id)?;
        r.check_range(&range)?;
        self.peer(peer)?;
        if !r.mem.peer_may_write() {
            return Err(TransportError::Refused(
                "memory the caller takes back after a failure cannot be granted for RDMA writes"
                    .into(),
            ));
        }
        let mr = match range.is_empty() {
            // An empty grant is put into by an eager notice carrying no bytes: no key.
            true => None,
            false => Some(Mr::new(
                &self.pd,
                &r.mem,
                range.start,
                range.len(),
                LOCAL | REMOTE_WRITE,
            )?),
        };
        if let Some(mr) = &mr {
            self.count_dmabuf(r, mr);
        }
        // A slot with the peer, while there is one: a put that fills the grant is then one
        // WRITE_WITH_IMM naming it.
        let seq = self.next_grant;
        let p = self.peer(peer)?;
        let slot = match p.free_slots.pop() {
            Some(s) => s,
            None if p.next_slot <= SLOTS => {
                p.next_slot += 1;
                p.next_slot - 1
            }
            None => 0,
        };
        let id = seq | (slot as u64) << SLOT_SHIFT;
        if slot != 0 {
            p.slots.insert(slot, id);
        }
        self.next_grant += 1;
        let rr = RemoteRegion {
            kind: KIND_RDMA,
            key: mr.as_ref().map_or(0, |m| m.rkey),
            id,
            addr: mr.as_ref().map_or(0, |m| m.addr),
            len: range.len() as u64,
        };
        self.grants.insert(
            id,
            Grant {
                peer,
                slot,
                start: range.start,
                len: range.len(),
                _mr: mr,
                region: r.clone(),
                revoking: None,
            },
        );
        Ok(rr)
    }

    fn revoke(
        &mut self,
        peer: PeerId,
        grant: &RemoteRegion,
        token: Token,
    ) -> Result<(), TransportError> {
        match self.grants.get_mut(&grant.id) {
            Some(g) if g.peer == peer && g.revoking.is_none() => {
                g.revoking = Some(token);
                self.control(
                    peer.0,
                    Head {
                        kind: REVOKE,
                        id: grant.id,
                        ..Head::default()
                    },
                );
                Ok(())
            }
            Some(_) => Err(TransportError::Refused(format!(
                "{grant:?} is not {peer}'s, or is already being revoked"
            ))),
            None => {
                self.done.push_back((token, None));
                Ok(())
            }
        }
    }

    fn forget(&mut self, peer: PeerId, grant: &RemoteRegion) {
        // A grant being revoked stays until its revoke completes (its token with it).
        if self
            .grants
            .get(&grant.id)
            .is_some_and(|g| g.peer == peer && g.revoking.is_none())
        {
            self.drop_grant(grant.id);
        }
    }

    unsafe fn send(
        &mut self,
        peer: PeerId,
        body: &[u8],
        data: Option<(&Region, Range<usize>, Token)>,
    ) -> Result<Sent, TransportError> {
        crate::backend::check_body(body.len(), self.max_body())?;
        if let Some((r, range, _)) = &data {
            r.check_owner(self.id)?;
            r.check_range(range)?;
        }
        let ours = self.cfg.buffer;
        let p = self.peer(peer)?;
        // A message fits our send buffer and the peer's receive buffer.
        let fits = p.their_buffer.min(ours);
        if HEAD + body.len() > fits {
            return Err(TransportError::Refused(format!(
                "a body of {} bytes (the peer's buffers take {})",
                body.len(),
                fits - HEAD
            )));
        }
        if !p.unsent.is_empty()
            || !self.room(
                self.peers.get(&peer.0).ok_or(TransportError::Closed)?,
                2,
                true,
                false,
            )
        {
            self.peer(peer)?.starved = 2;
            return Ok(Sent::WouldBlock);
        }
        let mut head = Head {
            kind: MSG,
            word: body.len() as u32,
            ..Head::default()
        };
        let (chain_slot, token, done_now) = match data {
            None => (self.send_wr(peer.0, head, body, None), None, None),
            Some((r, range, t)) if HEAD + body.len() + range.len() <= fits => {
                // Small data is copied after the body: the caller's memory is free at once.
                head.flags = EAGER;
                head.len = range.len() as u64;
                (
                    self.send_wr(peer.0, head, body, Some((r, range))),
                    None,
                    Some(t),
                )
            }
            Some((r, range, t)) => {
                let mr = self.mr_of(r)?;
                let p = self.peer(peer)?;
                let id = p.next_lent;
                p.next_lent += 1;
                head.flags = RNDV;
                head.id = id;
                head.off = mr.addr + range.start as u64;
                head.len = range.len() as u64;
                head.key = mr.rkey;
                p.lent.insert(id, (t, r.clone()));
                (self.send_wr(peer.0, head, body, None), None, None)
            }
        };
        let Some((w, slot)) = chain_slot else {
            // No send buffer free: they come back as sends complete.
            if let Some(p) = self.peers.get_mut(&peer.0) {
                p.starved = 2;
                if head.flags & RNDV != 0 {
                    p.lent.remove(&head.id);
                }
            }
            return Ok(Sent::WouldBlock);
        };
        if let Err(e) = self.post(peer.0, &mut [(w, slot, None)], token, 1) {
            // Not sent: the data lent for it is not lent (its token is the caller's error).
            if let Some(p) = self.peers.get_mut(&peer.0) {
                p.lent.remove(&head.id);
            }
            return Err(e);
        }
        if let Some(t) = done_now {
            self.done.push_back((t, None));
        }
        Ok(Sent::Posted)
    }

    unsafe fn put(
        &mut self,
        peer: PeerId,
        src: &Region,
        range: Range<usize>,
        dst: &RemoteRegion,
        offset: usize,
        imm: u32,
        token: Token,
    ) -> Result<Sent, TransportError> {
        src.check_owner(self.id)?;
        crate::backend::check_put(src, &range, dst, Some(KIND_RDMA), offset, imm)?;
        let len = range.len();
        let step = self.lim.max_msg;
        let need = put_requests(len, step, self.cfg.send_depth)?;
        let p = self.peer(peer)?;
        if p.revoked.contains(&dst.id) {
            return Err(TransportError::Refused(format!("{dst:?} was revoked")));
        }
        if !p.unsent.is_empty()
            || !self.room(
                self.peers.get(&peer.0).ok_or(TransportError::Closed)?,
                need,
                true,
                false,
            )
        {
            self.peer(peer)?.starved = need;
            return Ok(Sent::WouldBlock);
        }
        // The notice: which grant, where, how much, and the caller's immediate.
        let mut head = Head {
            kind: PUT,
            word: imm,
            id: dst.id,
            off: offset as u64,
            len: len as u64,
            ..Head::default()
        };
        let slot = (dst.id >> SLOT_SHIFT) as u32 & SLOTS;
        if self.cfg.write_imm && slot != 0 && offset == 0 && len > 0 && len as u64 == dst.len {
            return self.put_write_imm(
                peer.0,
                src,
                range,
                dst,
                slot << crate::IMM_BITS | imm,
                token,
            );
        }
        // A notice with its data fits our send buffer and the peer's receive buffer.
        let fits = (self.peers.get(&peer.0)).map_or(0, |p| p.their_buffer.min(self.cfg.buffer));
        if len <= self.cfg.eager_put && HEAD + len <= fits {
            // Small: the data rides in the notice and the receiver copies it into the grant,
            // one message where a write and a notice would be two (fewer packets, one post).
            head.flags = EAGER;
            let Some((w, slot)) = self.send_wr(peer.0, head, &[], Some((src, range))) else {
                // No send buffer free: they come back as sends complete.
                self.peer(peer)?.starved = need;
                return Ok(Sent::WouldBlock);
            };
            // The data was copied: the source is the caller's again at once.
            self.post(peer.0, &mut [(w, slot, None)], None, 1)?;
            self.done.push_back((token, None));
            return Ok(Sent::Posted);
        }
        let mr = self.mr_of(src)?;
        let mut chain = Vec::with_capacity(need - 1);
        for at in (0..len).step_by(step) {
            let k = step.min(len - at);
            let sge = ffi::ibv_sge {
                addr: mr.addr + (range.start + at) as u64,
                length: k as u32,
                lkey: mr.lkey,
            };
            let mut w = wr(ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE, sge, 0);
            w.wr.wr.rdma.remote_addr = dst.addr.wrapping_add((offset + at) as u64);
            w.wr.wr.rdma.rkey = dst.key;
            chain.push((w, None, None));
        }
        let Some((w, slot)) = self.send_wr(peer.0, head, &[], None) else {
            self.peer(peer)?.starved = need;
            return Ok(Sent::WouldBlock);
        };
        chain.push((w, slot, None));
        // The source stays registered and alive until the notice completes.
        if let Some(p) = self.peers.get_mut(&peer.0) {
            p.holds
                .push_back((p.next_seq + chain.len() as u64 - 1, src.clone(), mr));
        }
        self.post(peer.0, &mut chain, Some(token), 1)?;
        Ok(Sent::Posted)
    }

    fn flush(&mut self) -> Result<(), TransportError> {
        self.post_waiting_reads();
        self.push_unsent();
        Ok(())
    }

    fn arm(&mut self) -> Result<bool, TransportError> {
        if !self.done.is_empty() || !self.lost.is_empty() {
            return Ok(false);
        }
        let depth = self.cfg.send_depth;
        if self.peers.values().any(|p| {
            (!p.paused && (!p.held.is_empty() || p.inbox.front().is_some_and(ready)))
                || (!p.unread.is_empty() && p.posted.len() < depth)
        }) {
            return Ok(false);
        }
        // Credits that came back by a plain WRITE (no completion) to a side that waits for
        // them: a send or put told to wait, control messages queued, a note owed.
        let mut fresh = false;
        for p in self.peers.values_mut() {
            if p.starved > 0 || p.note_owed.is_some() || !p.unsent.is_empty() {
                let word = super::wire::credit_word(p);
                if word > p.returned {
                    p.returned = word;
                    fresh = true;
                }
            }
        }
        // A send or put told to wait whose room came back while this side was busy (its own
        // progress took the completions or the count): nothing is left to wake a sleep, so it
        // tries again now.
        let sends = !self.free_sends.is_empty();
        let retry: Vec<u32> = self
            .peers
            .iter()
            .filter(|(_, p)| p.starved > 0 && sends && self.room(p, p.starved, true, false))
            .map(|(k, _)| *k)
            .collect();
        for id in &retry {
            if let Some(p) = self.peers.get_mut(id) {
                p.starved = 0;
            }
        }
        if fresh || !retry.is_empty() {
            return Ok(false);
        }
        // A peer this side could not wake may be waiting for this side's credits too, its own
        // count in flight to here by a plain WRITE: a short spin sees it land, where a sleep
        // would miss it.
        let owed = self
            .peers
            .values()
            .filter_map(|p| p.note_owed.map(|t| t.elapsed()))
            .max();
        if owed.is_some_and(|t| t < super::NOTE_SPIN) {
            return Ok(false);
        }
        // Past the spin, a sleep ends now and then to look again.
        if let Some(t) = owed {
            let (least, most) = super::NOTE_POLL;
            self.wake_after((t / 4).clamp(least, most))?;
        }
        self.cq.arm()?;
        // What completed before the arm raises no event: look once more.
        // SAFETY: plain C structs, all zeroes valid.
        let mut wc: [ffi::ibv_wc; 1] = unsafe { std::mem::zeroed() };
        if self.cq.poll(&mut wc)? > 0 {
            let [w] = wc;
            self.early.push(OwnedWc(w));
            return Ok(false);
        }
        self.armed = true;
        Ok(true)
    }

    fn fd(&self) -> BorrowedFd<'_> {
        RdmaBackend::fd(self)
    }

    fn progress(&mut self, on: &mut dyn FnMut(Completion<'_>)) -> Result<usize, TransportError> {
        let mut n = 0;
        self.calls = self.calls.wrapping_add(1);
        let due = self.calls % 16 == 0 && self.last_events.elapsed() >= super::EVENTS_EVERY;
        if std::mem::take(&mut self.armed) || due || !self.handshakes.is_empty() {
            self.last_events = std::time::Instant::now();
            self.poll_events(on, &mut n)?;
            if due {
                self.sweep_registrations();
            }
        }
        for w in self.early.take() {
            self.on_wc(&w.0, on, &mut n);
        }
        self.poll_cq(on, &mut n)?;
        self.reap_drained();
        self.resume_held(on, &mut n);
        self.deliver(on, &mut n);
        // A peer whose link ended is lost after what it sent before the end was delivered.
        for id in std::mem::take(&mut self.ended) {
            self.lose(PeerId(id), TransportError::Closed);
        }
        self.post_waiting_reads();
        self.push_unsent();
        n += crate::backend::deliver(&mut self.done, &mut self.lost, on);
        Ok(n)
    }

    fn close(&mut self, peer: PeerId) {
        self.lose(peer, TransportError::Closed);
    }

    fn pause(&mut self, peer: PeerId, paused: bool) {
        if let Some(p) = self.peers.get_mut(&peer.0) {
            p.paused = paused;
        }
    }

    fn trust(&mut self, peer: PeerId) -> Result<(), TransportError> {
        let p = self.peers.get_mut(&peer.0).ok_or(TransportError::Closed)?;
        if !p.remote {
            p.qp.allow_remote()?;
            p.remote = true;
        }
        p.max_data = self.cfg.max_message;
        Ok(())
    }
}

fn ready(i: &Inbound) -> bool {
    !matches!(i, Inbound::Msg { reads, .. } if *reads > 0)
}

/// A work completion kept aside (found by the look after arming).
pub(super) struct OwnedWc(pub(super) ffi::ibv_wc);

/// Work completions to look at again: found by the look after arming, or of peers whose
/// handshake has not ended, with how many receives each such peer has parked since they were
/// last taken.
#[derive(Default)]
pub(super) struct Early {
    wcs: Vec<OwnedWc>,
    recvs: rustc_hash::FxHashMap<u32, usize>,
}

impl Early {
    pub(super) fn push(&mut self, wc: OwnedWc) {
        self.wcs.push(wc);
    }

    /// Parks a receive of starting peer `peer`: how many it has parked now.
    pub(super) fn park_recv(&mut self, peer: u32, wc: OwnedWc) -> usize {
        self.wcs.push(wc);
        let n = self.recvs.entry(peer).or_default();
        *n += 1;
        *n
    }

    /// Everything parked, to be looked at again (and parked again where still early: the
    /// counts start again with them).
    pub(super) fn take(&mut self) -> Vec<OwnedWc> {
        self.recvs.clear();
        std::mem::take(&mut self.wcs)
    }
}

/// The work requests a put of `len` bytes takes, in writes of `step` bytes at most: the
/// writes, the notice, and one to spare. A put that needs more than the send queue holds
/// (`depth`) could never be posted, and waiting for room would never end: it is refused.
pub(super) fn put_requests(len: usize, step: usize, depth: usize) -> Result<usize, TransportError> {
    let need = len.div_ceil(step.max(1)) + 2;
    if need > depth {
        return Err(TransportError::Oversize {
            len: len as u64,
            max: (depth.saturating_sub(2) as u64).saturating_mul(step as u64),
        });
    }
    Ok(need)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_put_longer_than_the_send_queue_can_post_is_refused() {
        let mib = 1 << 20;
        assert_eq!(super::put_requests(0, 8 * mib, 16).unwrap(), 2);
        assert_eq!(super::put_requests(14 * 8 * mib, 8 * mib, 16).unwrap(), 16);
        let e = super::put_requests(14 * 8 * mib + 1, 8 * mib, 16).unwrap_err();
        assert!(
            matches!(e, super::TransportError::Oversize { max, .. } if max == 14 * 8 * mib as u64),
            "{e}"
        );
    }
}
