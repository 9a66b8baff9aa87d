//! Shared memory between a worker and the servers on its host.
//!
//! Each worker owns one pool segment (pages it allocates: arrays from `KVStore::alloc`, and
//! staging for other arrays) and, per local server, a channel segment holding two descriptor
//! rings. Both segments, and two eventfd doorbells, travel to the server over an abstract Unix
//! socket (per network namespace: a peer in another namespace is another host). A descriptor
//! is a frame header (the same bytes as on TCP) plus a source region (the payload, read by the
//! server in place) and a destination region (where a pull's answer is written, once).

mod peer;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener, UnixStream};
use std::sync::Arc;
use std::time::Duration;

use kvstore_shm::{recv_fds, send_fds, Channel, ChannelConfig, Pool, Region, Segment, SLOT};
use kvstore_transport::{FrameHeader, HEADER_LEN};

use crate::ndarray::SharedBuf;
use crate::protocol::Msg;
pub use crate::shm_link::peer::PeerPages;
pub(crate) use crate::shm_link::peer::PeerProcess;
use crate::{DType, KvError, NDArray, Result};

/// Copies of tensor bytes a worker's shared-memory transport made: `(copies, bytes)`, per
/// store. Pushing an array from `KVStore::alloc` makes none; pushing another array makes one
/// (into the pool); a pull's one copy is the server's (into the output), and a pull through
/// staging pages (where cross-memory writes are forbidden) makes one more here.
#[derive(Default)]
pub(crate) struct Copies(std::cell::Cell<(u64, u64)>);

impl Copies {
    pub fn count(&self, bytes: usize) {
        let (n, b) = self.0.get();
        self.0.set((n + 1, b + bytes as u64));
    }

    pub fn get(&self) -> (u64, u64) {
        self.0.get()
    }
}

/// What makes two processes "on the same host" for shared memory: the same boot of the same
/// kernel and the same network namespace.
pub fn host_id() -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let net = std::fs::read_link("/proc/self/ns/net")
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    format!("{}/{}", boot.trim(), net.replace(['[', ']', ':'], ""))
}

fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

fn socket_addr(port: u16, secret: &str) -> Result<UnixAddr> {
    Ok(UnixAddr::from_abstract_name(format!(
        "kvstore.{port}.{:016x}",
        fnv(secret)
    ))?)
}

/// The server's listener for workers on its host.
pub(crate) fn listen(port: u16, secret: &str) -> Result<UnixListener> {
    Ok(UnixListener::bind_addr(&socket_addr(port, secret)?)?)
}

const HELLO: &str = "kvstore-shm-store-3";
const CANARY: &[u8; 8] = b"kvstoreC";
const RING_SLOTS: u64 = 1024;

// Descriptor layout after the 128-byte frame header.
const SRC_OFF: usize = HEADER_LEN;
const DST_OFF: usize = HEADER_LEN + 16;
const DST_ADDR: usize = HEADER_LEN + 32;
const DST_ALEN: usize = HEADER_LEN + 40;
const TEXT: usize = HEADER_LEN + 48;

