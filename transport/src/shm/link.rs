//! What a shared-memory link is made of: the process's page pool, the descriptors on the
//! rings, and the handshake that joins two processes over a Unix socket.
//!
//! Each process has two page pools, which every peer maps. Its send pool holds data sent by
//! reference (and `kv.alloc` arrays): it is sealed against writable mappings by anyone else
//! (`F_SEAL_FUTURE_WRITE`), so peers map it read-only and the kernel keeps them from ever
//! writing it. Its landing pool holds what peers are granted to write (receive slots, bounce
//! pages), mapped read-write. Each link has a channel segment (two descriptor rings and their
//! wake words) made by the connecting side. The handshake passes the pools, the channel and
//! the ringing ends of two doorbells (datagram sockets), and each side tries one cross-memory write into the other (a canary)
//! to learn whether the host lets it write there.

use std::os::fd::{AsFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvstore_shm::{recv_fds, send_fds, Channel, Pool, Segment, SLOT};

use super::PeerProcess;
use crate::backend::Place;
use crate::{Region, Storage, TransportError};

/// The handshake's first word.
pub(super) const HELLO: &str = "kvstore-shm-link-2";
const POOL_MAGIC: u64 = u64::from_le_bytes(*b"KVSHPOOL");
/// Where the pool starts in its segment (after a header page).
pub(super) const POOL_BASE: usize = 4096;

// Descriptor kinds.
pub(super) const MSG: u8 = 1;
pub(super) const PUT: u8 = 2;
pub(super) const RELEASE: u8 = 3;
pub(super) const REVOKE: u8 = 4;
pub(super) const REVOKED: u8 = 5;
pub(super) const CAPS: u8 = 6;
// Flags.
pub(super) const HAS_DATA: u8 = 1;
pub(super) const BODY_IN_POOL: u8 = 2;
/// Small data rides in the descriptor, after the body (no release needed).
pub(super) const DATA_INLINE: u8 = 4;
/// The data is the sender's caller's own pool memory (a `kv.alloc` array), sent in place, not
/// a copy staged for the send: a receiver may hold it (its release waits) at no cost of room
/// in the sender's pool.
pub(super) const IN_PLACE: u8 = 8;
/// The descriptor's fixed part; the rest of the slot carries a small body.
pub(super) const HEAD: usize = 64;
/// The largest body carried inside a descriptor.
pub(super) const INLINE: usize = SLOT - HEAD;

/// A descriptor, decoded. Which fields mean something depends on `kind`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Desc {
    pub kind: u8,
    pub flags: u8,
    /// Body length (MSG) or immediate (PUT).
    pub word: u32,
    /// Release sequence (MSG, RELEASE) or grant (PUT, REVOKE, REVOKED).
    pub id: u64,
    /// Data offset in the sender's pool (MSG) or offset in the grant (PUT).
    pub off: u64,
    /// Data length (MSG, PUT).
    pub len: u64,
    /// Body offset in the sender's pool (MSG with BODY_IN_POOL).
    pub body_off: u64,
}

impl Desc {
    pub fn encode(&self, body: &[u8]) -> [u8; SLOT] {
        let mut d = [0u8; SLOT];
        d[0] = self.kind;
        d[1] = self.flags;
        d[4..8].copy_from_slice(&self.word.to_le_bytes());
        d[8..16].copy_from_slice(&self.id.to_le_bytes());
        d[16..24].copy_from_slice(&self.off.to_le_bytes());
        d[24..32].copy_from_slice(&self.len.to_le_bytes());
        d[32..40].copy_from_slice(&self.body_off.to_le_bytes());
        let n = body.len().min(INLINE);
        d[HEAD..HEAD + n].copy_from_slice(&body[..n]);
        d
    }

    pub fn decode(d: &[u8; SLOT]) -> Desc {
        let u = |at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&d[at..at + 8]);
            u64::from_le_bytes(b)
        };
        Desc {
            kind: d[0],
            flags: d[1],
            word: u32::from_le_bytes([d[4], d[5], d[6], d[7]]),
            id: u(8),
            off: u(16),
            len: u(24),
            body_off: u(32),
        }
    }
}

