//! The verbs backend's operations: posting sends, puts, reads and receives, and turning work
//! completions into the interface's completions, in order per peer.

use std::ops::Range;
use std::os::fd::BorrowedFd;
use std::sync::Arc;

use rdma_sys as ffi;

use super::setup::HEAD;
use super::verbs::Mr;
use super::{Inbound, Peer, Posted, RdmaBackend, ASYNC, CHANNEL, HANDSHAKE, KIND_RDMA, LISTENER};
use crate::backend::Place;
use crate::{
    Access, Backend, Completion, Lent, Mem, PeerId, Region, RemoteRegion, Sent, Storage, Token,
    TransportError,
};

// Header kinds and flags.
const MSG: u8 = 1;
const PUT: u8 = 2;
const RELEASE: u8 = 3;
const REVOKE: u8 = 4;
const REVOKED: u8 = 5;
/// The data follows the body in the buffer.
const EAGER: u8 = 1;
/// The data is to be read from the sender (address, key and length in the header).
const RNDV: u8 = 2;

/// Work request ids: the peer in the high half, the kind and an index in the low half.
const WR_RECV: u64 = 1 << 30;
const WR_SEND: u64 = 2 << 30;
const INDEX: u64 = (1 << 30) - 1;

/// Credits kept back from messages and puts, for control messages (releases, revokes).
const RESERVE: u64 = 2;

#[derive(Clone, Copy, Default, Debug)]
struct Head {
    kind: u8,
    flags: u8,
    word: u32,
    id: u64,
    off: u64,
    len: u64,
    key: u32,
    credits: u64,
}

impl Head {
    fn encode(&self) -> [u8; HEAD] {
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

    fn decode(b: &[u8]) -> Option<Head> {
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
struct Wr {
    wr: ffi::ibv_send_wr,
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

fn wr(opcode: u32, sge: ffi::ibv_sge, flags: u32) -> Box<Wr> {
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
    fn post(
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
    fn control(&mut self, peer: u32, head: Head) {
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
    fn poll_cq(
        &mut self,
        on: &mut dyn FnMut(Completion<'_>),
        n: &mut usize,
    ) -> Result<(), TransportError> {
        // SAFETY: plain C structs, all zeroes valid.
        let mut wc: [ffi::ibv_wc; 32] = unsafe { std::mem::zeroed() };
        loop {
            let k = self.cq.poll(&mut wc)?;
            for w in &wc[..k] {
                self.on_wc(w, on, n);
            }
            if k < wc.len() {
                return Ok(());
            }
        }
    }

    fn on_wc(&mut self, wc: &ffi::ibv_wc, on: &mut dyn FnMut(Completion<'_>), n: &mut usize) {
        let peer = (wc.wr_id >> 32) as u32;
        if self.starting.contains(&peer) {
            // A peer whose queue pair is up but whose "ready" is not yet read: kept for it.
            // SAFETY: a plain C struct of numbers (no pointers, no drop): a bitwise copy.
            self.early.push(OwnedWc(unsafe { std::ptr::read(wc) }));
            return;
        }
        if !self.peers.contains_key(&peer) {
            // A lost peer's flushed requests: already failed.
            return;
        }
        if wc.status != ffi::ibv_wc_status::IBV_WC_SUCCESS {
            self.lose(PeerId(peer), wc_error(wc));
            return;
        }
        let idx = wc.wr_id & INDEX;
        if wc.wr_id & WR_RECV != 0 {
            if let Some(p) = self
                .peers
                .get_mut(&peer)
                .filter(|p| p.paused || !p.held.is_empty())
            {
                p.held.push_back((idx as u32, wc.byte_len as usize));
                return;
            }
            if let Err(e) = self.on_recv(peer, idx as u32, wc.byte_len as usize, on, n) {
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

    /// A SEND arrived in buffer `buf` of `peer`.
    fn on_recv(
        &mut self,
        peer: u32,
        buf: u32,
        got: usize,
        on: &mut dyn FnMut(Completion<'_>),
        n: &mut usize,
    ) -> Result<(), TransportError> {
        let size = self.cfg.buffer;
        let p = self.peers.get_mut(&peer).ok_or(TransportError::Closed)?;
        let base = p._recv.ptr() as usize + buf as usize * size;
        if got < HEAD || got > size {
            return Err(TransportError::Refused(format!("a message of {got} bytes")));
        }
        let mut hb = [0u8; HEAD];
        p._recv.read(buf as usize * size, &mut hb);
        let h = Head::decode(&hb).ok_or(TransportError::Refused("a short header".into()))?;
        p.returned = p.returned.max(h.credits);
        let direct = !p.paused && p.inbox.is_empty();
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
                let mut body = vec![0u8; blen];
                p._recv.read(buf as usize * size + HEAD, &mut body);
                let data = if h.flags & EAGER != 0 {
                    let m = Mem::zeroed(eager);
                    let mut v = vec![0u8; eager];
                    p._recv.read(buf as usize * size + HEAD + blen, &mut v);
                    m.write(0, &v);
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
                    Some(g) if g.peer == PeerId(peer) => {
                        if off.checked_add(len).is_none_or(|e| e > g.len) {
                            return Err(TransportError::Refused(format!(
                                "a put of {len} bytes at {off} into a grant of {}",
                                g.len
                            )));
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
                    None if h.id < self.next_grant => {}
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
                    if let Some(t) = self.grants.remove(&h.id).and_then(|g| g.revoking) {
                        self.done.push_back((t, None));
                    }
                }
            }
            k => return Err(TransportError::Refused(format!("a message of kind {k}"))),
        }
        self.repost(peer, buf)
    }

    fn repost(&mut self, peer: u32, buf: u32) -> Result<(), TransportError> {
        let size = self.cfg.buffer;
        let p = self.peers.get_mut(&peer).ok_or(TransportError::Closed)?;
        post_receive(p, buf, size)?;
        p.reposted += 1;
        Ok(())
    }

    /// Reads a message's data from the sender's memory into new registered memory, in pieces
    /// of at most the device's largest message.
    fn read_data(&mut self, peer: u32, tag: u64, h: &Head) -> Result<(), TransportError> {
        let len = h.len as usize;
        let mem = Mem::zeroed(len);
        let s: Arc<dyn Storage> = mem.clone();
        let mr = Mr::new(&self.pd, &s, 0, len, super::verbs::LOCAL)?;
        let mut chain = Vec::new();
        let step = self.lim.max_msg;
        for at in (0..len).step_by(step) {
            let k = step.min(len - at);
            let sge = ffi::ibv_sge {
                addr: mr.addr + at as u64,
                length: k as u32,
                lkey: mr.lkey,
            };
            let mut w = wr(ffi::ibv_wr_opcode::IBV_WR_RDMA_READ, sge, 0);
            w.wr.wr.rdma.remote_addr = h.off + at as u64;
            w.wr.wr.rdma.rkey = h.key;
            chain.push((w, None, Some(tag)));
        }
        let reads = chain.len();
        let p = self.peers.get_mut(&peer).ok_or(TransportError::Closed)?;
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
        if reads > 0 {
            self.post(peer, chain, None, 0)?;
        }
        Ok(())
    }

    /// Hands over what waited in the peers' inboxes, in order, as far as it is ready.
    fn deliver(&mut self, on: &mut dyn FnMut(Completion<'_>), n: &mut usize) {
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
pub(super) struct OwnedWc(ffi::ibv_wc);

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
