//! A value an updater replaced with another shape or dtype: lost, and never served; a round
//! that waits on a worker gone from the job; an init whose shape is not its size.

use super::tests::{data, empty, replies, req};
use super::*;
use crate::KvError;

#[test]
fn a_value_an_updater_replaced_with_another_shape_is_lost_and_never_served() {
    let mut s = ServerState::new(2, true);
    // Of the same size: the server's own checks of a request would not catch it.
    crate::register_updater("test_reshapes", |_, _, st| {
        *st = NDArray::full(&[2, 2], 7.0);
        Ok(())
    });
    let mut name = NDArray::from_slice(&[13], b"test_reshapes").unwrap();
    s.handle(0, 0, &req(Op::SetUpdater, 0, 0, 1), &mut name);
    s.handle(0, 0, &req(Op::Init, 5, 4, 2), &mut data(2.0, 4));
    s.handle(0, 0, &req(Op::Push, 5, 4, 3), &mut data(1.0, 4));
    s.handle(0, 0, &req(Op::Pull, 5, 4, 4), &mut empty());
    s.handle(1, 1, &req(Op::Push, 5, 4, 5), &mut data(1.0, 4));
    let codes: Vec<(u64, u16)> = replies(&mut s).iter().map(|r| (r.1, r.2)).collect();
    assert_eq!(
        codes,
        [
            (1, 0),
            (2, 0),
            (3, status::FAILED),
            (5, status::FAILED),
            (4, status::FAILED)
        ],
        "the round's pushes and the pull behind them fail"
    );
    // Every later request of the key is refused, saying why; a pull never gets the 7s.
    s.handle(1, 1, &req(Op::Pull, 5, 4, 6), &mut empty());
    s.handle(1, 1, &req(Op::Push, 5, 4, 7), &mut data(1.0, 4));
    let r: Vec<(u64, u16, String)> = (s.outbox.drain(..))
        .map(|o| match o.payload {
            Payload::Text(t) => (o.msg.req_id, o.msg.status, String::from_utf8(t).unwrap()),
            _ => (o.msg.req_id, o.msg.status, String::new()),
        })
        .collect();
    let why = "key 5: the updater replaced the stored [4] float32 with [2, 2] float32, so its \
               value is lost";
    assert_eq!(
        r,
        [
            (6, status::FAILED, why.to_string()),
            (7, status::FAILED, why.to_string())
        ]
    );
    // A worker that pushed twice (the second held for the next round) and then pulled: when
    // the round loses the value, the held push is refused and the pull behind it answered.
    let mut name = NDArray::from_slice(&[13], b"test_reshapes").unwrap();
    s.handle(0, 0, &req(Op::SetUpdater, 0, 0, 8), &mut name);
    s.handle(0, 0, &req(Op::Init, 6, 4, 9), &mut data(2.0, 4));
    s.handle(0, 0, &req(Op::Push, 6, 4, 10), &mut data(1.0, 4));
    s.handle(0, 0, &req(Op::Push, 6, 4, 11), &mut data(1.0, 4));
    s.handle(0, 0, &req(Op::Pull, 6, 4, 12), &mut empty());
    s.handle(1, 1, &req(Op::Push, 6, 4, 13), &mut data(1.0, 4));
    let mut codes: Vec<(u64, u16)> = replies(&mut s).iter().map(|r| (r.1, r.2)).collect();
    codes.sort();
    let failed = status::FAILED;
    assert_eq!(
        codes,
        [
            (8, 0),
            (9, 0),
            (10, failed),
            (11, failed),
            (12, failed),
            (13, failed)
        ]
    );
}

/// An updater that replaced the value with another shape and then failed: the value is lost
/// as much (before, the key held the new shape, and its pushes were taken).
#[test]
fn a_value_an_updater_replaced_and_then_failed_is_lost() {
    let mut s = ServerState::new(1, true);
    crate::register_updater("test_reshapes_and_fails", |k, _, st| {
        *st = NDArray::full(&[2], 7.0);
        Err(KvError::Updater {
            key: k.clone(),
            reason: "no".into(),
        })
    });
    let mut name = NDArray::from_slice(&[23], b"test_reshapes_and_fails").unwrap();
    s.handle(0, 0, &req(Op::SetUpdater, 0, 0, 1), &mut name);
    s.handle(0, 0, &req(Op::Init, 5, 4, 2), &mut data(2.0, 4));
    s.handle(0, 0, &req(Op::Push, 5, 4, 3), &mut data(1.0, 4));
    s.handle(0, 0, &req(Op::Pull, 5, 2, 4), &mut empty());
    let r: Vec<(u64, u16, String)> = (s.outbox.drain(..))
        .map(|o| match o.payload {
            Payload::Text(t) => (o.msg.req_id, o.msg.status, String::from_utf8(t).unwrap()),
            _ => (o.msg.req_id, o.msg.status, String::new()),
        })
        .collect();
    assert_eq!(
        r.iter().map(|r| (r.0, r.1)).collect::<Vec<_>>(),
        [(1, 0), (2, 0), (3, status::FAILED), (4, status::FAILED)]
    );
    assert!(r[3].2.contains("so its value is lost"), "{r:?}");
    // The round is counted as failed, not as applied.
    assert_eq!((s.metrics().rounds, s.metrics().rounds_failed), (0, 1));
}

