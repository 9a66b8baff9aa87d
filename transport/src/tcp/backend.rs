//! [`Backend`] over TCP: framed messages on non-blocking sockets, one mio poll for all peers.
//!
//! A message is a frame whose payload is its body and then its data; the receiver reads it into
//! one buffer of its own and lends both. A put is a frame naming a grant: its payload is read
//! straight into the granted memory, with no buffer in between. Sends are queued per peer and
//! written with `writev` straight from the caller's memory; a token completes when its frame is
//! in the kernel. A grant is fenced locally (the receiver does every write itself), so a revoke
//! completes at once, and a frame that was already on its way into a revoked grant is read into
//! scratch instead.

use rustc_hash::FxHashMap;
use std::collections::VecDeque;
use std::io;
use std::net::SocketAddr;
use std::ops::Range;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;
use std::time::Duration;

use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll};

use super::link::{
    meta, write_out, Admission, Grant, Out, Peer, Rx, Sink, MAX_BODY, MSG, PUT, READ_BUDGET,
};
use super::{FrameReader, OutQueue};
use crate::backend::{fresh_id, Place};
use crate::frame::FrameHeader;
use crate::table::PeerTable;
use crate::{
    Access, Backend, Completion, PeerId, Region, RemoteRegion, Sent, Storage, Token, TransportError,
};

const KIND_TCP: u32 = 1;
/// Bytes queued for one peer beyond which a send answers "would block".
const MAX_QUEUED: usize = 8 << 20;
const LISTENER: mio::Token = mio::Token(usize::MAX);

/// TCP as a [`Backend`].
pub struct TcpBackend {
    id: u64,
    poll: Poll,
    events: Events,
    /// `events` came from a sleep and are not yet handled.
    slept: bool,
    listener: Option<TcpListener>,
    peers: PeerTable<Peer>,
    next_peer: u32,
    grants: FxHashMap<u64, Grant>,
    next_grant: u64,
    done: VecDeque<(Token, Option<TransportError>)>,
    lost: VecDeque<(PeerId, TransportError)>,
    max_payload: u64,
    /// The largest payload a peer that connected here may send until its owner trusts it
    /// ([`TcpBackend::set_max_payload`]): a stranger's frames cost little.
    accepted_max: u64,
    /// Peers resumed after a pause: read at the next progress (their readiness came and went).
    resumed: Vec<u32>,
    /// Whether some peer's caller was told "would block" ([`Peer::starved`]): `arm` looks at
    /// the peers only then.
    starved: bool,
    accept_retry: crate::backend::AcceptRetry,
    /// Judges each message with data by its body before the data is read.
    admission: Option<Box<Admission>>,
}

/// The header of a message frame as this backend writes it, for a body of `body_len` bytes
/// followed by `data_len` bytes of data: for tools and tests that play a peer by hand.
pub fn msg_frame_header(body_len: usize, data_len: Option<usize>) -> [u8; crate::HEADER_LEN] {
    FrameHeader::new(
        meta(MSG, data_len.is_some(), body_len as u32, 0, 0),
        (body_len + data_len.unwrap_or(0)) as u64,
    )
    .encode()
}

impl TcpBackend {
    /// A backend with no peers, refusing frames over `max_payload` bytes.
    pub fn new(max_payload: u64) -> Result<TcpBackend, TransportError> {
        Ok(TcpBackend {
            id: fresh_id(),
            poll: Poll::new()?,
            events: Events::with_capacity(256),
            slept: false,
            listener: None,
            peers: PeerTable::new(),
            next_peer: 0,
            grants: FxHashMap::default(),
            next_grant: 1,
            done: VecDeque::new(),
            lost: VecDeque::new(),
            max_payload,
            accepted_max: max_payload,
            resumed: Vec::new(),
            starved: false,
            accept_retry: Default::default(),
            admission: None,
        })
    }

