use super::*;
use crate::DType;

pub(super) fn req(op: Op, key: u64, len: u64, id: u64) -> Msg {
    let mut m = Msg::new(op);
    m.key = key;
    m.total = len;
    m.len = len;
    (m.ndim, m.shape[0]) = (1, len);
    m.dtype = DType::F32;
    m.req_id = id;
    m
}

pub(super) fn data(v: f32, n: usize) -> NDArray {
    NDArray::full(&[n], v as f64)
}

pub(super) fn replies(s: &mut ServerState) -> Vec<(PeerId, u64, u16, Vec<f32>)> {
    s.outbox
        .drain(..)
        .map(|o| {
            let vals = match &o.payload {
                Payload::Array(a) => a.to_vec::<f32>().unwrap(),
                _ => vec![],
            };
            (o.to, o.msg.req_id, o.msg.status, vals)
        })
        .collect()
}

pub(super) fn empty() -> NDArray {
    NDArray::zeros_dtype(&[0], DType::U8)
}

#[test]
fn sync_round_holds_replies_until_every_worker_pushed() {
    let mut s = ServerState::new(3, true);
    s.handle(0, 0, &req(Op::Init, 3, 4, 1), &mut data(2.0, 4));
    assert_eq!(replies(&mut s), vec![(0, 1, 0, vec![])]);
    s.handle(0, 0, &req(Op::Push, 3, 4, 2), &mut data(1.0, 4));
    s.handle(1, 1, &req(Op::Push, 3, 4, 3), &mut data(1.0, 4));
    assert!(s.outbox.is_empty(), "no reply before the round is complete");
    // A pull in the middle of the round sees the previous value, never a partial sum.
    s.handle(2, 2, &req(Op::Pull, 3, 4, 4), &mut empty());
    assert_eq!(replies(&mut s), vec![(2, 4, 0, vec![2.0; 4])]);
    s.handle(2, 2, &req(Op::PushPull, 3, 4, 5), &mut data(1.0, 4));
    let r = replies(&mut s);
    assert_eq!(r.len(), 3);
    assert_eq!(r[2], (2, 5, 0, vec![3.0; 4]), "ASSIGN of the round's sum");
    assert_eq!(s.stored(3).unwrap().to_vec::<f32>().unwrap(), vec![3.0; 4]);
}

#[test]
fn a_second_push_in_a_round_waits_for_the_next_and_a_third_is_refused() {
    let mut s = ServerState::new(2, true);
    s.handle(0, 0, &req(Op::Init, 1, 2, 1), &mut data(0.0, 2));
    s.handle(0, 0, &req(Op::Push, 1, 2, 2), &mut data(1.0, 2));
    // Worker 0 pushes again before worker 1 pushed once (`push_async`, then a push): held
    // for the next round; a pull after it waits for that round; a third push is refused.
    s.handle(0, 0, &req(Op::Push, 1, 2, 3), &mut data(10.0, 2));
    s.handle(0, 0, &req(Op::Pull, 1, 2, 4), &mut empty());
    s.handle(0, 0, &req(Op::Push, 1, 2, 5), &mut data(100.0, 2));
    assert_eq!(replies(&mut s)[1..], [(0, 5, status::NOT_TAKEN, vec![])]);
    // Worker 1's first push completes round 1 (1 + 5); the held push starts round 2.
    s.handle(1, 1, &req(Op::Push, 1, 2, 6), &mut data(5.0, 2));
    assert_eq!(s.stored(1).unwrap().to_vec::<f32>().unwrap(), vec![6.0; 2]);
    let r = replies(&mut s);
    assert_eq!(r, [(0, 2, 0, vec![]), (1, 6, 0, vec![])]);
    // Its second completes round 2 (10 + 20): the held push and the pull behind it answered.
    s.handle(1, 1, &req(Op::Push, 1, 2, 7), &mut data(20.0, 2));
    assert_eq!(s.stored(1).unwrap().to_vec::<f32>().unwrap(), vec![30.0; 2]);
    let r = replies(&mut s);
    assert_eq!(
        r,
        [
            (0, 3, 0, vec![]),
            (1, 7, 0, vec![]),
            (0, 4, 0, vec![30.0; 2])
        ]
    );
    // A push held for a round that cannot complete (worker 1 gone) fails with it.
    s.handle(0, 0, &req(Op::Push, 1, 2, 8), &mut data(1.0, 2));
    s.handle(0, 0, &req(Op::PushPull, 1, 2, 9), &mut data(1.0, 2));
    s.worker_gone(1, "disconnected");
    let codes: Vec<(u64, u16)> = replies(&mut s).iter().map(|r| (r.1, r.2)).collect();
    assert_eq!(codes, [(8, status::PEER_LOST), (9, status::PEER_LOST)]);
    assert_eq!(s.stored(1).unwrap().to_vec::<f32>().unwrap(), vec![30.0; 2]);
}

