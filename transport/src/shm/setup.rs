//! Making links: listening, connecting, and the handshakes of the links that come in.

use super::*;

impl ShmBackend {
    /// Listens under `name` (an abstract Unix socket: per network namespace, nothing on disk).
    pub fn listen(&mut self, name: &str) -> Result<(), TransportError> {
        let l = UnixListener::bind_addr(&addr(name)?)?;
        l.set_nonblocking(true)?;
        self.poll.registry().register(
            &mut SourceFd(&l.as_raw_fd()),
            LISTENER,
            Interest::READABLE,
        )?;
        self.listener = Some(l);
        Ok(())
    }

    /// Connects to the backend listening under `name`, waiting up to `timeout`.
    pub fn connect(&mut self, name: &str, timeout: Duration) -> Result<PeerId, TransportError> {
        let deadline = Instant::now() + timeout;
        let sock = connect_by(name, deadline)?;
        let mut proc = PeerProcess::of(&sock)?;
        sock.set_read_timeout(Some(
            deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1)),
        ))?;
        let chan = Channel::create(
            &format!("{}-link", self.name),
            ChannelConfig {
                ring_slots: self.cfg.ring_slots,
                page_size: 4096,
                pages: 1,
            },
        )?;
        let (bell, ring) = kvstore_shm::doorbell()?;
        let me = Hello {
            canary: self.canary.as_ptr() as u64,
            wrote: false,
        };
        send_hello(
            &sock,
            &me,
            &[
                chan.segment().fd(),
                self.pool_seg.fd(),
                self.landing_seg.fd(),
                ring.as_fd(),
            ],
        )?;
        let (reply, mut fds) = recv_hello(&sock, 3).map_err(|e| match e {
            TransportError::Io(e) | TransportError::Shm(kvstore_shm::ShmError::Io(e))
                if e.kind() == std::io::ErrorKind::WouldBlock =>
            {
                TransportError::Timeout(format!("the shared-memory handshake with {name}"))
            }
            e => e,
        })?;
        let their_bell = link::take_bell(&mut fds)?;
        let (their_landing_seg, their_landing) =
            attach_pool(take_fd(&mut fds, "landing pool")?, true)?;
        let (their_seg, their_pool) = attach_pool(take_fd(&mut fds, "pool")?, false)?;
        let mut chan = chan;
        chan.set_tx_doorbell(their_bell);
        let i_write_peer = self.cfg.cross_memory && proc.probe(reply.canary);
        let parts = Parts {
            chan,
            sock,
            proc,
            their_seg,
            their_pool,
            their_landing_seg,
            their_landing,
            bell,
            peer_writes_me: reply.wrote,
            i_write_peer,
        };
        let peer = self.add(parts)?;
        let caps = Desc {
            kind: CAPS,
            flags: i_write_peer as u8,
            ..Desc::default()
        };
        self.post_control(peer, caps.encode(&[]));
        Ok(peer)
    }

    pub(super) fn add(&mut self, p: Parts) -> Result<PeerId, TransportError> {
        p.sock.set_nonblocking(true)?;
        let id = self.next_peer;
        self.next_peer += 1;
        let r = self.poll.registry();
        r.register(
            &mut SourceFd(&p.sock.as_raw_fd()),
            mio::Token(2 * id as usize),
            Interest::READABLE,
        )?;
        r.register(
            &mut SourceFd(&p.bell.as_raw_fd()),
            mio::Token(2 * id as usize + 1),
            Interest::READABLE,
        )?;
        self.peers.insert(
            id,
            Peer {
                chan: p.chan,
                sock: p.sock,
                proc: p.proc,
                their_seg: p.their_seg,
                their_pool: p.their_pool,
                their_landing_seg: p.their_landing_seg,
                their_landing: p.their_landing,
                bell: p.bell,
                peer_writes_me: p.peer_writes_me,
                i_write_peer: p.i_write_peer,
                refs: FxHashMap::default(),
                next_seq: 1,
                revoked: FxHashSet::default(),
                held: FxHashSet::default(),
                unsent: VecDeque::new(),
                starved: false,
                posted: false,
                rxbuf: Vec::new(),
                paused: false,
            },
        );
        Ok(PeerId(id))
    }

    pub(super) fn accept_all(&mut self) -> Result<(), TransportError> {
        while let Some(l) = &self.listener {
            let sock = match l.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionAborted => continue,
                // Out of descriptors or memory: tried again shortly.
                Err(_) => {
                    self.accept_retry.failed();
                    return Ok(());
                }
            };
            // Another user's process is refused before it costs anything, and so is one
            // beyond the handshakes already waiting.
            let Ok(proc) = PeerProcess::of(&sock) else {
                continue;
            };
            if self.pending.len() >= crate::backend::MAX_PENDING
                || sock.set_nonblocking(true).is_err()
            {
                continue;
            }
            let k = self.next_pending;
            self.next_pending += 1;
            if self
                .poll
                .registry()
                .register(
                    &mut SourceFd(&sock.as_raw_fd()),
                    mio::Token(HANDSHAKE + k),
                    Interest::READABLE,
                )
                .is_err()
            {
                continue;
            }
            self.pending.insert(
                k,
                Pending {
                    sock,
                    proc,
                    deadline: Instant::now() + self.cfg.handshake_timeout,
                },
            );
        }
        Ok(())
    }

    pub(super) fn handshake(
        &mut self,
        k: usize,
        on: &mut dyn FnMut(Completion<'_>),
        n: &mut usize,
    ) {
        let Some(p) = self.pending.get(&k) else {
            return;
        };
        let res = recv_hello(&p.sock, 4);
        if matches!(&res, Err(TransportError::Shm(kvstore_shm::ShmError::Io(e))) if e.kind() == std::io::ErrorKind::WouldBlock)
        {
            return;
        }
        let Some(p) = self.pending.remove(&k) else {
            return;
        };
        let _ = self
            .poll
            .registry()
            .deregister(&mut SourceFd(&p.sock.as_raw_fd()));
        let Ok((hello, fds)) = res else { return };
        let parts = accept_parts(
            p.sock,
            p.proc,
            hello,
            fds,
            [&self.pool_seg, &self.landing_seg],
            self.canary.as_ptr() as u64,
            self.cfg.cross_memory,
        );
        if let Ok(peer) = parts.and_then(|parts| self.add(parts)) {
            *n += 1;
            on(Completion::Connected { peer });
        }
    }

    pub(super) fn expire_handshakes(&mut self) {
        let now = Instant::now();
        let old: Vec<usize> = self
            .pending
            .iter()
            .filter(|(_, p)| p.deadline <= now)
            .map(|(&k, _)| k)
            .collect();
        for k in old {
            if let Some(p) = self.pending.remove(&k) {
                let _ = self
                    .poll
                    .registry()
                    .deregister(&mut SourceFd(&p.sock.as_raw_fd()));
            }
        }
    }
}