    /// Listens on `addr`; peers that connect are reported as [`Completion::Connected`].
    pub fn listen(&mut self, addr: SocketAddr) -> Result<SocketAddr, TransportError> {
        let mut l = TcpListener::bind(addr)?;
        self.poll
            .registry()
            .register(&mut l, LISTENER, Interest::READABLE)?;
        let at = l.local_addr()?;
        self.listener = Some(l);
        Ok(at)
    }

    /// Connects to a listening backend, retrying until `timeout`.
    pub fn connect(
        &mut self,
        addr: SocketAddr,
        timeout: Duration,
    ) -> Result<PeerId, TransportError> {
        let s = super::connect_retry(addr, timeout)?;
        s.set_nonblocking(true)?;
        self.add(TcpStream::from_std(s), self.max_payload)
    }

    /// Peers that connect to this backend's listener may send payloads of at most `max` bytes
    /// until [`TcpBackend::set_max_payload`] raises it for them (after their hello).
    pub fn set_accepted_max_payload(&mut self, max: u64) {
        self.accepted_max = max.min(self.max_payload);
    }

    /// Has every message that brings data judged by `admit` (peer, body, bytes of data) once
    /// its body is in and before its data is read ([`Admission`]): a refusal closes that link,
    /// and data the owner does not want is read into scratch and dropped, so a message the
    /// owner would refuse never costs the memory of its data.
    pub fn set_admission(&mut self, admit: Box<Admission>) {
        self.admission = Some(admit);
    }

    /// The largest payload `peer` may send from now on (at most the backend's).
    pub fn set_max_payload(&mut self, peer: PeerId, max: u64) {
        let max = max.min(self.max_payload);
        if let Some(p) = self.peers.get_mut(&peer.0) {
            p.reader.set_max_payload(max);
        }
    }

    fn add(&mut self, mut stream: TcpStream, max_payload: u64) -> Result<PeerId, TransportError> {
        stream.set_nodelay(true)?;
        liveness(&stream)?;
        let id = self.next_peer;
        self.next_peer += 1;
        self.poll.registry().register(
            &mut stream,
            mio::Token(id as usize),
            Interest::READABLE | Interest::WRITABLE,
        )?;
        self.peers.insert(
            id,
            Peer {
                stream,
                reader: FrameReader::new(max_payload),
                rx: Rx::default(),
                out: OutQueue::new(),
                paused: false,
                starved: false,
            },
        );
        Ok(PeerId(id))
    }

    /// Whether no peer is connected and nothing is left to report: then only the listener (if
    /// any) can bring work, and a busy loop may look at it less often.
    pub fn is_idle(&self) -> bool {
        self.peers.is_empty() && self.done.is_empty() && self.lost.is_empty()
    }

    /// Whether any peer is connected.
    pub fn has_peers(&self) -> bool {
        !self.peers.is_empty()
    }

    fn peer(&mut self, peer: PeerId) -> Result<&mut Peer, TransportError> {
        self.peers
            .get_mut(&peer.0)
            .ok_or_else(|| TransportError::PeerLost(format!("{peer} is not connected")))
    }

    fn lose(&mut self, peer: PeerId, error: TransportError) {
        let Some(mut p) = self.peers.remove(&peer.0) else {
            return;
        };
        let _ = self.poll.registry().deregister(&mut p.stream);
        for o in p.out.drain() {
            if let Some(t) = o.token {
                self.done.push_back((
                    t,
                    Some(TransportError::PeerLost(format!("{peer}: {error}"))),
                ));
            }
        }
        // The connection is closed: nothing more can arrive, so every grant to it is fenced.
        self.grants.retain(|_, g| g.peer != peer);
        self.lost.push_back((peer, error));
    }

    fn enqueue(&mut self, peer: PeerId, hdr: FrameHeader, o: Out) -> Result<Sent, TransportError> {
        let p = self.peer(peer)?;
        if p.out.pending_bytes() >= MAX_QUEUED {
            p.starved = true;
            self.starved = true;
            return Ok(Sent::WouldBlock);
        }
        p.out.push(hdr.encode(), o);
        p.starved = false;
        Ok(Sent::Posted)
    }

