//! The verbs backend's completions: work completions turned into the interface's, in order
//! per peer (messages whose data is still being read hold back what came after them).

use std::sync::Arc;

use rdma_sys as ffi;

use super::ops::OwnedWc;
use super::setup::HEAD;
use super::verbs::Mr;
use super::wire::{Head, EAGER, INDEX, MSG, PUT, RELEASE, REVOKE, REVOKED, RNDV, WR_RECV};
use super::{Arrival, Inbound, RdmaBackend, Read};
use crate::{Completion, Lent, Mem, PeerId, Storage, TransportError};

/// Why a work completion failed, in words.
fn wc_error(wc: &ffi::ibv_wc) -> TransportError {
    // SAFETY: returns a static string for any status value.
    let s = unsafe { std::ffi::CStr::from_ptr(ffi::ibv_wc_status_str(wc.status)) };
    TransportError::PeerLost(format!(
        "a work request failed: {} (status {}, vendor error {:#x})",
        s.to_string_lossy(),
        wc.status,
        wc.vendor_err
    ))
}

impl RdmaBackend {
    /// Takes what the completion queue has and acts on it.
    pub(super) fn poll_cq(
        &mut self,
        on: &mut dyn FnMut(Completion<'_>),
        n: &mut usize,
    ) -> Result<(), TransportError> {
        // The backend's array of completions, lent for the call (not zeroed each time).
        let mut wc = std::mem::take(&mut self.wcs);
        let r = loop {
            let k = match self.cq.poll(&mut wc) {
                Ok(k) => k,
                Err(e) => break Err(e),
            };
            for w in &wc[..k] {
                self.on_wc(w, on, n);
            }
            if k < wc.len() {
                break Ok(());
            }
        };
        self.wcs = wc;
        r
    }

    pub(super) fn on_wc(
        &mut self,
        wc: &ffi::ibv_wc,
        on: &mut dyn FnMut(Completion<'_>),
        n: &mut usize,
    ) {
        let idx = wc.wr_id & INDEX;
        let recv = wc.wr_id & WR_RECV != 0;
        // A receive names its buffer, and the queue pair it came on names the peer.
        let peer = match recv {
            true => match self.peers.values().find(|p| p.qp.num == wc.qp_num) {
                Some(p) => Some(p.id),
                // One still starting (or gone).
                None => self.by_qpn.get(&wc.qp_num).copied(),
            },
            false => Some((wc.wr_id >> 32) as u32),
        };
        if let Some(p) = peer.filter(|p| !self.starting.is_empty() && self.starting.contains(p)) {
            // A peer whose queue pair is up but whose "ready" is not yet read: kept for it.
            // SAFETY: a plain C struct of numbers (no pointers, no drop): a bitwise copy.
            let w = OwnedWc(unsafe { std::ptr::read(wc) });
            if !recv {
                self.early.push(w);
            } else if self.early.park_recv(p, w) > self.cfg.receives {
                // More messages than the receives it was given, before its handshake ended:
                // it broke the protocol, and would take other peers' buffers. Its handshake
                // ends here; what it parked goes back to the shared queue when next looked at.
                self.drop_handshake_of(p);
            }
            return;
        }
        let Some(peer) = peer.filter(|p| self.peers.contains_key(p)) else {
            // A lost peer's: its sends already failed; a buffer it took goes back.
            if recv {
                let _ = self.rx.post(idx as u32);
            }
            return;
        };
        if wc.status != ffi::ibv_wc_status::IBV_WC_SUCCESS {
            if recv {
                let _ = self.rx.post(idx as u32);
            }
            self.lose(PeerId(peer), wc_error(wc));
            return;
        }
        if recv {
            let credited = self.cfg.receives as u64;
            let over = self.peers.get_mut(&peer).is_some_and(|p| {
                p.arrived += 1;
                p.arrived > credited + p.reposted
            });
            if over {
                let _ = self.rx.post(idx as u32);
                let e = TransportError::Refused("more messages than its credits".into());
                self.lose(PeerId(peer), e);
                return;
            }
            let with_imm = wc.opcode == ffi::ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM;
            let a = Arrival {
                buf: idx as u32,
                got: wc.byte_len as usize,
                // SAFETY: the union's immediate is what a completion with one carries.
                imm: with_imm
                    .then(|| u32::from_be(unsafe { wc.imm_data_invalidated_rkey_union.imm_data })),
            };
            if let Some(p) = self
                .peers
                .get_mut(&peer)
                .filter(|p| p.paused || !p.held.is_empty())
            {
                p.held.push_back(a);
                return;
            }
            if let Err(e) = self.on_recv(peer, a, on, n) {
                // What it sent breaks the protocol: its buffer goes back, and it is lost.
                let _ = self.rx.post(a.buf);
                self.lose(PeerId(peer), e);
            }
            return;
        }
        let Some(p) = self.peers.get_mut(&peer) else {
            return;
        };
        while let Some(w) = p.posted.pop_front() {
            if let Some(s) = w.slot {
                self.free_sends.push(s);
            }
            if let Some(t) = w.token {
                self.done.push_back((t, None));
            }
            if let Some(tag) = w.read {
                for i in p.inbox.iter_mut() {
                    if let Inbound::Msg { tag: t, reads, .. } = i {
                        if *t == tag {
                            *reads = reads.saturating_sub(1);
                        }
                    }
                }
            }
            let seq = w.seq;
            while p.holds.front().is_some_and(|h| h.0 <= seq) {
                p.holds.pop_front();
            }
            if seq & INDEX == idx {
                break;
            }
        }
    }

    /// A SEND arrived in a receive buffer from `peer`, or a WRITE_WITH_IMM took one.
    pub(super) fn on_recv(
        &mut self,
        peer: u32,
        a: Arrival,
        on: &mut dyn FnMut(Completion<'_>),
        n: &mut usize,
    ) -> Result<(), TransportError> {
        let (buf, got) = (a.buf, a.got);
        if let Some(imm) = a.imm {
            self.on_write_imm(peer, imm, got, on, n)?;
            return self.repost(peer, buf);
        }
        let size = self.cfg.buffer;
        let base = self.rx.ptr(buf) as usize;
        let p = self.peers.get_mut(&peer).ok_or(TransportError::Closed)?;
        if got < HEAD || got > size {
            return Err(TransportError::Refused(format!("a message of {got} bytes")));
        }
        let mut hb = [0u8; HEAD];
        // SAFETY: the buffer holds `got` >= HEAD received bytes, and is not posted again
        // before this copy; `hb` is a distinct local.
        unsafe { std::ptr::copy_nonoverlapping(base as *const u8, hb.as_mut_ptr(), HEAD) };
        let h = Head::decode(&hb).ok_or(TransportError::Refused("a short header".into()))?;
        p.returned = p.returned.max(h.credits);
        let direct = !p.paused && p.inbox.is_empty();
        // The data a message may bring: less for an accepted peer not yet trusted.
        let max_data = p.max_data;
        match h.kind {
            MSG => {
                let blen = h.word as usize;
                let eager = if h.flags & EAGER != 0 {
                    h.len as usize
                } else {
                    0
                };
                if HEAD
                    .checked_add(blen)
                    .and_then(|x| x.checked_add(eager))
                    .is_none_or(|e| e > got)
                {
                    return Err(TransportError::Refused(format!(
                        "a message of {got} bytes claiming a body of {blen} and {eager} of data"
                    )));
                }
                if h.flags & (EAGER | RNDV) != 0 && h.len > max_data {
                    return Err(TransportError::Oversize {
                        len: h.len,
                        max: max_data,
                    });
                }
                if direct && h.flags & RNDV == 0 {
                    // SAFETY: the range was checked inside the received bytes of the buffer,
                    // which is not posted again before the callback returns.
                    let body =
                        unsafe { std::slice::from_raw_parts((base + HEAD) as *const u8, blen) };
                    let data = (h.flags & EAGER != 0)
                        .then(|| Lent::new((base + HEAD + blen) as *const u8, eager));
                    on(Completion::Recv {
                        peer: PeerId(peer),
                        body,
                        data,
                    });
                    *n += 1;
                    return self.repost(peer, buf);
                }
                // SAFETY: the range was checked inside the received bytes of the buffer, which is
                // not posted again before this copy.
                let body = unsafe { std::slice::from_raw_parts((base + HEAD) as *const u8, blen) }
                    .to_vec();
                let data = if h.flags & EAGER != 0 {
                    let m = Mem::zeroed(eager);
                    // SAFETY: the range lies in the received bytes of the buffer (checked
                    // above), which is not posted again before this copy; `m` is new.
                    unsafe {
                        crate::copy::copy_nonoverlapping(
                            (base + HEAD + blen) as *const u8,
                            m.ptr(),
                            eager,
                        )
                    };
                    Some(m)
                } else {
                    None
                };
                let tag = p.next_tag;
                p.next_tag += 1;
                p.inbox.push_back(Inbound::Msg {
                    body,
                    data,
                    reads: 0,
                    tag,
                    release: None,
                    mr: None,
                });
                if h.flags & RNDV != 0 {
                    self.read_data(peer, tag, &h)?;
                }
            }
            PUT => {
                let (off, len) = (h.off as usize, h.len as usize);
                match self.grants.get(&h.id) {
                    // Being revoked: the owner takes no more puts into it (none is copied in).
                    Some(g) if g.peer == PeerId(peer) && g.revoking.is_some() => {}
                    Some(g) if g.peer == PeerId(peer) => {
                        if off.checked_add(len).is_none_or(|e| e > g.len) {
                            return Err(TransportError::Refused(format!(
                                "a put of {len} bytes at {off} into a grant of {}",
                                g.len
                            )));
                        }
                        if h.flags & EAGER != 0 {
                            // The data came in the message: it goes into the grant here.
                            if HEAD + len > got {
                                return Err(TransportError::Refused(format!(
                                    "a put of {len} bytes in a message of {got}"
                                )));
                            }
                            // SAFETY: the source lies in the received bytes of the buffer
                            // (checked), not posted again before this copy; the destination
                            // is the granted range (checked), which the owner gave this peer
                            // to write and does not read until the put is reported.
                            unsafe {
                                let src =
                                    std::slice::from_raw_parts((base + HEAD) as *const u8, len);
                                g.region.write(g.start + off, src)?;
                            }
                        }
                        let item = Inbound::Put {
                            grant: h.id,
                            offset: off,
                            len,
                            imm: h.word,
                        };
                        let p = self.peers.get_mut(&peer).ok_or(TransportError::Closed)?;
                        if direct {
                            on(Completion::Put {
                                peer: PeerId(peer),
                                grant: h.id,
                                offset: off,
                                len,
                                imm: h.word,
                            });
                            *n += 1;
                        } else {
                            p.inbox.push_back(item);
                        }
                    }
                    // Revoked or forgotten: the bytes are not wanted.
                    None if h.id & ((1 << super::SLOT_SHIFT) - 1) < self.next_grant => {}
                    _ => {
                        return Err(TransportError::Refused(format!(
                            "a put into grant {} it was never given",
                            h.id
                        )))
                    }
                }
            }
            RELEASE => {
                if let Some((t, _)) = p.lent.remove(&h.id) {
                    self.done.push_back((t, None));
                }
            }
            REVOKE => {
                // A peer that says more revocations than any use makes, or that lets its
                // answers pile up unread, breaks the protocol (this process's memory is not
                // its queue).
                if p.revoked.len() >= super::REVOKED_MAX || p.unsent.len() >= super::UNSENT_MAX {
                    return Err(TransportError::Refused(
                        "revocations beyond any use, or their answers left unread".into(),
                    ));
                }
                p.revoked.insert(h.id);
                self.control(
                    peer,
                    Head {
                        kind: REVOKED,
                        id: h.id,
                        ..Head::default()
                    },
                );
            }
            REVOKED => {
                if self
                    .grants
                    .get(&h.id)
                    .is_some_and(|g| g.peer == PeerId(peer) && g.revoking.is_some())
                {
                    if let Some(t) = self.drop_grant(h.id).and_then(|g| g.revoking) {
                        self.done.push_back((t, None));
                    }
                }
            }
            k => return Err(TransportError::Refused(format!("a message of kind {k}"))),
        }
        self.repost(peer, buf)
    }

    /// Buffer `buf`, taken by `peer`, goes back to the shared queue: a credit owed to it.
    pub(super) fn repost(&mut self, peer: u32, buf: u32) -> Result<(), TransportError> {
        self.rx.post(buf)?;
        if let Some(p) = self.peers.get_mut(&peer) {
            p.reposted += 1;
        }
        Ok(())
    }

    /// A WRITE_WITH_IMM from `peer` filled one of the grants it was given, whose slot is in
    /// the immediate's high bits (the caller's immediate below them); its `got` bytes (the
    /// last piece of the put) are in place.
    fn on_write_imm(
        &mut self,
        peer: u32,
        imm: u32,
        got: usize,
        on: &mut dyn FnMut(Completion<'_>),
        n: &mut usize,
    ) -> Result<(), TransportError> {
        let slot = imm >> crate::IMM_BITS;
        let imm = imm & ((1 << crate::IMM_BITS) - 1);
        if slot == 0 && imm == 0 {
            // A note: the peer wrote its count of reposted buffers into our credit word, and
            // took a buffer so that this side wakes to use them (`tell_credits`).
            return Ok(());
        }
        let p = self.peers.get_mut(&peer).ok_or(TransportError::Closed)?;
        let Some(&id) = p.slots.get(&slot) else {
            if slot == 0 || slot >= p.next_slot {
                return Err(TransportError::Refused(format!(
                    "a write into slot {slot}, never given"
                )));
            }
            // Its grant was revoked or forgotten: the bytes are not wanted.
            return Ok(());
        };
        let len = match self.grants.get(&id) {
            // Being revoked: what landed is not reported (the owner takes no more puts).
            Some(g) if g.peer == PeerId(peer) && got <= g.len && g.revoking.is_some() => {
                return Ok(())
            }
            Some(g) if g.peer == PeerId(peer) && got <= g.len => g.len,
            _ => {
                return Err(TransportError::Refused(format!(
                    "a write of {got} bytes into slot {slot}"
                )))
            }
        };
        let p = self.peers.get_mut(&peer).ok_or(TransportError::Closed)?;
        if !p.paused && p.inbox.is_empty() {
            on(Completion::Put {
                peer: PeerId(peer),
                grant: id,
                offset: 0,
                len,
                imm,
            });
            *n += 1;
        } else {
            p.inbox.push_back(Inbound::Put {
                grant: id,
                offset: 0,
                len,
                imm,
            });
        }
        Ok(())
    }

    /// Reads a message's data from the sender's memory into new registered memory, in pieces
    /// of at most the device's largest message.
    pub(super) fn read_data(
        &mut self,
        peer: u32,
        tag: u64,
        h: &Head,
    ) -> Result<(), TransportError> {
        let len = h.len as usize;
        // What a peer's messages wait to have read at once is bounded by one message's
        // largest size, and memory that cannot be had fails that peer, not this process.
        let (waiting, max): (usize, u64) = self.peers.get(&peer).map_or((0, 0), |p| {
            let waiting = p.inbox.iter().map(|m| match m {
                Inbound::Msg { data: Some(d), .. } => d.len(),
                _ => 0,
            });
            (waiting.sum(), p.max_data)
        });
        if waiting.saturating_add(len) as u64 > max {
            return Err(TransportError::Refused(format!(
                "{len} more bytes to read with {waiting} waiting"
            )));
        }
        let mem = Mem::zeroed_or_refused(len)?;
        let s: Arc<dyn Storage> = mem.clone();
        let mr = Mr::new(&self.pd, &s, 0, len, super::verbs::LOCAL)?;
        let step = self.lim.max_msg;
        let p = self.peers.get_mut(&peer).ok_or(TransportError::Closed)?;
        let before = p.unread.len();
        for at in (0..len).step_by(step) {
            p.unread.push_back(Read {
                tag,
                to: mr.addr + at as u64,
                lkey: mr.lkey,
                len: step.min(len - at) as u32,
                from: h.off.wrapping_add(at as u64),
                rkey: h.key,
            });
        }
        let reads = p.unread.len() - before;
        if let Some(Inbound::Msg {
            data,
            reads: r,
            release,
            mr: m,
            ..
        }) = p.inbox.back_mut()
        {
            *data = Some(mem);
            *r = reads;
            *release = Some(h.id);
            *m = Some(mr);
        }
        self.post_reads(peer)
    }

    /// Hands over what waited in the peers' inboxes, in order, as far as it is ready.
    pub(super) fn deliver(&mut self, on: &mut dyn FnMut(Completion<'_>), n: &mut usize) {
        let ids: Vec<u32> = self
            .peers
            .iter()
            .filter(|(_, p)| !p.paused && !p.inbox.is_empty())
            .map(|(k, _)| *k)
            .collect();
        for id in ids {
            while let Some(p) = self.peers.get_mut(&id) {
                if p.paused {
                    break;
                }
                match p.inbox.front() {
                    Some(Inbound::Msg { reads, .. }) if *reads > 0 => break,
                    None => break,
                    _ => {}
                }
                let Some(item) = p.inbox.pop_front() else {
                    break;
                };
                match item {
                    Inbound::Msg {
                        body,
                        data,
                        release,
                        ..
                    } => {
                        let lent = data.as_ref().map(|m| Lent::new(m.ptr(), m.len()));
                        on(Completion::Recv {
                            peer: PeerId(id),
                            body: &body,
                            data: lent,
                        });
                        if let Some(r) = release {
                            self.control(
                                id,
                                Head {
                                    kind: RELEASE,
                                    id: r,
                                    ..Head::default()
                                },
                            );
                        }
                    }
                    Inbound::Put {
                        grant,
                        offset,
                        len,
                        imm,
                    } => {
                        on(Completion::Put {
                            peer: PeerId(id),
                            grant,
                            offset,
                            len,
                            imm,
                        });
                    }
                }
                *n += 1;
            }
        }
    }
}