#[test]
fn optimizer_runs_once_per_round_on_the_sum() {
    let mut s = ServerState::new(2, true);
    let bytes = crate::Multiplied::from(Optimizer::sgd(0.1)).encode_head();
    let mut p = NDArray::from_slice(&[bytes.len()], &bytes).unwrap();
    s.handle(0, 0, &req(Op::SetOptimizer, 0, 0, 1), &mut p);
    s.handle(0, 0, &req(Op::Init, 9, 3, 2), &mut data(0.0, 3));
    s.handle(0, 0, &req(Op::Push, 9, 3, 3), &mut data(1.0, 3));
    s.handle(1, 1, &req(Op::Push, 9, 3, 4), &mut data(1.0, 3));
    let w = s.stored(9).unwrap().to_vec::<f32>().unwrap();
    assert!(w.iter().all(|&x| (x + 0.2).abs() < 1e-7), "{w:?}");
}

#[test]
fn async_applies_each_push_and_needs_an_updater() {
    let mut s = ServerState::new(2, false);
    s.handle(0, 0, &req(Op::Init, 4, 2, 1), &mut data(1.0, 2));
    s.handle(0, 0, &req(Op::Push, 4, 2, 2), &mut data(1.0, 2));
    let r = replies(&mut s);
    assert_eq!(r[1].2, status::FAILED);
    assert_eq!(s.stored(4).unwrap().to_vec::<f32>().unwrap(), vec![1.0; 2]);
    crate::register_updater("test_async_add", |_, i, st| st.add_assign(i));
    let mut name = NDArray::from_slice(&[14], b"test_async_add").unwrap();
    s.handle(0, 0, &req(Op::SetUpdater, 0, 0, 3), &mut name);
    s.handle(0, 0, &req(Op::Push, 4, 2, 4), &mut data(1.0, 2));
    s.handle(1, 1, &req(Op::PushPull, 4, 2, 5), &mut data(1.0, 2));
    let r = replies(&mut s);
    assert_eq!(r[2], (1, 5, 0, vec![3.0; 2]));
}

#[test]
fn bad_requests_get_errors_and_change_nothing() {
    let mut s = ServerState::new(1, true);
    s.handle(0, 0, &req(Op::Init, 2, 3, 1), &mut data(7.0, 3));
    s.handle(0, 0, &req(Op::Init, 2, 3, 2), &mut data(1.0, 3));
    s.handle(0, 0, &req(Op::Push, 5, 3, 3), &mut data(1.0, 3));
    s.handle(0, 0, &req(Op::Push, 2, 4, 4), &mut data(1.0, 4));
    let mut f64push = req(Op::Push, 2, 3, 5);
    f64push.dtype = DType::F64;
    s.handle(
        0,
        0,
        &f64push,
        &mut NDArray::full_dtype(&[3], 1.0, DType::F64),
    );
    s.handle(0, 0, &req(Op::Barrier, 2, 3, 6), &mut empty());
    // A pull of the key as another dtype (a worker whose own init differed from rank 0's):
    // refused, not answered with bytes of the stored dtype.
    let mut f64pull = req(Op::Pull, 2, 3, 7);
    f64pull.dtype = DType::F64;
    s.handle(0, 0, &f64pull, &mut empty());
    let codes: Vec<u16> = replies(&mut s).iter().map(|r| r.2).collect();
    assert_eq!(
        codes,
        vec![
            0,
            status::DOUBLE_INIT,
            status::UNKNOWN_KEY,
            status::MISMATCH,
            status::MISMATCH,
            status::FAILED,
            status::MISMATCH
        ]
    );
    assert_eq!(s.stored(2).unwrap().to_vec::<f32>().unwrap(), vec![7.0; 3]);
}