fn put(d: &mut [u8; SLOT], at: usize, v: u64) {
    d[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

fn get(d: &[u8; SLOT], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&d[at..at + 8]);
    u64::from_le_bytes(b)
}

/// A descriptor: the message, its payload length, the source and destination regions, and
/// (for errors) text.
pub(crate) fn encode(
    m: &Msg,
    payload_len: usize,
    src: Option<Region>,
    dst: Option<Region>,
    text: &[u8],
) -> [u8; SLOT] {
    encode_to(m, payload_len, src, dst, None, text)
}

/// [`encode`], with the answer's destination given as an address in the worker's memory.
pub(crate) fn encode_to(
    m: &Msg,
    payload_len: usize,
    src: Option<Region>,
    dst: Option<Region>,
    dst_addr: Option<(u64, usize)>,
    text: &[u8],
) -> [u8; SLOT] {
    let mut d = [0u8; SLOT];
    d[..HEADER_LEN].copy_from_slice(&m.header(payload_len));
    for (at, r) in [(SRC_OFF, src), (DST_OFF, dst)] {
        if let Some(r) = r {
            put(&mut d, at, r.offset as u64);
            put(&mut d, at + 8, r.len as u64);
        }
    }
    if let Some((addr, len)) = dst_addr {
        put(&mut d, DST_ADDR, addr);
        put(&mut d, DST_ALEN, len as u64);
    }
    let n = text.len().min(SLOT - TEXT);
    d[TEXT..TEXT + n].copy_from_slice(&text[..n]);
    d
}

/// What a descriptor says.
pub(crate) struct Desc {
    pub msg: Msg,
    pub payload_len: u64,
    pub src: Option<Region>,
    pub dst: Option<Region>,
    /// The answer's destination as an address in the worker's memory (see [`cma_write`]).
    pub dst_addr: Option<(u64, usize)>,
    pub text: String,
}

pub(crate) fn decode(d: &[u8; SLOT]) -> Result<Desc> {
    let mut hb = [0u8; HEADER_LEN];
    hb.copy_from_slice(&d[..HEADER_LEN]);
    let h = FrameHeader::decode(&hb, u64::MAX)?;
    let msg = Msg::decode(&h.meta)?;
    let region = |at: usize| {
        let len = get(d, at + 8) as usize;
        (len > 0).then(|| Region {
            offset: get(d, at) as usize,
            len,
        })
    };
    let text = &d[TEXT..];
    let end = text.iter().position(|&b| b == 0).unwrap_or(text.len());
    Ok(Desc {
        msg,
        payload_len: h.payload_len,
        src: region(SRC_OFF),
        dst: region(DST_OFF),
        dst_addr: (get(d, DST_ALEN) > 0).then(|| (get(d, DST_ADDR), get(d, DST_ALEN) as usize)),
        text: String::from_utf8_lossy(&text[..end]).into_owned(),
    })
}

/// A worker's pool segment.
pub(crate) struct WorkerPool {
    pub seg: Arc<Segment>,
    pub pool: Arc<Pool>,
    npages: usize,
    page: usize,
}

impl WorkerPool {
    /// A pool of `bytes` (rounded to 64 KiB pages); the kernel backs pages only when touched.
    pub fn create(bytes: usize) -> Result<WorkerPool> {
        let page = 64 * 1024;
        let npages = bytes.div_ceil(page).max(16);
        let seg = Arc::new(
            Segment::create("kvstore-pool", Pool::bytes_needed(npages, page)).map_err(shm)?,
        );
        let pool = Arc::new(Pool::new(seg.clone(), 0, npages, page).map_err(shm)?);
        Ok(WorkerPool {
            seg,
            pool,
            npages,
            page,
        })
    }

    /// An array whose pages are in the pool: pushing it copies nothing.
    pub fn alloc_array(&self, shape: &[usize], dtype: DType) -> Result<NDArray> {
        let len = shape.iter().product::<usize>() * dtype.size();
        let r = self.pool.alloc(len.max(1)).map_err(shm)?;
        let pool = self.pool.clone();
        let mut a = NDArray::from_shared(
            shape,
            dtype,
            SharedBuf {
                seg: self.seg.clone(),
                offset: r.offset,
                len,
                release: Some(Box::new(move |reg| {
                    let _ = pool.free(Region {
                        offset: reg.offset,
                        len: reg.len.max(1),
                    });
                })),
            },
        );
        a.as_bytes_mut().fill(0);
        Ok(a)
    }

    /// Where `a`'s bytes are in this pool, if they are.
    pub fn offset_of(&self, a: &NDArray) -> Option<usize> {
        a.shared_region()
            .filter(|(seg, _)| Arc::ptr_eq(seg, &self.seg))
            .map(|(_, off)| off)
    }
}

pub(crate) fn shm(e: kvstore_shm::ShmError) -> KvError {
    KvError::Transport(e.into())
}

/// A worker's end of a channel to one server.
pub(crate) struct WorkerLink {
    pub chan: Channel,
    /// The server rings this when the worker sleeps.
    pub doorbell: OwnedFd,
    /// The server can write answers straight into this process's memory.
    pub cma: bool,
    /// The server's process, as the kernel names it for the socket.
    pub server: PeerProcess,
    _sock: UnixStream,
}

fn eventfd() -> Result<OwnedFd> {
    use rustix::event::{eventfd, EventfdFlags};
    Ok(eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK).map_err(std::io::Error::from)?)
}

