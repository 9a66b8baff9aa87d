//! Room on a link: a sender told "would block" is woken when room comes back, also when each
//! of two peers is out of the other's room.

use std::time::{Duration, Instant};

use kvstore_transport::{PeerId, Region, RemoteRegion, Sent, Token};

use super::harness::*;

/// What a sender sends: a message with or without data, or a put.
#[derive(Clone, Copy, Debug)]
enum Item {
    /// A message with a body alone.
    Body,
    /// A message with this many bytes of data.
    Data(usize),
    /// A put of this many bytes into the peer's grant.
    Put(usize),
}

/// Posts `item` with `body`: number `i` is its token, and a put's immediate.
fn post(
    s: &mut Side,
    to: PeerId,
    item: Item,
    body: &[u8],
    i: u64,
    src: &Region,
    grant: Option<&RemoteRegion>,
) -> Sent {
    let t = Token(i);
    // SAFETY: `src` is never written.
    let sent = unsafe {
        match item {
            Item::Body => s.b.send(to, body, None),
            Item::Data(n) => s.b.send(to, body, Some((src, 0..n, t))),
            Item::Put(n) => {
                let g = grant.expect("a grant to put into");
                s.b.put(to, src, 0..n, g, 0, i as u32, t)
            }
        }
    };
    sent.unwrap()
}

/// Posts `item` with `body` until the link to `to` is full; how many went.
fn fill(
    s: &mut Side,
    to: PeerId,
    item: Item,
    body: &[u8],
    src: &Region,
    grant: Option<&RemoteRegion>,
) -> u64 {
    let mut posted = 0u64;
    while post(s, to, item, body, posted, src, grant) == Sent::Posted {
        posted += 1;
        // (Small messages fill a TCP link's socket buffers.)
        assert!(posted < 1_000_000, "a link that never fills");
    }
    posted
}

/// A sender that was told "would block" and then sleeps as a caller does (`wait`) is woken
/// once the receiver has taken what filled the link: no sleep outlasts the lack of room. With
/// eager-sized data, with bodies alone, and with small puts (the last two the receiver takes
/// without a word back).
pub(crate) fn a_sender_told_to_wait_wakes_when_room_comes_back(kind: Kind) {
    for what in [Item::Data(EAGER), Item::Body, Item::Put(64)] {
        sender_wakes(kind, what, false);
    }
}

/// A sender told "would block" whose room came back while it was busy (its own progress took
/// what the receiver said, or wrote out what it had queued), so that nothing is left to wake
/// a sleep, does not sleep when it next waits: it has not tried again since.
pub(crate) fn a_sender_whose_room_came_back_while_busy_does_not_sleep(kind: Kind) {
    // (Over shared memory, large data fills the pool that stages it before the ring.)
    for what in [
        Item::Data(EAGER),
        Item::Data(BIG),
        Item::Body,
        Item::Put(64),
    ] {
        sender_wakes(kind, what, true);
    }
}

