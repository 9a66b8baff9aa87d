//! [`Transport`] over a shared-memory [`Channel`]: descriptors on rings; payloads up to 200 bytes
//! inline in the descriptor, larger ones in pool pages (one copy in, one copy out); a put writes
//! straight into the peer's exposed pool region and the notification carries the immediate.
//! The channel's segment travels over a Unix socket, which also tells when the peer is gone.

use std::io::Read;
use std::os::fd::AsFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener, UnixStream};
use std::time::{Duration, Instant};

use kvstore_shm::{recv_fds, send_fds, Channel, ChannelConfig, Region, Segment, SLOT};

use crate::{Event, RegionHandle, Transport, TransportError};

const SEND_INLINE: u8 = 1;
const SEND_POOL: u8 = 2;
const PUT: u8 = 3;
const HEAD: usize = 40;
/// Largest payload carried inside a descriptor.
pub const INLINE_MAX: usize = SLOT - HEAD;
const HELLO: &[u8] = b"kvstore-shm-1";

/// Waits for peers on an abstract Unix socket (per network namespace, nothing on disk).
pub struct ShmListener {
    l: UnixListener,
}

fn addr(name: &str) -> Result<UnixAddr, TransportError> {
    Ok(UnixAddr::from_abstract_name(format!("kvstore-shm.{name}"))?)
}

impl ShmListener {
    /// Listens under `name`.
    pub fn bind(name: &str) -> Result<ShmListener, TransportError> {
        Ok(ShmListener {
            l: UnixListener::bind_addr(&addr(name)?)?,
        })
    }

    /// Waits for one peer and attaches to the channel it sends.
    pub fn accept(&self) -> Result<ShmPair, TransportError> {
        let (s, _) = self.l.accept()?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        let mut buf = [0u8; 64];
        let (n, mut fds) = recv_fds(&s, &mut buf)?;
        if &buf[..n] != HELLO || fds.len() != 1 {
            return Err(TransportError::Refused("not a kvstore shm peer".into()));
        }
        let chan = Channel::attach(Segment::from_fd(fds.remove(0))?)?;
        ShmPair::new(chan, s)
    }
}

/// One end of a shared-memory channel as a [`Transport`].
pub struct ShmPair {
    chan: Channel,
    sock: UnixStream,
    spin: Duration,
}

