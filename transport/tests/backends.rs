//! What each backend does beyond the shared suite (conformance.rs): TCP's limits on strangers
//! and on claimed payloads, RDMA's registrations and reads (shared memory's: shm.rs).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

#[cfg(feature = "rdma")]
use kvstore_transport::Backend;
use kvstore_transport::PeerId;

// Shared with conformance.rs, which uses all of it; this file, a part.
#[allow(dead_code)]
#[path = "conformance/harness.rs"]
mod harness;
use harness::*;

/// A peer that connected may send only small frames until its owner trusts it: a larger
/// header closes its link at once; a trusted peer may send up to the backend's limit.
#[test]
fn tcp_a_stranger_sends_small_frames_until_trusted() {
    use kvstore_transport::Backend;
    use std::io::Write;
    let mut b = kvstore_transport::TcpBackend::new(1 << 30).unwrap();
    b.set_accepted_max_payload(1000);
    let at = b.listen("127.0.0.1:0".parse().unwrap()).unwrap();
    let mut events = Vec::new();
    let pump = |b: &mut kvstore_transport::TcpBackend, events: &mut Vec<String>| {
        b.progress(&mut |c| events.push(format!("{c:?}"))).unwrap();
    };
    let connect = |b: &mut kvstore_transport::TcpBackend, events: &mut Vec<String>| {
        let raw = std::net::TcpStream::connect(at).unwrap();
        let start = Instant::now();
        while !events.iter().any(|e| e.starts_with("Connected")) {
            pump(b, events);
            assert!(start.elapsed() < Duration::from_secs(5));
        }
        let e = events.remove(0);
        let n: u32 = e
            .trim_start_matches("Connected(peer ")
            .trim_end_matches(')')
            .parse()
            .unwrap();
        (raw, PeerId(n))
    };
    let (mut stranger, p) = connect(&mut b, &mut events);
    stranger
        .write_all(&kvstore_transport::tcp::msg_frame_header(16, Some(2000)))
        .unwrap();
    let start = Instant::now();
    while !events.iter().any(|e| e.starts_with(&format!("Lost({p}"))) {
        pump(&mut b, &mut events);
        assert!(start.elapsed() < Duration::from_secs(5), "{events:?}");
    }
    events.clear();
    let (mut trusted, q) = connect(&mut b, &mut events);
    b.trust(q).unwrap();
    trusted
        .write_all(&kvstore_transport::tcp::msg_frame_header(16, Some(2000)))
        .unwrap();
    trusted.write_all(&[7u8; 2016]).unwrap();
    let start = Instant::now();
    while !events.iter().any(|e| e.starts_with("Recv")) {
        pump(&mut b, &mut events);
        assert!(start.elapsed() < Duration::from_secs(5), "{events:?}");
    }
    assert!(
        events.iter().any(|e| e.contains("Some(2000)")),
        "{events:?}"
    );
}