#[test]
fn a_gone_worker_fails_the_rounds_that_wait_on_it_and_only_those() {
    let mut s = ServerState::new(2, true);
    s.handle(0, 0, &req(Op::Init, 1, 2, 1), &mut data(0.0, 2));
    s.handle(0, 0, &req(Op::Init, 4, 2, 2), &mut data(0.0, 2));
    // Worker 1 pushed key 4 this round, not key 1; worker 0 pushed key 1.
    s.handle(1, 1, &req(Op::Push, 4, 2, 3), &mut data(5.0, 2));
    s.handle(0, 0, &req(Op::Push, 1, 2, 4), &mut data(1.0, 2));
    replies(&mut s);
    s.worker_gone(1, "disconnected");
    let out: Vec<_> = s.outbox.drain(..).collect();
    assert_eq!(out.len(), 1);
    assert_eq!(
        (out[0].msg.req_id, out[0].msg.status),
        (4, status::PEER_LOST)
    );
    let Payload::Text(t) = &out[0].payload else {
        panic!("{:?}", out[0].payload)
    };
    let text = String::from_utf8_lossy(t).into_owned();
    assert!(
        text.contains("key 1 cannot complete: worker 1 disconnected"),
        "{text}"
    );
    // A later push of a key worker 1 has not pushed is refused at once, naming it; the round
    // it did push completes; pulls are served; the store is not failed.
    s.handle(0, 0, &req(Op::Push, 1, 2, 5), &mut data(1.0, 2));
    assert_eq!(replies(&mut s)[0].2, status::PEER_LOST);
    s.handle(0, 0, &req(Op::Push, 4, 2, 6), &mut data(1.0, 2));
    assert_eq!(replies(&mut s).len(), 2, "the round of key 4 completed");
    assert_eq!(s.stored(4).unwrap().to_vec::<f32>().unwrap(), vec![6.0; 2]);
    s.handle(0, 0, &req(Op::Pull, 1, 2, 7), &mut empty());
    assert_eq!(replies(&mut s)[0].2, status::OK);
    assert_eq!(s.failed(), None);
}

/// Sets SGD with learning rate `lr` as the server's updater (as request 1).
fn set_sgd(s: &mut ServerState, lr: f64) {
    let w = crate::Multiplied::from(Optimizer::sgd(lr)).encode_head();
    let mut params = NDArray::from_bytes(&[w.len()], DType::U8, &w).unwrap();
    s.handle(0, 0, &req(Op::SetOptimizer, 0, 0, 1), &mut params);
}

/// The address of an array's bytes, to tell buffers apart.
fn addr(a: &NDArray) -> usize {
    a.as_bytes().as_ptr() as usize
}

#[test]
fn an_update_never_touches_a_value_a_reply_still_holds_and_reuses_the_spare_buffer() {
    let mut s = ServerState::new(1, true);
    set_sgd(&mut s, 1.0);
    s.handle(0, 0, &req(Op::Init, 4, 8, 2), &mut data(10.0, 8));
    replies(&mut s);
    // A pushpull's answer holds the stored value (as a put in flight does).
    let mut held = Vec::new();
    let mut bufs = Vec::new();
    for (i, want) in [9.0f32, 8.0, 7.0, 6.0].into_iter().enumerate() {
        s.handle(
            0,
            0,
            &req(Op::PushPull, 4, 8, 3 + i as u64),
            &mut data(1.0, 8),
        );
        let out = s.outbox.pop().expect("an answer");
        let Payload::Array(a) = out.payload else {
            panic!("a value")
        };
        assert_eq!(a.to_vec::<f32>().unwrap(), vec![want; 8]);
        bufs.push(addr(&a));
        held.push(a);
        // Answers older than the last are done: their buffers may be written again.
        if held.len() > 1 {
            held.remove(0);
        }
    }
    // Every update left the answer in flight intact and wrote the other buffer: two buffers
    // in turn, never a third (no copy-on-write allocation per update).
    assert_eq!(bufs[0], bufs[2]);
    assert_eq!(bufs[1], bufs[3]);
    assert_ne!(bufs[0], bufs[1]);
    assert_eq!(held[0].to_vec::<f32>().unwrap(), vec![6.0; 8]);
}

