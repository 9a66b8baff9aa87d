//! The verbs backend's operations: the interface's calls, and posting sends, puts and the
//! credit count (with the credits and send-queue room they need).

use std::ops::Range;
use std::os::fd::BorrowedFd;
use std::sync::Arc;

use rdma_sys as ffi;

use super::setup::HEAD;
use super::verbs::{Mr, LOCAL, REMOTE_WRITE};
use super::wire::{
    credit_word, wr, wr_inline, wr_inline_with, Head, Wr, EAGER, INDEX, MSG, PUT, RESERVE, REVOKE,
    RNDV, WR_SEND,
};
use super::{Grant, Inbound, Peer, Posted, RdmaBackend, KIND_RDMA, SLOTS, SLOT_SHIFT};
use crate::backend::Place;
use crate::{
    Access, Backend, Completion, Mem, PeerId, Region, RemoteRegion, Sent, Storage, Token,
    TransportError,
};

impl RdmaBackend {
    /// Whether `n` more work requests and (if `credit`) one of the peer's buffers can be used
    /// for a message (`control`: from the reserve too).
    fn room(&self, p: &Peer, n: usize, credit: bool, control: bool) -> bool {
        let p_returned = p.returned.max(credit_word(p));
        let sq = p.posted.len() + n <= self.cfg.send_depth;
        let avail = (p.their_receives as u64 + p_returned).saturating_sub(p.sent);
        let need = if control { 1 } else { RESERVE + 1 };
        sq && (!credit || avail >= need)
    }

    /// Posts `chain` on `peer`'s queue pair; the last request is signalled (with `token`) if
    /// asked or when due, and every request is remembered in order.
    pub(super) fn post(
        &mut self,
        peer: u32,
        chain: &mut [(Wr, Option<u32>, Option<u64>)],
        token: Option<Token>,
        sends: u64,
    ) -> Result<(), TransportError> {
        let free_low = self.free_sends.len() < 8;
        let Some(p) = self.peers.get_mut(&peer) else {
            return Err(TransportError::PeerLost(format!(
                "peer {peer} is not connected"
            )));
        };
        let n = chain.len();
        for (i, (w, _, read)) in chain.iter_mut().enumerate() {
            let seq = p.next_seq + i as u64;
            w.wr.wr_id = ((peer as u64) << 32) | WR_SEND | (seq & INDEX);
            let last = i + 1 == n;
            let due = token.is_some()
                || seq % 16 == 0
                || free_low
                || p.posted.len() + n * 2 >= self.cfg.send_depth;
            if read.is_some() || (last && due) {
                w.wr.send_flags |= ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
            }
        }
        // Linked back to front, each to the next, now that the chain stays where it is.
        let mut next: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        for (w, _, _) in chain.iter_mut().rev() {
            w.link(next);
            next = &mut w.wr;
        }
        // SAFETY: every request names a range of a registration that lives until it completes:
        // send buffers (freed on completion), the caller's regions (held by `Posted` through
        // the token's contract and by the region cache), and read destinations (held by the
        // inbox); the chain's memory is alive for the call.
        unsafe { p.qp.post_send(&mut chain[0].0.wr) }?;
        p.sent += sends;
        for (i, (_, slot, read)) in chain.iter().enumerate() {
            p.posted.push_back(Posted {
                seq: p.next_seq + i as u64,
                slot: *slot,
                token: if i + 1 == n { token } else { None },
                read: *read,
            });
        }
        p.next_seq += n as u64;
        Ok(())
    }

