//! What a peer that connected to a verbs backend may do before its owner trusts it (after the
//! job's handshake, `Backend::trust`): its messages bring little data, and its queue pair takes
//! no WRITE into the backend's memory, whatever key it names; once trusted, both as any peer.
//! (TCP's limit on strangers: backends.rs.) Runs in the soft-RoCE VM.
#![cfg(feature = "rdma")]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvstore_transport::{PeerId, RdmaBackend, Sent, Token};

// Shared with conformance.rs, which uses all of it; this file, a part.
#[allow(dead_code)]
#[path = "conformance/harness.rs"]
mod harness;
use harness::*;

/// A listening verbs backend whose accepted peers may bring 1,000 bytes until trusted.
fn guarded() -> (Side, SocketAddr) {
    let mut b = RdmaBackend::new(small_rdma()).unwrap();
    b.set_accepted_max_payload(1000);
    let ip = *b.addresses().first().expect("an RDMA device");
    let at = b.listen(SocketAddr::new(ip, 0)).unwrap();
    (
        Side {
            b: Box::new(b),
            log: vec![],
        },
        at,
    )
}

/// Connects a client to `s`: the client, its name for `s`, and `s`'s name for it.
fn join(s: &mut Side, at: SocketAddr) -> (Side, PeerId, PeerId) {
    connect(Kind::Rdma, s, &at.to_string())
}

/// Pumps both sides for a while (what the device might still deliver).
fn settle(a: &mut Side, b: &mut Side) {
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(300) {
        a.pump();
        b.pump();
    }
}

/// `c`'s message (token 1) of `body` and `data` reaches `s` whole, from `from`.
fn delivered(c: &mut Side, s: &mut Side, from: PeerId, body: &[u8], data: &[u8]) {
    drive(c, s, |c, s| {
        c.log.contains(&Ev::Done(1)) && s.log.iter().any(|e| matches!(e, Ev::Recv(..)))
    });
    let got = s.take();
    let whole = Ev::Recv(from, body.to_vec(), Some(data.to_vec()));
    assert!(got.contains(&whole), "{got:?}");
}

/// A put by a peer not yet trusted, into a grant of another peer's (its key and address
/// guessed): a WRITE_WITH_IMM (it fills the grant) or a WRITE and its notice (it does not, and
/// is too large to go in a message). The device refuses the WRITE: the memory keeps the
/// owner's bytes, nothing reaches the owner of the grant, and the stranger's link is lost.
#[test]
fn rdma_a_peer_not_yet_trusted_writes_nothing() {
    for (len, what) in [
        (64, "a WRITE_WITH_IMM"),
        (16 << 10, "a WRITE and its notice"),
    ] {
        let (mut s, at) = guarded();
        let (mut owner, owner_to_s, s_to_owner) = join(&mut s, at);
        s.b.trust(s_to_owner).unwrap();
        let (mut stranger, stranger_to_s, s_to_stranger) = join(&mut s, at);
        let dst = heap(&mut s, &vec![0u8; 64 << 10]);
        let glen = if len == 64 { 64 } else { 64 << 10 };
        let g = grant_to(&mut s, s_to_owner, &dst, 0..glen);
        // The owner's put lands: the grant is writable by the peer it was made for.
        let mine = heap(&mut owner, &vec![5u8; len]);
        // SAFETY: `mine` is not written until the put completes.
        let sent = unsafe { owner.b.put(owner_to_s, &mine, 0..len, &g, 0, 1, Token(1)) };
        assert_eq!(sent.unwrap(), Sent::Posted, "{what}");
        drive(&mut owner, &mut s, |o, s| {
            o.log.contains(&Ev::Done(1)) && s.log.iter().any(|e| matches!(e, Ev::Put(..)))
        });
        s.take();
        let theirs = heap(&mut stranger, &vec![9u8; len]);
        // SAFETY: `theirs` is not written until the put completes or fails.
        let sent = unsafe {
            stranger
                .b
                .put(stranger_to_s, &theirs, 0..len, &g, 0, 2, Token(2))
        };
        assert_eq!(sent.unwrap(), Sent::Posted, "{what}");
        // The device refuses the WRITE, and the server loses the stranger's link. (What the
        // stranger's put reports is the device's: on rxe, Linux 6.1, it was reported done.)
        drive(&mut stranger, &mut s, |_, s| {
            s.log.contains(&Ev::Lost(s_to_stranger))
        });
        settle(&mut stranger, &mut s);
        let got = read(&dst);
        assert!(
            got[..len].iter().all(|&x| x == 5),
            "{what}: the stranger's bytes landed"
        );
        assert!(got[len..].iter().all(|&x| x == 0), "{what}");
        assert!(
            !s.log.iter().any(|e| matches!(e, Ev::Put(..))),
            "{what}: {:?}",
            s.log
        );
        let _ = owner;
    }
}