/// Gives `s` its arrays from a shared-memory send pool, as a server over shared memory has
/// them; the backend, which must live as long as they do.
fn in_pool(s: &mut ServerState) -> kvstore_transport::ShmBackend {
    let shm = kvstore_transport::ShmBackend::new("state-test", Default::default()).unwrap();
    let pages = shm.send_pages();
    s.set_alloc(Box::new(move |shape, dtype| {
        let bytes = shape.iter().product::<usize>() * dtype.size();
        Some(NDArray::from_region(
            shape,
            dtype,
            pages.alloc(bytes, true).ok()?,
        ))
    }));
    shm
}

/// With its arrays in a shared-memory send pool, the server answers by reference: the
/// transport then holds the value's pages (not the array), and an update must still leave them
/// alone until it lets go.
#[test]
fn an_update_never_touches_pool_pages_a_send_by_reference_still_holds() {
    let mut s = ServerState::new(1, true);
    let _shm = in_pool(&mut s);
    set_sgd(&mut s, 1.0);
    s.handle(0, 0, &req(Op::Init, 4, 8, 2), &mut data(10.0, 8));
    replies(&mut s);
    let mut held_pages = Vec::new();
    let mut bufs = Vec::new();
    for (i, (grad, want)) in [(1.0f32, 9.0f32), (2.0, 7.0), (3.0, 4.0)]
        .into_iter()
        .enumerate()
    {
        s.handle(
            0,
            0,
            &req(Op::PushPull, 4, 8, 3 + i as u64),
            &mut data(grad, 8),
        );
        let out = s.outbox.pop().expect("an answer");
        let Payload::Array(a) = out.payload else {
            panic!("a value")
        };
        assert!(a.is_shared_memory());
        assert_eq!(a.to_vec::<f32>().unwrap(), vec![want; 8]);
        bufs.push(addr(&a));
        // What a send by reference keeps: the pages, not the array.
        held_pages.push((a.region().unwrap().clone(), want));
        drop(a);
        if held_pages.len() > 1 {
            held_pages.remove(0);
        }
    }
    assert_ne!(bufs[0], bufs[1], "the held pages were written");
    assert_eq!(bufs[0], bufs[2], "the spare came back once let go");
    let (r, want) = &held_pages[0];
    let mut got = vec![0u8; 32];
    // SAFETY: nothing writes these pages while they are held (what this test checks).
    unsafe { r.read(0, &mut got) }.unwrap();
    assert_eq!(got, data(*want, 8).as_bytes());
}

/// Data in a receive slot, as the loop lends it.
fn lent(a: &NDArray) -> PeerData<'_> {
    let b = a.as_bytes();
    // SAFETY: the array's bytes, valid while it is borrowed.
    unsafe { PeerData::new(b.as_ptr(), a.size(), a.dtype()) }
}

#[test]
fn a_rounds_first_push_stays_in_its_slot_until_the_next_is_summed_with_it() {
    let mut s = ServerState::new(3, true);
    s.handle(0, 0, &req(Op::Init, 3, 4, 1), &mut data(0.0, 4));
    replies(&mut s);
    for round in 1..=2u64 {
        let (a, b, c) = (data(1.0, 4), data(2.5, 4), data(4.0, 4));
        s.handle(
            0,
            0,
            &req(Op::Push, 3, 4, 10 * round),
            Input::Peer(&lent(&a), Some(7)),
        );
        assert_eq!(s.take_kept(), Some(7), "the first push is kept in its slot");
        assert!(s.take_released().collect::<Vec<_>>().is_empty());
        s.handle(
            1,
            1,
            &req(Op::Push, 3, 4, 10 * round + 1),
            Input::Peer(&lent(&b), Some(8)),
        );
        assert_eq!(s.take_kept(), None, "a later push is read in full");
        assert_eq!(
            s.take_released().collect::<Vec<_>>(),
            vec![7],
            "the first is summed and let go"
        );
        s.handle(
            2,
            2,
            &req(Op::Push, 3, 4, 10 * round + 2),
            Input::Peer(&lent(&c), None),
        );
        assert_eq!(s.stored(3).unwrap().to_vec::<f32>().unwrap(), vec![7.5; 4]);
        assert_eq!(replies(&mut s).len(), 3);
    }
}