/// `busy`: the receiver takes everything while the sender never sleeps, and then the sender
/// waits; else the sender sleeps first.
fn sender_wakes(kind: Kind, what: Item, busy: bool) {
    let (mut a, to_b, mut b, to_a) = pair(kind);
    let n = match what {
        Item::Data(n) | Item::Put(n) => n,
        Item::Body => 0,
    };
    let src = heap(&mut a, &pattern(n.max(1), 9));
    let target = heap(&mut b, &[0u8; 64]);
    let grant = grant_to(&mut b, to_a, &target, 0..64);
    let posted = fill(&mut a, to_b, what, b"y", &src, Some(&grant));
    // The sender has nothing left to do but wait for room: what it posted has completed
    // (a wait of 300 ms passes with nothing to wake it).
    let start = Instant::now();
    if !busy {
        loop {
            a.pump();
            let t0 = Instant::now();
            kvstore_transport::wait(&mut [a.b.as_mut()], Duration::from_millis(300)).unwrap();
            if t0.elapsed() >= Duration::from_millis(290) {
                break;
            }
            assert!(start.elapsed() < Duration::from_secs(20), "never idle");
        }
    }
    // Now the receiver takes everything (on its own thread, as another process would).
    let taken = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let count = taken.clone();
    let receiver = std::thread::spawn(move || {
        let mut b = b;
        let start = Instant::now();
        while (b.log.len() as u64) <= posted {
            b.pump();
            count.store(b.log.len() as u64, std::sync::atomic::Ordering::SeqCst);
            kvstore_transport::wait(&mut [b.b.as_mut()], Duration::from_millis(5)).unwrap();
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "hung: {:?}",
                b.log.len()
            );
        }
        b
    });
    while busy && taken.load(std::sync::atomic::Ordering::SeqCst) < posted {
        a.pump();
        std::thread::sleep(Duration::from_millis(1));
        assert!(start.elapsed() < Duration::from_secs(30), "never taken");
    }
    // (Busy: whatever the receiver sent back on the way is taken now, by this side's own
    // progress, before it waits.)
    for _ in 0..busy as usize * 100 {
        a.pump();
    }
    let t0 = Instant::now();
    kvstore_transport::wait(&mut [a.b.as_mut()], Duration::from_secs(10)).unwrap();
    assert!(
        t0.elapsed() < Duration::from_secs(9),
        "a sender slept through the room coming back ({what:?}, busy: {busy})"
    );
    // It can send again, and everything arrives in order.
    let start = Instant::now();
    loop {
        a.pump();
        // SAFETY: no data.
        if unsafe { a.b.send(to_b, b"last", None) }.unwrap() == Sent::Posted {
            break;
        }
        kvstore_transport::wait(&mut [a.b.as_mut()], Duration::from_millis(5)).unwrap();
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "no room came back"
        );
    }
    while !receiver.is_finished() {
        a.pump();
        kvstore_transport::wait(&mut [a.b.as_mut()], Duration::from_millis(5)).unwrap();
    }
    let mut b = receiver.join().unwrap();
    let got = b.take();
    assert_eq!(got.len() as u64, posted + 1);
    let want = (n > 0).then(|| pattern(n, 9));
    for (i, e) in got[..posted as usize].iter().enumerate() {
        let ok = match what {
            Item::Put(_) => *e == Ev::Put(to_a, grant.id(), 0, n, i as u32),
            _ => matches!(e, Ev::Recv(_, body, d) if body == b"y" && *d == want),
        };
        assert!(ok, "{what:?}: {e:?}");
    }
    if matches!(what, Item::Put(_)) {
        assert_eq!(read(&target), want.unwrap());
    }
    assert!(matches!(&got[posted as usize], Ev::Recv(_, body, None) if body == b"last"));
}

/// Eager-sized data (one receive buffer over RDMA), so that a link fills soon.
const EAGER: usize = 60_000;

/// Two peers that each filled the link to the other before reading anything both go on, each
/// on its own thread sleeping as a caller does: each takes what the other sent, room comes back
/// both ways, and neither sleeps through it. (Over RDMA the count of room given back must reach
/// a peer that has no room left to be told in.)
pub(crate) fn two_peers_each_out_of_the_others_room_both_go_on(kind: Kind) {
    let (mut a, to_b, mut b, to_a) = pair(kind);
    let (src_a, src_b) = (
        heap(&mut a, &pattern(EAGER, 3)),
        heap(&mut b, &pattern(EAGER, 5)),
    );
    let from_a = fill(&mut a, to_b, Item::Data(EAGER), b"z", &src_a, None);
    let from_b = fill(&mut b, to_a, Item::Data(EAGER), b"z", &src_b, None);
    assert!(from_a >= 1 && from_b >= 1);
    let done = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    // Takes `expect` messages of `salt`'s pattern and a last one, and sends its own last one;
    // then keeps the link going until the other side has done the same.
    let run = |mut s: Side, to: PeerId, expect: u64, salt: u8| {
        let done = done.clone();
        std::thread::spawn(move || {
            let start = Instant::now();
            let (mut told, mut finished) = (false, false);
            let recvs = |s: &Side| s.log.iter().filter(|e| matches!(e, Ev::Recv(..))).count();
            loop {
                s.pump();
                // SAFETY: no data.
                told = told || unsafe { s.b.send(to, b"last", None) }.unwrap() == Sent::Posted;
                s.pump();
                if !finished && told && recvs(&s) as u64 == expect + 1 {
                    finished = true;
                    done.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                }
                if done.load(std::sync::atomic::Ordering::SeqCst) == 2 {
                    break;
                }
                let t0 = Instant::now();
                let nap = if finished { 5 } else { 10_000 };
                kvstore_transport::wait(&mut [s.b.as_mut()], Duration::from_millis(nap)).unwrap();
                assert!(
                    finished || t0.elapsed() < Duration::from_secs(9),
                    "slept through the other side's room coming back ({} of {expect} taken)",
                    recvs(&s)
                );
                assert!(start.elapsed() < Duration::from_secs(40), "hung");
            }
            let want = pattern(EAGER, salt);
            let got: Vec<Ev> = s
                .take()
                .into_iter()
                .filter(|e| matches!(e, Ev::Recv(..)))
                .collect();
            for e in &got[..expect as usize] {
                assert!(matches!(e, Ev::Recv(_, body, Some(d)) if body == b"z" && *d == want));
            }
            assert!(matches!(&got[expect as usize], Ev::Recv(_, body, None) if body == b"last"));
            s
        })
    };
    let ta = run(a, to_b, from_b, 5);
    let tb = run(b, to_a, from_a, 3);
    let (a, b) = (ta.join().unwrap(), tb.join().unwrap());
    drop((src_a, src_b, a, b));
}