    /// Writes what `peer` has queued until the socket would block.
    fn write_peer(&mut self, id: u32) {
        let Some(p) = self.peers.get_mut(&id) else {
            return;
        };
        match write_out(p, &mut self.done) {
            Ok(()) => {}
            Err(e) => self.lose(PeerId(id), e.into()),
        }
    }

    fn read_peer(&mut self, id: u32, on: &mut dyn FnMut(Completion<'_>), n: &mut usize) {
        let Some(p) = self.peers.get_mut(&id) else {
            return;
        };
        if p.paused {
            return;
        }
        let mut sink = Sink {
            peer: PeerId(id),
            rx: &mut p.rx,
            grants: &self.grants,
            next_grant: self.next_grant,
            on,
            n,
            budget: READ_BUDGET,
            admit: self.admission.as_deref_mut(),
        };
        let res = p.reader.read_from(&mut p.stream, &mut sink);
        let more = sink.budget == 0;
        match res {
            Err(e) => self.lose(PeerId(id), e),
            // Stopped before the socket was drained: its readiness will not come again.
            Ok(()) if more => self.resumed.push(id),
            Ok(()) => {}
        }
    }
}

impl Backend for TcpBackend {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn id(&self) -> u64 {
        self.id
    }

    fn max_body(&self) -> usize {
        MAX_BODY
    }

    fn register(&mut self, mem: Arc<dyn Storage>) -> Result<Region, TransportError> {
        Ok(Region::new(self.id, mem, Place::Local))
    }

    fn alloc(&mut self, len: usize, _access: Access) -> Result<Region, TransportError> {
        self.register(crate::Mem::zeroed_or_refused(len)?)
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
        let id = self.next_grant;
        self.next_grant += 1;
        let len = range.len() as u64;
        self.grants.insert(
            id,
            Grant {
                peer,
                region: r.clone(),
                range,
            },
        );
        Ok(RemoteRegion {
            key: 0,
            kind: KIND_TCP,
            id,
            addr: 0,
            len,
        })
    }

    fn revoke(
        &mut self,
        _peer: PeerId,
        grant: &RemoteRegion,
        token: Token,
    ) -> Result<(), TransportError> {
        // Only this process writes granted memory (from its own socket), so dropping the grant
        // is the fence.
        self.grants.remove(&grant.id);
        self.done.push_back((token, None));
        Ok(())
    }

    fn forget(&mut self, _peer: PeerId, grant: &RemoteRegion) {
        self.grants.remove(&grant.id);
    }

    unsafe fn send(
        &mut self,
        peer: PeerId,
        body: &[u8],
        data: Option<(&Region, Range<usize>, Token)>,
    ) -> Result<Sent, TransportError> {
        crate::backend::check_body(body.len(), MAX_BODY)?;
        let (data, token) = match data {
            Some((r, range, t)) => {
                // Another backend's region may be memory a peer writes (landing pages).
                r.check_owner(self.id)?;
                r.check_range(&range)?;
                (Some((r.clone(), range)), Some(t))
            }
            None => (None, None),
        };
        let dlen = data.as_ref().map_or(0, |(_, r)| r.len());
        let hdr = FrameHeader::new(
            meta(MSG, data.is_some(), body.len() as u32, 0, 0),
            (body.len() + dlen) as u64,
        );
        self.enqueue(
            peer,
            hdr,
            Out {
                body: body.to_vec(),
                data,
                token,
            },
        )
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
        crate::backend::check_put(src, &range, dst, Some(KIND_TCP), offset, imm)?;
        let hdr = FrameHeader::new(
            meta(PUT, true, imm, dst.id, offset as u64),
            range.len() as u64,
        );
        self.enqueue(
            peer,
            hdr,
            Out {
                body: Vec::new(),
                data: Some((src.clone(), range)),
                token: Some(token),
            },
        )
    }

