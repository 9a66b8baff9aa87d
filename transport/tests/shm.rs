//! What the shared-memory backend does beyond the shared suite (conformance.rs): read-only
//! send pools, a connect's deadline, and the memory a lost peer may still write.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kvstore_transport::{Backend, Completion, ShmBackend};

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
