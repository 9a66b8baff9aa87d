//! One suite, written once against the `Backend` trait, run over every backend: TCP, shared
//! memory, and shared memory where cross-memory writes are off (grants through pool pages).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvstore_transport::{Access, Region, RemoteRegion, Sent, Token};

#[path = "conformance/harness.rs"]
mod harness;
use harness::*;
#[path = "conformance/room.rs"]
mod room;
use room::*;
#[path = "conformance/hold.rs"]
mod hold;
use hold::*;

fn messages_and_data_of_every_size_arrive_in_order(kind: Kind) {
    let (mut a, to_b, mut b, _) = pair(kind);
    let bodies = [0usize, 1, 100, 192, 193, 4000, 65536];
    let datas: [Option<(usize, bool)>; 6] = [
        None,
        Some((0, false)),
        Some((1, true)),
        Some((5000, false)),
        Some((5000, true)),
        Some((1 << 20, false)),
    ];
    let mut want = Vec::new();
    let mut tok = 0u64;
    for (i, &n) in bodies.iter().enumerate() {
        for (j, d) in datas.iter().enumerate() {
            let body = pattern(n, (i * 7 + j) as u8);
            let data = d.map(|(len, from_pool)| {
                let bytes = pattern(len, (i + 3 * j) as u8);
                let r = if from_pool {
                    pool(&mut a, &bytes)
                } else {
                    heap(&mut a, &bytes)
                };
                (r, bytes)
            });
            let next = tok + data.is_some() as u64;
            loop {
                let d = data.as_ref().map(|(r, v)| (r, 0..v.len(), Token(next)));
                // SAFETY: the regions are not written again.
                match unsafe { a.b.send(to_b, &body, d) }.unwrap() {
                    Sent::Posted => break,
                    Sent::WouldBlock => {
                        a.pump();
                        b.pump();
                    }
                }
            }
            tok = next;
            want.push((body, data.map(|(_, v)| v)));
        }
    }
    let sends_with_data = tok as usize;
    drive(&mut a, &mut b, |a, b| {
        b.log.len() >= want.len()
            && a.log.iter().filter(|e| matches!(e, Ev::Done(_))).count() >= sends_with_data
    });
    let got: Vec<Ev> = b.take();
    assert_eq!(got.len(), want.len());
    for (g, (wb, wd)) in got.iter().zip(&want) {
        let Ev::Recv(_, gb, gd) = g else {
            panic!("{g:?}")
        };
        assert_eq!(gb, wb);
        assert_eq!(gd, wd);
    }
    // Every token completed exactly once, and each as done.
    let mut done: Vec<u64> = a
        .take()
        .into_iter()
        .map(|e| match e {
            Ev::Done(t) => t,
            other => panic!("{other:?}"),
        })
        .collect();
    done.sort();
    let expect: Vec<u64> = (1..=tok).collect();
    assert_eq!(done, expect);
}

fn puts_land_in_granted_ranges(kind: Kind) {
    let (mut a, to_b, mut b, to_a) = pair(kind);
    // Into private memory, send-pool pages (which peers cannot write themselves) and landing
    // pages; from private memory and send-pool pages.
    for (from_pool, into) in [
        (false, None),
        (true, Some(Access::Send)),
        (true, Some(Access::Land)),
    ] {
        let target = match into {
            Some(access) => alloc(&mut b, &[0u8; 64 * 1024], access),
            None => heap(&mut b, &[0u8; 64 * 1024]),
        };
        let g = grant_to(&mut b, to_a, &target, 1000..9000);
        // The handle crosses as bytes, as it would in a request.
        let msg = g.to_bytes();
        // SAFETY: no data.
        assert_eq!(unsafe { b.b.send(to_a, &msg, None) }.unwrap(), Sent::Posted);
        drive(&mut a, &mut b, |a, _| !a.log.is_empty());
        let Ev::Recv(_, body, None) = a.take().remove(0) else {
            panic!()
        };
        let remote = RemoteRegion::from_bytes(&body).unwrap();
        assert_eq!(remote.len(), 8000);
        let data = pattern(5000, 9);
        let src = if from_pool {
            pool(&mut a, &data)
        } else {
            heap(&mut a, &data)
        };
        // SAFETY: `src` is not written again.
        let r = unsafe { a.b.put(to_b, &src, 0..5000, &remote, 1000, 42, Token(7)) };
        assert_eq!(r.unwrap(), Sent::Posted);
        drive(&mut a, &mut b, |a, b| {
            !a.log.is_empty() && !b.log.is_empty()
        });
        assert_eq!(a.take(), vec![Ev::Done(7)]);
        assert_eq!(b.take(), vec![Ev::Put(to_a, g.id(), 1000, 5000, 42)]);
        let mem = read(&target);
        assert_eq!(&mem[2000..7000], &data[..]);
        assert!(mem[..2000].iter().chain(&mem[7000..]).all(|&x| x == 0));
        // Beyond the grant: refused where it is posted.
        // SAFETY: as above.
        let r = unsafe { a.b.put(to_b, &src, 0..5000, &remote, 3001, 1, Token(8)) };
        assert!(r.is_err());
        b.b.forget(to_a, &g);
    }
}