    fn flush(&mut self) -> Result<(), TransportError> {
        let mut failed = Vec::new();
        for (id, p) in self.peers.iter_mut() {
            if !p.out.is_empty() {
                if let Err(e) = write_out(p, &mut self.done) {
                    failed.push((id, e));
                }
            }
        }
        for (id, e) in failed {
            self.lose(PeerId(id), e.into());
        }
        Ok(())
    }

    fn arm(&mut self) -> Result<bool, TransportError> {
        if !self.done.is_empty() || !self.lost.is_empty() || !self.resumed.is_empty() {
            return Ok(false);
        }
        // A caller told to wait for room whose queue drained since (its own flush or progress
        // wrote it out, so no readiness will come): it retries instead of sleeping.
        let mut room = false;
        if std::mem::take(&mut self.starved) {
            for (_, p) in self.peers.iter_mut() {
                if p.starved && p.out.pending_bytes() < MAX_QUEUED {
                    p.starved = false;
                    room = true;
                }
                self.starved |= p.starved;
            }
        }
        Ok(!room)
    }

    fn fd(&self) -> BorrowedFd<'_> {
        use std::os::fd::AsRawFd;
        // SAFETY: the poll's descriptor lives as long as `self`, which the borrow is tied to.
        unsafe { BorrowedFd::borrow_raw(self.poll.as_raw_fd()) }
    }

    fn progress(&mut self, on: &mut dyn FnMut(Completion<'_>)) -> Result<usize, TransportError> {
        let mut n = 0;
        if std::mem::take(&mut self.slept) {
            // The events of the sleep are handled now.
        } else if self.done.is_empty() && self.lost.is_empty() {
            self.poll_events(Duration::ZERO)?;
        } else {
            // Completions are pending: they are reported now, and the sockets looked at on
            // the next call (one system call fewer on every send that completed at once).
            self.events.clear();
        }
        let ready: Vec<(mio::Token, bool, bool)> = self
            .events
            .iter()
            .map(|e| {
                (
                    e.token(),
                    e.is_readable() || e.is_read_closed(),
                    e.is_writable(),
                )
            })
            .collect();
        for id in std::mem::take(&mut self.resumed) {
            self.read_peer(id, on, &mut n);
        }
        if self.accept_retry.due() {
            self.accept_all(on, &mut n)?;
        }
        for (t, readable, writable) in ready {
            if t == LISTENER {
                self.accept_all(on, &mut n)?;
                continue;
            }
            let id = t.0 as u32;
            if writable {
                self.write_peer(id);
            }
            if readable {
                self.read_peer(id, on, &mut n);
            }
        }
        n += crate::backend::deliver(&mut self.done, &mut self.lost, on);
        Ok(n)
    }

    fn close(&mut self, peer: PeerId) {
        self.lose(peer, TransportError::Closed);
    }

    fn pause(&mut self, peer: PeerId, paused: bool) {
        if let Some(p) = self.peers.get_mut(&peer.0) {
            if p.paused && !paused {
                self.resumed.push(peer.0);
            }
            p.paused = paused;
        }
    }

    fn trust(&mut self, peer: PeerId) -> Result<(), TransportError> {
        self.set_max_payload(peer, u64::MAX);
        Ok(())
    }
}

impl TcpBackend {
    fn poll_events(&mut self, timeout: Duration) -> io::Result<()> {
        match self.poll.poll(&mut self.events, Some(timeout)) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {
                self.events.clear();
                Ok(())
            }
            r => r,
        }
    }

    /// Sleeps until a peer has work or `timeout` passes, when TCP is all a loop waits on: one
    /// system call, whose events the next [`Backend::progress`] handles (instead of arming,
    /// sleeping on [`Backend::fd`] and polling again). Returns at once if work is pending.
    pub fn sleep(&mut self, timeout: Duration) -> Result<(), TransportError> {
        if !self.arm()? || self.slept {
            return Ok(());
        }
        self.poll_events(timeout)?;
        self.slept = true;
        Ok(())
    }