/// Drains a doorbell (an eventfd) after waking.
pub(crate) fn drain(fd: &OwnedFd) {
    let mut b = [0u8; 8];
    let _ = rustix::io::read(fd, &mut b);
}

/// Connects to the server listening at `port` on this host and hands it a channel and the pool.
pub(crate) fn attach(
    port: u16,
    secret: &str,
    rank: usize,
    pool: &WorkerPool,
    timeout: Duration,
) -> Result<WorkerLink> {
    let sock = UnixStream::connect_addr(&socket_addr(port, secret)?)?;
    // Whoever holds the name must be a process of this user before it gets the pool.
    let server = PeerProcess::of(&sock)?;
    sock.set_read_timeout(Some(timeout))?;
    let cfg = ChannelConfig {
        ring_slots: RING_SLOTS,
        page_size: 4096,
        pages: 1,
    };
    let mut chan = Channel::create("kvstore-channel", cfg).map_err(shm)?;
    let (to_server, to_worker) = (eventfd()?, eventfd()?);
    chan.set_tx_doorbell(to_server.try_clone()?);
    // A canary the server writes through process_vm_writev, if this host allows it.
    let canary = Box::new([0u8; 8]);
    let hello = format!(
        "{HELLO}\n{secret}\n{rank}\n{}\n{}\n{}",
        pool.npages,
        pool.page,
        canary.as_ptr() as usize
    );
    send_fds(
        &sock,
        hello.as_bytes(),
        &[
            chan.segment().fd(),
            pool.seg.fd(),
            to_server.as_fd(),
            to_worker.as_fd(),
        ],
    )
    .map_err(shm)?;
    let mut ok = [0u8; 3];
    (&sock).read_exact(&mut ok)?;
    if &ok[..2] != b"ok" {
        return Err(KvError::Protocol(
            "the server refused the shared-memory channel".into(),
        ));
    }
    // The server wrote the canary before answering, so its bytes are settled.
    let cma = ok[2] == b'1' && std::hint::black_box(&*canary) == CANARY;
    Ok(WorkerLink {
        chan,
        doorbell: to_worker,
        cma,
        server,
        _sock: sock,
    })
}

/// A server's end of a channel from one worker.
pub(crate) struct ServerLink {
    pub chan: Channel,
    pub pool_seg: Arc<Segment>,
    pub pool: Pool,
    /// Rung by the worker when this server sleeps.
    pub doorbell: OwnedFd,
    pub sock: UnixStream,
    pub worker: usize,
    /// The worker's process (from the kernel, not from the hello), for writes straight into
    /// its memory.
    pub peer: PeerProcess,
    /// Whether such writes work.
    pub cma: bool,
    /// Where each pending pull's answer goes.
    pub pulls: HashMap<u64, Dest>,
    /// Answers the worker's ring had no room for yet, in order. While it holds a ring's worth,
    /// the server takes no more requests from this worker (backpressure), so it stays bounded
    /// and a worker that does not read never stalls the server.
    pub backlog: std::collections::VecDeque<[u8; SLOT]>,
}

/// Where a pull's answer goes.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Dest {
    /// Pages of the worker's pool.
    Pool(Region),
    /// An address in the worker's memory (written with `process_vm_writev`).
    Addr(u64, usize),
}