/// A put that names a grant of another peer's, or an immediate wider than a put's, closes
/// the link it came on, and the granted memory is not written.
#[test]
fn tcp_a_put_into_another_peers_grant_or_with_a_wide_immediate_closes_its_link() {
    use kvstore_transport::Access;
    use std::io::Write;
    for case in ["another's grant", "a wide immediate"] {
        let (mut s, at) = server(Kind::Tcp);
        let connect = |s: &mut Side| {
            let raw = std::net::TcpStream::connect(at.parse::<SocketAddr>().unwrap()).unwrap();
            let start = Instant::now();
            loop {
                if let Some(Ev::Connected(p)) = s.log.pop() {
                    return (raw, p);
                }
                s.pump();
                assert!(start.elapsed() < Duration::from_secs(5));
            }
        };
        let (_owner, owner) = connect(&mut s);
        let (mut writer, w) = connect(&mut s);
        let r = s.b.alloc(64, Access::Land).unwrap();
        let to = if case == "a wide immediate" { w } else { owner };
        // SAFETY: the region is not touched until the grant is revoked or the peer is lost.
        let g = unsafe { s.b.grant(to, &r, 0..64) }.unwrap();
        let imm = if case == "a wide immediate" {
            1 << 20
        } else {
            1
        };
        writer
            .write_all(&kvstore_transport::tcp::put_frame_header(
                g.id(),
                0,
                imm,
                16,
            ))
            .unwrap();
        writer.write_all(&[9u8; 16]).unwrap();
        let start = Instant::now();
        while !s.log.contains(&Ev::Lost(w)) {
            s.pump();
            assert!(
                start.elapsed() < Duration::from_secs(5),
                "{case}: {:?}",
                s.log
            );
        }
        s.b.forget(to, &g);
        let mut back = [1u8; 64];
        // SAFETY: the grant is gone (over TCP only this thread writes granted memory).
        unsafe { r.read(0, &mut back) }.unwrap();
        assert_eq!(back, [0u8; 64], "{case}");
    }
}

