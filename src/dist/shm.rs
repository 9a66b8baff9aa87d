//! Shared memory between a worker and the servers on its host.
//!
//! Each worker owns one pool segment (pages it allocates: arrays from `KVStore::alloc`, and
//! staging for other arrays) and, per local server, a channel segment holding two descriptor
//! rings. Both segments, and two eventfd doorbells, travel to the server over an abstract Unix
//! socket (per network namespace: a peer in another namespace is another host). A descriptor
//! is a frame header (the same bytes as on TCP) plus a source region (the payload, read by the
//! server in place) and a destination region (where a pull's answer is written, once).

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener, UnixStream};
use std::sync::Arc;
use std::time::Duration;

use kvstore_shm::{recv_fds, send_fds, Channel, ChannelConfig, Pool, Region, Segment, SLOT};
use kvstore_transport::{FrameHeader, HEADER_LEN};

use super::proto::Msg;
use crate::ndarray::SharedBuf;
use crate::{DType, Element, KvError, NDArray, Result};

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

/// Which transport a worker uses for servers on its host (`KVSTORE_TRANSPORT`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Choice {
    /// Shared memory where the server is on this host, TCP otherwise (the default).
    Auto,
    /// TCP everywhere.
    Tcp,
    /// Shared memory, and an error if a server is not on this host.
    Shm,
}