/// Takes a worker's channel from a connection on the listener.
pub(crate) fn accept(sock: UnixStream, secret: &str, num_workers: usize) -> Result<ServerLink> {
    let peer = PeerProcess::of(&sock)?;
    sock.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut buf = [0u8; 512];
    let (n, fds) = recv_fds(&sock, &mut buf).map_err(shm)?;
    let text = String::from_utf8_lossy(&buf[..n]).into_owned();
    let f: Vec<&str> = text.split('\n').collect();
    let bad = || KvError::Protocol("malformed shared-memory hello".into());
    if f.len() != 6 || f[0] != HELLO || fds.len() != 4 {
        return Err(bad());
    }
    if !crate::config::secret_matches(f[1].as_bytes(), secret.as_bytes()) {
        return Err(KvError::Protocol("wrong job secret".into()));
    }
    let worker: usize = f[2].parse().map_err(|_| bad())?;
    let npages: usize = f[3].parse().map_err(|_| bad())?;
    let page: usize = f[4].parse().map_err(|_| bad())?;
    let canary: u64 = f[5].parse().map_err(|_| bad())?;
    if worker >= num_workers {
        return Err(bad());
    }
    let mut fds = fds.into_iter();
    let (Some(cseg), Some(pseg), Some(to_server), Some(to_worker)) =
        (fds.next(), fds.next(), fds.next(), fds.next())
    else {
        return Err(bad());
    };
    let mut chan = Channel::attach(Segment::from_fd(cseg).map_err(shm)?).map_err(shm)?;
    chan.set_tx_doorbell(to_worker);
    let pool_seg = Arc::new(Segment::from_fd(pseg).map_err(shm)?);
    let pool = Pool::new(pool_seg.clone(), 0, npages, page).map_err(shm)?;
    // Cross-memory attach works here (same user, no ptrace restriction) if the canary lands.
    // SAFETY: CANARY is 8 bytes of static memory.
    let cma = unsafe { peer.write(canary, CANARY.as_ptr(), CANARY.len()) }.is_ok();
    (&sock).write_all(if cma { b"ok1" } else { b"ok0" })?;
    sock.set_nonblocking(true)?;
    Ok(ServerLink {
        chan,
        pool_seg,
        pool,
        doorbell: to_server,
        sock,
        worker,
        peer,
        cma,
        pulls: HashMap::new(),
        backlog: std::collections::VecDeque::new(),
    })
}

impl ServerLink {
    /// A payload in the worker's pool, after checking the region is allocated there.
    pub fn view(&self, r: Region, len: usize, dtype: DType) -> Result<PeerPages> {
        self.pool.check(r).map_err(shm)?;
        if r.len < len * dtype.size() {
            return Err(KvError::Protocol(
                "payload region shorter than the message".into(),
            ));
        }
        Ok(PeerPages {
            seg: self.pool_seg.clone(),
            offset: r.offset,
            len,
            dtype,
        })
    }

    /// Whether the worker closed its end.
    pub fn closed(&self) -> bool {
        let mut b = [0u8; 1];
        matches!((&self.sock).read(&mut b), Ok(0))
    }

    /// Whether the server should take no more requests from this worker for now.
    pub fn backlogged(&self) -> bool {
        self.backlog.len() >= RING_SLOTS as usize
    }

    /// Posts queued answers while the worker's ring has room.
    pub fn flush(&mut self) -> Result<()> {
        while let Some(d) = self.backlog.front() {
            if !self.chan.try_send(d).map_err(shm)? {
                break;
            }
            self.backlog.pop_front();
        }
        Ok(())
    }

    /// Answers a request: a pull's value is written once, into the region the worker named,
    /// and the descriptor is posted (or queued, never waited for, if the ring is full).
    pub fn answer(&mut self, msg: &Msg, payload: &[u8], text: &[u8]) -> Result<()> {
        let mut dst = None;
        let mut msg = *msg;
        let mut text = text.to_vec();
        if !payload.is_empty() {
            let to = self.pulls.remove(&msg.req_id).ok_or_else(|| {
                KvError::Protocol("an answer with data but no destination".into())
            })?;
            match to {
                Dest::Pool(r) => {
                    self.pool.check(r).map_err(shm)?;
                    if r.len != payload.len() {
                        return Err(KvError::Protocol(
                            "destination region of the wrong size".into(),
                        ));
                    }
                    self.pool_seg.write(r.offset, payload).map_err(shm)?;
                    dst = Some(r);
                }
                Dest::Addr(addr, len) => {
                    let res = if len == payload.len() {
                        // SAFETY: `payload` is borrowed for the call.
                        unsafe { self.peer.write(addr, payload.as_ptr(), payload.len()) }
                    } else {
                        Err(std::io::Error::other("destination of the wrong size"))
                    };
                    match res {
                        Ok(()) => {}
                        Err(e) => {
                            msg.status = crate::protocol::status::FAILED;
                            text = format!("cannot write the answer into the worker: {e}")
                                .into_bytes();
                        }
                    }
                }
            }
        } else {
            self.pulls.remove(&msg.req_id);
        }
        let plen = if msg.status == 0 { payload.len() } else { 0 };
        self.backlog.push_back(encode(&msg, plen, None, dst, &text));
        self.flush()
    }
}

#[cfg(test)]
mod tests;
