//! The conformance suite's harness: a backend and the log of what it reported, driven in
//! pairs; listening and connecting sides of each kind; memory to send from and put into.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kvstore_transport::{
    Access, Backend, Completion, Mem, PeerId, Region, ShmBackend, ShmConfig, TcpBackend,
};

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Ev {
    Connected(PeerId),
    Recv(PeerId, Vec<u8>, Option<Vec<u8>>),
    Put(PeerId, u64, usize, usize, u32),
    Done(u64),
    Failed(u64),
    Lost(PeerId),
}

pub(crate) struct Side {
    pub(crate) b: Box<dyn Backend>,
    pub(crate) log: Vec<Ev>,
}

impl Side {
    pub(crate) fn pump(&mut self) -> usize {
        let log = &mut self.log;
        self.b.flush().unwrap();
        self.b
            .progress(&mut |c| {
                log.push(match c {
                    Completion::Connected { peer } => Ev::Connected(peer),
                    Completion::Recv { peer, body, data } => {
                        Ev::Recv(peer, body.to_vec(), data.map(|d| d.to_vec()))
                    }
                    Completion::Put {
                        peer,
                        grant,
                        offset,
                        len,
                        imm,
                    } => Ev::Put(peer, grant, offset, len, imm),
                    Completion::Done(t) => Ev::Done(t.0),
                    Completion::Failed(t, _) => Ev::Failed(t.0),
                    Completion::Lost { peer, .. } => Ev::Lost(peer),
                })
            })
            .unwrap()
    }

    pub(crate) fn take(&mut self) -> Vec<Ev> {
        std::mem::take(&mut self.log)
    }
}

/// Progresses both sides until `done` says so; a hang is a failure after 20 s.
pub(crate) fn drive(a: &mut Side, b: &mut Side, mut done: impl FnMut(&Side, &Side) -> bool) {
    let start = Instant::now();
    while !done(a, b) {
        a.pump();
        b.pump();
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "hung: {:?} / {:?}",
            a.log,
            b.log
        );
    }
}

pub(crate) static SEQ: AtomicUsize = AtomicUsize::new(0);

pub(crate) fn small_shm(cross_memory: bool) -> ShmConfig {
    ShmConfig {
        ring_slots: 64,
        page_size: 4096,
        pages: 1024,
        landing_pages: 1024,
        handshake_timeout: Duration::from_millis(300),
        cross_memory,
    }
}

#[derive(Clone, Copy, Debug)]
pub(crate) enum Kind {
    Tcp,
    Shm,
    ShmBounce,
    #[cfg(feature = "rdma")]
    Rdma,
}

/// A small verbs backend for the tests (few buffers, so that "would block" comes soon).
#[cfg(feature = "rdma")]
pub(crate) fn small_rdma() -> kvstore_transport::RdmaConfig {
    kvstore_transport::RdmaConfig {
        device: std::env::var("KVSTORE_RDMA_DEVICE").ok(),
        receives: 16,
        sends: 32,
        // Under emulation (the soft-RoCE VM) a client's queue pair and registrations, made
        // before its hello goes out, once took longer than 300 ms, and the server dropped it.
        handshake_timeout: Duration::from_secs(2),
        ..Default::default()
    }
}

/// A listening server and where to reach it.
pub(crate) fn server(kind: Kind) -> (Side, String) {
    match kind {
        Kind::Tcp => {
            let mut b = TcpBackend::new(1 << 30).unwrap();
            let at = b.listen("127.0.0.1:0".parse().unwrap()).unwrap();
            (
                Side {
                    b: Box::new(b),
                    log: vec![],
                },
                at.to_string(),
            )
        }
        #[cfg(feature = "rdma")]
        Kind::Rdma => {
            let mut b = kvstore_transport::RdmaBackend::new(small_rdma()).unwrap();
            let ip = *b
                .addresses()
                .first()
                .expect("an RDMA device with a RoCE v2 address");
            let at = b.listen(SocketAddr::new(ip, 0)).unwrap();
            (
                Side {
                    b: Box::new(b),
                    log: vec![],
                },
                at.to_string(),
            )
        }
        Kind::Shm | Kind::ShmBounce => {
            let name = format!(
                "conf-{}-{}",
                std::process::id(),
                SEQ.fetch_add(1, Ordering::Relaxed)
            );
            let mut b = ShmBackend::new("srv", small_shm(matches!(kind, Kind::Shm))).unwrap();
            b.listen(&name).unwrap();
            (
                Side {
                    b: Box::new(b),
                    log: vec![],
                },
                name,
            )
        }
    }
}