impl Choice {
    pub(crate) fn from_env() -> Result<Choice> {
        match std::env::var("KVSTORE_TRANSPORT").as_deref() {
            Err(_) | Ok("") | Ok("auto") => Ok(Choice::Auto),
            Ok("tcp") => Ok(Choice::Tcp),
            Ok("shm") => Ok(Choice::Shm),
            Ok(other) => Err(KvError::Config(format!(
                "KVSTORE_TRANSPORT={other:?}; expected auto, tcp or shm"
            ))),
        }
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

/// The process at the other end of a Unix socket, as the kernel reports it (`SO_PEERCRED`),
/// held by a pidfd so that a reused pid is never mistaken for it. A peer of another user is
/// refused: shared memory and cross-memory writes are for the job's own processes.
pub(crate) struct PeerProcess {
    pub pid: i32,
    pidfd: OwnedFd,
}

impl PeerProcess {
    pub fn of(sock: &UnixStream) -> Result<PeerProcess> {
        let cred = rustix::net::sockopt::socket_peercred(sock).map_err(std::io::Error::from)?;
        if cred.uid != rustix::process::geteuid() {
            return Err(KvError::Protocol(format!(
                "refused a shared-memory peer of another user (uid {})",
                cred.uid.as_raw()
            )));
        }
        let pidfd = rustix::process::pidfd_open(cred.pid, rustix::process::PidfdFlags::empty())
            .map_err(std::io::Error::from)?;
        Ok(PeerProcess {
            pid: cred.pid.as_raw_nonzero().get(),
            pidfd,
        })
    }

    /// Whether the process has exited (its pidfd is readable).
    pub fn exited(&self) -> bool {
        use rustix::event::{poll, PollFd, PollFlags};
        let mut fds = [PollFd::new(&self.pidfd, PollFlags::IN)];
        let zero = rustix::event::Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        matches!(poll(&mut fds, Some(&zero)), Ok(n) if n > 0)
    }

    /// Writes `data` at `addr` in this process, if it is still the process the socket named.
    pub fn write(&self, addr: u64, data: &[u8]) -> std::io::Result<()> {
        if self.exited() {
            return Err(std::io::Error::other("the peer process has exited"));
        }
        cma_write(self.pid, addr, data)
    }
}

/// Writes `data` at `addr` in process `pid` (`process_vm_writev`, "cross-memory attach"):
/// one copy, made by the kernel, straight into the other process's memory.
fn cma_write(pid: i32, addr: u64, data: &[u8]) -> std::io::Result<()> {
    let mut done = 0usize;
    while done < data.len() {
        let local = libc::iovec {
            iov_base: data[done..].as_ptr() as *mut libc::c_void,
            iov_len: data.len() - done,
        };
        let remote = libc::iovec {
            iov_base: (addr as usize + done) as *mut libc::c_void,
            iov_len: data.len() - done,
        };
        // SAFETY: `local` describes bytes of this process that `data` borrows for the whole
        // call (the kernel only reads them); `remote` names memory of another process, which
        // the kernel checks (EFAULT) and which cannot alias this process's memory. Only
        // initialised `iovec`s are passed, one of each.
        let n = unsafe { libc::process_vm_writev(pid, &local, 1, &remote, 1, 0) };
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        done += n as usize;
    }
    Ok(())
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

/// A payload in a peer's pool pages. The peer can write those pages at any time (it should not
/// while it waits for the answer, but nothing here can enforce that), so they are never viewed
/// as a slice: they are read once, element by element, into this process's own memory.
pub struct PeerPages {
    seg: Arc<Segment>,
    offset: usize,
    /// Elements of `dtype`.
    len: usize,
    dtype: DType,
}

impl PeerPages {
    fn nbytes(&self) -> usize {
        self.len * self.dtype.size()
    }

    /// The bytes, copied (control payloads: names, optimizer parameters).
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let mut v = vec![0u8; self.nbytes()];
        self.seg.read(self.offset, &mut v).map_err(shm)?;
        Ok(v)
    }

    /// Copies the elements into `dst` (same length and dtype).
    pub fn copy_into(&self, dst: &mut NDArray) -> Result<()> {
        self.check_like(dst)?;
        self.seg.read(self.offset, dst.as_bytes_mut()).map_err(shm)
    }

    /// The elements in a new array of this process.
    pub fn to_array(&self) -> Result<NDArray> {
        let mut a = NDArray::zeros_dtype(&[self.len], self.dtype);
        self.copy_into(&mut a)?;
        Ok(a)
    }

    /// `dst += self`, reading each element once where it lies (no copy).
    pub fn add_into(&self, dst: &mut NDArray) -> Result<()> {
        self.check_like(dst)?;
        let p = self.seg.ptr(self.offset, self.nbytes()).map_err(shm)?;
        crate::dtype::with_dtype!(self.dtype, T => add_peer::<T>(dst, p))
    }

    fn check_like(&self, dst: &NDArray) -> Result<()> {
        if dst.dtype() != self.dtype || dst.size() != self.len {
            return Err(KvError::Protocol(format!(
                "{} {} elements do not fit {} {} elements",
                self.len,
                self.dtype,
                dst.size(),
                dst.dtype()
            )));
        }
        Ok(())
    }
}

fn add_peer<T: Element>(dst: &mut NDArray, p: *const u8) -> Result<()> {
    if (p as usize) % std::mem::align_of::<T>() != 0 {
        return Err(KvError::Protocol("a misaligned payload region".into()));
    }
    let d: &mut [T] = bytemuck::cast_slice_mut(dst.as_bytes_mut());
    // SAFETY: `p` addresses `d.len()` elements inside the peer's mapped pool (checked by
    // `Segment::ptr` against the mapping, and by the pool against its pages), is aligned for
    // `T` (checked above), and cannot overlap `d`, which is this process's own heap memory
    // (a merge buffer). The mapping lives while `self.seg` does, which outlives the call.
    unsafe { crate::ops::add_from_raw(d, p as *const T) };
    Ok(())
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
    let cma = peer.write(canary, CANARY).is_ok();
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
                        self.peer.write(addr, payload)
                    } else {
                        Err(std::io::Error::other("destination of the wrong size"))
                    };
                    match res {
                        Ok(()) => {}
                        Err(e) => {
                            msg.status = super::proto::status::FAILED;
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
mod tests {
    use super::*;
    use crate::dist::proto::Op;

    #[test]
    fn descriptors_round_trip() {
        let mut m = Msg::new(Op::PushPull);
        m.key = 7;
        m.len = 3;
        m.total = 3;
        let src = Region {
            offset: 65536,
            len: 12,
        };
        let dst = Region {
            offset: 131072,
            len: 12,
        };
        let d = encode(&m, 12, Some(src), Some(dst), b"why");
        let x = decode(&d).unwrap();
        assert_eq!(x.msg, m);
        assert_eq!(
            (x.payload_len, x.src, x.dst, x.text.as_str()),
            (12, Some(src), Some(dst), "why")
        );
        let mut bad = d;
        bad[0] ^= 0xff;
        assert!(decode(&bad).is_err());
    }

    #[test]
    fn pool_arrays_live_in_the_pool_and_give_their_pages_back() {
        let p = WorkerPool::create(1 << 20).unwrap();
        let free = p.pool.free_pages();
        let a = p.alloc_array(&[1000], DType::F32).unwrap();
        assert!(a.is_shared_memory());
        assert!(p.offset_of(&a).is_some());
        assert_eq!(p.pool.free_pages(), free - 1);
        let copy = a.clone();
        let mut written = copy.clone();
        written.fill(1.0);
        assert!(
            !written.is_shared_memory(),
            "writing a clone copies it out of the pool"
        );
        drop(a);
        drop(copy);
        assert_eq!(p.pool.free_pages(), free);
    }

    #[test]
    fn the_peer_is_the_process_the_kernel_names_and_another_user_is_refused() {
        use std::os::unix::process::CommandExt;
        let (a, _b) = UnixStream::pair().unwrap();
        let p = PeerProcess::of(&a).unwrap();
        assert_eq!(p.pid as u32, std::process::id());
        assert!(!p.exited());
        if !rustix::process::geteuid().is_root() {
            println!("SKIPPED: another user needs root");
            return;
        }
        let name = format!("kvstore.test-peer.{}", std::process::id());
        let l = UnixListener::bind_addr(&UnixAddr::from_abstract_name(&name).unwrap()).unwrap();
        l.set_nonblocking(true).unwrap();
        let script = format!(
            "import socket,time\ns=socket.socket(socket.AF_UNIX)\ns.connect('\\0{name}')\ntime.sleep(10)"
        );
        let Ok(mut child) = std::process::Command::new("python3")
            .args(["-c", &script])
            .uid(65534)
            .gid(65534)
            .spawn()
        else {
            println!("SKIPPED: no python3 to connect as another user");
            return;
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        let sock = loop {
            match l.accept() {
                Ok((s, _)) => break s,
                Err(_) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                Err(e) => panic!("the other user's process never connected: {e}"),
            }
        };
        let refused = PeerProcess::of(&sock);
        let _ = child.kill();
        let _ = child.wait();
        match refused {
            Err(e) => assert!(e.to_string().contains("another user"), "{e}"),
            Ok(_) => panic!("a peer of another user was accepted"),
        }
    }

    #[test]
    fn peer_pages_are_read_by_copy_or_summed_in_place() {
        let p = WorkerPool::create(1 << 20).unwrap();
        let r = p.pool.alloc(16).unwrap();
        let vals = [1.0f32, 2.0, 3.0, 4.0];
        p.seg.write(r.offset, bytemuck::cast_slice(&vals)).unwrap();
        let pages = PeerPages {
            seg: p.seg.clone(),
            offset: r.offset,
            len: 4,
            dtype: DType::F32,
        };
        let mut acc = NDArray::from_vec(&[4], vec![10.0f32; 4]).unwrap();
        pages.add_into(&mut acc).unwrap();
        assert_eq!(acc.to_vec::<f32>().unwrap(), vec![11.0, 12.0, 13.0, 14.0]);
        assert_eq!(pages.to_array().unwrap().to_vec::<f32>().unwrap(), vals);
        assert_eq!(pages.to_bytes().unwrap(), bytemuck::cast_slice(&vals));
        assert!(pages.add_into(&mut NDArray::zeros(&[3])).is_err());
        assert!(pages
            .copy_into(&mut NDArray::zeros_dtype(&[4], DType::F64))
            .is_err());
        // A region past the mapping is refused, not read.
        let past = PeerPages {
            seg: p.seg.clone(),
            offset: p.seg.len() - 8,
            len: 4,
            dtype: DType::F32,
        };
        assert!(past.add_into(&mut NDArray::zeros(&[4])).is_err());
        assert!(past.to_array().is_err());
    }

    #[test]
    fn host_ids_are_stable() {
        assert_eq!(host_id(), host_id());
        assert!(host_id().contains("net"));
    }
}