fn put_u64(d: &mut [u8], at: usize, v: u64) {
    d[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

fn get_u64(d: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(d[at..at + 8].try_into().unwrap_or([0; 8]))
}

impl ShmPair {
    fn new(chan: Channel, sock: UnixStream) -> Result<ShmPair, TransportError> {
        sock.set_nonblocking(true)?;
        Ok(ShmPair {
            chan,
            sock,
            spin: Duration::from_micros(200),
        })
    }

    /// Creates a channel and hands it to the peer listening under `name`.
    pub fn connect(
        name: &str,
        cfg: ChannelConfig,
        timeout: Duration,
    ) -> Result<ShmPair, TransportError> {
        let deadline = Instant::now() + timeout;
        let sock = loop {
            match UnixStream::connect_addr(&addr(name)?) {
                Ok(s) => break s,
                Err(_) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                Err(e) => return Err(e.into()),
            }
        };
        let chan = Channel::create(name, cfg)?;
        send_fds(&sock, HELLO, &[chan.segment().fd().as_fd()])?;
        ShmPair::new(chan, sock)
    }

    /// How long a receive spins before it sleeps (default 200 µs).
    pub fn set_spin(&mut self, spin: Duration) {
        self.spin = spin;
    }

    /// The channel (for direct use of its pools).
    pub fn channel(&self) -> &Channel {
        &self.chan
    }

    fn peer_alive(&self) -> bool {
        let mut b = [0u8; 1];
        !matches!((&self.sock).read(&mut b), Ok(0))
    }

    fn post(&self, d: &[u8], deadline: Instant) -> Result<(), TransportError> {
        self.chan.send(d, deadline).map_err(|e| match e {
            kvstore_shm::ShmError::Timeout => {
                TransportError::Timeout("the peer's ring stayed full".into())
            }
            other => other.into(),
        })
    }
}

impl Transport for ShmPair {
    fn name(&self) -> &'static str {
        "shm"
    }

    fn send(&mut self, tag: u64, payload: &[u8], deadline: Instant) -> Result<(), TransportError> {
        let mut d = [0u8; SLOT];
        put_u64(&mut d, 8, tag);
        put_u64(&mut d, 16, payload.len() as u64);
        if payload.len() <= INLINE_MAX {
            d[0] = SEND_INLINE;
            d[HEAD..HEAD + payload.len()].copy_from_slice(payload);
        } else {
            // The one copy: into pool pages the receiver frees after its copy out. A full pool
            // is back-pressure: wait for the receiver to free pages.
            let r = loop {
                match self.chan.my_pool().alloc(payload.len()) {
                    Ok(r) => break r,
                    Err(kvstore_shm::ShmError::Exhausted(_)) if Instant::now() < deadline => {
                        if payload.len() > self.chan.my_pool().capacity() {
                            return Err(TransportError::Refused(format!(
                                "{} bytes exceed the pool of {}",
                                payload.len(),
                                self.chan.my_pool().capacity()
                            )));
                        }
                        std::thread::yield_now();
                    }
                    Err(kvstore_shm::ShmError::Exhausted(_)) => {
                        return Err(TransportError::Timeout(
                            "waiting for free pool pages".into(),
                        ))
                    }
                    Err(e) => return Err(e.into()),
                }
            };
            self.chan.segment().write(r.offset, payload)?;
            d[0] = SEND_POOL;
            put_u64(&mut d, 24, r.offset as u64);
        }
        self.post(&d, deadline)
    }

    fn recv(&mut self, buf: &mut [u8], deadline: Instant) -> Result<Event, TransportError> {
        let mut d = [0u8; SLOT];
        loop {
            let tick = deadline.min(Instant::now() + Duration::from_millis(100));
            match self.chan.recv(&mut d, self.spin, tick) {
                Ok(()) => break,
                Err(kvstore_shm::ShmError::Timeout) => {
                    if !self.peer_alive() {
                        return Err(TransportError::PeerLost("the peer closed its end".into()));
                    }
                    if Instant::now() >= deadline {
                        return Err(TransportError::Timeout("receiving".into()));
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
        let (tag, len) = (get_u64(&d, 8), get_u64(&d, 16) as usize);
        match d[0] {
            SEND_INLINE | SEND_POOL if len > buf.len() => Err(TransportError::Refused(format!(
                "{len} bytes for a buffer of {}",
                buf.len()
            ))),
            SEND_INLINE if len <= INLINE_MAX => {
                buf[..len].copy_from_slice(&d[HEAD..HEAD + len]);
                Ok(Event::Message { tag, len })
            }
            SEND_POOL => {
                let r = Region {
                    offset: get_u64(&d, 24) as usize,
                    len,
                };
                // A descriptor pointing outside the pool, or at pages not allocated, is refused.
                self.chan.peer_pool().check(r)?;
                self.chan.segment().read(r.offset, &mut buf[..len])?;
                self.chan.peer_pool().free(r)?;
                Ok(Event::Message { tag, len })
            }
            PUT => {
                let region = Region {
                    offset: get_u64(&d, 24) as usize,
                    len: get_u64(&d, 32) as usize,
                };
                let offset = get_u64(&d, 40) as usize;
                self.chan.my_pool().check(region)?;
                if offset.checked_add(len).is_none_or(|e| e > region.len) {
                    return Err(TransportError::Refused(
                        "put notice beyond its region".into(),
                    ));
                }
                Ok(Event::Put {
                    imm: tag,
                    region: RegionHandle {
                        key: region.offset as u64,
                        len: region.len as u64,
                    },
                    offset,
                    len,
                })
            }
            k => Err(TransportError::Refused(format!("bad descriptor kind {k}"))),
        }
    }

    fn expose(&mut self, len: usize) -> Result<RegionHandle, TransportError> {
        let r = self.chan.my_pool().alloc(len)?;
        Ok(RegionHandle {
            key: r.offset as u64,
            len: len as u64,
        })
    }

    fn release(&mut self, region: RegionHandle) -> Result<(), TransportError> {
        self.chan.my_pool().free(Region {
            offset: region.key as usize,
            len: region.len as usize,
        })?;
        Ok(())
    }

    fn put(
        &mut self,
        remote: RegionHandle,
        offset: usize,
        data: &[u8],
        imm: u64,
        deadline: Instant,
    ) -> Result<(), TransportError> {
        let r = Region {
            offset: remote.key as usize,
            len: remote.len as usize,
        };
        self.chan.peer_pool().check(r)?;
        if offset.checked_add(data.len()).is_none_or(|e| e > r.len) {
            return Err(TransportError::Refused(
                "put beyond the remote region".into(),
            ));
        }
        // The one copy, straight into the peer's region.
        self.chan.segment().write(r.offset + offset, data)?;
        let mut d = [0u8; SLOT];
        d[0] = PUT;
        put_u64(&mut d, 8, imm);
        put_u64(&mut d, 16, data.len() as u64);
        put_u64(&mut d, 24, r.offset as u64);
        put_u64(&mut d, 32, r.len as u64);
        put_u64(&mut d, 40, offset as u64);
        self.post(&d, deadline)
    }

    fn read_region(
        &self,
        region: RegionHandle,
        offset: usize,
        out: &mut [u8],
    ) -> Result<(), TransportError> {
        let r = Region {
            offset: region.key as usize,
            len: region.len as usize,
        };
        self.chan.my_pool().check(r)?;
        if offset.checked_add(out.len()).is_none_or(|e| e > r.len) {
            return Err(TransportError::Refused("read beyond the region".into()));
        }
        self.chan.segment().read(r.offset + offset, out)?;
        Ok(())
    }
}
