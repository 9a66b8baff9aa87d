//! What the shared-memory backend does beyond the shared suite (conformance.rs): read-only
//! send pools, a connect's deadline, the memory a lost peer may still write, a send the pool
//! can never hold, a peer that stops reading, and what a peer posted before it closed.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kvstore_transport::{
    Backend, Completion, PeerId, Sent, ShmBackend, ShmConfig, Token, TransportError,
};

// Shared with conformance.rs, which uses all of it; this file, a part.
#[allow(dead_code)]
#[path = "conformance/harness.rs"]
mod harness;
use harness::*;

/// The perms of this process's mappings of the memfd named `name` (`/proc/self/maps`).
fn mapping_perms(name: &str) -> Vec<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let tag = format!("/memfd:{name} ");
    let mut perms: Vec<String> = maps
        .lines()
        .filter(|l| l.contains(&tag))
        .map(|l| l.split_whitespace().nth(1).unwrap().to_string())
        .collect();
    perms.sort();
    perms
}

/// Over shared memory a peer maps the other side's send pool (its `kv.alloc` arrays, its data
/// sent by reference) read-only, and the kernel refuses it more; only the landing pool, where
/// grants to the peer lie, is mapped writable by both.
#[test]
fn shm_peers_map_each_others_send_pool_read_only() {
    let id = format!(
        "ro{}x{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    );
    let (owner, peer) = (format!("{id}o"), format!("{id}p"));
    let mut a = ShmBackend::new(&owner, small_shm(true)).unwrap();
    a.listen(&id).unwrap();
    let (id2, peer2) = (id.clone(), peer.clone());
    let t = std::thread::spawn(move || {
        let mut b = ShmBackend::new(&peer2, small_shm(true)).unwrap();
        b.connect(&id2, Duration::from_secs(5)).unwrap();
        b
    });
    let mut connected = false;
    let start = Instant::now();
    while !connected {
        a.progress(&mut |c| connected |= matches!(c, Completion::Connected { .. }))
            .unwrap();
        assert!(start.elapsed() < Duration::from_secs(10), "no connection");
    }
    let b = t.join().unwrap();
    for side in [&owner, &peer] {
        assert_eq!(
            mapping_perms(&format!("{side}-pool")),
            ["r--s", "rw-s"],
            "{side}"
        );
        assert_eq!(
            mapping_perms(&format!("{side}-landing")),
            ["rw-s", "rw-s"],
            "{side}"
        );
    }
    drop((a, b));
}

/// A listener that stopped accepting, its backlog full: a connect gives up at its deadline
/// with an error, where a blocking connect would wait in the kernel for good.
#[test]
fn shm_connect_to_a_full_backlog_ends_at_its_deadline() {
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
    let id = format!(
        "bl{}x{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    );
    let at = SocketAddr::from_abstract_name(format!("kvstore-shm.{id}")).unwrap();
    let _listener = UnixListener::bind_addr(&at).unwrap();
    // Fill the backlog: non-blocking connects until the kernel says it is full.
    let mut held = Vec::new();
    let filled = (0..100_000).any(|_| {
        let s = rustix::net::socket_with(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::STREAM,
            rustix::net::SocketFlags::NONBLOCK,
            None,
        )
        .unwrap();
        let to =
            rustix::net::SocketAddrUnix::new_abstract_name(format!("kvstore-shm.{id}").as_bytes())
                .unwrap();
        match rustix::net::connect(&s, &to) {
            Ok(()) => {
                held.push(UnixStream::from(s));
                false
            }
            Err(e) => {
                assert_eq!(e, rustix::io::Errno::AGAIN, "{e}");
                true
            }
        }
    });
    assert!(filled, "the backlog never filled");
    let mut b = ShmBackend::new(&format!("{id}c"), small_shm(false)).unwrap();
    let start = Instant::now();
    assert!(b.connect(&id, Duration::from_millis(300)).is_err());
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "{:?}",
        start.elapsed()
    );
}

/// The peer of `shm_a_lost_peers_memory_is_freed_once_its_process_exits`, run by it as a
/// process of its own (this test binary again, with the listener's name in the environment;
/// not a test by itself): it connects, closes its link while it lives on, and exits once its
/// stdin closes (the test saw its grant kept), or after 60 s.
#[test]
#[ignore = "a peer process that shm_a_lost_peers_memory_is_freed_once_its_process_exits runs"]
fn shm_peer_process_that_leaves_then_exits() {
    let Ok(at) = std::env::var("KVSTORE_TEST_SHM_AT") else {
        // Run by `--include-ignored`, not by the test that needs a peer: nothing to do.
        return;
    };
    let mut b = ShmBackend::new("child", small_shm(true)).unwrap();
    b.connect(&at, Duration::from_secs(5)).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    drop(b);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::Read;
        let _ = std::io::stdin().read_to_end(&mut Vec::new());
        let _ = tx.send(());
    });
    let _ = rx.recv_timeout(Duration::from_secs(60));
}