#[test]
fn a_kept_first_push_is_let_go_when_its_round_fails() {
    let mut s = ServerState::new(2, true);
    s.handle(0, 0, &req(Op::Init, 3, 4, 1), &mut data(0.0, 4));
    let a = data(1.0, 4);
    s.handle(
        0,
        0,
        &req(Op::Push, 3, 4, 2),
        Input::Peer(&lent(&a), Some(3)),
    );
    assert_eq!(s.take_kept(), Some(3));
    s.worker_gone(1, "disconnected");
    assert_eq!(s.take_released().collect::<Vec<_>>(), vec![3]);
    s.handle(
        0,
        0,
        &req(Op::Push, 3, 4, 4),
        Input::Peer(&lent(&a), Some(4)),
    );
    s.fail("stopping");
    assert_eq!(
        s.take_released().collect::<Vec<_>>(),
        Vec::<usize>::new(),
        "worker 1 is gone: nothing kept"
    );
    // With one worker nothing is kept: the round completes at once.
    let mut one = ServerState::new(1, true);
    one.handle(0, 0, &req(Op::Init, 3, 4, 1), &mut data(0.0, 4));
    one.handle(
        0,
        0,
        &req(Op::Push, 3, 4, 2),
        Input::Peer(&lent(&a), Some(5)),
    );
    assert_eq!(one.take_kept(), None);
    assert_eq!(
        one.stored(3).unwrap().to_vec::<f32>().unwrap(),
        vec![1.0; 4]
    );
    // A round that fails with its first push kept lets it go.
    let mut two = ServerState::new(2, true);
    two.handle(0, 0, &req(Op::Init, 3, 4, 1), &mut data(0.0, 4));
    two.handle(
        0,
        0,
        &req(Op::Push, 3, 4, 2),
        Input::Peer(&lent(&a), Some(6)),
    );
    assert_eq!(two.take_kept(), Some(6));
    two.fail("stopping");
    assert_eq!(two.take_released().collect::<Vec<_>>(), vec![6]);
}