/// A process's page pool, in a segment with a header that peers check when they map it:
/// `landing` pages peers may write, or else pages only this process can write.
pub(super) fn create_pool(
    name: &str,
    pages: usize,
    page: usize,
    landing: bool,
) -> Result<(Arc<Segment>, Arc<Pool>), TransportError> {
    let len = Pool::bytes_needed(pages, page)
        .and_then(|n| n.checked_add(POOL_BASE))
        .ok_or_else(|| TransportError::Refused(format!("a pool of {pages} pages of {page}")))?;
    let seg = Arc::new(if landing {
        Segment::create(&format!("{name}-landing"), len)?
    } else {
        Segment::create_read_only_for_peers(&format!("{name}-pool"), len)?
    });
    for (i, w) in [POOL_MAGIC, pages as u64, page as u64].iter().enumerate() {
        seg.write(i * 8, &w.to_le_bytes())?;
    }
    let pool = Arc::new(Pool::new(seg.clone(), POOL_BASE, pages, page)?);
    Ok((seg, pool))
}

/// A peer's pool, from its descriptor: its header is checked, and its size bounded by the
/// mapping. Its send pool is mapped read-only (the kernel refuses more); its landing pool
/// read-write.
pub(super) fn attach_pool(
    fd: OwnedFd,
    landing: bool,
) -> Result<(Arc<Segment>, Pool), TransportError> {
    let seg = Arc::new(if landing {
        Segment::from_fd(fd)?
    } else {
        Segment::from_fd_read_only(fd)?
    });
    let mut w = [0u8; 24];
    seg.read(0, &mut w)?;
    let word = |i: usize| u64::from_le_bytes(w[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8]));
    if word(0) != POOL_MAGIC {
        return Err(TransportError::Refused("not a kvstore pool segment".into()));
    }
    // The peer's numbers: `Pool::new` checks them (sizes, overflow) against the mapping.
    let (pages, page) = (
        usize::try_from(word(1)).unwrap_or(usize::MAX),
        usize::try_from(word(2)).unwrap_or(usize::MAX),
    );
    let pool = Pool::new(seg.clone(), POOL_BASE, pages, page)?;
    Ok((seg, pool))
}

/// Pages of this process's pool as [`Storage`]: freed when the last holder lets go.
pub(super) struct PoolPages {
    pub seg: Arc<Segment>,
    pub pool: Arc<Pool>,
    pub region: kvstore_shm::Region,
    pub len: usize,
}

// SAFETY: the pages lie inside a mapping that `seg` keeps alive and never moves; they are
// allocated (so no other holder gets them) until `drop`; the backend reaches them only through
// raw pointers and copies.
unsafe impl Storage for PoolPages {
    fn ptr(&self) -> *mut u8 {
        // In bounds by construction (the pool handed the region out), in this process's own
        // writable mapping: a failure here is a bug of this process, never a peer's doing.
        self.seg
            .ptr_mut(self.region.offset, self.region.len)
            .expect("a pool region of this process lies in its mapping")
    }
    fn len(&self) -> usize {
        self.len
    }
}

impl Drop for PoolPages {
    fn drop(&mut self) {
        let _ = self.pool.free(self.region);
    }
}

/// Whether regions of each of `sizes` (0: none) could be had from `pool` at once: each is
/// allocated, held while the next is, then all are freed.
pub(super) fn pool_has(pool: &Pool, sizes: [usize; 2]) -> bool {
    let got: Vec<_> = sizes
        .iter()
        .filter(|&&n| n > 0)
        .map(|&n| pool.alloc(n))
        .collect();
    let room = got.iter().all(Result::is_ok);
    for r in got.into_iter().flatten() {
        let _ = pool.free(r);
    }
    room
}

/// The abstract socket address of a listener named `name`.
pub(super) fn addr(name: &str) -> Result<UnixAddr, TransportError> {
    Ok(UnixAddr::from_abstract_name(format!("kvstore-shm.{name}"))?)
}