/// A server counts the rounds and async pushes whose updater failed apart from those applied.
#[test]
fn rounds_whose_updater_failed_are_counted_apart() {
    crate::register_updater("test_fails_on_negatives", |k, input, _| {
        let bad = input.to_vec::<f32>().unwrap().iter().any(|x| *x < 0.0);
        match bad {
            true => Err(KvError::Updater {
                key: k.clone(),
                reason: "negative".into(),
            }),
            false => Ok(()),
        }
    });
    for sync in [true, false] {
        let mut s = ServerState::new(1, sync);
        let mut name = NDArray::from_slice(&[23], b"test_fails_on_negatives").unwrap();
        s.handle(0, 0, &req(Op::SetUpdater, 0, 0, 1), &mut name);
        s.handle(0, 0, &req(Op::Init, 5, 4, 2), &mut data(2.0, 4));
        s.handle(0, 0, &req(Op::Push, 5, 4, 3), &mut data(1.0, 4));
        s.handle(0, 0, &req(Op::Push, 5, 4, 4), &mut data(-1.0, 4));
        s.handle(0, 0, &req(Op::Push, 5, 4, 5), &mut data(1.0, 4));
        let codes: Vec<(u64, u16)> = replies(&mut s).iter().map(|r| (r.1, r.2)).collect();
        assert_eq!(
            codes,
            [(1, 0), (2, 0), (3, 0), (4, status::FAILED), (5, 0)],
            "sync {sync}"
        );
        let m = s.metrics();
        assert_eq!(
            (m.rounds, m.rounds_failed, m.pushes),
            (2, 1, 3),
            "sync {sync}"
        );
        assert!(
            m.to_json().contains("\"rounds\":2,\"rounds_failed\":1,"),
            "{}",
            m.to_json()
        );
    }
}

/// A worker pushed twice (the second held for the next round) and then pulled; another worker
/// finished cleanly after its own push of the round, and the round completed: the held push
/// starts a round that waits on the gone worker, so it is refused, and the pull behind it gets
/// the round's value at once. Before, no round started and the pull waited for its timeout.
#[test]
fn a_pull_behind_a_push_refused_for_a_gone_worker_gets_the_stored_value() {
    let mut s = ServerState::new(3, true);
    s.handle(0, 0, &req(Op::Init, 1, 2, 1), &mut data(0.0, 2));
    s.handle(0, 0, &req(Op::Push, 1, 2, 2), &mut data(1.0, 2));
    s.handle(0, 0, &req(Op::Push, 1, 2, 3), &mut data(1.0, 2));
    s.handle(0, 0, &req(Op::Pull, 1, 2, 4), &mut empty());
    s.handle(1, 1, &req(Op::Push, 1, 2, 5), &mut data(1.0, 2));
    s.worker_gone(1, "finished");
    assert_eq!(replies(&mut s), [(0, 1, 0, vec![])]);
    s.handle(2, 2, &req(Op::Push, 1, 2, 6), &mut data(1.0, 2));
    let mut got = replies(&mut s);
    got.sort_by_key(|r| r.1);
    assert_eq!(
        got.iter().map(|r| (r.1, r.2)).collect::<Vec<_>>(),
        [(2, 0), (3, status::PEER_LOST), (4, 0), (5, 0), (6, 0)]
    );
    assert_eq!(got[2].3, [3.0, 3.0], "the pull gets the round's sum");
}

/// An init whose shape does not hold the key's elements is refused: every later request is
/// checked against that shape.
#[test]
fn an_init_whose_shape_is_not_its_size_is_refused() {
    let mut s = ServerState::new(1, true);
    let mut m = req(Op::Init, 2, 6, 1);
    (m.ndim, m.shape[0], m.shape[1]) = (2, 2, 4);
    s.handle(0, 0, &m, &mut data(1.0, 6));
    assert_eq!(replies(&mut s)[0].2, status::MISMATCH);
    assert!(s.stored(2).is_none());
    (m.shape[1], m.req_id) = (3, 2);
    s.handle(0, 0, &m, &mut data(1.0, 6));
    assert_eq!(replies(&mut s), vec![(0, 2, 0, vec![])]);
}