#[test]
fn a_workers_pull_after_its_own_push_waits_for_the_round() {
    let mut s = ServerState::new(2, true);
    s.handle(0, 0, &req(Op::Init, 1, 2, 1), &mut data(0.0, 2));
    replies(&mut s);
    // Worker 0 pushes and pulls at once (push_async, then pull): its pull waits for the
    // round, while worker 1's pull, which pushed nothing yet, sees the stored value now.
    s.handle(0, 0, &req(Op::Push, 1, 2, 2), &mut data(1.0, 2));
    s.handle(0, 0, &req(Op::Pull, 1, 2, 3), &mut empty());
    s.handle(1, 1, &req(Op::Pull, 1, 2, 4), &mut empty());
    assert_eq!(replies(&mut s), vec![(1, 4, 0, vec![0.0; 2])]);
    s.handle(1, 1, &req(Op::Push, 1, 2, 5), &mut data(2.0, 2));
    let r = replies(&mut s);
    assert_eq!(
        r,
        vec![
            (0, 2, 0, vec![]),
            (1, 5, 0, vec![]),
            (0, 3, 0, vec![3.0; 2])
        ]
    );
    // A round that fails for a gone worker still answers the pulls behind it, with the
    // stored value; a failing server answers them with its reason.
    s.handle(0, 0, &req(Op::Push, 1, 2, 6), &mut data(1.0, 2));
    s.handle(0, 0, &req(Op::Pull, 1, 2, 7), &mut empty());
    assert!(replies(&mut s).is_empty());
    s.worker_gone(1, "disconnected");
    let r = replies(&mut s);
    assert_eq!((r[0].1, r[0].2), (6, status::PEER_LOST));
    assert_eq!(r[1], (0, 7, 0, vec![3.0; 2]));
    let mut s = ServerState::new(2, true);
    s.handle(0, 0, &req(Op::Init, 1, 2, 1), &mut data(0.0, 2));
    s.handle(0, 0, &req(Op::Push, 1, 2, 2), &mut data(1.0, 2));
    s.handle(0, 0, &req(Op::Pull, 1, 2, 3), &mut empty());
    replies(&mut s);
    s.fail("stopping");
    let r = replies(&mut s);
    assert_eq!(
        r.iter().map(|x| (x.1, x.2)).collect::<Vec<_>>(),
        [(2, status::PEER_LOST), (3, status::PEER_LOST)]
    );
    // A closed connection's pulls are dropped with it.
    let mut s = ServerState::new(2, true);
    s.handle(0, 0, &req(Op::Init, 1, 2, 1), &mut data(0.0, 2));
    s.handle(0, 0, &req(Op::Push, 1, 2, 2), &mut data(1.0, 2));
    s.handle(0, 0, &req(Op::Pull, 1, 2, 3), &mut empty());
    s.forget_peer(0);
    s.handle(1, 1, &req(Op::Push, 1, 2, 4), &mut data(1.0, 2));
    let r = replies(&mut s);
    assert!(
        r.iter().all(|x| x.1 != 3) && r.iter().any(|x| x.1 == 4),
        "{r:?}"
    );
}

/// A store of `workers` workers holding key 4: the elements 0 to 5.
fn key_4(workers: usize) -> ServerState {
    let mut s = ServerState::new(workers, true);
    let mut init = NDArray::from_vec(&[6], vec![0f32, 1.0, 2.0, 3.0, 4.0, 5.0]).unwrap();
    s.handle(0, 0, &req(Op::Init, 4, 6, 1), &mut init);
    replies(&mut s);
    s
}

/// A request `id` for the run of key 4's elements `start..start + len`.
fn part(op: Op, start: u64, len: u64, id: u64) -> Msg {
    let mut m = req(op, 4, 6, id);
    m.start = start;
    m.len = len;
    m
}

#[test]
fn a_pull_may_name_a_run_inside_the_slice_and_gets_only_that_run_and_a_push_may_not() {
    let mut s = key_4(1);
    s.handle(0, 0, &part(Op::Pull, 2, 3, 2), &mut empty());
    assert_eq!(replies(&mut s), vec![(0, 2, 0, vec![2.0, 3.0, 4.0])]);
    // Past the slice, empty, or overflowing: refused. A push names the slice exactly.
    for (start, len, id) in [(4, 3, 3), (6, 1, 4), (2, 0, 5), (u64::MAX, 2, 6)] {
        s.handle(0, 0, &part(Op::Pull, start, len, id), &mut empty());
        assert_eq!(replies(&mut s)[0].2, status::MISMATCH, "{start}+{len}");
    }
    s.handle(0, 0, &part(Op::Push, 2, 3, 7), &mut data(1.0, 3));
    assert_eq!(replies(&mut s)[0].2, status::MISMATCH);
}

#[test]
fn a_run_pulled_behind_a_push_gets_the_rounds_value_or_the_stored_one_if_a_worker_left() {
    let mut s = key_4(2);
    // Worker 0 pushes, then pulls a run: held until worker 1's push completes the round.
    s.handle(0, 0, &req(Op::Push, 4, 6, 2), &mut data(1.0, 6));
    s.handle(0, 0, &part(Op::Pull, 4, 2, 3), &mut empty());
    assert!(replies(&mut s).is_empty(), "held behind the push");
    s.handle(1, 1, &req(Op::Push, 4, 6, 4), &mut data(2.0, 6));
    let r = replies(&mut s);
    assert!(r.contains(&(0, 3, 0, vec![3.0, 3.0])), "{r:?}");
    // Held again, and worker 1 leaves: the run gets the stored value's run.
    s.handle(0, 0, &req(Op::Push, 4, 6, 5), &mut data(9.0, 6));
    s.handle(0, 0, &part(Op::Pull, 1, 3, 6), &mut empty());
    assert!(replies(&mut s).is_empty(), "held behind the push");
    s.worker_gone(1, "disconnected");
    let r = replies(&mut s);
    assert!(r.contains(&(0, 6, 0, vec![3.0, 3.0, 3.0])), "{r:?}");
}