    fn accept_all(
        &mut self,
        on: &mut dyn FnMut(Completion<'_>),
        n: &mut usize,
    ) -> Result<(), TransportError> {
        loop {
            let Some(l) = &self.listener else {
                return Ok(());
            };
            match l.accept() {
                // A connection that cannot be set up is dropped; the listener goes on.
                Ok((s, _)) => {
                    if let Ok(peer) = self.add(s, self.accepted_max) {
                        *n += 1;
                        on(Completion::Connected { peer });
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::ConnectionAborted => {}
                // Out of descriptors or memory: the connections wait in the backlog, and the
                // accept is tried again shortly.
                Err(_) => {
                    self.accept_retry.failed();
                    return Ok(());
                }
            }
        }
    }
}

impl AsFd for TcpBackend {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd()
    }
}

/// A peer's death is seen by the kernel, whatever the peer's threads are doing: an exit closes
/// the connection (EOF or reset); a host that is gone is found by keepalive probes after
/// `KEEPALIVE_IDLE` of silence (`KEEPALIVE_PROBES` unanswered, `KEEPALIVE_INTERVAL` apart),
/// and data left unacknowledged for `USER_TIMEOUT` ends the connection. So a worker computing
/// between calls, or a server in a long updater, is never taken for dead, and needs no thread
/// to answer heartbeats.
pub(crate) fn liveness(s: impl std::os::fd::AsFd) -> std::io::Result<()> {
    use rustix::net::sockopt;
    let s = s.as_fd();
    sockopt::set_socket_keepalive(s, true)?;
    sockopt::set_tcp_keepidle(s, KEEPALIVE_IDLE)?;
    sockopt::set_tcp_keepintvl(s, KEEPALIVE_INTERVAL)?;
    sockopt::set_tcp_keepcnt(s, KEEPALIVE_PROBES)?;
    sockopt::set_tcp_user_timeout(s, USER_TIMEOUT.as_millis() as u32)?;
    Ok(())
}

/// Silence on a connection before the kernel probes the peer.
pub const KEEPALIVE_IDLE: Duration = Duration::from_secs(5);
/// Time between probes.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(1);
/// Unanswered probes before the connection is declared dead.
pub const KEEPALIVE_PROBES: u32 = 5;
/// How long sent data may stay unacknowledged before the connection is declared dead.
pub const USER_TIMEOUT: Duration = Duration::from_secs(10);

#[cfg(test)]
mod tests {
    use super::*;
    use rustix::net::sockopt;

    #[test]
    fn both_ends_of_a_link_have_the_kernel_watch_the_peer() {
        let mut server = TcpBackend::new(1 << 20).unwrap();
        let at = server.listen("127.0.0.1:0".parse().unwrap()).unwrap();
        let mut client = TcpBackend::new(1 << 20).unwrap();
        client.connect(at, Duration::from_secs(5)).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while server.peers.is_empty() {
            server.progress(&mut |_| {}).unwrap();
            assert!(std::time::Instant::now() < deadline, "no connection");
        }
        for b in [&server, &client] {
            let s = &b.peers.values().next().unwrap().stream;
            assert!(sockopt::socket_keepalive(s).unwrap());
            assert_eq!(sockopt::tcp_keepidle(s).unwrap(), KEEPALIVE_IDLE);
            assert_eq!(sockopt::tcp_keepintvl(s).unwrap(), KEEPALIVE_INTERVAL);
            assert_eq!(sockopt::tcp_keepcnt(s).unwrap(), KEEPALIVE_PROBES);
            let ut = sockopt::tcp_user_timeout(s).unwrap();
            assert_eq!(ut as u128, USER_TIMEOUT.as_millis());
        }
    }
}