/// A peer not yet trusted that sends a message with more data than it may bring loses its
/// link; the same message from a trusted peer arrives, and its put lands.
#[test]
fn rdma_a_trusted_peer_sends_and_writes_as_any() {
    let (mut s, at) = guarded();
    // In the message's buffer, and read from the sender's memory (more than a buffer).
    for (trusted, len) in [(false, 4000), (false, 128 << 10), (true, 4000)] {
        let data = pattern(len, 1);
        let (mut c, c_to_s, s_to_c) = join(&mut s, at);
        if trusted {
            s.b.trust(s_to_c).unwrap();
        }
        let src = heap(&mut c, &data);
        // SAFETY: `src` is not written until the send completes.
        let sent = unsafe { c.b.send(c_to_s, b"hello", Some((&src, 0..len, Token(1)))) };
        assert_eq!(sent.unwrap(), Sent::Posted);
        if !trusted {
            drive(&mut c, &mut s, |_, s| s.log.contains(&Ev::Lost(s_to_c)));
            assert!(
                !s.log.iter().any(|e| matches!(e, Ev::Recv(..))),
                "{:?}",
                s.log
            );
            s.take();
            continue;
        }
        delivered(&mut c, &mut s, s_to_c, b"hello", &data);
        // Its queue pair now takes WRITEs: a put of 16 KiB into half a grant lands.
        let dst = heap(&mut s, &vec![0u8; 32 << 10]);
        let g = grant_to(&mut s, s_to_c, &dst, 0..32 << 10);
        let big = pattern(16 << 10, 7);
        let src = heap(&mut c, &big);
        // SAFETY: as above.
        let sent = unsafe { c.b.put(c_to_s, &src, 0..16 << 10, &g, 0, 3, Token(2)) };
        assert_eq!(sent.unwrap(), Sent::Posted);
        drive(&mut c, &mut s, |c, s| {
            c.log.contains(&Ev::Done(2)) && s.log.iter().any(|e| matches!(e, Ev::Put(..)))
        });
        assert_eq!(read(&dst)[..16 << 10], big[..]);
    }
}

/// A client that connects untrusted (`set_connected_untrusted`: a worker, before the server
/// proved itself), and a listening server: the client, its name for the server, the server,
/// and its name for the client.
fn untrusted_client() -> (Side, PeerId, Side, PeerId) {
    let (mut s, at) = server(Kind::Rdma);
    let (c, c_to_s, s_to_c) = connect_with(&mut s, move || {
        let mut b = RdmaBackend::new(small_rdma()).unwrap();
        b.set_connected_untrusted();
        let p = b.connect(at.parse().unwrap(), Duration::from_secs(5));
        let c = Side {
            b: Box::new(b),
            log: vec![],
        };
        (c, p.unwrap())
    });
    (c, c_to_s, s, s_to_c)
}