/// Puts that fill their grant exactly (how the store puts: a push into its receive slot, a
/// pull's answer into its output), of every size, into many grants, with the widest
/// immediate: each arrives whole, in order, naming its grant; a paused peer hears of them
/// only once resumed. A wider immediate is refused where it is posted.
fn puts_that_fill_their_grant_arrive_whole(kind: Kind) {
    let (mut a, to_b, mut b, to_a) = pair(kind);
    #[allow(unused_mut)]
    // Over shared memory, 40,000 bytes go through the peer's memory file, 70,000 by
    // `process_vm_writev`, the smaller ones through landing pages.
    let mut sizes = vec![1usize, 8, 200, 4096, 8192, 8193, 40_000, 70_000];
    #[cfg(feature = "rdma")]
    if matches!(kind, Kind::Rdma) {
        // Beyond rxe's largest message (8 MiB): split, the last piece carrying the immediate.
        sizes.push(9 << 20);
    }
    let top = (1u32 << kvstore_transport::IMM_BITS) - 1;
    for paused in [false, true] {
        let targets: Vec<Region> = sizes.iter().map(|&n| heap(&mut b, &vec![0u8; n])).collect();
        let grants: Vec<RemoteRegion> = targets
            .iter()
            .map(|t| grant_to(&mut b, to_a, t, 0..t.len()))
            .collect();
        b.b.pause(to_a, paused);
        let mut want = Vec::new();
        for (i, (g, &n)) in grants.iter().zip(&sizes).enumerate() {
            let src = heap(&mut a, &pattern(n, i as u8 + paused as u8));
            let imm = top - i as u32;
            loop {
                // SAFETY: `src` is not written again.
                match unsafe { a.b.put(to_b, &src, 0..n, g, 0, imm, Token(i as u64)) }.unwrap() {
                    Sent::Posted => break,
                    Sent::WouldBlock => {
                        a.pump();
                        b.pump();
                    }
                }
            }
            want.push(Ev::Put(to_a, g.id(), 0, n, imm));
        }
        drive(&mut a, &mut b, |a, _| a.log.len() == sizes.len());
        if paused {
            let until = Instant::now() + Duration::from_millis(100);
            while Instant::now() < until {
                a.pump();
                b.pump();
            }
            assert!(b.log.is_empty(), "a paused peer was told: {:?}", b.log);
            b.b.pause(to_a, false);
        }
        drive(&mut a, &mut b, |_, b| b.log.len() == sizes.len());
        assert_eq!(b.take(), want);
        a.take();
        for (i, (t, &n)) in targets.iter().zip(&sizes).enumerate() {
            assert!(read(t) == pattern(n, i as u8 + paused as u8), "size {n}");
        }
        let wide = heap(&mut a, &[1u8; 8]);
        let g = &grants[1];
        // SAFETY: as above.
        let r = unsafe { a.b.put(to_b, &wide, 0..8, g, 0, top + 1, Token(99)) };
        assert!(
            r.is_err(),
            "an immediate of {} bits was taken",
            kvstore_transport::IMM_BITS + 1
        );
        for g in &grants {
            b.b.forget(to_a, g);
        }
    }
}

fn a_full_link_would_block_and_drains(kind: Kind) {
    let (mut a, to_b, mut b, _) = pair(kind);
    let src = heap(&mut a, &pattern(1 << 20, 1));
    let mut posted = 0u64;
    // SAFETY: `src` is never written.
    while unsafe {
        a.b.send(to_b, b"x", Some((&src, 0..1 << 20, Token(posted))))
    }
    .unwrap()
        == Sent::Posted
    {
        posted += 1;
        assert!(posted < 1000, "a link that never fills");
    }
    assert!(posted >= 1);
    drive(&mut a, &mut b, |_, b| b.log.len() as u64 == posted);
    assert!(b
        .take()
        .iter()
        .all(|e| matches!(e, Ev::Recv(_, body, Some(d)) if body == b"x" && d.len() == 1 << 20)));
}