/// This process's resident memory, in bytes (`/proc/self/statm`).
fn rss() -> usize {
    let s = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: usize = s.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

/// A header that claims a payload of nearly 1 GiB and sends a few bytes of it commits no
/// memory for the rest: the receive buffer grows only as bytes arrive.
#[test]
fn tcp_a_claimed_payload_costs_nothing_until_it_arrives() {
    use std::io::Write;
    let (mut s, at) = server(Kind::Tcp);
    let mut raw = std::net::TcpStream::connect(at.parse::<SocketAddr>().unwrap()).unwrap();
    let start = Instant::now();
    while !s.log.iter().any(|e| matches!(e, Ev::Connected(_))) {
        s.pump();
        assert!(start.elapsed() < Duration::from_secs(5));
    }
    let before = rss();
    let claim = (1usize << 30) - 64;
    raw.write_all(&kvstore_transport::tcp::msg_frame_header(
        16,
        Some(claim - 16),
    ))
    .unwrap();
    raw.write_all(&[7u8; 100_000]).unwrap();
    let until = Instant::now() + Duration::from_millis(300);
    while Instant::now() < until {
        s.pump();
    }
    let grew = rss().saturating_sub(before);
    // Other tests run beside this one: the bound leaves them room, and a claim none.
    assert!(
        grew < 256 << 20,
        "a claim of {claim} bytes took {grew} bytes"
    );
    assert!(!s.log.iter().any(|e| matches!(e, Ev::Recv(..))));
}

/// Storage over memory the test owns: a new value over the same bytes is what storage freed
/// and allocated again at the same address looks like.
#[cfg(feature = "rdma")]
struct At(*mut u8, usize);

// SAFETY: the bytes belong to a buffer the test keeps alive past every `At` over it, and are
// reached only by copies.
#[cfg(feature = "rdma")]
unsafe impl kvstore_transport::Storage for At {
    fn ptr(&self) -> *mut u8 {
        self.0
    }
    fn len(&self) -> usize {
        self.1
    }
}

// SAFETY: as above; the pointer is only an address.
#[cfg(feature = "rdma")]
unsafe impl Send for At {}
// SAFETY: as above.
#[cfg(feature = "rdma")]
unsafe impl Sync for At {}

/// The verbs backend caches registrations by storage identity: the same storage registered
/// again costs nothing, and new storage at the address of freed storage is registered anew
/// (a put from it carries its own bytes, not those the old registration saw).
#[cfg(feature = "rdma")]
#[test]
fn rdma_registrations_are_cached_by_storage_not_address() {
    use kvstore_transport::{RdmaBackend, Sent, Token};
    let (mut a, to_b, mut b, to_a) = pair(Kind::Rdma);
    let regs = |s: &Side| {
        // SAFETY: the box holds an `RdmaBackend` (made by `pair(Kind::Rdma)`).
        let r: &RdmaBackend =
            unsafe { &*(s.b.as_ref() as *const dyn Backend as *const RdmaBackend) };
        r.registrations()
    };
    let mut buf = vec![0u8; 4096].into_boxed_slice();
    let p = buf.as_mut_ptr();
    for round in 0..4u8 {
        buf.fill(round + 1);
        let mem: std::sync::Arc<dyn kvstore_transport::Storage> = std::sync::Arc::new(At(p, 4096));
        let n = regs(&a);
        let src = a.b.register(mem.clone()).unwrap();
        assert_eq!(
            regs(&a),
            n + 1,
            "new storage at an old address is registered anew"
        );
        let again = a.b.register(mem).unwrap();
        assert_eq!(regs(&a), n + 1, "the same storage is registered once");
        let dst = heap(&mut b, &[0u8; 4096]);
        let g = grant_to(&mut b, to_a, &dst, 0..4096);
        // SAFETY: `src` is not written until the put completes.
        let sent = unsafe {
            a.b.put(to_b, &again, 0..4096, &g, 0, 7, Token(round as u64))
        };
        assert_eq!(sent.unwrap(), Sent::Posted);
        drive(&mut a, &mut b, |a, b| {
            a.log.contains(&Ev::Done(round as u64))
                && b.log.iter().any(|e| matches!(e, Ev::Put(..)))
        });
        assert!(read(&dst).iter().all(|&x| x == round + 1), "round {round}");
        a.take();
        b.take();
        drop((src, again));
    }
    // The registrations of storage that is gone are dropped, by progress alone (their pages
    // were pinned, and left readable through their old keys, for as long as they were kept).
    let cached = |s: &Side| {
        // SAFETY: as above.
        let r: &RdmaBackend =
            unsafe { &*(s.b.as_ref() as *const dyn Backend as *const RdmaBackend) };
        r.cached_registrations()
    };
    let start = Instant::now();
    while cached(&a) > 0 {
        a.pump();
        assert!(start.elapsed() < Duration::from_secs(5), "{}", cached(&a));
    }
}

/// On a host without RDMA the backend says so, as an error, never a panic.
#[cfg(feature = "rdma")]
#[test]
fn rdma_without_a_device_is_a_clean_error() {
    let devices = kvstore_transport::rdma::devices().unwrap_or_default();
    match kvstore_transport::RdmaBackend::new(small_rdma()) {
        Ok(b) => assert!(devices.iter().any(|d| d == b.device())),
        Err(e) => {
            assert!(devices.is_empty(), "{e}");
            assert!(e.to_string().contains("RDMA"), "{e}");
        }
    }
}

/// A dma-buf of `len` bytes exported by the first DRM device (vgem in the test VM: its dumb
/// buffers, exported with PRIME), mapped here; closed and unmapped when dropped.
#[cfg(feature = "rdma")]
struct DmaBufMem {
    host: Box<[u8]>,
    map: *mut u8,
    len: usize,
    buf: std::os::fd::OwnedFd,
    _card: std::os::fd::OwnedFd,
}

#[cfg(feature = "rdma")]
impl DmaBufMem {
    fn new(len: usize) -> DmaBufMem {
        use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
        #[repr(C)]
        struct CreateDumb {
            height: u32,
            width: u32,
            bpp: u32,
            flags: u32,
            handle: u32,
            pitch: u32,
            size: u64,
        }
        #[repr(C)]
        struct PrimeHandle {
            handle: u32,
            flags: u32,
            fd: i32,
        }
        // _IOWR('d', 0xb2, struct drm_mode_create_dumb), _IOWR('d', 0x2d, struct
        // drm_prime_handle).
        const CREATE_DUMB: libc::c_ulong = 0xc020_64b2;
        const PRIME_HANDLE_TO_FD: libc::c_ulong = 0xc00c_642d;
        let card = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/dri/card0")
            .expect("a DRM device for dma-bufs (the test VM loads vgem)");
        let mut c = CreateDumb {
            height: 1,
            width: u32::try_from(len).unwrap(),
            bpp: 8,
            flags: 0,
            handle: 0,
            pitch: 0,
            size: 0,
        };
        // SAFETY: the request's argument is a `drm_mode_create_dumb`, laid out as the kernel's.
        let rc = unsafe { libc::ioctl(card.as_raw_fd(), CREATE_DUMB, &mut c) };
        assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
        assert!(c.size >= len as u64);
        let mut p = PrimeHandle {
            handle: c.handle,
            flags: (libc::O_CLOEXEC | libc::O_RDWR) as u32,
            fd: -1,
        };
        // SAFETY: the argument is a `drm_prime_handle`, laid out as the kernel's.
        let rc = unsafe { libc::ioctl(card.as_raw_fd(), PRIME_HANDLE_TO_FD, &mut p) };
        assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
        // SAFETY: the call returned a new descriptor, owned here from now on.
        let buf = unsafe { OwnedFd::from_raw_fd(p.fd) };
        // SAFETY: maps `len` bytes of the dma-buf, shared; unmapped in `Drop`.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                buf.as_raw_fd(),
                0,
            )
        };
        assert_ne!(map, libc::MAP_FAILED, "{}", std::io::Error::last_os_error());
        DmaBufMem {
            host: vec![0u8; len].into_boxed_slice(),
            map: map.cast(),
            len,
            buf,
            _card: card.into(),
        }
    }

    /// Writes `data` into both copies: the host bytes and the device memory.
    fn fill(&mut self, data: &[u8]) {
        self.host.copy_from_slice(data);
        // SAFETY: the mapping is `len` bytes, writable, and no reference covers it.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.map, self.len) };
    }
}

