//! One peer of a transport backend, driven with blocking calls: what `kvperf lat` and `bw`
//! measure. Every wait ends at its deadline; a lost peer is an error.

use std::collections::VecDeque;
use std::ops::Range;
use std::time::{Duration, Instant};

use kvstore_transport::{
    Access, Backend, Completion, PeerId, Region, RemoteRegion, Sent, ShmBackend, ShmConfig,
    TcpBackend, Token,
};

/// What arrived from the peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// A message: its tag (the body's first 8 bytes), the rest of its body, and how many bytes
    /// of data it carried (copied out into a buffer of the receiver's, as a receive into a
    /// posted buffer would leave them).
    Msg {
        /// The tag.
        tag: u64,
        /// The body after the tag.
        body: Vec<u8>,
        /// Bytes of data.
        data: usize,
    },
    /// A put landed in a region this side granted.
    Put {
        /// The immediate.
        imm: u32,
        /// Bytes.
        len: usize,
    },
}

/// A backend and the one peer it talks to.
pub struct Conn {
    b: Box<dyn Backend>,
    peer: Option<PeerId>,
    inbox: VecDeque<Event>,
    next: u64,
    /// Tokens posted and not yet complete.
    in_flight: usize,
    /// How long a receive spins before it sleeps.
    spin: Duration,
    /// Why the link failed: reported once what arrived before has been taken.
    failed: Option<String>,
    /// Where received data is copied.
    rx: Vec<u8>,
    /// Where an outgoing body is assembled (tag, then body), reused.
    tx: Vec<u8>,
}

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

impl Conn {
    /// Waits for one peer on `backend` (already listening).
    pub fn accept(b: Box<dyn Backend>, timeout: Duration) -> Result<Conn, String> {
        let deadline = Instant::now() + timeout;
        let mut c = Conn::new(b, None);
        while c.peer.is_none() {
            // What the peer sends at once arrives in the same progress call: it is kept.
            c.pump()?;
            if Instant::now() >= deadline {
                return Err("no peer connected in time".into());
            }
            if c.peer.is_none() {
                kvstore_transport::wait(&mut [c.b.as_mut()], Duration::from_millis(50))
                    .map_err(err)?;
            }
        }
        Ok(c)
    }

    /// A connection to `peer` of `b` (`None`: the first to connect).
    pub fn new(b: Box<dyn Backend>, peer: Option<PeerId>) -> Conn {
        Conn {
            b,
            peer,
            inbox: VecDeque::new(),
            next: 1,
            in_flight: 0,
            spin: Duration::from_micros(200),
            failed: None,
            rx: Vec::new(),
            tx: Vec::new(),
        }
    }