fn many_peers_one_loop_and_no_missed_wakeup(kind: Kind) {
    let (mut s, at) = server(kind);
    const CLIENTS: usize = 3;
    const ROUNDS: usize = 100;
    let mut handles = Vec::new();
    for i in 0..CLIENTS {
        let at = at.clone();
        handles.push(std::thread::spawn(move || {
            let (mut c, to_s) = client(kind, &at);
            let mut slow = 0;
            for r in 0..ROUNDS {
                let body = format!("{i}:{r}");
                // SAFETY: no data.
                assert_eq!(
                    unsafe { c.b.send(to_s, body.as_bytes(), None) }.unwrap(),
                    Sent::Posted
                );
                loop {
                    c.pump();
                    if let Some(Ev::Recv(_, echo, _)) = c.log.pop() {
                        assert_eq!(echo, format!("echo {body}").into_bytes());
                        break;
                    }
                    let t0 = Instant::now();
                    kvstore_transport::wait(&mut [c.b.as_mut()], Duration::from_secs(2)).unwrap();
                    if t0.elapsed() >= Duration::from_millis(1900) {
                        slow += 1;
                    }
                }
            }
            slow
        }));
    }
    let mut echoed = 0;
    let start = Instant::now();
    while echoed < CLIENTS * ROUNDS {
        s.pump();
        for e in s.take() {
            match e {
                Ev::Recv(p, body, None) => {
                    let mut reply = b"echo ".to_vec();
                    reply.extend(body);
                    // SAFETY: no data.
                    assert_eq!(unsafe { s.b.send(p, &reply, None) }.unwrap(), Sent::Posted);
                    echoed += 1;
                }
                Ev::Connected(_) | Ev::Lost(_) => {}
                other => panic!("{other:?}"),
            }
        }
        kvstore_transport::wait(&mut [s.b.as_mut()], Duration::from_millis(200)).unwrap();
        assert!(start.elapsed() < Duration::from_secs(60));
    }
    for h in handles {
        assert_eq!(h.join().unwrap(), 0, "a waiter slept through a wake-up");
    }
}

fn a_lost_peer_is_reported_and_fails_what_it_had(kind: Kind) {
    let (a, to_b, mut b, to_a) = pair(kind);
    // A small grant (bounced over shared memory) and a larger one (written by the kernel).
    let targets = [heap(&mut b, &[0u8; 4096]), heap(&mut b, &[0u8; 40_000])];
    let grants: Vec<RemoteRegion> = targets
        .iter()
        .map(|t| grant_to(&mut b, to_a, t, 0..t.len()))
        .collect();
    let _ = to_b;
    drop(a);
    let start = Instant::now();
    while !b.log.contains(&Ev::Lost(to_a)) {
        b.pump();
        assert!(start.elapsed() < Duration::from_secs(5), "{:?}", b.log);
    }
    b.take();
    // Each grant's fence completes exactly once: done where closing the link fenced it (TCP),
    // failed where the peer's process (this one) still lives (shared memory).
    for (i, g) in grants.iter().enumerate() {
        let t = 5 + i as u64;
        b.b.revoke(to_a, g, Token(t)).unwrap();
        b.pump();
        let got = b.take();
        assert_eq!(got.len(), 1, "{got:?}");
        let fenced = !matches!(kind, Kind::Shm | Kind::ShmBounce);
        assert!(
            match got[0] {
                Ev::Done(x) => fenced && x == t,
                Ev::Failed(x) => !fenced && x == t,
                _ => false,
            },
            "{got:?}"
        );
    }
    // SAFETY: no data.
    assert!(unsafe { b.b.send(to_a, b"anyone?", None) }.is_err());
}

fn a_revoked_grant_is_never_written(kind: Kind) {
    // Small (bounced over shared memory) and larger (written by the kernel).
    for n in [4096usize, 40_000] {
        let (mut a, to_b, mut b, to_a) = pair(kind);
        let target = heap(&mut b, &vec![0u8; n]);
        let g = grant_to(&mut b, to_a, &target, 0..n);
        b.b.revoke(to_a, &g, Token(1)).unwrap();
        drive(&mut a, &mut b, |_, b| b.log.contains(&Ev::Done(1)));
        let src = heap(&mut a, &vec![0xaa; n]);
        // SAFETY: `src` is not written.
        let r = unsafe { a.b.put(to_b, &src, 0..n, &g, 0, 3, Token(2)) };
        // Refused by the writer (shared memory knows of the revoke), or posted and dropped by
        // the receiver (TCP): either way the memory is untouched.
        if r.is_ok() {
            drive(&mut a, &mut b, |a, _| a.log.contains(&Ev::Done(2)));
            for _ in 0..20 {
                a.pump();
                b.pump();
            }
        }
        assert!(read(&target).iter().all(|&x| x == 0), "{n} bytes");
        assert!(!b.log.iter().any(|e| matches!(e, Ev::Put(..))), "{n} bytes");
    }
}