/// Connects to the backend listening under `name`, retrying until `deadline`: the socket is
/// non-blocking while it connects, so a listener whose backlog is full (one that stopped
/// accepting) is retried like one not there yet, never waited on without a bound.
pub(super) fn connect_by(name: &str, deadline: Instant) -> Result<UnixStream, TransportError> {
    use rustix::net::{socket_with, AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let to = SocketAddrUnix::new_abstract_name(format!("kvstore-shm.{name}").as_bytes())
        .map_err(std::io::Error::from)?;
    loop {
        let fd = socket_with(
            AddressFamily::UNIX,
            SocketType::STREAM,
            SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
            None,
        )
        .map_err(std::io::Error::from)?;
        match rustix::net::connect(&fd, &to) {
            Ok(()) => {
                let s = UnixStream::from(fd);
                s.set_nonblocking(false)?;
                return Ok(s);
            }
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            Err(e) => return Err(std::io::Error::from(e).into()),
        }
    }
}

/// The last descriptor a peer passed (they come in a fixed order), or a refusal naming it.
pub(super) fn take_fd(fds: &mut Vec<OwnedFd>, what: &str) -> Result<OwnedFd, TransportError> {
    fds.pop()
        .ok_or_else(|| TransportError::Refused(format!("no {what}")))
}

/// The peer's doorbell, refused unless it is a Unix datagram socket (the ringing end of its
/// [`kvstore_shm::doorbell`]): rings are sent with `MSG_DONTWAIT`, which no flag the peer sets
/// on the file can undo, so ringing it never blocks this process.
pub(super) fn take_bell(fds: &mut Vec<OwnedFd>) -> Result<OwnedFd, TransportError> {
    use rustix::net::{sockopt, AddressFamily, SocketType};
    let fd = take_fd(fds, "doorbell")?;
    let kind = sockopt::socket_type(&fd).ok();
    let domain = sockopt::socket_domain(&fd).ok();
    if kind != Some(SocketType::DGRAM) || domain != Some(AddressFamily::UNIX) {
        return Err(TransportError::Refused(
            "a doorbell that is not a Unix datagram socket".into(),
        ));
    }
    Ok(fd)
}

/// Empties a doorbell after a wake-up.
pub(super) fn drain(fd: &OwnedFd) {
    kvstore_shm::drain_doorbell(fd);
}

/// What one side tells the other in the handshake.
pub(super) struct Hello {
    /// Where the sender keeps a canary the receiver may write to test cross-memory writes.
    pub canary: u64,
    /// Whether the sender could write the receiver's canary (the reply only).
    pub wrote: bool,
}

impl Hello {
    pub fn encode(&self) -> Vec<u8> {
        format!("{HELLO} {:x} {}", self.canary, self.wrote as u8).into_bytes()
    }

    pub fn decode(b: &[u8]) -> Result<Hello, TransportError> {
        let s = std::str::from_utf8(b).unwrap_or("");
        let w: Vec<&str> = s.split(' ').collect();
        let bad = || TransportError::Refused(format!("a bad shared-memory hello {s:?}"));
        if w.len() != 3 || w[0] != HELLO {
            return Err(bad());
        }
        Ok(Hello {
            canary: u64::from_str_radix(w[1], 16).map_err(|_| bad())?,
            wrote: w[2] == "1",
        })
    }
}

/// Allocates send-pool pages of one [`super::ShmBackend`]: memory peers read by reference (a send of
/// it is a descriptor) and can never write. Only the backend's own thread may allocate.
#[derive(Clone)]
pub struct SendPages {
    pub(super) id: u64,
    pub(super) seg: Arc<Segment>,
    pub(super) pool: Arc<Pool>,
}

impl SendPages {
    /// Pages of `len` bytes, zeroed if `zero`; an error when the pool has no room.
    pub fn alloc(&self, len: usize, zero: bool) -> Result<Region, TransportError> {
        pages_of(self.id, &self.seg, &self.pool, len, zero, Place::Pool)
    }
}

/// Pages of `len` bytes from `pool` (in `seg`), zeroed if `zero`, as a region of backend `id`.
pub(super) fn pages_of(
    id: u64,
    seg: &Arc<Segment>,
    pool: &Arc<Pool>,
    len: usize,
    zero: bool,
    place: fn(usize) -> Place,
) -> Result<Region, TransportError> {
    let region = pool.alloc(len)?;
    let pages = PoolPages {
        seg: seg.clone(),
        pool: pool.clone(),
        region,
        len,
    };
    // Pages come back dirty from earlier use: zero them, unless only a peer's put will be read
    // from them.
    static ZEROS: [u8; 64 * 1024] = [0; 64 * 1024];
    for at in (0..if zero { len } else { 0 }).step_by(ZEROS.len()) {
        let n = ZEROS.len().min(len - at);
        seg.write(region.offset + at, &ZEROS[..n])?;
    }
    Ok(Region::new(id, Arc::new(pages), place(region.offset)))
}

/// The parts of a link both sides end up with.
pub(super) struct Parts {
    pub chan: Channel,
    pub sock: UnixStream,
    pub proc: PeerProcess,
    pub their_seg: Arc<Segment>,
    pub their_pool: Pool,
    pub their_landing_seg: Arc<Segment>,
    pub their_landing: Pool,
    pub bell: OwnedFd,
    /// Whether the peer can write this process's memory by cross-memory writes.
    pub peer_writes_me: bool,
    /// Whether this process can write the peer's.
    pub i_write_peer: bool,
}

/// Sends this side's part of the handshake.
pub(super) fn send_hello(
    sock: &UnixStream,
    hello: &Hello,
    fds: &[std::os::fd::BorrowedFd<'_>],
) -> Result<(), TransportError> {
    send_fds(sock, &hello.encode(), fds)?;
    Ok(())
}

/// Receives the peer's part: the hello and exactly `nfds` descriptors.
pub(super) fn recv_hello(
    sock: &UnixStream,
    nfds: usize,
) -> Result<(Hello, Vec<OwnedFd>), TransportError> {
    let mut buf = [0u8; 128];
    let (n, fds) = recv_fds(sock, &mut buf)?;
    if fds.len() != nfds {
        return Err(TransportError::Refused(format!(
            "a shared-memory hello with {} descriptors",
            fds.len()
        )));
    }
    Ok((Hello::decode(&buf[..n])?, fds))
}

/// The acceptor's side, once the hello arrived: attach, reply, test the canary.
pub(super) fn accept_parts(
    sock: UnixStream,
    mut proc: PeerProcess,
    hello: Hello,
    mut fds: Vec<OwnedFd>,
    my_pools: [&Segment; 2],
    my_canary: u64,
    cross_memory: bool,
) -> Result<Parts, TransportError> {
    let their_bell = take_bell(&mut fds)?;
    let landing_fd = take_fd(&mut fds, "landing pool")?;
    let pool_fd = take_fd(&mut fds, "pool")?;
    let chan_fd = take_fd(&mut fds, "channel")?;
    let mut chan = Channel::attach(Segment::from_fd(chan_fd)?)?;
    chan.set_tx_doorbell(their_bell);
    let (their_seg, their_pool) = attach_pool(pool_fd, false)?;
    let (their_landing_seg, their_landing) = attach_pool(landing_fd, true)?;
    let i_write_peer = cross_memory && proc.probe(hello.canary);
    let (bell, ring) = kvstore_shm::doorbell()?;
    send_hello(
        &sock,
        &Hello {
            canary: my_canary,
            wrote: i_write_peer,
        },
        &[my_pools[0].fd(), my_pools[1].fd(), ring.as_fd()],
    )?;
    Ok(Parts {
        chan,
        sock,
        proc,
        their_seg,
        their_pool,
        their_landing_seg,
        their_landing,
        bell,
        // Learned from the peer's first descriptor (CAPS).
        peer_writes_me: false,
        i_write_peer,
    })
}

/// The fuzzers' way in ([`crate::fuzz`]): a ring slot's descriptor and a socket hello, decoded
/// from arbitrary bytes.
#[cfg(feature = "fuzzing")]
pub(crate) fn fuzz(data: &[u8]) {
    let mut slot = [0u8; SLOT];
    let n = data.len().min(SLOT);
    slot[..n].copy_from_slice(&data[..n]);
    let d = Desc::decode(&slot);
    let _ = (d.kind, d.flags, d.word);
    let _ = Hello::decode(data);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_doorbell_must_be_a_unix_datagram_socket() {
        let (_keep, good) = kvstore_shm::doorbell().unwrap();
        assert!(take_bell(&mut vec![good]).is_ok());
        // An eventfd (whose O_NONBLOCK the peer could clear on the file it shares, and then
        // fill its counter: a ring would wait), a stream socket, a file: refused.
        let eventfd = rustix::event::eventfd(0, rustix::event::EventfdFlags::NONBLOCK).unwrap();
        let (a, _b) = UnixStream::pair().unwrap();
        let file = OwnedFd::from(std::fs::File::open("/dev/null").unwrap());
        for fd in [eventfd, OwnedFd::from(a), file] {
            match take_bell(&mut vec![fd]) {
                Err(TransportError::Refused(why)) => assert!(why.contains("datagram"), "{why}"),
                other => panic!("{other:?}"),
            }
        }
        assert!(matches!(
            take_bell(&mut vec![]),
            Err(TransportError::Refused(_))
        ));
        // A ring never waits, even once the peer made its end of the socket blocking and
        // filled it: the ring is dropped (the sleeper has plenty to wake it already).
        let (keep, ring) = kvstore_shm::doorbell().unwrap();
        rustix::fs::fcntl_setfl(&keep, rustix::fs::OFlags::empty()).unwrap();
        rustix::fs::fcntl_setfl(&ring, rustix::fs::OFlags::empty()).unwrap();
        let mut w = kvstore_shm::Wake::new(
            std::sync::Arc::new(kvstore_shm::Segment::create("bell-test", 4096).unwrap()),
            0,
        )
        .unwrap();
        w.set_doorbell(ring);
        for _ in 0..100_000 {
            w.ring().unwrap();
        }
        kvstore_shm::drain_doorbell(&keep);
    }
}
