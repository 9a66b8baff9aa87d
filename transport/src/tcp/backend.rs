//! [`Backend`] over TCP: framed messages on non-blocking sockets, one mio poll for all peers.
//!
//! A message is a frame whose payload is its body and then its data; the receiver reads it into
//! one buffer of its own and lends both. A put is a frame naming a grant: its payload is read
//! straight into the granted memory, with no buffer in between. Sends are queued per peer and
//! written with `writev` straight from the caller's memory; a token completes when its frame is
//! in the kernel. A grant is fenced locally (the receiver does every write itself), so a revoke
//! completes at once, and a frame that was already on its way into a revoked grant is read into
//! scratch instead.

use std::collections::{HashMap, VecDeque};
use std::io::{self, IoSlice, Write};
use std::net::SocketAddr;
use std::ops::Range;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;
use std::time::Duration;

use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll};

use super::{FrameReader, FrameSink};
use crate::backend::{fresh_id, Place};
use crate::frame::{FrameHeader, HEADER_LEN, META_LEN};
use crate::table::PeerTable;
use crate::{
    Backend, Completion, Lent, PeerId, Region, RemoteRegion, Sent, Storage, Token, TransportError,
};

const MSG: u8 = 1;
const PUT: u8 = 2;
const KIND_TCP: u32 = 1;
/// The largest message body.
pub const MAX_BODY: usize = 64 * 1024;
/// Bytes queued for one peer beyond which a send answers "would block".
const MAX_QUEUED: usize = 8 << 20;
const LISTENER: mio::Token = mio::Token(usize::MAX);
const MAX_IOV: usize = 64;

struct Out {
    hdr: [u8; HEADER_LEN],
    body: Vec<u8>,
    data: Option<(Region, Range<usize>)>,
    token: Option<Token>,
}

impl Out {
    fn total(&self) -> usize {
        HEADER_LEN + self.body.len() + self.data.as_ref().map_or(0, |(_, r)| r.len())
    }
}

/// The bytes of a queued frame's data. Safe to view: the caller of `send`/`put` promised not to
/// write them until the token completes, and the region holds the storage alive.
fn data_slice(d: &Option<(Region, Range<usize>)>) -> &[u8] {
    match d {
        // SAFETY: the range was checked against the region when posted; the storage is valid
        // and unwritten while queued (the caller's side of `send`/`put`).
        Some((r, range)) => unsafe {
            std::slice::from_raw_parts(r.mem.ptr().add(range.start), range.len())
        },
        None => &[],
    }
}

#[derive(Default)]
struct Rx {
    buf: Vec<u8>,
    scratch: Vec<u8>,
    kind: u8,
    body_len: usize,
    has_data: bool,
    /// The put in progress: grant, offset, immediate, and whether the grant is live.
    put: Option<(u64, usize, u32, bool)>,
}

struct Peer {
    stream: TcpStream,
    reader: FrameReader,
    rx: Rx,
    out: VecDeque<Out>,
    off: usize,
    queued: usize,
}

struct Grant {
    peer: PeerId,
    region: Region,
    range: Range<usize>,
}

/// TCP as a [`Backend`].
pub struct TcpBackend {
    id: u64,
    poll: Poll,
    events: Events,
    listener: Option<TcpListener>,
    peers: PeerTable<Peer>,
    next_peer: u32,
    grants: HashMap<u64, Grant>,
    next_grant: u64,
    done: VecDeque<(Token, Option<TransportError>)>,
    lost: VecDeque<(PeerId, TransportError)>,
    max_payload: u64,
}

fn meta(kind: u8, has_data: bool, word: u32, grant: u64, offset: u64) -> [u8; META_LEN] {
    let mut m = [0u8; META_LEN];
    m[0] = kind;
    m[1] = has_data as u8;
    m[4..8].copy_from_slice(&word.to_le_bytes());
    m[8..16].copy_from_slice(&grant.to_le_bytes());
    m[16..24].copy_from_slice(&offset.to_le_bytes());
    m
}

fn word(m: &[u8; META_LEN], r: Range<usize>) -> u64 {
    let mut b = [0u8; 8];
    b[..r.len()].copy_from_slice(&m[r]);
    u64::from_le_bytes(b)
}