    /// A SEND of `head` (+ `body` and `data` copied after it): inline when it fits, else from
    /// a send buffer. `None`: no send buffer is free.
    fn send_wr(
        &mut self,
        peer: u32,
        mut head: Head,
        body: &[u8],
        data: Option<(&Region, Range<usize>)>,
    ) -> Option<(Wr, Option<u32>)> {
        let p = self.peers.get_mut(&peer)?;
        head.credits = p.reposted;
        p.told = p.reposted;
        let dlen = data.as_ref().map_or(0, |(_, r)| r.len());
        let len = HEAD + body.len() + dlen;
        if len <= p.max_inline {
            let w = wr_inline_with(ffi::ibv_wr_opcode::IBV_WR_SEND, |b| {
                b[..HEAD].copy_from_slice(&head.encode());
                b[HEAD..HEAD + body.len()].copy_from_slice(body);
                if let Some((r, range)) = data {
                    // SAFETY: the range was checked against the region; the caller does not
                    // write it during the call; `b` is a distinct buffer.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            r.mem.ptr().add(range.start),
                            b.as_mut_ptr().add(HEAD + body.len()),
                            dlen,
                        )
                    };
                }
                len
            });
            return Some((w, None));
        }
        let slot = self.free_sends.pop()?;
        let at = slot as usize * self.cfg.buffer;
        self.send_mem.write(at, &head.encode());
        self.send_mem.write(at + HEAD, body);
        if let Some((r, range)) = data {
            // SAFETY: the range was checked against the region, and the send buffer holds
            // `len` bytes (the caller keeps `len` within a buffer); the caller does not write
            // the range during the call; distinct allocations do not overlap.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    r.mem.ptr().add(range.start),
                    self.send_mem.ptr().add(at + HEAD + body.len()),
                    dlen,
                )
            };
        }
        let sge = ffi::ibv_sge {
            addr: self.send_mr.addr + at as u64,
            length: len as u32,
            lkey: self.send_mr.lkey,
        };
        Some((wr(ffi::ibv_wr_opcode::IBV_WR_SEND, sge, 0), Some(slot)))
    }

    /// Sends a header-only control message now, or queues it until there is a credit.
    pub(super) fn control(&mut self, peer: u32, head: Head) {
        let Some(p) = self.peers.get(&peer) else {
            return;
        };
        if !p.unsent.is_empty() || !self.room(p, 1, true, true) {
            if let Some(p) = self.peers.get_mut(&peer) {
                p.unsent.push_back(head.encode());
            }
            return;
        }
        if let Some((w, slot)) = self.send_wr(peer, head, &[], None) {
            if let Err(e) = self.post(peer, &mut [(w, slot, None)], None, 1) {
                self.lose(PeerId(peer), e);
            }
        } else if let Some(p) = self.peers.get_mut(&peer) {
            p.unsent.push_back(head.encode());
        }
    }

    /// Control messages that waited for a credit; the credit count when enough are owed.
    fn push_unsent(&mut self) {
        // Only peers with something to do (most turns: none, and nothing is allocated).
        let owed = (self.cfg.receives as u64 / 4).max(1);
        let ids: Vec<u32> = self
            .peers
            .iter()
            .filter(|(_, p)| !p.unsent.is_empty() || p.reposted - p.told >= owed)
            .map(|(k, _)| *k)
            .collect();
        for id in ids {
            while let Some(p) = self.peers.get_mut(&id) {
                let Some(b) = p.unsent.front().copied() else {
                    break;
                };
                p.returned = p.returned.max(credit_word(p));
                let ok = (p.their_receives as u64 + p.returned).saturating_sub(p.sent) >= 1
                    && p.posted.len() < self.cfg.send_depth;
                if !ok {
                    break;
                }
                let Some(h) = Head::decode(&b) else { break };
                match self.send_wr(id, h, &[], None) {
                    Some((w, slot)) => {
                        if let Some(p) = self.peers.get_mut(&id) {
                            p.unsent.pop_front();
                        }
                        if let Err(e) = self.post(id, &mut [(w, slot, None)], None, 1) {
                            self.lose(PeerId(id), e);
                        }
                    }
                    None => break,
                }
            }
            self.tell_credits(id);
        }
    }

    /// Writes the count of reposted buffers into the peer's credit word when a quarter of
    /// them is owed (no buffer of the peer is used: a plain RDMA WRITE).
    fn tell_credits(&mut self, id: u32) {
        let Some(p) = self.peers.get_mut(&id) else {
            return;
        };
        if p.reposted - p.told < (self.cfg.receives as u64 / 4).max(1)
            || p.posted.len() >= self.cfg.send_depth
        {
            return;
        }
        self.write_credits(id, false);
    }

    /// An RDMA WRITE of the count of buffers posted again into the peer's credit word;
    /// `signaled`: its completion says that everything posted before it was acknowledged.
    fn write_credits(&mut self, id: u32, signaled: bool) {
        let Some(p) = self.peers.get_mut(&id) else {
            return;
        };
        p.told = p.reposted;
        let mut w = wr_inline(
            ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE,
            &p.reposted.to_le_bytes(),
        );
        w.wr.wr.rdma.remote_addr = p.their_credit.0;
        w.wr.wr.rdma.rkey = p.their_credit.1;
        if signaled {
            w.wr.send_flags |= ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        }
        let r = self.post(id, &mut [(w, None, None)], None, 0);
        if let Err(e) = r {
            self.lose(PeerId(id), e);
        }
    }

    /// A put that fills the grant `dst` (whose slot is in `imm`'s high bits): RDMA WRITEs of
    /// all but its last piece, then a WRITE_WITH_IMM of that piece, one post. The receiver
    /// takes a receive (a credit) for the last, which names the grant.
    fn put_write_imm(
        &mut self,
        peer: u32,
        src: &Region,
        range: Range<usize>,
        dst: &RemoteRegion,
        imm: u32,
        token: Token,
    ) -> Result<Sent, TransportError> {
        let len = range.len();
        let step = self.lim.max_msg;
        let max_inline = self.peers.get(&peer).map_or(0, |p| p.max_inline);
        let mut chain = Vec::with_capacity(len.div_ceil(step).max(1));
        let mut mr = None;
        let mut at = 0;
        loop {
            let k = step.min(len - at);
            let last = at + k == len;
            let op = if last {
                ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM
            } else {
                ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE
            };
            let mut w = if len <= max_inline {
                // SAFETY: the range was checked against the region, which the caller does not
                // write during the call; the post copies it.
                let bytes =
                    unsafe { std::slice::from_raw_parts(src.mem.ptr().add(range.start), len) };
                wr_inline(op, bytes)
            } else {
                let m = match &mr {
                    Some(m) => m,
                    None => mr.insert(self.mr_of(src)?),
                };
                let sge = ffi::ibv_sge {
                    addr: m.addr + (range.start + at) as u64,
                    length: k as u32,
                    lkey: m.lkey,
                };
                wr(op, sge, 0)
            };
            w.wr.wr.rdma.remote_addr = dst.addr + at as u64;
            w.wr.wr.rdma.rkey = dst.key;
            if last {
                w.wr.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
            }
            chain.push((w, None, None));
            at += k;
            if last {
                break;
            }
        }
        let Some(m) = mr else {
            // Inline: the post copies the bytes, so the source is the caller's again at once
            // (and the request need not be signalled: no completion to wait for).
            self.post(peer, &mut chain, None, 1)?;
            self.done.push_back((token, None));
            return Ok(Sent::Posted);
        };
        // The source stays registered and alive until the last write completes.
        if let Some(p) = self.peers.get_mut(&peer) {
            p.holds
                .push_back((p.next_seq + chain.len() as u64 - 1, src.clone(), m));
        }
        self.post(peer, &mut chain, Some(token), 1)?;
        Ok(Sent::Posted)
    }

    /// Waits, at most `limit`, until every peer has acknowledged what was posted to it: the
    /// last post to each is followed by a signaled credit write, whose completion (RC order)
    /// covers everything before it. For a backend being dropped.
    pub(super) fn linger(&mut self, limit: std::time::Duration) {
        self.push_unsent();
        let busy: Vec<u32> = self
            .peers
            .iter()
            .filter(|(_, p)| !p.posted.is_empty() && p.posted.len() < self.cfg.send_depth)
            .map(|(id, _)| *id)
            .collect();
        for id in busy {
            self.write_credits(id, true);
        }
        let deadline = std::time::Instant::now() + limit;
        while self.peers.values().any(|p| !p.posted.is_empty())
            && std::time::Instant::now() < deadline
        {
            let mut n = 0;
            if self.poll_cq(&mut |_| {}, &mut n).is_err() {
                return;
            }
            std::thread::yield_now();
        }
    }
}

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
        self.mr_of(&r)?;
        Ok(r)
    }

    /// New memory registered for sends and puts; what peers may write is granted range by
    /// range, whatever the access asked for.
    fn alloc(&mut self, len: usize, _access: Access) -> Result<Region, TransportError> {
        self.register(Mem::zeroed(len))
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
        let mr = Mr::new(
            &self.pd,
            &r.mem,
            range.start,
            range.len(),
            LOCAL | REMOTE_WRITE,
        )?;
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
            key: mr.rkey,
            id,
            addr: mr.addr,
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
        if self.grants.get(&grant.id).is_some_and(|g| g.peer == peer) {
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
            if head.flags & RNDV != 0 {
                if let Some(p) = self.peers.get_mut(&peer.0) {
                    p.lent.remove(&head.id);
                }
            }
            return Ok(Sent::WouldBlock);
        };
        self.post(peer.0, &mut [(w, slot, None)], token, 1)?;
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
        crate::backend::check_imm(imm)?;
        src.check_owner(self.id)?;
        src.check_range(&range)?;
        let len = range.len();
        if dst.kind != KIND_RDMA || offset.checked_add(len).is_none_or(|e| e as u64 > dst.len) {
            return Err(TransportError::Refused(format!(
                "a put of {len} bytes at {offset} into {dst:?} (of kind {})",
                dst.kind
            )));
        }
        let step = self.lim.max_msg;
        let writes = len.div_ceil(step);
        let p = self.peer(peer)?;
        if p.revoked.contains(&dst.id) {
            return Err(TransportError::Refused(format!("{dst:?} was revoked")));
        }
        if !p.unsent.is_empty()
            || !self.room(
                self.peers.get(&peer.0).ok_or(TransportError::Closed)?,
                writes + 2,
                true,
                false,
            )
        {
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
        if self.cfg.write_imm && slot != 0 && offset == 0 && len as u64 == dst.len {
            return self.put_write_imm(
                peer.0,
                src,
                range,
                dst,
                slot << crate::IMM_BITS | imm,
                token,
            );
        }
        if len <= self.cfg.eager_put && HEAD + len <= self.cfg.buffer {
            // Small: the data rides in the notice and the receiver copies it into the grant,
            // one message where a write and a notice would be two (fewer packets, one post).
            head.flags = EAGER;
            let Some((w, slot)) = self.send_wr(peer.0, head, &[], Some((src, range))) else {
                return Ok(Sent::WouldBlock);
            };
            // The data was copied: the source is the caller's again at once.
            self.post(peer.0, &mut [(w, slot, None)], None, 1)?;
            self.done.push_back((token, None));
            return Ok(Sent::Posted);
        }
        let mr = self.mr_of(src)?;
        let mut chain = Vec::with_capacity(writes + 1);
        for at in (0..len).step_by(step) {
            let k = step.min(len - at);
            let sge = ffi::ibv_sge {
                addr: mr.addr + (range.start + at) as u64,
                length: k as u32,
                lkey: mr.lkey,
            };
            let mut w = wr(ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE, sge, 0);
            w.wr.wr.rdma.remote_addr = dst.addr + (offset + at) as u64;
            w.wr.wr.rdma.rkey = dst.key;
            chain.push((w, None, None));
        }
        let Some((w, slot)) = self.send_wr(peer.0, head, &[], None) else {
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
        self.push_unsent();
        Ok(())
    }

    fn arm(&mut self) -> Result<bool, TransportError> {
        if !self.done.is_empty() || !self.lost.is_empty() {
            return Ok(false);
        }
        if self
            .peers
            .values()
            .any(|p| !p.paused && (!p.held.is_empty() || p.inbox.front().is_some_and(ready)))
        {
            return Ok(false);
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
        }
        for w in std::mem::take(&mut self.early) {
            self.on_wc(&w.0, on, &mut n);
        }
        self.poll_cq(on, &mut n)?;
        self.resume_held(on, &mut n);
        self.deliver(on, &mut n);
        // A peer whose link ended is lost after what it sent before the end was delivered.
        for id in std::mem::take(&mut self.ended) {
            self.lose(PeerId(id), TransportError::Closed);
        }
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
}

fn ready(i: &Inbound) -> bool {
    !matches!(i, Inbound::Msg { reads, .. } if *reads > 0)
}

/// A work completion kept aside (found by the look after arming).
pub(super) struct OwnedWc(pub(super) ffi::ibv_wc);