/// Pumps `s` until the backend closed every one of `ends` (a read sees the end of the stream
/// or a reset), within 10 s: a backend that kept a junk or silent connection open fails.
fn until_closed<C: std::io::Read>(s: &mut Side, ends: &mut [Option<C>]) {
    let start = Instant::now();
    while ends.iter().any(Option::is_some) {
        s.pump();
        for end in ends.iter_mut() {
            let mut b = [0u8; 64];
            let closed = match end.as_mut().map(|c| c.read(&mut b)) {
                Some(Ok(0)) => true,
                Some(Err(e)) => e.kind() != std::io::ErrorKind::WouldBlock,
                _ => false,
            };
            if closed {
                *end = None;
            }
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "a connection that never became a peer was kept open"
        );
    }
}

fn garbage_closes_only_its_own_link(kind: Kind) {
    let (mut s, at) = server(kind);
    let (mut good, to_s, _) = connect(kind, &mut s, &at);
    match kind {
        #[cfg(feature = "rdma")]
        Kind::Rdma => {
            // One that sends junk, one that sends nothing: neither becomes a peer.
            use std::io::Write;
            let addr = at.parse::<SocketAddr>().unwrap();
            let mut junk = std::net::TcpStream::connect(addr).unwrap();
            let silent = std::net::TcpStream::connect(addr).unwrap();
            let _ = junk.write_all(&[0x5a; 300]);
            // Both are closed by the backend: the junk at once or at its deadline, the silent
            // one at its deadline (5 s).
            let mut ends = [junk, silent].map(|c| {
                c.set_nonblocking(true).unwrap();
                Some(c)
            });
            until_closed(&mut s, &mut ends);
            let n = s
                .log
                .iter()
                .filter(|e| matches!(e, Ev::Connected(_)))
                .count();
            assert_eq!(n, 0, "{:?}", s.log);
        }
        Kind::Tcp => {
            use std::io::Write;
            let mut raw = std::net::TcpStream::connect(at.parse::<SocketAddr>().unwrap()).unwrap();
            let start = Instant::now();
            while !s.log.iter().any(|e| matches!(e, Ev::Connected(_))) {
                s.pump();
                assert!(start.elapsed() < Duration::from_secs(5));
            }
            let Some(Ev::Connected(bad)) = s.log.pop() else {
                panic!()
            };
            raw.write_all(&[0x5a; 300]).unwrap();
            while !s.log.contains(&Ev::Lost(bad)) {
                s.pump();
                assert!(start.elapsed() < Duration::from_secs(5));
            }
        }
        Kind::Shm | Kind::ShmBounce => {
            use std::os::linux::net::SocketAddrExt;
            let addr =
                std::os::unix::net::SocketAddr::from_abstract_name(format!("kvstore-shm.{at}"))
                    .unwrap();
            // One that sends junk, one that sends nothing: neither becomes a peer, and the
            // silent one is dropped at its deadline.
            let junk = std::os::unix::net::UnixStream::connect_addr(&addr).unwrap();
            let silent = std::os::unix::net::UnixStream::connect_addr(&addr).unwrap();
            (&junk).write_all_ok(b"hello?");
            let mut ends = [junk, silent].map(|c| {
                c.set_nonblocking(true).unwrap();
                Some(c)
            });
            until_closed(&mut s, &mut ends);
            let s_shm = s
                .log
                .iter()
                .filter(|e| matches!(e, Ev::Connected(_)))
                .count();
            assert_eq!(s_shm, 0, "{:?}", s.log);
        }
    }
    s.take();
    // The good peer is still served.
    // SAFETY: no data.
    assert_eq!(
        unsafe { good.b.send(to_s, b"still here", None) }.unwrap(),
        Sent::Posted
    );
    drive(&mut good, &mut s, |_, s| !s.log.is_empty());
    assert!(matches!(&s.log[0], Ev::Recv(_, b, None) if b == b"still here"));
}

trait WriteOk {
    fn write_all_ok(self, b: &[u8]);
}

impl WriteOk for &std::os::unix::net::UnixStream {
    fn write_all_ok(mut self, b: &[u8]) {
        use std::io::Write;
        let _ = self.write_all(b);
    }
}