/// The most bytes of one item's data.
const BIG: usize = 200_000;

/// `n` items drawn from `seed` (xorshift: the same plan on every run).
fn plan(seed: u64, n: usize) -> Vec<Item> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let len = 1 + (x >> 8) as usize % BIG;
            match x % 3 {
                0 => Item::Body,
                1 => Item::Data(len),
                _ => Item::Put(len),
            }
        })
        .collect()
}

/// One side of the random traffic: where it sends, from what, and what each side sends.
struct Way {
    to: PeerId,
    src: Region,
    grant: RemoteRegion,
    mine: Vec<Item>,
    theirs: Vec<Item>,
    /// The salt of the peer's data pattern.
    salt: u8,
}

/// Sends each way's `mine` in order, as fast as its link takes it, and takes everything the
/// peers send, sleeping in `wait` between; once `parties` sides (this one included) are done,
/// checks what came from each peer.
fn both_ways(
    mut s: Side,
    ways: Vec<Way>,
    done: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    parties: usize,
) -> Side {
    use std::sync::atomic::Ordering::SeqCst;
    let start = Instant::now();
    let mut next = vec![0usize; ways.len()];
    let mut finished = false;
    let from = |e: &Ev| match e {
        Ev::Recv(p, ..) | Ev::Put(p, ..) => Some(*p),
        _ => None,
    };
    let taken = |s: &Side, to: PeerId| s.log.iter().filter(|e| from(e) == Some(to)).count();
    loop {
        s.pump();
        for (w, next) in ways.iter().zip(next.iter_mut()) {
            while *next < w.mine.len() {
                let (item, tag) = (w.mine[*next], (*next as u32).to_le_bytes());
                let sent = post(
                    &mut s,
                    w.to,
                    item,
                    &tag,
                    *next as u64,
                    &w.src,
                    Some(&w.grant),
                );
                if sent == Sent::WouldBlock {
                    break;
                }
                *next += 1;
            }
        }
        s.pump();
        let all = |s: &Side| {
            ways.iter()
                .zip(&next)
                .all(|(w, n)| *n == w.mine.len() && taken(s, w.to) == w.theirs.len())
        };
        if !finished && all(&s) {
            finished = true;
            done.fetch_add(1, SeqCst);
        }
        if done.load(SeqCst) == parties {
            break;
        }
        let t0 = Instant::now();
        let nap = Duration::from_millis(if finished { 5 } else { 10_000 });
        kvstore_transport::wait(&mut [s.b.as_mut()], nap).unwrap();
        if !finished && t0.elapsed() >= Duration::from_secs(9) {
            let state: Vec<String> = ways
                .iter()
                .zip(&next)
                .map(|(w, n)| {
                    let (sent, want) = (n, w.mine.len());
                    let (got, of) = (taken(&s, w.to), w.theirs.len());
                    format!("{}: {sent} of {want} sent, {got} of {of} taken", w.to)
                })
                .collect();
            panic!("slept through work: {}", state.join("; "));
        }
        assert!(start.elapsed() < Duration::from_secs(120), "hung");
    }
    // What came from each peer: its messages in order, and its puts in order.
    let log = s.take();
    for w in &ways {
        let data = pattern(BIG, w.salt);
        let mine: Vec<&Ev> = log.iter().filter(|e| from(e) == Some(w.to)).collect();
        let mut m = mine.iter().filter(|e| matches!(e, Ev::Recv(..)));
        let mut p = mine.iter().filter(|e| matches!(e, Ev::Put(..)));
        for (i, item) in w.theirs.iter().enumerate() {
            let tag = (i as u32).to_le_bytes();
            match *item {
                Item::Body => assert!(
                    matches!(m.next(), Some(Ev::Recv(_, b, None)) if *b == tag),
                    "message {i}"
                ),
                Item::Data(n) => assert!(
                    matches!(m.next(), Some(Ev::Recv(_, b, Some(d))) if *b == tag && d[..] == data[..n]),
                    "message {i} with {n} bytes"
                ),
                Item::Put(n) => assert!(
                    matches!(p.next(), Some(Ev::Put(_, _, 0, len, imm)) if *len == n && *imm == i as u32),
                    "put {i} of {n} bytes"
                ),
            }
        }
        assert!(m.next().is_none() && p.next().is_none());
    }
    s
}