pub(crate) fn client(kind: Kind, at: &str) -> (Side, PeerId) {
    let t = Duration::from_secs(5);
    let (b, p): (Box<dyn Backend>, PeerId) = match kind {
        Kind::Tcp => {
            let mut b = TcpBackend::new(1 << 30).unwrap();
            let p = b.connect(at.parse::<SocketAddr>().unwrap(), t).unwrap();
            (Box::new(b), p)
        }
        #[cfg(feature = "rdma")]
        Kind::Rdma => {
            let mut b = kvstore_transport::RdmaBackend::new(small_rdma()).unwrap();
            let p = b.connect(at.parse::<SocketAddr>().unwrap(), t).unwrap();
            (Box::new(b), p)
        }
        Kind::Shm | Kind::ShmBounce => {
            let mut b = ShmBackend::new("cli", small_shm(matches!(kind, Kind::Shm))).unwrap();
            let p = b.connect(at, t).unwrap();
            (Box::new(b), p)
        }
    };
    (Side { b, log: vec![] }, p)
}

/// Connects a client while the server progresses; returns both sides and each one's name for
/// the other.
pub(crate) fn connect(kind: Kind, srv: &mut Side, at: &str) -> (Side, PeerId, PeerId) {
    let at2 = at.to_string();
    connect_with(srv, move || client(kind, &at2))
}

/// Connects the client `make` makes on a thread of its own while the server progresses;
/// returns the client, its name for the server, and the server's name for it.
pub(crate) fn connect_with(
    srv: &mut Side,
    make: impl FnOnce() -> (Side, PeerId) + Send + 'static,
) -> (Side, PeerId, PeerId) {
    let t = std::thread::spawn(make);
    let start = Instant::now();
    let peer = loop {
        srv.pump();
        if let Some(i) = srv.log.iter().position(|e| matches!(e, Ev::Connected(_))) {
            let Ev::Connected(p) = srv.log.remove(i) else {
                unreachable!()
            };
            break p;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "no connection");
        std::thread::sleep(Duration::from_micros(100));
    };
    let (c, to_srv) = t.join().unwrap();
    (c, to_srv, peer)
}

pub(crate) fn pair(kind: Kind) -> (Side, PeerId, Side, PeerId) {
    let (mut s, at) = server(kind);
    let (c, to_srv, to_cli) = connect(kind, &mut s, &at);
    (c, to_srv, s, to_cli)
}

pub(crate) fn pattern(n: usize, salt: u8) -> Vec<u8> {
    (0..n).map(|i| (i % 251) as u8 ^ salt).collect()
}

pub(crate) fn heap(b: &mut Side, data: &[u8]) -> Region {
    b.b.register(Mem::from_bytes(data)).unwrap()
}

pub(crate) fn pool(b: &mut Side, data: &[u8]) -> Region {
    alloc(b, data, Access::Send)
}

pub(crate) fn alloc(b: &mut Side, data: &[u8], access: Access) -> Region {
    let r = b.b.alloc(data.len(), access).unwrap();
    // SAFETY: fresh, not granted, not sent.
    unsafe { r.write(0, data) }.unwrap();
    r
}

pub(crate) fn read(r: &Region) -> Vec<u8> {
    let mut v = vec![0u8; r.len()];
    // SAFETY: the tests read after the put completed, with no put in flight.
    unsafe { r.read(0, &mut v) }.unwrap();
    v
}

/// `s`'s grant of `range` of `r` to `peer`.
pub(crate) fn grant_to(
    s: &mut Side,
    peer: PeerId,
    r: &Region,
    range: std::ops::Range<usize>,
) -> kvstore_transport::RemoteRegion {
    // SAFETY: the tests read granted memory only after a put into it completed.
    unsafe { s.b.grant(peer, r, range) }.unwrap()
}