#[test]
fn packed_pushes_are_checked_unpacked_and_summed() {
    let mut s = ServerState::new(2, true);
    s.handle(0, 0, &req(Op::Init, 1, 5, 1), &mut data(0.0, 5));
    let mut f64s = NDArray::zeros_dtype(&[5], DType::F64);
    let init_f64 = Msg {
        dtype: DType::F64,
        ..req(Op::Init, 2, 5, 2)
    };
    s.handle(0, 0, &init_f64, &mut f64s);
    let packed = |op, key, id| {
        let mut m = req(op, key, 5, id);
        m.flags = crate::protocol::flags::PACKED;
        m.aux = 0.5f32.to_bits();
        m
    };
    let bytes = |b: &[u8]| NDArray::from_slice(&[b.len()], b).unwrap();
    // +t -t 0 +t | -t
    s.handle(
        0,
        0,
        &packed(Op::Push, 1, 3),
        &mut bytes(&[0b1110_0011, 0b1000_0000, 0, 0]),
    );
    // Too few bytes, and a float64 key: refused, and the round goes on without them.
    s.handle(1, 1, &packed(Op::Push, 1, 4), &mut bytes(&[0xff, 0xff]));
    s.handle(1, 1, &packed(Op::Push, 2, 5), &mut bytes(&[0xff; 4]));
    let r = replies(&mut s);
    let statuses: Vec<(u64, u16)> = r.iter().map(|(_, id, st, _)| (*id, *st)).collect();
    assert_eq!(
        statuses,
        [(1, 0), (2, 0), (4, status::MISMATCH), (5, status::MISMATCH)]
    );
    // The second worker's +t everywhere completes the round; the answer is whole.
    s.handle(
        1,
        1,
        &packed(Op::PushPull, 1, 6),
        &mut bytes(&[0xff, 0xff, 0, 0]),
    );
    let r = replies(&mut s);
    assert_eq!(r[0], (0, 3, 0, vec![]));
    assert_eq!(r[1], (1, 6, 0, vec![1.0, 0.0, 0.5, 1.0, 0.0]));
    assert_eq!(s.stored(2).unwrap().to_vec::<f64>().unwrap(), vec![0.0; 5]);
}

/// A push held for the next round is copied into the transport's memory, as every buffer
/// that may become the stored value is, so that answers still go by reference after the
/// round it starts (before, the copy was process memory, and every other round's stored
/// value was).
#[test]
fn a_push_held_for_the_next_round_is_copied_into_the_transports_memory() {
    let mut s = ServerState::new(2, true);
    let _shm = in_pool(&mut s);
    s.handle(0, 0, &req(Op::Init, 1, 8, 1), &mut data(0.0, 8));
    let mut id = 1;
    let mut push = |s: &mut ServerState, worker: usize, v: f32| {
        id += 1;
        let a = data(v, 8);
        s.handle(
            worker as PeerId,
            worker,
            &req(Op::Push, 1, 8, id),
            Input::Peer(&lent(&a), None),
        );
    };
    push(&mut s, 0, 1.0);
    // Held for the next round.
    push(&mut s, 0, 2.0);
    for (round, (v, want)) in [(3.0, 4.0), (5.0, 7.0), (1.0, 0.0)].into_iter().enumerate() {
        push(&mut s, 1, v);
        if round == 2 {
            // The round after the held push's, from its start.
            push(&mut s, 0, -1.0);
        }
        let stored = s.stored(1).unwrap();
        assert_eq!(
            stored.to_vec::<f32>().unwrap(),
            vec![want; 8],
            "round {round}"
        );
        assert!(stored.is_shared_memory(), "round {round}");
    }
}