    /// `"tcp"` or `"shm"`.
    pub fn name(&self) -> &'static str {
        self.b.name()
    }

    /// Memory this backend moves best, of `len` bytes, for `access` (sent from, or put into).
    pub fn alloc(&mut self, len: usize, access: Access) -> Result<Region, String> {
        self.b.alloc(len, access).map_err(err)
    }

    /// Grants the peer `range` of `r`.
    pub fn grant(&mut self, r: &Region, range: Range<usize>) -> Result<RemoteRegion, String> {
        // SAFETY: kvperf never reads or writes a granted region (it measures the movement).
        unsafe { self.b.grant(self.peer()?, r, range) }.map_err(err)
    }

    /// Drops a grant once the measurement that used it is over.
    pub fn forget(&mut self, g: &RemoteRegion) {
        if let Some(p) = self.peer {
            self.b.forget(p, g);
        }
    }

    fn pump(&mut self) -> Result<usize, String> {
        if let Some(f) = &self.failed {
            return Err(f.clone());
        }
        let (inbox, in_flight, peer, rx) = (
            &mut self.inbox,
            &mut self.in_flight,
            &mut self.peer,
            &mut self.rx,
        );
        let mut failure = None;
        let n = self
            .b
            .progress(&mut |c| match c {
                Completion::Recv { body, data, .. } => {
                    let mut tag = [0u8; 8];
                    let k = body.len().min(8);
                    tag[..k].copy_from_slice(&body[..k]);
                    let n = data.map_or(0, |d| {
                        if rx.len() < d.len() {
                            rx.resize(d.len(), 0);
                        }
                        let _ = d.read(0, &mut rx[..d.len()]);
                        d.len()
                    });
                    inbox.push_back(Event::Msg {
                        tag: u64::from_le_bytes(tag),
                        body: body[k..].to_vec(),
                        data: n,
                    })
                }
                Completion::Put { imm, len, .. } => inbox.push_back(Event::Put { imm, len }),
                Completion::Done(_) => *in_flight -= 1,
                Completion::Failed(_, e) => failure = Some(e.to_string()),
                Completion::Lost { error, .. } => failure = Some(format!("peer lost: {error}")),
                Completion::Connected { peer: p } => {
                    peer.get_or_insert(p);
                }
            })
            .map_err(err)?;
        self.failed = failure;
        Ok(n)
    }

    /// Zeroes the copy of the last message's data.
    pub fn wipe_data(&mut self) {
        self.rx.fill(0);
    }

    /// The next event if one has arrived, without waiting (one progress call).
    pub fn try_recv(&mut self) -> Result<Option<Event>, String> {
        if self.inbox.is_empty() {
            self.pump()?;
        }
        Ok(self.inbox.pop_front())
    }

    /// The first `n` bytes of the data of the last message that brought some.
    pub fn last_data(&self, n: usize) -> &[u8] {
        &self.rx[..n.min(self.rx.len())]
    }

    fn peer(&self) -> Result<PeerId, String> {
        self.peer.ok_or_else(|| "no peer".to_string())
    }

    fn token(&mut self) -> Token {
        self.next += 1;
        self.in_flight += 1;
        Token(self.next)
    }

    /// Sends a message: `tag`, then `body`, and optionally a range of a region as data.
    pub fn send(
        &mut self,
        tag: u64,
        body: &[u8],
        data: Option<(&Region, Range<usize>)>,
        deadline: Instant,
    ) -> Result<(), String> {
        let peer = self.peer()?;
        let mut b = std::mem::take(&mut self.tx);
        b.clear();
        b.extend_from_slice(&tag.to_le_bytes());
        b.extend_from_slice(body);
        let r = self.send_body(peer, &b, data, deadline);
        self.tx = b;
        r
    }

    fn send_body(
        &mut self,
        peer: PeerId,
        b: &[u8],
        data: Option<(&Region, Range<usize>)>,
        deadline: Instant,
    ) -> Result<(), String> {
        loop {
            let t = data.as_ref().map(|_| self.token());
            let d = data
                .as_ref()
                .map(|(r, range)| (*r, range.clone(), t.unwrap_or(Token(0))));
            // SAFETY: kvperf never writes a region it sends from.
            let sent = unsafe { self.b.send(peer, b, d) }.map_err(err)?;
            if sent == Sent::Posted {
                return self.b.flush().map_err(err);
            }
            if t.is_some() {
                self.in_flight -= 1;
            }
            self.progress_until(deadline)?;
        }
    }

    /// Puts `range` of `src` at `offset` of `dst`, notifying with `imm`.
    pub fn put(
        &mut self,
        src: &Region,
        range: Range<usize>,
        dst: &RemoteRegion,
        offset: usize,
        imm: u32,
        deadline: Instant,
    ) -> Result<(), String> {
        let peer = self.peer()?;
        loop {
            let t = self.token();
            // SAFETY: kvperf never writes a region it puts from.
            let sent = unsafe { self.b.put(peer, src, range.clone(), dst, offset, imm, t) }
                .map_err(err)?;
            if sent == Sent::Posted {
                return self.b.flush().map_err(err);
            }
            self.in_flight -= 1;
            self.progress_until(deadline)?;
        }
    }

    /// One turn of a wait: a progress call, then the deadline, looked at whether or not
    /// anything came (a peer that keeps sending does not hold a wait past it).
    fn progress_until(&mut self, deadline: Instant) -> Result<(), String> {
        if self.pump()? == 0 {
            std::hint::spin_loop();
        }
        if Instant::now() >= deadline {
            return Err("timed out".into());
        }
        Ok(())
    }

    /// The next event, waiting until `deadline`: spins for a while, then sleeps.
    pub fn recv(&mut self, deadline: Instant) -> Result<Event, String> {
        // Read on the first look at the clock, not per message.
        let mut start = None;
        let mut polls = 0u32;
        loop {
            if let Some(e) = self.inbox.pop_front() {
                return Ok(e);
            }
            if let Some(f) = &self.failed {
                return Err(f.clone());
            }
            if self.pump()? > 0 {
                continue;
            }
            // The clock is read on one empty poll in 32: a read costs as much as a poll, and
            // would delay seeing what arrives (perftest's loops read no clock either).
            polls = polls.wrapping_add(1);
            if polls % 32 != 0 {
                std::hint::spin_loop();
                continue;
            }
            let now = Instant::now();
            if now >= deadline {
                return Err("timed out waiting for the peer".into());
            }
            if now - *start.get_or_insert(now) > self.spin {
                let left = (deadline - now).min(Duration::from_millis(100));
                kvstore_transport::wait(&mut [self.b.as_mut()], left).map_err(err)?;
            }
        }
    }

    /// Waits until every posted operation is complete.
    pub fn drain(&mut self, deadline: Instant) -> Result<(), String> {
        while self.in_flight > 0 {
            self.progress_until(deadline)?;
        }
        Ok(())
    }
}

