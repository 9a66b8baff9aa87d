//! A message's data held past its callback (`Lent::hold`): where a backend lends the sender's
//! own pages (shared memory), the sender gets them back only once the holder releases them,
//! and they stay readable meanwhile, even after the sender is gone; elsewhere nothing is held.

use std::time::{Duration, Instant};

use kvstore_transport::{Completion, Held, PeerId, Sent, Token};

use super::harness::*;

/// Runs `b`'s progress once, holding the data of each message that has some.
fn pump_holding(b: &mut Side, held: &mut Vec<(PeerId, Held)>) {
    b.b.flush().unwrap();
    b.b.progress(&mut |c| {
        if let Completion::Recv {
            peer,
            data: Some(d),
            ..
        } = c
        {
            if let Some(h) = d.hold() {
                assert!(d.hold().is_none(), "held twice");
                held.push((peer, h));
            }
            b.log.push(Ev::Recv(peer, Vec::new(), Some(d.to_vec())));
        }
    })
    .unwrap();
}

fn read(h: &Held) -> Vec<u8> {
    let mut v = vec![0u8; h.len()];
    // SAFETY: the held data is valid for reads of its length while `h` lives; copied out.
    unsafe { std::ptr::copy(h.as_ptr(), v.as_mut_ptr(), v.len()) };
    v
}

pub(crate) fn held_data_is_the_senders_until_released(kind: Kind) {
    let (mut a, to_b, mut b, to_a) = pair(kind);
    // A copy staged for the send (from private memory) is never held: holding it would take
    // room in the sender's pool that it may need to send what the holder waits for.
    let staged = pattern(64 * 1024, 3);
    let h = heap(&mut a, &staged);
    // SAFETY: the region is not written again.
    let _ = unsafe { a.b.send(to_b, b"s", Some((&h, 0..staged.len(), Token(7)))) }.unwrap();
    let mut held = Vec::new();
    let start = Instant::now();
    while b.log.is_empty() {
        a.pump();
        pump_holding(&mut b, &mut held);
        assert!(start.elapsed() < Duration::from_secs(20), "nothing came");
    }
    assert!(held.is_empty(), "a staged copy was held");
    assert_eq!(b.take(), [Ev::Recv(to_a, vec![], Some(staged))]);
    drive(&mut a, &mut b, |a, _| a.log.contains(&Ev::Done(7)));
    let bytes = pattern(64 * 1024, 9);
    let r = pool(&mut a, &bytes);
    // SAFETY: the region is not written again.
    assert!(matches!(
        unsafe { a.b.send(to_b, b"m", Some((&r, 0..bytes.len(), Token(1)))) }.unwrap(),
        Sent::Posted
    ));
    let start = Instant::now();
    while b.log.is_empty() {
        a.pump();
        pump_holding(&mut b, &mut held);
        assert!(start.elapsed() < Duration::from_secs(20), "nothing came");
    }
    assert_eq!(b.log, [Ev::Recv(to_a, vec![], Some(bytes.clone()))]);
    let Some((peer, h)) = held.pop() else {
        // Nothing to hold here (TCP and RDMA land data in the receiver's own buffers): the
        // send completes as ever.
        assert!(
            !matches!(kind, Kind::Shm | Kind::ShmBounce),
            "shared memory holds"
        );
        drive(&mut a, &mut b, |a, _| a.log.contains(&Ev::Done(1)));
        return;
    };
    // Held: the sender's token stays open, the bytes readable where they lie.
    for _ in 0..50 {
        a.pump();
        b.pump();
    }
    assert!(
        !a.log.contains(&Ev::Done(1)),
        "the sender got held pages back"
    );
    assert_eq!(read(&h), bytes);
    b.b.release(peer, h);
    drive(&mut a, &mut b, |a, _| a.log.contains(&Ev::Done(1)));
    // Held again, the sender then gone: the bytes stay mapped for the holder, and its release
    // does nothing.
    let r2 = pool(&mut a, &bytes);
    // SAFETY: the region is not written again.
    let _ = unsafe { a.b.send(to_b, b"n", Some((&r2, 0..bytes.len(), Token(2)))) }.unwrap();
    b.log.clear();
    let start = Instant::now();
    while held.is_empty() {
        a.pump();
        pump_holding(&mut b, &mut held);
        assert!(start.elapsed() < Duration::from_secs(20), "nothing came");
    }
    drop(a);
    drive_one(&mut b, |b| b.log.iter().any(|e| matches!(e, Ev::Lost(_))));
    let (peer, h) = held.pop().unwrap();
    assert_eq!(read(&h), bytes);
    b.b.release(peer, h);
    b.pump();
}

/// Pumps one side until `done`, at most 20 s.
fn drive_one(s: &mut Side, done: impl Fn(&Side) -> bool) {
    let start = Instant::now();
    while !done(s) {
        s.pump();
        assert!(start.elapsed() < Duration::from_secs(20), "{:?}", s.log);
        std::thread::sleep(Duration::from_millis(1));
    }
}
