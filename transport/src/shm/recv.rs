//! Taking messages off a peer's ring: a ring read, and each message's body copied out and
//! its data lent where it lies.

use super::*;

/// Delivers a message: its body copied out of the descriptor or the peer's pool, its data lent
/// where it lies; then releases what the peer lent.
pub(super) fn recv_msg(
    p: &mut Peer,
    peer: PeerId,
    d: &Desc,
    slot: &[u8; SLOT],
    on: &mut dyn FnMut(Completion<'_>),
) -> Result<(), TransportError> {
    let blen = d.word as usize;
    if blen > MAX_BODY || (d.flags & BODY_IN_POOL == 0 && blen > INLINE) {
        return Err(TransportError::Refused(format!("a body of {blen} bytes")));
    }
    if d.flags & BODY_IN_POOL != 0 {
        let r = kvstore_shm::Region {
            offset: d.body_off as usize,
            len: blen,
        };
        p.their_pool.check_span(r.offset, blen)?;
        p.rxbuf.resize(blen, 0);
        p.their_seg.read(r.offset, &mut p.rxbuf)?;
    }
    // Data in the sender's pages may be held past the callback: the peer's mapping stays
    // alive with it, and the pages' release waits for it. Only its caller's own memory sent in
    // place, with no body staged in the pool: nothing held takes room the sender needs to
    // send what a holder waits for.
    let in_place = HAS_DATA | IN_PLACE;
    let holdable = d.flags & (in_place | DATA_INLINE | BODY_IN_POOL) == in_place && d.len != 0;
    let hold = holdable.then(|| crate::backend::HoldSlot {
        id: d.id,
        keep: p.their_seg.clone(),
        taken: std::cell::Cell::new(false),
    });
    let data = if d.flags & DATA_INLINE != 0 {
        let len = d.len as usize;
        if d.flags & BODY_IN_POOL != 0 || blen.checked_add(len).is_none_or(|e| e > INLINE) {
            return Err(TransportError::Refused(format!(
                "{len} bytes of inline data"
            )));
        }
        let at = &slot[HEAD + blen..HEAD + blen + len];
        Some(Lent::new(at.as_ptr(), len))
    } else if d.flags & HAS_DATA != 0 {
        let len = d.len as usize;
        if len == 0 {
            Some(Lent::new(std::ptr::NonNull::<u8>::dangling().as_ptr(), 0))
        } else {
            let r = kvstore_shm::Region {
                offset: d.off as usize,
                len,
            };
            // Pages outside the peer's pool, or not allocated, are refused.
            p.their_pool.check_span(r.offset, len)?;
            let at = p.their_seg.ptr(r.offset, len)?;
            Some(match &hold {
                Some(h) => Lent::holdable(at, len, h),
                None => Lent::new(at, len),
            })
        }
    } else {
        None
    };
    let body = if d.flags & BODY_IN_POOL != 0 {
        &p.rxbuf[..]
    } else {
        &slot[HEAD..HEAD + blen]
    };
    on(Completion::Recv { peer, body, data });
    if hold.as_ref().is_some_and(|h| h.taken.get()) {
        p.held.insert(d.id);
    } else if d.flags & DATA_INLINE == 0 && d.flags & (HAS_DATA | BODY_IN_POOL) != 0 {
        let r = Desc {
            kind: RELEASE,
            id: d.id,
            ..Desc::default()
        };
        p.unsent.push_back(r.encode(&[]));
    }
    Ok(())
}

/// Posts queued control descriptors while the ring has room.
pub(super) fn push_unsent(p: &mut Peer) -> Result<(), TransportError> {
    while let Some(d) = p.unsent.front() {
        if !p.chan.try_post(d)? {
            break;
        }
        p.unsent.pop_front();
        p.posted = true;
    }
    Ok(())
}

impl ShmBackend {
    /// Takes every descriptor `id` posted before its socket closed, paused or not (what it
    /// posted is all there will be), before it is lost: its messages, puts and releases count
    /// as TCP's bytes up to the end do. What waits to go to it can no longer go.
    pub(super) fn read_remains(
        &mut self,
        id: u32,
        on: &mut dyn FnMut(Completion<'_>),
        n: &mut usize,
    ) {
        // A ring holds at most its slots; a peer that posts on after closing is not waited for.
        for _ in 0..=self.cfg.ring_slots as usize / BATCH + 1 {
            let Some(p) = self.peers.get_mut(&id) else {
                return;
            };
            // (Cleared before each batch: the answers a batch queues, releases say, can
            // never go, and would stop the next batch at the queue's bound.)
            p.unsent.clear();
            p.paused = false;
            if !p.chan.rx_pending() || self.read_peer(id, on, n).is_err() {
                break;
            }
        }
    }

    /// Takes up to [`BATCH`] descriptors from `id`'s ring. An error is the peer's fault: the
    /// link is closed.
    pub(super) fn read_peer(
        &mut self,
        id: u32,
        on: &mut dyn FnMut(Completion<'_>),
        n: &mut usize,
    ) -> Result<(), TransportError> {
        let peer = PeerId(id);
        let ShmBackend {
            peers,
            grants,
            done,
            next_grant,
            copies,
            ..
        } = self;
        let Some(p) = peers.get_mut(&id) else {
            return Ok(());
        };
        if p.paused {
            return Ok(());
        }
        let mut slot = [0u8; SLOT];
        for i in 0..=BATCH {
            if i == BATCH || p.unsent.len() >= UNSENT_MAX || !p.chan.try_recv(&mut slot)? {
                if i > 0 {
                    // Slots were freed: the peer may be waiting for one.
                    p.chan.took()?;
                }
                break;
            }
            let d = Desc::decode(&slot);
            match d.kind {
                MSG => {
                    recv_msg(p, peer, &d, &slot, on)?;
                    *n += 1;
                }
                PUT => {
                    let (off, len) = (d.off as usize, d.len as usize);
                    match grants.get(&d.id) {
                        Some(g) if g.peer == peer => {
                            if off.checked_add(len).is_none_or(|e| e > g.range.len()) {
                                return Err(TransportError::Refused(format!(
                                    "a put of {len} bytes at {off} into a grant of {}",
                                    g.range.len()
                                )));
                            }
                            if g.revoking.is_some() {
                                continue;
                            }
                            if let Some(b) = &g.bounce {
                                copies.0 += 1;
                                copies.1 += len as u64;
                                // SAFETY: both ranges were checked against their regions; the
                                // bounce pages are this process's, written by the peer before
                                // it posted this descriptor; the destination is granted.
                                unsafe {
                                    crate::copy::copy_nonoverlapping(
                                        b.mem.ptr().add(off),
                                        g.region.mem.ptr().add(g.range.start + off),
                                        len,
                                    )
                                };
                            }
                            on(Completion::Put {
                                peer,
                                grant: d.id,
                                offset: off,
                                len,
                                imm: d.word,
                            });
                            *n += 1;
                        }
                        // Revoked or forgotten: the bytes are not wanted.
                        None if d.id < *next_grant => {}
                        _ => {
                            return Err(TransportError::Refused(format!(
                                "a put into grant {} it was never given",
                                d.id
                            )))
                        }
                    }
                }
                RELEASE => {
                    if let Some(out) = p.refs.remove(&d.id) {
                        if let Some(t) = out.token {
                            done.push_back((t, None));
                        }
                    }
                }
                REVOKE => {
                    if p.revoked.len() >= REVOKED_MAX {
                        return Err(TransportError::Refused(format!(
                            "more than {REVOKED_MAX} revocations"
                        )));
                    }
                    p.revoked.insert(d.id);
                    let ack = Desc {
                        kind: REVOKED,
                        id: d.id,
                        ..Desc::default()
                    };
                    p.unsent.push_back(ack.encode(&[]));
                }
                REVOKED => {
                    if let Some(g) = grants.get(&d.id) {
                        if g.peer == peer {
                            if let Some(t) = g.revoking {
                                grants.remove(&d.id);
                                done.push_back((t, None));
                            }
                        }
                    }
                }
                CAPS => p.peer_writes_me = d.flags & 1 != 0,
                k => return Err(TransportError::Refused(format!("a descriptor of kind {k}"))),
            }
        }
        push_unsent(p)
    }
}