/// A listening TCP backend on `port` of every interface.
pub fn tcp_server(port: u16) -> Result<Box<dyn Backend>, String> {
    let mut b = TcpBackend::new(1 << 32).map_err(err)?;
    b.listen(std::net::SocketAddr::from(([0, 0, 0, 0], port)))
        .map_err(|e| format!("port {port}: {e}"))?;
    Ok(Box::new(b))
}

/// A TCP backend connected to `addr`.
pub fn tcp_client(addr: std::net::SocketAddr, timeout: Duration) -> Result<Conn, String> {
    let mut b = TcpBackend::new(1 << 32).map_err(err)?;
    let p = b
        .connect(addr, timeout)
        .map_err(|e| format!("connecting to {addr}: {e}"))?;
    Ok(Conn::new(Box::new(b), Some(p)))
}

fn shm_config() -> ShmConfig {
    ShmConfig {
        // 1 GiB of address space each: two 256 MiB regions and staging; landing regions.
        pages: 16 * 1024,
        landing_pages: 16 * 1024,
        ..ShmConfig::default()
    }
}

/// A shared-memory backend listening under `name`.
pub fn shm_server(name: &str) -> Result<Box<dyn Backend>, String> {
    let mut b = ShmBackend::new("kvperf", shm_config()).map_err(err)?;
    b.listen(name)
        .map_err(|e| format!("shm name {name}: {e}"))?;
    Ok(Box::new(b))
}

/// A shared-memory backend connected to the one listening under `name`.
pub fn shm_client(name: &str, timeout: Duration) -> Result<Conn, String> {
    let mut b = ShmBackend::new("kvperf", shm_config()).map_err(err)?;
    let p = b
        .connect(name, timeout)
        .map_err(|e| format!("shm name {name}: {e}"))?;
    Ok(Conn::new(Box::new(b), Some(p)))
}

/// A verbs backend on the first device with an active port, listening on `port` of the
/// device's first address (the queue pairs take the path of the TCP link they are set up on).
#[cfg(feature = "rdma")]
pub fn rdma_server(port: u16) -> Result<Box<dyn Backend>, String> {
    let mut b = kvstore_transport::RdmaBackend::new(rdma_config()?).map_err(err)?;
    let ip = rdma_address(&b)?;
    b.listen(std::net::SocketAddr::new(ip, port))
        .map_err(|e| format!("{ip} port {port}: {e}"))?;
    Ok(Box::new(b))
}

/// A verbs backend connected to the one listening at `host` (default: this device's first
/// address) and `port`.
#[cfg(feature = "rdma")]
pub fn rdma_client(host: Option<&str>, port: u16, timeout: Duration) -> Result<Conn, String> {
    let mut b = kvstore_transport::RdmaBackend::new(rdma_config()?).map_err(err)?;
    let ip = match host {
        Some(h) => h.parse().map_err(|_| format!("{h} is not an IP address"))?,
        None => rdma_address(&b)?,
    };
    let addr = std::net::SocketAddr::new(ip, port);
    let p = b
        .connect(addr, timeout)
        .map_err(|e| format!("connecting to {addr}: {e}"))?;
    Ok(Conn::new(Box::new(b), Some(p)))
}

/// The backend's defaults, but for `KVSTORE_RDMA_WRITE_IMM` (as the store reads it): `0`
/// sends a put that fills its grant as an eager SEND, to measure it against WRITE_WITH_IMM.
#[cfg(feature = "rdma")]
fn rdma_config() -> Result<kvstore_transport::RdmaConfig, String> {
    let mut c = kvstore_transport::RdmaConfig::default();
    if let Ok(v) = std::env::var("KVSTORE_RDMA_WRITE_IMM") {
        c.write_imm = match v.as_str() {
            "0" => false,
            "1" => true,
            _ => return Err(format!("KVSTORE_RDMA_WRITE_IMM={v:?}: expected 0 or 1")),
        };
    }
    Ok(c)
}

/// The device's first address (IPv4 first).
#[cfg(feature = "rdma")]
fn rdma_address(b: &kvstore_transport::RdmaBackend) -> Result<std::net::IpAddr, String> {
    b.addresses()
        .first()
        .copied()
        .ok_or_else(|| format!("{} has no RoCE address", b.device()))
}