/// Messages with and without data and puts, of random sizes, both ways at once as fast as the
/// links take them, each side on its own thread sleeping in `wait` between: everything
/// arrives in order, and no side sleeps through work it could do.
pub(crate) fn random_traffic_both_ways_never_sleeps_through_work(kind: Kind) {
    let (mut a, to_b, mut b, to_a) = pair(kind);
    let (src_a, src_b) = (
        heap(&mut a, &pattern(BIG, 11)),
        heap(&mut b, &pattern(BIG, 13)),
    );
    let (into_a, into_b) = (heap(&mut a, &[0u8; BIG]), heap(&mut b, &[0u8; BIG]));
    let (grant_b, grant_a) = (
        grant_to(&mut b, to_a, &into_b, 0..BIG),
        grant_to(&mut a, to_b, &into_a, 0..BIG),
    );
    let (plan_a, plan_b) = (plan(1, 300), plan(2, 300));
    let done = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let way_a = Way {
        to: to_b,
        src: src_a,
        grant: grant_b,
        mine: plan_a.clone(),
        theirs: plan_b.clone(),
        salt: 13,
    };
    let way_b = Way {
        to: to_a,
        src: src_b,
        grant: grant_a,
        mine: plan_b,
        theirs: plan_a,
        salt: 11,
    };
    let d = done.clone();
    let ta = std::thread::spawn(move || both_ways(a, vec![way_a], d, 2));
    let tb = std::thread::spawn(move || both_ways(b, vec![way_b], done, 2));
    let (a, b) = (ta.join().unwrap(), tb.join().unwrap());
    drop((a, b, into_a, into_b));
}

/// The same with one side serving two peers from one loop, as a server does: each link both
/// ways at once, and the serving side sleeps through no peer's work.
pub(crate) fn random_traffic_with_two_peers_on_one_loop(kind: Kind) {
    let (mut s, at) = server(kind);
    let (mut a, a_to_s, s_to_a) = connect(kind, &mut s, &at);
    let (mut b, b_to_s, s_to_b) = connect(kind, &mut s, &at);
    let src_s = heap(&mut s, &pattern(BIG, 13));
    let (src_a, src_b) = (
        heap(&mut a, &pattern(BIG, 11)),
        heap(&mut b, &pattern(BIG, 12)),
    );
    let (s_for_a, s_for_b) = (heap(&mut s, &[0u8; BIG]), heap(&mut s, &[0u8; BIG]));
    let (a_for_s, b_for_s) = (heap(&mut a, &[0u8; BIG]), heap(&mut b, &[0u8; BIG]));
    let grants = [
        grant_to(&mut s, s_to_a, &s_for_a, 0..BIG),
        grant_to(&mut s, s_to_b, &s_for_b, 0..BIG),
        grant_to(&mut a, a_to_s, &a_for_s, 0..BIG),
        grant_to(&mut b, b_to_s, &b_for_s, 0..BIG),
    ];
    let [into_s_from_a, into_s_from_b, into_a, into_b] = grants;
    let plans: Vec<Vec<Item>> = (1..=4).map(|seed| plan(seed, 200)).collect();
    let way = |to, src: &Region, grant, mine: usize, theirs: usize, salt| Way {
        to,
        src: src.clone(),
        grant,
        mine: plans[mine].clone(),
        theirs: plans[theirs].clone(),
        salt,
    };
    let ways_s = vec![
        way(s_to_a, &src_s, into_a, 0, 1, 11),
        way(s_to_b, &src_s, into_b, 2, 3, 12),
    ];
    let way_a = way(a_to_s, &src_a, into_s_from_a, 1, 0, 13);
    let way_b = way(b_to_s, &src_b, into_s_from_b, 3, 2, 13);
    let done = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (d1, d2) = (done.clone(), done.clone());
    let ts = std::thread::spawn(move || both_ways(s, ways_s, done, 3));
    let ta = std::thread::spawn(move || both_ways(a, vec![way_a], d1, 3));
    let tb = std::thread::spawn(move || both_ways(b, vec![way_b], d2, 3));
    let sides = (ts.join().unwrap(), ta.join().unwrap(), tb.join().unwrap());
    drop((sides, s_for_a, s_for_b, a_for_s, b_for_s));
}
