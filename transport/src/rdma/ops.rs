//! The verbs backend's operations: posting sends, puts, reads and receives, and turning work
//! completions into the interface's completions, in order per peer.

use std::ops::Range;
use std::os::fd::BorrowedFd;
use std::sync::Arc;

use rdma_sys as ffi;

use super::setup::HEAD;
use super::{Inbound, Peer, Posted, RdmaBackend, ASYNC, CHANNEL, HANDSHAKE, KIND_RDMA, LISTENER};
use crate::backend::Place;
use crate::{
    Access, Backend, Completion, PeerId, Region, RemoteRegion, Sent, Storage, Token, TransportError,
};

// Header kinds and flags.
pub(super) const MSG: u8 = 1;
pub(super) const PUT: u8 = 2;
pub(super) const RELEASE: u8 = 3;
pub(super) const REVOKE: u8 = 4;
pub(super) const REVOKED: u8 = 5;
/// The data follows the body in the buffer.
pub(super) const EAGER: u8 = 1;
/// The data is to be read from the sender (address, key and length in the header).
pub(super) const RNDV: u8 = 2;

/// Work request ids: the peer in the high half, the kind and an index in the low half.
pub(super) const WR_RECV: u64 = 1 << 30;
const WR_SEND: u64 = 2 << 30;
pub(super) const INDEX: u64 = (1 << 30) - 1;

/// Credits kept back from messages and puts, for control messages (releases, revokes).
const RESERVE: u64 = 2;

#[derive(Clone, Copy, Default, Debug)]
pub(super) struct Head {
    pub(super) kind: u8,
    pub(super) flags: u8,
    pub(super) word: u32,
    pub(super) id: u64,
    pub(super) off: u64,
    pub(super) len: u64,
    pub(super) key: u32,
    pub(super) credits: u64,
}

impl Head {
    pub(super) fn encode(&self) -> [u8; HEAD] {
        let mut b = [0u8; HEAD];
        b[0] = self.kind;
        b[1] = self.flags;
        b[4..8].copy_from_slice(&self.word.to_le_bytes());
        b[8..16].copy_from_slice(&self.id.to_le_bytes());
        b[16..24].copy_from_slice(&self.off.to_le_bytes());
        b[24..32].copy_from_slice(&self.len.to_le_bytes());
        b[32..36].copy_from_slice(&self.key.to_le_bytes());
        b[40..48].copy_from_slice(&self.credits.to_le_bytes());
        b
    }

    pub(super) fn decode(b: &[u8]) -> Option<Head> {
        let u = |r: Range<usize>| Some(u64::from_le_bytes(b.get(r)?.try_into().ok()?));
        Some(Head {
            kind: *b.first()?,
            flags: *b.get(1)?,
            word: u32::from_le_bytes(b.get(4..8)?.try_into().ok()?),
            id: u(8..16)?,
            off: u(16..24)?,
            len: u(24..32)?,
            key: u32::from_le_bytes(b.get(32..36)?.try_into().ok()?),
            credits: u(40..48)?,
        })
    }
}

/// The count of buffers the peer posted again, as it last wrote it into our credit word.
fn credit_word(p: &Peer) -> u64 {
    // SAFETY: the word is 8 bytes of 64-byte aligned memory that the peer holds alive; the peer
    // writes it only whole (one 8-byte RDMA write), and an atomic load reads it whole.
    unsafe {
        (*(p._credit.ptr() as *const std::sync::atomic::AtomicU64))
            .load(std::sync::atomic::Ordering::Acquire)
    }
}

/// Posts receive buffer `i` of a peer.
pub(super) fn post_receive(p: &Peer, i: u32, size: usize) -> Result<(), TransportError> {
    let mut sge = ffi::ibv_sge {
        addr: p.recv_mr.addr + (i as usize * size) as u64,
        length: size as u32,
        lkey: p.recv_mr.lkey,
    };
    let mut wr = ffi::ibv_recv_wr {
        wr_id: ((p.id as u64) << 32) | WR_RECV | i as u64,
        next: std::ptr::null_mut(),
        sg_list: &mut sge,
        num_sge: 1,
    };
    // SAFETY: the buffer lies in the peer's receive registration, which the peer holds (and
    // drops after its queue pair); nothing reads it until this request completes.
    unsafe { p.qp.post_recv(&mut wr) }
}

/// One work request being built: its gather entry, and an inline payload, live beside it
/// (boxed, so the pointers to them stay valid until the post).
pub(super) struct Wr {
    pub(super) wr: ffi::ibv_send_wr,
    sge: ffi::ibv_sge,
    inline: [u8; HEAD],
}