#[cfg(feature = "rdma")]
impl Drop for DmaBufMem {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once.
        unsafe { libc::munmap(self.map.cast(), self.len) };
    }
}

// SAFETY: the host bytes are a buffer this value owns, at a fixed address, reached by copies
// only while a backend holds it; the descriptor stays open while it lives.
#[cfg(feature = "rdma")]
unsafe impl kvstore_transport::Storage for DmaBufMem {
    fn ptr(&self) -> *mut u8 {
        self.host.as_ptr().cast_mut()
    }
    fn len(&self) -> usize {
        self.len
    }
    fn dmabuf(&self) -> Option<kvstore_transport::DmaBuf> {
        use std::os::fd::AsRawFd;
        Some(kvstore_transport::DmaBuf {
            fd: self.buf.as_raw_fd(),
            offset: 0,
        })
    }
}

// SAFETY: the pointers are only addresses of memory this value owns.
#[cfg(feature = "rdma")]
unsafe impl Send for DmaBufMem {}
// SAFETY: as above.
#[cfg(feature = "rdma")]
unsafe impl Sync for DmaBufMem {}

/// Storage that names a dma-buf (device memory) is registered with `ibv_reg_dmabuf_mr` first;
/// rxe refuses it, and its host bytes are registered instead: a put from it, and a put into a
/// grant of it, carry and land the right bytes. (With a NIC that takes dma-bufs the device
/// memory itself would be registered; none is at hand.)
#[cfg(feature = "rdma")]
#[test]
fn rdma_dmabuf_memory_is_tried_then_its_host_bytes_are_registered() {
    use kvstore_transport::{RdmaBackend, Sent, Token};
    let (mut a, to_b, mut b, to_a) = pair(Kind::Rdma);
    let dmabuf = |s: &Side| {
        // SAFETY: the box holds an `RdmaBackend` (made by `pair(Kind::Rdma)`).
        let r: &RdmaBackend =
            unsafe { &*(s.b.as_ref() as *const dyn Backend as *const RdmaBackend) };
        let (tried, taken, why) = r.dmabuf_registrations();
        (tried, taken, why.map(str::to_string))
    };
    let data = pattern(4096, 3);
    let mut src = DmaBufMem::new(4096);
    src.fill(&data);
    let src = a.b.register(std::sync::Arc::new(src)).unwrap();
    let (tried, taken, why) = dmabuf(&a);
    assert_eq!((tried, taken), (1, 0), "tried, and refused by rxe");
    assert!(
        why.as_ref()
            .is_some_and(|w| w.starts_with("ibv_reg_dmabuf_mr: ")),
        "{why:?}"
    );
    let dst = heap(&mut b, &[0u8; 4096]);
    let g = grant_to(&mut b, to_a, &dst, 0..4096);
    // SAFETY: `src` is not written until the put completes.
    let sent = unsafe { a.b.put(to_b, &src, 0..4096, &g, 0, 7, Token(1)) };
    assert_eq!(sent.unwrap(), Sent::Posted);
    drive(&mut a, &mut b, |a, b| {
        a.log.contains(&Ev::Done(1)) && b.log.iter().any(|e| matches!(e, Ev::Put(..)))
    });
    assert_eq!(read(&dst), data);
    a.take();
    b.take();

    // The other way: a grant of such storage, written by the peer.
    let mut land = DmaBufMem::new(4096);
    land.fill(&[0u8; 4096]);
    let land = b.b.register(std::sync::Arc::new(land)).unwrap();
    let (tried, taken, _) = dmabuf(&b);
    assert_eq!((tried, taken), (1, 0));
    let g = grant_to(&mut b, to_a, &land, 0..4096);
    let (tried, taken, why) = dmabuf(&b);
    assert_eq!((tried, taken), (2, 0), "the grant tried it too");
    println!("rxe's answer: {}", why.unwrap_or_default());
    let from = heap(&mut a, &pattern(4096, 9));
    // SAFETY: `from` is not written until the put completes.
    let sent = unsafe { a.b.put(to_b, &from, 0..4096, &g, 0, 8, Token(2)) };
    assert_eq!(sent.unwrap(), Sent::Posted);
    drive(&mut a, &mut b, |a, b| {
        a.log.contains(&Ev::Done(2)) && b.log.iter().any(|e| matches!(e, Ev::Put(..)))
    });
    assert_eq!(read(&land), pattern(4096, 9));
}