impl TcpBackend {
    /// A backend with no peers, refusing frames over `max_payload` bytes.
    pub fn new(max_payload: u64) -> Result<TcpBackend, TransportError> {
        Ok(TcpBackend {
            id: fresh_id(),
            poll: Poll::new()?,
            events: Events::with_capacity(256),
            listener: None,
            peers: PeerTable::new(),
            next_peer: 0,
            grants: HashMap::new(),
            next_grant: 1,
            done: VecDeque::new(),
            lost: VecDeque::new(),
            max_payload,
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
        self.add(TcpStream::from_std(s))
    }

    /// The number of peers connected.
    pub fn peers(&self) -> usize {
        self.peers.len()
    }

    fn add(&mut self, mut stream: TcpStream) -> Result<PeerId, TransportError> {
        stream.set_nodelay(true)?;
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
                reader: FrameReader::new(self.max_payload),
                rx: Rx::default(),
                out: VecDeque::new(),
                off: 0,
                queued: 0,
            },
        );
        Ok(PeerId(id))
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
        for o in p.out.drain(..) {
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

    fn enqueue(&mut self, peer: PeerId, o: Out) -> Result<Sent, TransportError> {
        let p = self.peer(peer)?;
        if p.queued >= MAX_QUEUED {
            return Ok(Sent::WouldBlock);
        }
        p.queued += o.total();
        p.out.push_back(o);
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
        let mut sink = Sink {
            peer: PeerId(id),
            rx: &mut p.rx,
            grants: &self.grants,
            next_grant: self.next_grant,
            on,
            n,
        };
        if let Err(e) = p.reader.read_from(&mut p.stream, &mut sink) {
            self.lose(PeerId(id), e);
        }
    }
}

fn write_out(p: &mut Peer, done: &mut VecDeque<(Token, Option<TransportError>)>) -> io::Result<()> {
    while !p.out.is_empty() {
        let res = {
            let mut iov = [IoSlice::new(&[]); MAX_IOV];
            let mut n = 0;
            let mut skip = p.off;
            for o in p.out.iter() {
                if n + 3 > MAX_IOV {
                    break;
                }
                for part in [&o.hdr[..], &o.body[..], data_slice(&o.data)] {
                    if skip >= part.len() {
                        skip -= part.len();
                        continue;
                    }
                    iov[n] = IoSlice::new(&part[skip..]);
                    skip = 0;
                    n += 1;
                }
            }
            p.stream.write_vectored(&iov[..n])
        };
        match res {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(mut written) => {
                p.queued -= written.min(p.queued);
                while written > 0 {
                    let Some(o) = p.out.front() else { break };
                    let left = o.total() - p.off;
                    if written >= left {
                        written -= left;
                        p.off = 0;
                        if let Some(t) = p.out.pop_front().and_then(|o| o.token) {
                            done.push_back((t, None));
                        }
                    } else {
                        p.off += written;
                        written = 0;
                    }
                }
                // Zero-length frames at the front are complete too.
                while p.out.front().is_some_and(|o| o.total() == 0) {
                    p.out.pop_front();
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

struct Sink<'a> {
    peer: PeerId,
    rx: &'a mut Rx,
    grants: &'a HashMap<u64, Grant>,
    next_grant: u64,
    on: &'a mut dyn FnMut(Completion<'_>),
    n: &'a mut usize,
}

impl FrameSink for Sink<'_> {
    fn on_header(&mut self, h: &FrameHeader) -> Result<(), TransportError> {
        let len = h.payload_len as usize;
        self.rx.kind = h.meta[0];
        match h.meta[0] {
            MSG => {
                let body = word(&h.meta, 4..8) as usize;
                if body > len || body > MAX_BODY {
                    return Err(TransportError::Refused(format!(
                        "a body of {body} bytes in a frame of {len}"
                    )));
                }
                self.rx.body_len = body;
                self.rx.has_data = h.meta[1] != 0;
                self.rx.buf.resize(len, 0);
            }
            PUT => {
                let (grant, offset) = (word(&h.meta, 8..16), word(&h.meta, 16..24) as usize);
                let imm = word(&h.meta, 4..8) as u32;
                let live = match self.grants.get(&grant) {
                    Some(g) if g.peer == self.peer => {
                        if offset.checked_add(len).is_none_or(|e| e > g.range.len()) {
                            return Err(TransportError::Refused(format!(
                                "a put of {len} bytes at {offset} into a grant of {}",
                                g.range.len()
                            )));
                        }
                        true
                    }
                    // Revoked or forgotten (or another peer's): read into scratch, report
                    // nothing. A grant never issued is a protocol error.
                    _ if grant < self.next_grant => false,
                    _ => return Err(TransportError::Refused(format!("unknown grant {grant}"))),
                };
                if !live {
                    self.rx.scratch.resize(len, 0);
                }
                self.rx.put = Some((grant, offset, imm, live));
            }
            k => return Err(TransportError::Refused(format!("frame kind {k}"))),
        }
        Ok(())
    }

    fn payload_dest(&mut self, h: &FrameHeader) -> &mut [u8] {
        let len = h.payload_len as usize;
        match (self.rx.kind, self.rx.put) {
            (PUT, Some((grant, offset, _, true))) => match self.grants.get(&grant) {
                // SAFETY: the grant is live, so its caller promised not to touch the range
                // (`Backend::grant`); the bounds were checked in `on_header`; the region holds
                // the storage alive for the call.
                Some(g) => unsafe {
                    std::slice::from_raw_parts_mut(
                        g.region.mem.ptr().add(g.range.start + offset),
                        len,
                    )
                },
                // Revoked in the middle of the frame: the rest goes to scratch.
                None => {
                    self.rx.scratch.resize(len, 0);
                    self.rx.put = Some((grant, offset, 0, false));
                    &mut self.rx.scratch[..]
                }
            },
            (PUT, _) => &mut self.rx.scratch[..len],
            _ => &mut self.rx.buf[..],
        }
    }

    fn on_frame(&mut self, h: &FrameHeader) -> Result<(), TransportError> {
        *self.n += 1;
        match (self.rx.kind, self.rx.put.take()) {
            (PUT, Some((grant, offset, imm, true))) if self.grants.contains_key(&grant) => {
                (self.on)(Completion::Put {
                    peer: self.peer,
                    grant,
                    offset,
                    len: h.payload_len as usize,
                    imm,
                })
            }
            (PUT, _) => *self.n -= 1,
            _ => {
                let (body, data) = self.rx.buf.split_at(self.rx.body_len);
                let data = self
                    .rx
                    .has_data
                    .then(|| Lent::new(data.as_ptr(), data.len()));
                (self.on)(Completion::Recv {
                    peer: self.peer,
                    body,
                    data,
                })
            }
        }
        Ok(())
    }
}

impl Backend for TcpBackend {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn max_body(&self) -> usize {
        MAX_BODY
    }

    fn register(&mut self, mem: Arc<dyn Storage>) -> Result<Region, TransportError> {
        Ok(Region::new(self.id, mem, Place::Local))
    }

    fn alloc(&mut self, len: usize) -> Result<Region, TransportError> {
        self.register(crate::Mem::zeroed(len))
    }

    unsafe fn grant(
        &mut self,
        peer: PeerId,
        r: &Region,
        range: Range<usize>,
    ) -> Result<RemoteRegion, TransportError> {
        if r.backend != self.id {
            return Err(TransportError::Refused(
                "a region of another backend".into(),
            ));
        }
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
        if body.len() > MAX_BODY {
            return Err(TransportError::Refused(format!(
                "a body of {} bytes (at most {MAX_BODY})",
                body.len()
            )));
        }
        let (data, token) = match data {
            Some((r, range, t)) => {
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
            Out {
                hdr: hdr.encode(),
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
        src.check_range(&range)?;
        if dst.kind != KIND_TCP
            || offset
                .checked_add(range.len())
                .is_none_or(|e| e as u64 > dst.len)
        {
            return Err(TransportError::Refused(format!(
                "a put of {} bytes at {offset} into {dst:?}",
                range.len()
            )));
        }
        let hdr = FrameHeader::new(
            meta(PUT, true, imm, dst.id, offset as u64),
            range.len() as u64,
        );
        self.enqueue(
            peer,
            Out {
                hdr: hdr.encode(),
                body: Vec::new(),
                data: Some((src.clone(), range)),
                token: Some(token),
            },
        )
    }

    fn flush(&mut self) -> Result<(), TransportError> {
        let ids: Vec<u32> = self
            .peers
            .iter()
            .filter(|(_, p)| !p.out.is_empty())
            .map(|(id, _)| id)
            .collect();
        for id in ids {
            self.write_peer(id);
        }
        Ok(())
    }

    fn arm(&mut self) -> Result<bool, TransportError> {
        Ok(self.done.is_empty() && self.lost.is_empty())
    }

    fn fd(&self) -> BorrowedFd<'_> {
        use std::os::fd::AsRawFd;
        // SAFETY: the poll's descriptor lives as long as `self`, which the borrow is tied to.
        unsafe { BorrowedFd::borrow_raw(self.poll.as_raw_fd()) }
    }

    fn progress(&mut self, on: &mut dyn FnMut(Completion<'_>)) -> Result<usize, TransportError> {
        let mut n = 0;
        self.poll
            .poll(&mut self.events, Some(Duration::ZERO))
            .or_else(|e| {
                if e.kind() == io::ErrorKind::Interrupted {
                    Ok(())
                } else {
                    Err(e)
                }
            })?;
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
}

impl TcpBackend {
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
                Ok((s, _)) => {
                    let peer = self.add(s)?;
                    *n += 1;
                    on(Completion::Connected { peer });
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                // Out of descriptors, or a connection reset before accept: the listener lives
                // on; the next readiness tries again.
                Err(_) => return Ok(()),
            }
        }
    }
}

impl AsFd for TcpBackend {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd()
    }
}