/// A request whose payload (at most [`HEAD`] bytes) is copied into the queue by the post.
fn wr_inline(opcode: u32, payload: &[u8]) -> Box<Wr> {
    let n = payload.len().min(HEAD);
    let mut b = wr(
        opcode,
        ffi::ibv_sge {
            addr: 0,
            length: n as u32,
            lkey: 0,
        },
        ffi::ibv_send_flags::IBV_SEND_INLINE.0,
    );
    b.inline[..n].copy_from_slice(&payload[..n]);
    b.sge.addr = b.inline.as_ptr() as u64;
    b
}

pub(super) fn wr(opcode: u32, sge: ffi::ibv_sge, flags: u32) -> Box<Wr> {
    // SAFETY: a plain C struct, all zeroes valid.
    let mut w: ffi::ibv_send_wr = unsafe { std::mem::zeroed() };
    w.opcode = opcode;
    w.send_flags = flags;
    w.num_sge = if sge.length == 0 { 0 } else { 1 };
    let mut b = Box::new(Wr {
        wr: w,
        sge,
        inline: [0; HEAD],
    });
    b.wr.sg_list = &mut b.sge;
    b
}

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
        mut chain: Vec<(Box<Wr>, Option<u32>, Option<u64>)>,
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
        for i in 0..n.saturating_sub(1) {
            let next: *mut ffi::ibv_send_wr = &mut chain[i + 1].0.wr;
            chain[i].0.wr.next = next;
        }
        // SAFETY: every request names a range of a registration that lives until it completes:
        // send buffers (freed on completion), the caller's regions (held by `Posted` through
        // the token's contract and by the region cache), and read destinations (held by the
        // inbox); the chain's memory is alive for the call.
        unsafe { p.qp.post_send(&mut chain[0].0.wr) }?;
        p.sent += sends;
        for (i, (_, slot, read)) in chain.into_iter().enumerate() {
            p.posted.push_back(Posted {
                seq: p.next_seq + i as u64,
                slot,
                token: if i + 1 == n { token } else { None },
                read,
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
        parts: &[&[u8]],
    ) -> Option<(Box<Wr>, Option<u32>)> {
        let p = self.peers.get_mut(&peer)?;
        head.credits = p.reposted;
        p.told = p.reposted;
        let len = HEAD + parts.iter().map(|x| x.len()).sum::<usize>();
        if len <= p.max_inline && parts.iter().all(|x| x.is_empty()) {
            return Some((
                wr_inline(ffi::ibv_wr_opcode::IBV_WR_SEND, &head.encode()),
                None,
            ));
        }
        let slot = self.free_sends.pop()?;
        let at = slot as usize * self.cfg.buffer;
        let mut off = at;
        self.send_mem.write(off, &head.encode());
        off += HEAD;
        for x in parts {
            self.send_mem.write(off, x);
            off += x.len();
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
        if let Some((w, slot)) = self.send_wr(peer, head, &[]) {
            if let Err(e) = self.post(peer, vec![(w, slot, None)], None, 1) {
                self.lose(PeerId(peer), e);
            }
        } else if let Some(p) = self.peers.get_mut(&peer) {
            p.unsent.push_back(head.encode());
        }
    }

    /// Control messages that waited for a credit; the credit count when enough are owed.
    fn push_unsent(&mut self) {
        let ids: Vec<u32> = self.peers.keys().copied().collect();
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
                match self.send_wr(id, h, &[]) {
                    Some((w, slot)) => {
                        if let Some(p) = self.peers.get_mut(&id) {
                            p.unsent.pop_front();
                        }
                        if let Err(e) = self.post(id, vec![(w, slot, None)], None, 1) {
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
        p.told = p.reposted;
        let mut w = wr_inline(
            ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE,
            &p.reposted.to_le_bytes(),
        );
        w.wr.wr.rdma.remote_addr = p.their_credit.0;
        w.wr.wr.rdma.rkey = p.their_credit.1;
        let r = self.post(id, vec![(w, None, None)], None, 0);
        if let Err(e) = r {
            self.lose(PeerId(id), e);
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

    fn alloc(&mut self, len: usize, access: Access) -> Result<Region, TransportError> {
        self.alloc_mem(len, access)
    }

    unsafe fn grant(
        &mut self,
        peer: PeerId,
        r: &Region,
        range: Range<usize>,
    ) -> Result<RemoteRegion, TransportError> {
        self.grant_range(peer, r, range)
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
            self.grants.remove(&grant.id);
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
        let p = self.peer(peer)?;
        let their = p.their_buffer;
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
            None => (self.send_wr(peer.0, head, &[body]), None, None),
            Some((r, range, t)) if HEAD + body.len() + range.len() <= their => {
                // Small data is copied after the body: the caller's memory is free at once.
                head.flags = EAGER;
                head.len = range.len() as u64;
                let mut v = vec![0u8; range.len()];
                // SAFETY: in range (checked); the caller does not write it during the call.
                unsafe { r.read(range.start, &mut v) }?;
                (self.send_wr(peer.0, head, &[body, &v]), None, Some(t))
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
                (self.send_wr(peer.0, head, &[body]), None, None)
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
        self.post(peer.0, vec![(w, slot, None)], token, 1)?;
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
        let head = Head {
            kind: PUT,
            word: imm,
            id: dst.id,
            off: offset as u64,
            len: len as u64,
            ..Head::default()
        };
        let Some((w, slot)) = self.send_wr(peer.0, head, &[]) else {
            return Ok(Sent::WouldBlock);
        };
        chain.push((w, slot, None));
        // The source stays registered and alive until the notice completes.
        if let Some(p) = self.peers.get_mut(&peer.0) {
            p.holds
                .push_back((p.next_seq + chain.len() as u64 - 1, src.clone(), mr));
        }
        self.post(peer.0, chain, Some(token), 1)?;
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
        if std::mem::take(&mut self.armed) || self.calls % 16 == 0 || !self.handshakes.is_empty() {
            self.poll_events(on, &mut n)?;
        }
        for w in std::mem::take(&mut self.early) {
            self.on_wc(&w.0, on, &mut n);
        }
        self.poll_cq(on, &mut n)?;
        self.resume_held(on, &mut n);
        self.deliver(on, &mut n);
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

impl RdmaBackend {
    /// Readiness of the listener, handshakes, the completion channel, device events and the
    /// peers' TCP links (whose end is the peer's end).
    fn poll_events(
        &mut self,
        on: &mut dyn FnMut(Completion<'_>),
        n: &mut usize,
    ) -> Result<(), TransportError> {
        match self
            .poll
            .poll(&mut self.events, Some(std::time::Duration::ZERO))
        {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
        let ready: Vec<usize> = self.events.iter().map(|e| e.token().0).collect();
        for t in ready {
            match mio::Token(t) {
                LISTENER => self.accept_all()?,
                CHANNEL => self.cq.drain_events(),
                ASYNC => self.async_events(),
                _ if t >= HANDSHAKE => {
                    if let Some(peer) = self.handshake(t) {
                        on(Completion::Connected { peer });
                        *n += 1;
                        // What it sent while the handshake ended.
                        for w in std::mem::take(&mut self.early) {
                            self.on_wc(&w.0, on, n);
                        }
                    }
                }
                _ => self.check_link(t as u32),
            }
        }
        self.expire_handshakes();
        // Events are asked for again before each sleep; a wake-up may also have been spent.
        Ok(())
    }

    /// The peer's TCP link is readable: it closed (the peer is gone), or sent what it never
    /// should.
    fn check_link(&mut self, id: u32) {
        use std::io::Read;
        let Some(p) = self.peers.get_mut(&id) else {
            return;
        };
        let Some(s) = &mut p.sock else { return };
        let mut b = [0u8; 16];
        match s.read(&mut b) {
            Ok(0) => self.lose(PeerId(id), TransportError::Closed),
            Ok(_) => self.lose(
                PeerId(id),
                TransportError::Refused("bytes on the RDMA link's TCP side".into()),
            ),
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => self.lose(PeerId(id), e.into()),
        }
    }

    /// Device events: a fatal error of a queue pair loses its peer; a port that goes down
    /// loses every peer.
    fn async_events(&mut self) {
        use ffi::ibv_event_type as t;
        while let Some((kind, qpn)) = self.ctx.next_async_event() {
            match (kind, qpn) {
                (
                    t::IBV_EVENT_QP_FATAL | t::IBV_EVENT_QP_REQ_ERR | t::IBV_EVENT_QP_ACCESS_ERR,
                    Some(q),
                ) => {
                    if let Some(&id) = self.by_qpn.get(&q) {
                        self.lose(
                            PeerId(id),
                            TransportError::Rdma(format!("queue pair {q} failed ({kind:?})")),
                        );
                    }
                }
                (t::IBV_EVENT_PORT_ERR | t::IBV_EVENT_DEVICE_FATAL, _) => {
                    let ids: Vec<u32> = self.peers.keys().copied().collect();
                    for id in ids {
                        self.lose(
                            PeerId(id),
                            TransportError::Rdma(format!(
                                "{} port {} went down ({kind:?})",
                                self.ctx.name, self.cfg.port
                            )),
                        );
                    }
                }
                _ => {}
            }
        }
    }

    /// Receives held while their peer was paused, taken in order once it is resumed.
    fn resume_held(&mut self, on: &mut dyn FnMut(Completion<'_>), n: &mut usize) {
        let ids: Vec<u32> = self
            .peers
            .iter()
            .filter(|(_, p)| !p.paused && !p.held.is_empty())
            .map(|(k, _)| *k)
            .collect();
        for id in ids {
            while let Some((buf, got)) = self
                .peers
                .get_mut(&id)
                .filter(|p| !p.paused)
                .and_then(|p| p.held.pop_front())
            {
                if let Err(e) = self.on_recv(id, buf, got, on, n) {
                    self.lose(PeerId(id), e);
                    break;
                }
            }
        }
    }
}
