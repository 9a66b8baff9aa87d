//! Posting for the verbs backend: sends, puts (WRITE_WITH_IMM) and the credit count, with
//! the credits and send-queue room they need, and the linger of a backend being dropped.

use std::ops::Range;

use rdma_sys as ffi;

use super::setup::HEAD;
use super::wire::{credit_word, wr, wr_inline, wr_inline_with, Head, Wr, INDEX, RESERVE, WR_SEND};
use super::{Peer, Posted, RdmaBackend};
use crate::{PeerId, Region, RemoteRegion, Sent, Storage, Token, TransportError};

impl RdmaBackend {
    /// Whether `n` more work requests and (if `credit`) one of the peer's buffers can be used
    /// for a message (`control`: from the reserve too).
    pub(super) fn room(&self, p: &Peer, n: usize, credit: bool, control: bool) -> bool {
        let p_returned = p.returned.max(credit_word(p));
        let sq = p.posted.len() + n <= self.cfg.send_depth;
        let avail = (p.their_receives as u64)
            .saturating_add(p_returned)
            .saturating_sub(p.sent);
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
            // The send buffers the chain took go back.
            self.free_sends
                .extend(chain.iter().filter_map(|(_, slot, _)| *slot));
            return Err(TransportError::PeerLost(format!(
                "peer {peer} is not connected"
            )));
        };
        let n = chain.len();
        if p.posted.len() + n > self.cfg.send_depth {
            // The queue was sized for `send_depth` requests: the device would refuse the
            // post. Every caller checks room first; this one did not.
            self.free_sends
                .extend(chain.iter().filter_map(|(_, slot, _)| *slot));
            return Err(TransportError::Refused(format!(
                "{n} work requests posted with {} of {} in flight",
                p.posted.len(),
                self.cfg.send_depth
            )));
        }
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
        if let Err((e, bad)) = unsafe { p.qp.post_send(&mut chain[0].0.wr) } {
            // The requests before `bad` were taken; the rest were not, and their send buffers
            // go back.
            let taken = chain
                .iter()
                .position(|(w, _, _)| std::ptr::eq(bad, &w.wr))
                .unwrap_or(n);
            self.free_sends
                .extend(chain[taken..].iter().filter_map(|(_, slot, _)| *slot));
            if taken == 0 {
                return Err(e);
            }
            // A part of the chain is on the wire and the rest never will be: what the peer
            // sees no longer matches the sequence kept here, so the peer is lost (the taken
            // requests are recorded first, so that their buffers are accounted for there).
            for (i, (_, slot, read)) in chain[..taken].iter().enumerate() {
                p.posted.push_back(Posted {
                    seq: p.next_seq + i as u64,
                    slot: *slot,
                    token: None,
                    read: *read,
                });
            }
            p.next_seq += taken as u64;
            let why = format!("a chain of work requests posted in part: {e}");
            self.lose(PeerId(peer), TransportError::Rdma(why.clone()));
            return Err(TransportError::PeerLost(why));
        }
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
    pub(super) fn send_wr(
        &mut self,
        peer: u32,
        mut head: Head,
        body: &[u8],
        data: Option<(&Region, Range<usize>)>,
    ) -> Option<(Wr, Option<u32>)> {
        let p = self.peers.get_mut(&peer)?;
        head.credits = p.reposted;
        let dlen = data.as_ref().map_or(0, |(_, r)| r.len());
        let len = HEAD + body.len() + dlen;
        // Told once it goes (a message takes a buffer of the peer, so it wakes it too).
        let tell = |p: &mut super::Peer| {
            p.told = p.reposted;
            p.note_owed = None;
        };
        if len <= p.max_inline {
            tell(p);
            let w = wr_inline_with(ffi::ibv_wr_opcode::IBV_WR_SEND, |b| {
                b[..HEAD].copy_from_slice(&head.encode());
                b[HEAD..HEAD + body.len()].copy_from_slice(body);
                if let Some((r, range)) = data {
                    // SAFETY: the range was checked against the region; the caller does not
                    // write it during the call; `b` is a distinct buffer.
                    unsafe {
                        crate::copy::copy_nonoverlapping(
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
        tell(p);
        let at = slot as usize * self.cfg.buffer;
        self.send_mem.write(at, &head.encode());
        self.send_mem.write(at + HEAD, body);
        if let Some((r, range)) = data {
            // SAFETY: the range was checked against the region, and the send buffer holds
            // `len` bytes (the caller keeps `len` within a buffer); the caller does not write
            // the range during the call; distinct allocations do not overlap.
            unsafe {
                crate::copy::copy_nonoverlapping(
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
            if p.unsent.len() >= super::UNSENT_MAX {
                // It sends and never gives credits for our answers: this process's memory is
                // not its queue.
                let e = TransportError::Refused("its answers left unread beyond any use".into());
                return self.lose(PeerId(peer), e);
            }
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

    /// Posts the reads of messages' data that wait (`Peer::unread`), as many as the send queue
    /// has room for: the rest wait for completions to free it. Posting past the room would
    /// fail the post, and with it the peer.
    pub(super) fn post_reads(&mut self, peer: u32) -> Result<(), TransportError> {
        let Some(p) = self.peers.get_mut(&peer) else {
            return Ok(());
        };
        let k = self
            .cfg
            .send_depth
            .saturating_sub(p.posted.len())
            .min(p.unread.len());
        if k == 0 {
            return Ok(());
        }
        let mut chain: Vec<_> = p
            .unread
            .drain(..k)
            .map(|r| {
                let sge = ffi::ibv_sge {
                    addr: r.to,
                    length: r.len,
                    lkey: r.lkey,
                };
                let mut w = wr(ffi::ibv_wr_opcode::IBV_WR_RDMA_READ, sge, 0);
                w.wr.wr.rdma.remote_addr = r.from;
                w.wr.wr.rdma.rkey = r.rkey;
                (w, None, Some(r.tag))
            })
            .collect();
        self.post(peer, &mut chain, None, 0)
    }

    /// The reads that waited for room, for every peer that has room now.
    pub(super) fn post_waiting_reads(&mut self) {
        let ids: Vec<u32> = self
            .peers
            .iter()
            .filter(|(_, p)| !p.unread.is_empty() && p.posted.len() < self.cfg.send_depth)
            .map(|(k, _)| *k)
            .collect();
        for id in ids {
            if let Err(e) = self.post_reads(id) {
                self.lose(PeerId(id), e);
            }
        }
    }

    /// Control messages that waited for a credit; the credit count when enough are owed.
    pub(super) fn push_unsent(&mut self) {
        // Only peers with something to do (most turns: none, and nothing is allocated).
        let owed = (self.cfg.receives as u64 / 4).max(1);
        let ids: Vec<u32> = self
            .peers
            .iter()
            .filter(|(_, p)| {
                !p.unsent.is_empty() || p.note_owed.is_some() || p.reposted - p.told >= owed
            })
            .map(|(k, _)| *k)
            .collect();
        for id in ids {
            while let Some(p) = self.peers.get_mut(&id) {
                let Some(b) = p.unsent.front().copied() else {
                    break;
                };
                p.returned = p.returned.max(credit_word(p));
                let ok = (p.their_receives as u64)
                    .saturating_add(p.returned)
                    .saturating_sub(p.sent)
                    >= 1
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
    /// them is owed, as a note: a WRITE_WITH_IMM naming slot 0, which takes one of the peer's
    /// buffers and so wakes it if it sleeps waiting for these credits (a plain WRITE raises
    /// no completion there). Without a credit for the note, a plain WRITE, and the note once
    /// a credit comes back.
    fn tell_credits(&mut self, id: u32) {
        let Some(p) = self.peers.get(&id) else {
            return;
        };
        if p.posted.len() >= self.cfg.send_depth {
            return;
        }
        let owed = p.reposted - p.told >= (self.cfg.receives as u64 / 4).max(1);
        if !owed && p.note_owed.is_none() {
            return;
        }
        let note = self.room(p, 1, true, true);
        if !note && !owed {
            return;
        }
        if let Some(p) = self.peers.get_mut(&id) {
            p.note_owed = match note {
                true => None,
                false => p.note_owed.or_else(|| Some(std::time::Instant::now())),
            };
        }
        self.write_credits(id, false, note);
    }

    /// An RDMA WRITE of the count of buffers posted again into the peer's credit word
    /// (`note`: with an immediate, see `tell_credits`); `signaled`: its completion says that
    /// everything posted before it was acknowledged.
    fn write_credits(&mut self, id: u32, signaled: bool, note: bool) {
        let Some(p) = self.peers.get_mut(&id) else {
            return;
        };
        p.told = p.reposted;
        let op = if note {
            ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM
        } else {
            ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE
        };
        let mut w = wr_inline(op, &p.reposted.to_le_bytes());
        w.wr.wr.rdma.remote_addr = p.their_credit.0;
        w.wr.wr.rdma.rkey = p.their_credit.1;
        // Slot 0 and immediate 0: a note, never a put (a put's slot is never 0).
        w.wr.imm_data_invalidated_rkey_union.imm_data = 0;
        if signaled {
            w.wr.send_flags |= ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        }
        let r = self.post(id, &mut [(w, None, None)], None, note as u64);
        if let Err(e) = r {
            self.lose(PeerId(id), e);
        }
    }

    /// A put that fills the grant `dst` (whose slot is in `imm`'s high bits): RDMA WRITEs of
    /// all but its last piece, then a WRITE_WITH_IMM of that piece, one post. The receiver
    /// takes a receive (a credit) for the last, which names the grant.
    pub(super) fn put_write_imm(
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
            w.wr.wr.rdma.remote_addr = dst.addr.wrapping_add(at as u64);
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
            self.write_credits(id, true, false);
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