fn a_handle_of_another_kind_or_size_is_refused(kind: Kind) {
    let (mut a, to_b, _b, _) = pair(kind);
    let src = heap(&mut a, &[1u8; 64]);
    let mut bytes = [0u8; kvstore_transport::REMOTE_LEN];
    bytes[0] = 99;
    bytes[24] = 64;
    let bogus = RemoteRegion::from_bytes(&bytes).unwrap();
    // SAFETY: `src` is not written.
    assert!(unsafe { a.b.put(to_b, &src, 0..64, &bogus, 0, 0, Token(1)) }.is_err());
    assert!(RemoteRegion::from_bytes(&bytes[..20]).is_none());
    // A range outside the source region.
    // SAFETY: as above.
    assert!(unsafe { a.b.send(to_b, b"", Some((&src, 10..100, Token(2)))) }.is_err());
    let big = vec![0u8; a.b.max_body() + 1];
    // SAFETY: no data.
    assert!(unsafe { a.b.send(to_b, &big, None) }.is_err());
    // A region of another backend (its memory may be pages a peer writes) is refused.
    let (mut other, _, _c, _) = pair(kind);
    let foreign = heap(&mut other, &[2u8; 64]);
    // SAFETY: `foreign` is not written.
    assert!(unsafe { a.b.send(to_b, b"", Some((&foreign, 0..64, Token(3)))) }.is_err());
}

fn a_paused_peer_is_not_read_until_resumed(kind: Kind) {
    let (mut a, to_b, mut b, to_a) = pair(kind);
    b.b.pause(to_a, true);
    for i in 0..10u8 {
        // SAFETY: no data rides with it.
        let sent = unsafe { a.b.send(to_b, &[i; 40], None) }.unwrap();
        assert_eq!(sent, Sent::Posted);
    }
    let until = Instant::now() + Duration::from_millis(200);
    while Instant::now() < until {
        a.pump();
        b.pump();
    }
    let recvd = |s: &Side| s.log.iter().filter(|e| matches!(e, Ev::Recv(..))).count();
    assert_eq!(recvd(&b), 0, "a paused peer was read: {:?}", b.log);
    b.b.pause(to_a, false);
    drive(&mut a, &mut b, |_, b| recvd(b) == 10);
    let got: Vec<Vec<u8>> = b
        .take()
        .into_iter()
        .filter_map(|e| match e {
            Ev::Recv(_, body, None) => Some(body),
            _ => None,
        })
        .collect();
    assert_eq!(got, (0..10u8).map(|i| vec![i; 40]).collect::<Vec<_>>());
}

/// Memory that cannot be had (more than any machine has) is an error, not the process
/// stopped; memory that can be had is still given afterwards.
fn memory_that_cannot_be_had_is_an_error(kind: Kind) {
    let (mut a, _, _b, _) = pair(kind);
    for access in [Access::Send, Access::Land] {
        let r = a.b.alloc(1 << 60, access);
        assert!(r.is_err(), "{kind:?} gave 2^60 bytes");
        assert_eq!(a.b.alloc(4096, access).unwrap().len(), 4096);
    }
}

macro_rules! suite {
    ($($name:ident),*) => {
        mod tcp { $( #[test] fn $name() { super::$name(super::Kind::Tcp); } )* }
        mod shm { $( #[test] fn $name() { super::$name(super::Kind::Shm); } )* }
        mod shm_bounce { $( #[test] fn $name() { super::$name(super::Kind::ShmBounce); } )* }
        #[cfg(feature = "rdma")]
        mod rdma { $( #[test] fn $name() { super::$name(super::Kind::Rdma); } )* }
    };
}

suite!(
    messages_and_data_of_every_size_arrive_in_order,
    puts_land_in_granted_ranges,
    puts_that_fill_their_grant_arrive_whole,
    a_full_link_would_block_and_drains,
    a_sender_told_to_wait_wakes_when_room_comes_back,
    a_sender_whose_room_came_back_while_busy_does_not_sleep,
    two_peers_each_out_of_the_others_room_both_go_on,
    random_traffic_both_ways_never_sleeps_through_work,
    random_traffic_with_two_peers_on_one_loop,
    many_peers_one_loop_and_no_missed_wakeup,
    a_lost_peer_is_reported_and_fails_what_it_had,
    a_revoked_grant_is_never_written,
    garbage_closes_only_its_own_link,
    a_handle_of_another_kind_or_size_is_refused,
    a_paused_peer_is_not_read_until_resumed,
    held_data_is_the_senders_until_released,
    memory_that_cannot_be_had_is_an_error
);