/// A receiver with more receive credits than send-queue room, sent more large messages at
/// once than that room (each's data read from the sender's memory by an RDMA READ), reads
/// them all: the reads that find the queue full wait for completions to free it. Before, the
/// reads past the room were posted anyway, and on a device whose queue is as long as asked
/// the failed post lost the sender, an honest peer whose only fault was to be busy (rxe makes
/// its queues longer than asked; a post past `send_depth` is now refused as such a device
/// would refuse it, so this test fails here too without the wait).
#[cfg(feature = "rdma")]
#[test]
fn rdma_reads_of_many_large_messages_wait_for_send_queue_room() {
    use kvstore_transport::{RdmaBackend, RdmaConfig, Sent, Token};
    const N: u64 = 48;
    const LEN: usize = 96 << 10;
    let cfg = RdmaConfig {
        receives: 64,
        send_depth: 16,
        ..small_rdma()
    };
    let mut srv = RdmaBackend::new(cfg).unwrap();
    let ip = *srv.addresses().first().expect("an RDMA device");
    let at = srv.listen(SocketAddr::new(ip, 0)).unwrap();
    let mut s = Side {
        b: Box::new(srv),
        log: vec![],
    };
    let (mut c, to_srv, _) = connect_with(&mut s, move || {
        let mut b = RdmaBackend::new(small_rdma()).unwrap();
        let p = b.connect(at, Duration::from_secs(5)).unwrap();
        let c = Side {
            b: Box::new(b),
            log: vec![],
        };
        (c, p)
    });
    let start = Instant::now();
    let data = pattern(N as usize * LEN, 3);
    let src = heap(&mut c, &data);
    for i in 0..N {
        let at = i as usize * LEN;
        loop {
            // SAFETY: `src` is never written.
            let sent = unsafe {
                c.b.send(
                    to_srv,
                    &i.to_le_bytes(),
                    Some((&src, at..at + LEN, Token(i))),
                )
            };
            if sent.unwrap() == Sent::Posted {
                break;
            }
            // The client's own queue: it frees as the device acknowledges, without the server.
            c.pump();
            assert!(start.elapsed() < Duration::from_secs(20), "{:?}", c.log);
        }
    }
    // Every message is in the receiver's queue before it looks: its first look finds more
    // than its send queue holds.
    std::thread::sleep(Duration::from_secs(1));
    drive(&mut c, &mut s, |c, s| {
        let got = s.log.iter().filter(|e| matches!(e, Ev::Recv(..))).count();
        let done = c.log.iter().filter(|e| matches!(e, Ev::Done(_))).count();
        got == N as usize && done == N as usize
            || s.log
                .iter()
                .chain(&c.log)
                .any(|e| matches!(e, Ev::Lost(_) | Ev::Failed(_)))
    });
    let lost: Vec<&Ev> = (s.log.iter().chain(&c.log))
        .filter(|e| matches!(e, Ev::Lost(_) | Ev::Failed(_)))
        .collect();
    assert!(lost.is_empty(), "{lost:?}");
    for e in &s.log {
        if let Ev::Recv(_, body, Some(got)) = e {
            let i = u64::from_le_bytes(body[..8].try_into().unwrap()) as usize;
            assert!(got == &data[i * LEN..(i + 1) * LEN], "message {i}");
        }
    }
}