/// The client grants memory to its peer: the peer's put writes nothing until the client
/// trusts it, and lands once it does.
#[test]
fn rdma_a_peer_connected_to_writes_nothing_until_trusted() {
    for trusted in [false, true] {
        let (mut c, c_to_s, mut s, s_to_c) = untrusted_client();
        if trusted {
            c.b.trust(c_to_s).unwrap();
        }
        let dst = heap(&mut c, &[0u8; 64]);
        let g = grant_to(&mut c, c_to_s, &dst, 0..64);
        let src = heap(&mut s, &[4u8; 64]);
        // SAFETY: `src` is not written until the put completes or fails.
        let sent = unsafe { s.b.put(s_to_c, &src, 0..64, &g, 0, 1, Token(1)) };
        assert_eq!(sent.unwrap(), Sent::Posted);
        if trusted {
            drive(&mut s, &mut c, |s, c| {
                s.log.contains(&Ev::Done(1)) && c.log.iter().any(|e| matches!(e, Ev::Put(..)))
            });
            assert_eq!(read(&dst), [4u8; 64]);
        } else {
            drive(&mut s, &mut c, |_, c| c.log.contains(&Ev::Lost(c_to_s)));
            settle(&mut s, &mut c);
            assert_eq!(read(&dst), [0u8; 64], "the untrusted peer's bytes landed");
            assert!(
                !c.log.iter().any(|e| matches!(e, Ev::Put(..))),
                "{:?}",
                c.log
            );
        }
    }
}

/// The client sends a message whose data its peer must read from the client's memory (more
/// than a buffer): the peer's READ is refused until the client trusts it, and the message
/// never arrives; once trusted, it arrives whole.
#[test]
fn rdma_a_peer_connected_to_reads_nothing_until_trusted() {
    let data = pattern(128 << 10, 9);
    for trusted in [false, true] {
        let (mut c, c_to_s, mut s, s_to_c) = untrusted_client();
        if trusted {
            c.b.trust(c_to_s).unwrap();
        }
        let src = heap(&mut c, &data);
        // SAFETY: `src` is not written until the send completes or fails.
        let sent = unsafe {
            c.b.send(c_to_s, b"big", Some((&src, 0..data.len(), Token(1))))
        };
        assert_eq!(sent.unwrap(), Sent::Posted);
        if trusted {
            delivered(&mut c, &mut s, s_to_c, b"big", &data);
        } else {
            drive(&mut c, &mut s, |_, s| s.log.contains(&Ev::Lost(s_to_c)));
            settle(&mut c, &mut s);
            assert!(
                !s.log.iter().any(|e| matches!(e, Ev::Recv(..))),
                "{:?}",
                s.log
            );
            assert!(!c.log.contains(&Ev::Done(1)), "{:?}", c.log);
        }
    }
}

/// A stranger that streams bytes at the listener without end holds nothing up: the backend
/// reads no more of a connection than a hello and a "ready" (before, it read on, a byte per
/// call, for as long as bytes came, and nothing else in the process moved), and a real peer
/// joins and is served meanwhile.
#[test]
fn rdma_a_stranger_streaming_at_the_listener_holds_nothing_up() {
    use std::io::Write;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let (mut s, at) = guarded();
    let stop = Arc::new(AtomicBool::new(false));
    let flood = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut t = std::net::TcpStream::connect(at).unwrap();
            let junk = [7u8; 1 << 16];
            while !stop.load(Ordering::Relaxed) && t.write_all(&junk).is_ok() {}
        })
    };
    // Held up, the backend would never return to this test: it fails instead.
    let done = Arc::new(AtomicBool::new(false));
    let watchdog = {
        let done = done.clone();
        std::thread::spawn(move || {
            let start = Instant::now();
            while !done.load(Ordering::Relaxed) {
                if start.elapsed() > Duration::from_secs(60) {
                    eprintln!("a stranger's stream held the backend up for 60 s");
                    std::process::exit(1);
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    let (mut c, c_to_s, s_to_c) = join(&mut s, at);
    s.b.trust(s_to_c).unwrap();
    let data = pattern(100, 2);
    let src = heap(&mut c, &data);
    // SAFETY: `src` is not written until the send completes.
    let sent = unsafe { c.b.send(c_to_s, b"hi", Some((&src, 0..100, Token(1)))) };
    assert_eq!(sent.unwrap(), Sent::Posted);
    delivered(&mut c, &mut s, s_to_c, b"hi", &data);
    done.store(true, Ordering::Relaxed);
    stop.store(true, Ordering::Relaxed);
    // The stranger's connection was dropped (its hello was junk), so its writes end.
    s.pump();
    flood.join().unwrap();
    watchdog.join().unwrap();
}
