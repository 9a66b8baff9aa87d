//! The shared-memory backend's operations: posting, and the rings' progress.

use super::link::pool_has;
use super::recv::push_unsent;
use super::*;

impl Backend for ShmBackend {
    fn name(&self) -> &'static str {
        "shm"
    }

    fn max_body(&self) -> usize {
        MAX_BODY
    }

    fn register(&mut self, mem: Arc<dyn Storage>) -> Result<Region, TransportError> {
        Ok(Region::new(self.id, mem, Place::Local))
    }

    fn sends_in_place(&self, r: &Region) -> bool {
        r.backend == self.id && matches!(r.place, Place::Pool(_))
    }

    fn alloc(&mut self, len: usize, access: Access) -> Result<Region, TransportError> {
        self.alloc_pages(len, true, access)
    }

    unsafe fn grant(
        &mut self,
        peer: PeerId,
        r: &Region,
        range: Range<usize>,
    ) -> Result<RemoteRegion, TransportError> {
        r.check_owner(self.id)?;
        r.check_range(&range)?;
        let cma = self.peer(peer)?.peer_writes_me;
        let id = self.next_grant;
        let len = range.len();
        let cma_addr = r.mem.ptr() as u64 + range.start as u64;
        let may_cma = cma && r.mem.peer_may_write();
        // A small range is cheaper to bounce: the peer's copy into landing pages and one here
        // cost less than the system call of a cross-memory write.
        let cma = may_cma && len >= CMA_FROM;
        // Only landing pages are written by the peer itself; send-pool pages (mapped read-only
        // by peers) and private memory are written by the kernel on its behalf, or through
        // landing pages copied into place here.
        let (kind, addr, bounce) = match r.place {
            Place::Landing(off) => (KIND_SEG, (off + range.start) as u64, None),
            Place::Local | Place::Pool(_) if cma => (KIND_CMA, cma_addr, None),
            Place::Local | Place::Pool(_) => match self.alloc_pages(len, false, Access::Land) {
                Ok(b) => {
                    let Place::Landing(off) = b.place else {
                        return Err(TransportError::Refused("bounce pages".into()));
                    };
                    (KIND_SEG, off as u64, Some(b))
                }
                Err(_) if may_cma => (KIND_CMA, cma_addr, None),
                Err(e) => return Err(e),
            },
        };
        self.next_grant += 1;
        self.grants.insert(
            id,
            Grant {
                peer,
                region: r.clone(),
                range,
                bounce,
                revoking: None,
            },
        );
        Ok(RemoteRegion {
            key: 0,
            kind,
            id,
            addr,
            len: len as u64,
        })
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
                let d = Desc {
                    kind: REVOKE,
                    id: grant.id,
                    ..Desc::default()
                };
                self.post_control(peer, d.encode(&[]));
            }
            Some(_) => {
                return Err(TransportError::Refused(format!(
                    "{grant:?} is not {peer}'s, or is already being revoked"
                )))
            }
            // A grant to a peer that was lost while its process lives: its memory is kept,
            // and the revoke fails, as the contract says.
            None if self.kept.contains(&grant.id) => self.done.push_back((
                token,
                Some(TransportError::PeerLost(format!(
                    "{peer} closed its link but still runs: grant {} kept, never freed",
                    grant.id
                ))),
            )),
            None => self.done.push_back((token, None)),
        }
        Ok(())
    }

    fn release(&mut self, peer: PeerId, held: crate::Held) {
        if let Some(p) = self.peers.get_mut(&peer.0) {
            if p.held.remove(&held.id()) {
                let r = Desc {
                    kind: RELEASE,
                    id: held.id(),
                    ..Desc::default()
                };
                p.unsent.push_back(r.encode(&[]));
            }
        }
        // The mapping it kept alive may go now (the peer's, where it is gone).
        drop(held);
    }

    fn forget(&mut self, peer: PeerId, grant: &RemoteRegion) {
        // A grant being revoked stays until its revoke completes (its token with it).
        if self
            .grants
            .get(&grant.id)
            .is_some_and(|g| g.peer == peer && g.revoking.is_none())
        {
            self.grants.remove(&grant.id);
        }
    }

    unsafe fn send(
        &mut self,
        peer: PeerId,
        body: &[u8],
        data: Option<(&Region, Range<usize>, Token)>,
    ) -> Result<Sent, TransportError> {
        crate::backend::check_body(body.len(), MAX_BODY)?;
        // A full link is found before any staging copy, so a retry never copies twice.
        let p = self.peer(peer)?;
        if p.full() {
            return Ok(Sent::WouldBlock);
        }
        let mut d = Desc {
            kind: MSG,
            word: body.len() as u32,
            ..Desc::default()
        };
        // What rides in the descriptor: a small body, and after it small data.
        let mut inline = [0u8; INLINE];
        let mut inline_len = 0;
        let mut hold = Vec::new();
        if body.len() > INLINE {
            let Some(b) = self.stage(body.as_ptr(), body.len())? else {
                // (Data to stage as well is found, and added, by the retry.)
                self.pool_starved = Some([body.len(), 0]);
                return Ok(Sent::WouldBlock);
            };
            d.flags |= BODY_IN_POOL;
            d.body_off = pool_offset(&b);
            hold.push(b);
        } else {
            inline[..body.len()].copy_from_slice(body);
            inline_len = body.len();
        }
        let (mut token, mut done_now) = (None, None);
        if let Some((r, range, t)) = data {
            r.check_owner(self.id)?;
            r.check_range(&range)?;
            d.flags |= HAS_DATA;
            d.len = range.len() as u64;
            if d.flags & BODY_IN_POOL == 0 && inline_len + range.len() <= INLINE {
                // Small data is copied into the descriptor: no pages, no release.
                let end = inline_len + range.len();
                // SAFETY: the range was checked; the caller does not write it meanwhile.
                unsafe { r.read(range.start, &mut inline[inline_len..end]) }?;
                inline_len = end;
                d.flags |= DATA_INLINE;
                done_now = Some(t);
            } else {
                match r.place {
                    Place::Pool(off) => {
                        d.off = (off + range.start) as u64;
                        d.flags |= IN_PLACE;
                        hold.push(r.clone());
                        token = Some(t);
                    }
                    Place::Local | Place::Landing(_) if range.is_empty() => done_now = Some(t),
                    Place::Local | Place::Landing(_) => {
                        // SAFETY: the range was checked; the caller does not write it meanwhile.
                        let src = unsafe { r.mem.ptr().add(range.start) };
                        let Some(s) = self.stage(src, range.len())? else {
                            let staged = if d.flags & BODY_IN_POOL != 0 {
                                body.len()
                            } else {
                                0
                            };
                            // Each fits the pool alone, but both at once never would: no
                            // retry could post it.
                            let pages = |n: usize| n.max(1).div_ceil(self.pool.page_size());
                            let total = self.pool.capacity() / self.pool.page_size();
                            if staged > 0 && pages(staged) + pages(range.len()) > total {
                                return Err(
                                    kvstore_shm::ShmError::Exhausted(staged + range.len()).into()
                                );
                            }
                            self.pool_starved = Some([staged, range.len()]);
                            return Ok(Sent::WouldBlock);
                        };
                        self.copies.0 += 1;
                        self.copies.1 += range.len() as u64;
                        d.off = pool_offset(&s);
                        hold.push(s);
                        done_now = Some(t);
                    }
                }
            }
        }
        let p = self.peer(peer)?;
        if !hold.is_empty() {
            d.id = p.next_seq;
        }
        if !p.chan.try_post(&d.encode(&inline[..inline_len]))? {
            p.starved = true;
            return Ok(Sent::WouldBlock);
        }
        p.posted = true;
        p.starved = false;
        if !hold.is_empty() {
            p.next_seq += 1;
            p.refs.insert(d.id, RefOut { token, _hold: hold });
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
        crate::backend::check_put(src, &range, dst, None, offset, imm)?;
        let n = range.len();
        let p = self.peer(peer)?;
        if p.revoked.contains(&dst.id) {
            return Err(TransportError::Refused(format!("{dst:?} was revoked")));
        }
        // A full link is found before the copy, so a retry never copies twice.
        if p.full() {
            return Ok(Sent::WouldBlock);
        }
        // SAFETY: the range was checked; the caller does not write it until the token completes
        // (which is before this returns: the copy is made here).
        let from = unsafe { src.mem.ptr().add(range.start) } as *const u8;
        match dst.kind {
            KIND_SEG => {
                let whole = kvstore_shm::Region {
                    offset: dst.addr as usize,
                    len: dst.len as usize,
                };
                // Only pages the peer allocated, inside its landing pool.
                p.their_landing.check_span(whole.offset, whole.len)?;
                if n > 0 {
                    let to = p.their_landing_seg.ptr_mut(whole.offset + offset, n)?;
                    // SAFETY: `to` is inside the peer's mapped landing pool (checked), which
                    // cannot overlap `from` (this process's memory, or its own pools); `from`
                    // is valid for `n` bytes (the region's contract and the range check).
                    unsafe { crate::copy::copy_nonoverlapping(from, to, n) };
                }
            }
            KIND_CMA if p.i_write_peer => {
                // SAFETY: `from` is valid for `n` bytes, as above.
                unsafe { p.proc.write(dst.addr.wrapping_add(offset as u64), from, n) }?;
            }
            _ => {
                return Err(TransportError::Refused(format!(
                    "{dst:?} is not a shared-memory grant this process can write"
                )))
            }
        }
        let d = Desc {
            kind: PUT,
            word: imm,
            id: dst.id,
            off: offset as u64,
            len: n as u64,
            ..Desc::default()
        };
        if !p.chan.try_post(&d.encode(&[]))? {
            p.starved = true;
            return Ok(Sent::WouldBlock);
        }
        p.posted = true;
        if n > 0 {
            self.copies.0 += 1;
            self.copies.1 += n as u64;
        }
        self.done.push_back((token, None));
        Ok(Sent::Posted)
    }

    fn flush(&mut self) -> Result<(), TransportError> {
        // A peer whose ring or wake-up words make no sense is lost, alone.
        let mut broken = Vec::new();
        for (id, p) in self.peers.iter_mut() {
            let r = push_unsent(p).and_then(|()| {
                if std::mem::take(&mut p.posted) {
                    p.chan.wake_peer()?;
                }
                Ok(())
            });
            if let Err(e) = r {
                broken.push((id, e));
            }
        }
        for (id, e) in broken {
            self.lose(PeerId(id), e);
        }
        Ok(())
    }

    fn id(&self) -> u64 {
        self.id
    }

    fn arm(&mut self) -> Result<bool, TransportError> {
        if !self.done.is_empty() || !self.lost.is_empty() {
            return Ok(false);
        }
        // Pages a send was told to wait for, freed since by this side's own progress (the
        // peer's releases it took): no wake-up is left for them, so it tries again now.
        if self.pool_starved.is_some_and(|n| pool_has(&self.pool, n)) {
            self.pool_starved = None;
            return Ok(false);
        }
        self.armed = true;
        for (_, p) in self.peers.iter_mut() {
            // Descriptors waiting for room, or a caller told to wait for it: the peer rings
            // when it frees a slot, unless there is room already (then post, or retry, now).
            if (p.starved || !p.unsent.is_empty()) && p.chan.want_room()? {
                p.starved = false;
                return Ok(false);
            }
            // A paused peer's ring is not read, nor one whose answers wait for room (the
            // room's wake-up above reads it again), so what waits there is no work yet.
            if !p.paused && p.unsent.len() < UNSENT_MAX && !p.chan.arm_rx()? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    fn fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the poll's descriptor lives as long as `self`, which the borrow is tied to.
        unsafe { BorrowedFd::borrow_raw(self.poll.as_raw_fd()) }
    }

    fn progress(&mut self, on: &mut dyn FnMut(Completion<'_>)) -> Result<usize, TransportError> {
        let mut n = 0;
        if std::mem::take(&mut self.armed) {
            for p in self.peers.values() {
                p.chan.disarm_rx()?;
            }
        } else {
            // A busy loop: the rings are all there is to look at, and the clock is read only
            // now and then.
            self.calls = self.calls.wrapping_add(1);
            if self.calls % 32 != 0 || self.last_poll.elapsed() < POLL_EVERY {
                return self.progress_rings(on, n);
            }
        }
        self.last_poll = Instant::now();
        self.release_quarantine();
        if self.accept_retry.due() {
            self.accept_all()?;
        }
        match self.poll.poll(&mut self.events, Some(Duration::ZERO)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
        let ready: Vec<usize> = self.events.iter().map(|e| e.token().0).collect();
        for t in ready {
            if t == LISTENER.0 {
                self.accept_all()?;
            } else if t >= HANDSHAKE {
                self.handshake(t - HANDSHAKE, on, &mut n);
            } else if let Some(p) = self.peers.get(&((t / 2) as u32)) {
                if t % 2 == 1 {
                    drain(&p.bell);
                } else {
                    // After the handshake the socket only says the peer is gone: its end
                    // closed, an error, or bytes it had no reason to send.
                    let gone = match (&p.sock).read(&mut [0u8; 1]) {
                        Ok(0) => Some(TransportError::Closed),
                        Ok(_) => Some(TransportError::Refused(
                            "bytes on the socket after the handshake".into(),
                        )),
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => None,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => None,
                        Err(e) => Some(e.into()),
                    };
                    if let Some(e) = gone {
                        self.read_remains((t / 2) as u32, on, &mut n);
                        self.lose(PeerId((t / 2) as u32), e);
                    }
                }
            }
        }
        self.expire_handshakes();
        self.progress_rings(on, n)
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

impl ShmBackend {
    /// Takes what the rings hold and reports what completed.
    fn progress_rings(
        &mut self,
        on: &mut dyn FnMut(Completion<'_>),
        mut n: usize,
    ) -> Result<usize, TransportError> {
        let mut ids = std::mem::take(&mut self.ids);
        ids.clear();
        ids.extend(self.peers.keys());
        for &id in &ids {
            if let Err(e) = self.read_peer(id, on, &mut n) {
                self.lose(PeerId(id), e);
            }
        }
        self.ids = ids;
        n += crate::backend::deliver(&mut self.done, &mut self.lost, on);
        Ok(n)
    }
}

fn pool_offset(r: &Region) -> u64 {
    match r.place {
        Place::Pool(off) => off as u64,
        Place::Local | Place::Landing(_) => 0,
    }
}

impl AsFd for ShmBackend {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd()
    }
}

impl Drop for ShmBackend {
    fn drop(&mut self) {
        // Memory a living peer may still write is never given back to the allocator.
        self.release_quarantine();
        let keep = std::mem::take(&mut self.quarantine);
        let live: Vec<Region> = self
            .grants
            .drain()
            .filter(|(_, g)| self.peers.get(&g.peer.0).is_some_and(|p| !p.proc.exited()))
            .flat_map(|(_, g)| std::iter::once(g.region).chain(g.bounce))
            .collect();
        std::mem::forget(keep);
        std::mem::forget(live);
    }
}