/// A put small enough to ride in a message (`eager_put`) goes so only where the message fits
/// the receiver's buffers, which may be smaller than the sender's: else it is a WRITE and its
/// notice (before, the sender measured it against its own buffer, and the receiver's queue
/// pair failed on a message too long for its buffer: the link was lost).
#[cfg(feature = "rdma")]
#[test]
fn rdma_a_small_put_fits_the_receivers_buffers_not_the_senders() {
    use kvstore_transport::{RdmaBackend, RdmaConfig, Sent, Token};
    let (mut s, at) = server(Kind::Rdma);
    let (mut c, c_to_s, s_to_c) = connect_with(&mut s, move || {
        let cfg = RdmaConfig {
            buffer: 2048,
            ..small_rdma()
        };
        let mut b = RdmaBackend::new(cfg).unwrap();
        let p = b.connect(at.parse().unwrap(), Duration::from_secs(5));
        let c = Side {
            b: Box::new(b),
            log: vec![],
        };
        (c, p.unwrap())
    });
    let dst = heap(&mut c, &[0u8; 8000]);
    let g = grant_to(&mut c, c_to_s, &dst, 0..8000);
    let data = pattern(4000, 5);
    let src = heap(&mut s, &data);
    // SAFETY: `src` is not written until the put completes.
    let sent = unsafe { s.b.put(s_to_c, &src, 0..4000, &g, 100, 1, Token(1)) };
    assert_eq!(sent.unwrap(), Sent::Posted);
    drive(&mut s, &mut c, |s, c| {
        let put = c.log.iter().any(|e| matches!(e, Ev::Put(..)));
        let lost = (s.log.iter().chain(&c.log)).any(|e| matches!(e, Ev::Lost(_)));
        (s.log.contains(&Ev::Done(1)) && put) || lost
    });
    assert!(
        !(s.log.iter().chain(&c.log)).any(|e| matches!(e, Ev::Lost(_))),
        "{:?} {:?}",
        s.log,
        c.log
    );
    let got = read(&dst);
    assert_eq!(got[100..4100], data[..]);
    assert!(got[..100].iter().chain(&got[4100..]).all(|&x| x == 0));
}