/// Memory granted to a peer whose link closed while its process lived is kept (it may still
/// write it), and freed once that process has exited: the backend looks as it progresses.
/// Before, it was kept for good, and a process that closes its files before its pidfd says
/// it exited (every exiting one) left its grants kept almost always.
#[test]
fn shm_a_lost_peers_memory_is_freed_once_its_process_exits() {
    let name = format!("kept-{}", std::process::id());
    let mut srv = ShmBackend::new("srv", small_shm(true)).unwrap();
    srv.listen(&name).unwrap();
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "shm_peer_process_that_leaves_then_exits",
            "--ignored",
            "--test-threads=1",
        ])
        .env("KVSTORE_TEST_SHM_AT", &name)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut s = Side {
        b: Box::new(srv),
        log: vec![],
    };
    let start = Instant::now();
    let until = |s: &mut Side, what: &dyn Fn(&Side) -> bool| {
        while !what(s) {
            s.pump();
            assert!(start.elapsed() < Duration::from_secs(20), "{:?}", s.log);
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    until(&mut s, &|s| {
        s.log.iter().any(|e| matches!(e, Ev::Connected(_)))
    });
    let Some(Ev::Connected(peer)) = s.log.first().cloned() else {
        unreachable!()
    };
    let mem = heap(&mut s, &[0u8; 4096]);
    let _g = grant_to(&mut s, peer, &mem, 0..4096);
    until(&mut s, &|s| s.log.iter().any(|e| matches!(e, Ev::Lost(_))));
    let kept = |s: &Side| {
        // SAFETY: the box holds a `ShmBackend` (made above).
        let b: &ShmBackend = unsafe { &*(s.b.as_ref() as *const dyn Backend as *const ShmBackend) };
        b.kept_grants()
    };
    assert_eq!(kept(&s), 1, "the peer still runs: its grant is kept");
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
    until(&mut s, &|s| kept(s) == 0);
}

/// A server and a client of `cfg`, connected, each one's capabilities taken by the other:
/// (client, its name for the server, server, its name for the client).
fn pair_of(cfg: ShmConfig) -> (Side, PeerId, Side, PeerId) {
    let name = format!(
        "pair-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    );
    let mut srv = ShmBackend::new("srv", cfg.clone()).unwrap();
    srv.listen(&name).unwrap();
    let t = std::thread::spawn(move || {
        let mut b = ShmBackend::new("cli", cfg).unwrap();
        let p = b.connect(&name, Duration::from_secs(5)).unwrap();
        (b, p)
    });
    let mut s = Side {
        b: Box::new(srv),
        log: vec![],
    };
    let start = Instant::now();
    let to_cli = loop {
        s.pump();
        if let Some(Ev::Connected(p)) = s.log.first().cloned() {
            s.log.clear();
            break p;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "no connection");
    };
    let (b, to_srv) = t.join().unwrap();
    let mut c = Side {
        b: Box::new(b),
        log: vec![],
    };
    for _ in 0..10 {
        c.pump();
        s.pump();
    }
    (c, to_srv, s, to_cli)
}

/// Progresses `s` until it loses its peer (10 s at most).
fn pump_until_lost(s: &mut Side) {
    let start = Instant::now();
    while !s.log.iter().any(|e| matches!(e, Ev::Lost(_))) {
        s.pump();
        assert!(start.elapsed() < Duration::from_secs(10), "never lost");
    }
}

fn recvs(s: &Side) -> usize {
    s.log.iter().filter(|e| matches!(e, Ev::Recv(..))).count()
}

/// A body staged in pool pages and data staged after it, each of which fits the pool alone
/// but not both at once: no retry could ever post it, so it is refused (before, every try
/// answered "would block", and the caller waited for room that never came).
#[test]
fn shm_a_send_the_pool_can_never_hold_is_refused() {
    let cfg = ShmConfig {
        pages: 4,
        ..small_shm(false)
    };
    let (mut c, to_srv, mut s, _) = pair_of(cfg);
    let body = vec![7u8; 1000];
    let data = pattern(4 * 4096, 3);
    let src = heap(&mut c, &data);
    // SAFETY: `src` is not written while a send of it is in flight.
    let r = unsafe { c.b.send(to_srv, &body, Some((&src, 0..4 * 4096, Token(1)))) };
    assert!(
        matches!(
            r,
            Err(TransportError::Shm(kvstore_shm::ShmError::Exhausted(_)))
        ),
        "{r:?}"
    );
    // A body and data that fit together go, whole.
    // SAFETY: as above.
    let r = unsafe { c.b.send(to_srv, &body, Some((&src, 0..3 * 4096, Token(2)))) };
    assert!(matches!(r, Ok(Sent::Posted)), "{r:?}");
    drive(&mut c, &mut s, |c, s| {
        recvs(s) == 1 && c.log.iter().any(|e| matches!(e, Ev::Done(2)))
    });
    let Some(Ev::Recv(_, b, Some(d))) = s.log.iter().find(|e| matches!(e, Ev::Recv(..))) else {
        panic!("{:?}", s.log)
    };
    assert_eq!((b, d), (&body, &data[..3 * 4096].to_vec()));
}

/// A peer that stops reading its ring (it computes, and calls no progress) while it sends:
/// the answers owed to it (releases of its pages) fill the ring to it and then the queue
/// behind it, and this side stops reading its messages. With nothing it can do until the
/// peer frees room, it sleeps (`arm` says so; before, it said there was work, and a wait spun
/// a core), and it wakes when the peer reads again, losing nothing.
#[test]
fn shm_a_side_waiting_for_room_to_answer_sleeps_and_loses_nothing() {
    let (mut b, to_a, mut a, _) = pair_of(small_shm(false));
    let src = heap(&mut b, &pattern(4096, 9));
    let mut sent = 0u64;
    let mut stalled = 0;
    while stalled < 3 {
        loop {
            // SAFETY: `src` is never written.
            let r = unsafe { b.b.send(to_a, b"m", Some((&src, 0..4096, Token(sent)))) };
            match r.unwrap() {
                Sent::Posted => sent += 1,
                Sent::WouldBlock => break,
            }
        }
        b.b.flush().unwrap();
        // `a` takes what it can; `b` does not progress.
        if a.pump() == 0 {
            stalled += 1;
        } else {
            stalled = 0;
        }
        assert!(sent < 4000, "a never stopped reading");
    }
    assert!(
        recvs(&a) < sent as usize,
        "a read everything: the case was not made"
    );
    assert!(
        a.b.arm().unwrap(),
        "nothing to do until b frees room, but arm says there is work"
    );
    drive(&mut b, &mut a, |b, a| {
        recvs(a) == sent as usize
            && b.log.iter().filter(|e| matches!(e, Ev::Done(_))).count() == sent as usize
    });
}

/// A peer that posts more descriptors than one batch takes and then closes: everything it
/// posted before it went is delivered before it is lost (before, one batch of 256 was, and the
/// rest, its messages and its releases, were dropped), and while paused too, as nothing more
/// can come.
#[test]
fn shm_what_a_peer_posted_before_it_closed_is_all_delivered() {
    for paused in [false, true] {
        let cfg = ShmConfig {
            ring_slots: 1024,
            ..small_shm(false)
        };
        let (mut b, to_a, mut a, to_b) = pair_of(cfg);
        if paused {
            a.b.pause(to_b, true);
        }
        // Armed, `a` looks at its sockets first when it next progresses, so it finds the peer
        // gone before its ring's turn.
        assert!(a.b.arm().unwrap());
        for i in 0..300u32 {
            // SAFETY: no data.
            let r = unsafe { b.b.send(to_a, &i.to_le_bytes(), None) };
            assert!(matches!(r, Ok(Sent::Posted)), "{r:?}");
        }
        b.b.flush().unwrap();
        drop(b);
        pump_until_lost(&mut a);
        let got: Vec<u32> = a
            .log
            .iter()
            .filter_map(|e| match e {
                Ev::Recv(_, body, None) => Some(u32::from_le_bytes(body[..4].try_into().unwrap())),
                _ => None,
            })
            .collect();
        assert_eq!(got, (0..300).collect::<Vec<_>>(), "paused: {paused}");
    }
}

/// As above, where what was posted is data in the peer's pages, each taken with a release
/// owed to the peer, and the ring to it is full: the releases can never go, and no bound on
/// them stops what it posted from being delivered (before, two batches were, 512).
#[test]
fn what_a_closed_peer_posted_is_delivered_though_its_answers_cannot_go() {
    let cfg = ShmConfig {
        ring_slots: 1024,
        ..small_shm(false)
    };
    let (mut b, to_a, mut a, to_b) = pair_of(cfg);
    // a's ring to b, full: b never reads it.
    let mut filled = 0;
    // SAFETY: no data.
    while let Ok(Sent::Posted) = unsafe { a.b.send(to_b, b"x", None) } {
        filled += 1;
        assert!(filled <= 4096, "the ring never filled");
    }
    // Armed, `a` looks at its sockets first when it next progresses.
    assert!(a.b.arm().unwrap());
    // Sent in place from pages `b` allocated: each taken by reference, its release owed.
    // (Kept past `b`'s end, as a killed process's pages are: a backend dropped frees its
    // staged copies, and a descriptor naming freed pages is refused.)
    let src = pool(&mut b, &pattern(4096, 5));
    for i in 0..600u64 {
        // SAFETY: `src` is never written.
        let r = unsafe {
            b.b.send(to_a, &i.to_le_bytes(), Some((&src, 0..4096, Token(i))))
        };
        assert!(matches!(r, Ok(Sent::Posted)), "{i}: {r:?}");
    }
    b.b.flush().unwrap();
    drop(b);
    pump_until_lost(&mut a);
    assert_eq!(recvs(&a), 600);
    drop(src);
}
