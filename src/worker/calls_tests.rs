use super::*;
use crate::protocol::{slot_imm, status};

/// A call with one pull of 16 bytes from server 0, posted with its destination granted
/// as grant 7; returns the call and its request id.
fn one_pull(calls: &mut Calls<u64>) -> (CallId, u64) {
    let call = calls.start(
        Instant::now(),
        [pull_16_bytes()].into(),
        [NDArray::zeros(&[4])].into(),
    );
    let Some(Action::Send { req, token, .. }) = calls.poll_action() else {
        panic!("the pull is not sent");
    };
    calls.on_sent(call, req, Some(7), token);
    let id = calls.request(call, req).expect("the request").0.msg.req_id;
    (call, id)
}

/// A pull of 16 bytes from server 0 into the first output.
fn pull_16_bytes() -> Request {
    Request {
        server: 0,
        msg: Msg::new(Op::Pull),
        data: None,
        text: Vec::new(),
        dest: Some((0, 0..16)),
    }
}

/// The next action releases grant 7 without revoking it: the answer is in.
fn assert_forgets_grant_7(calls: &mut Calls<u64>) {
    assert_eq!(
        calls.poll_action(),
        Some(Action::Release {
            server: 0,
            grant: 7,
            revoke: false
        })
    );
}

#[test]
fn an_answer_put_without_the_follows_bit_is_the_whole_answer() {
    let mut calls = Calls::<u64>::new(0, Duration::from_secs(5));
    let (call, id) = one_pull(&mut calls);
    // A put whose reply follows does not answer yet.
    calls.on_answer_put(0, slot_imm(id, true), |g| *g == 7, 0, 16);
    assert!(!calls.is_done(call));
    calls.on_answer_put(0, slot_imm(id, false), |g| *g == 7, 0, 16);
    assert!(calls.is_done(call));
    assert!(calls.take(call).expect("finished").result.is_ok());
    assert_forgets_grant_7(&mut calls);
}

#[test]
fn an_answer_put_that_does_not_fill_its_destination_fails_every_call() {
    for (server, grant, offset, len) in [(1, 7, 0, 16), (0, 8, 0, 16), (0, 7, 4, 12), (0, 7, 0, 8)]
    {
        let mut calls = Calls::<u64>::new(0, Duration::from_secs(5));
        let (call, id) = one_pull(&mut calls);
        calls.on_answer_put(server, slot_imm(id, false), |g| *g == grant, offset, len);
        let r = calls.take(call).expect("the call is over").result;
        assert!(matches!(r, Err(KvError::Protocol(_))), "{r:?}");
        assert!(calls.check().is_err());
    }
}

#[test]
fn a_reply_carrying_its_value_fills_the_destination_or_fails_every_call() {
    let mut calls = Calls::<u64>::new(0, Duration::from_secs(5));
    let (call, id) = one_pull(&mut calls);
    let mut m = Msg::new(Op::Reply);
    m.req_id = id;
    m.flags = crate::protocol::flags::DATA;
    calls.on_reply_value(0, &m, &[], None, |dst| {
        dst.copy_from_slice(&[7u8; 16]);
        true
    });
    let f = calls.take(call).expect("finished");
    assert!(f.result.is_ok());
    assert_eq!(f.outputs[0].as_bytes(), &[7u8; 16]);
    // The grant is only forgotten: the server did not write it.
    assert_forgets_grant_7(&mut calls);
    // A value of another length (the filler says so), or from another server.
    for server in [0, 1] {
        let mut calls = Calls::<u64>::new(0, Duration::from_secs(5));
        let (call, id) = one_pull(&mut calls);
        m.req_id = id;
        calls.on_reply_value(server, &m, &[], None, |_| server == 1);
        if server == 1 {
            // Not the request's server: ignored, the call waits on.
            assert!(!calls.is_done(call));
            continue;
        }
        let r = calls.take(call).expect("the call is over").result;
        assert!(matches!(r, Err(KvError::Protocol(_))), "{r:?}");
    }
}

#[test]
fn an_ok_reply_for_a_destination_no_put_filled_fails_every_call() {
    let reply = |id| {
        let mut m = Msg::new(Op::Reply);
        m.req_id = id;
        m
    };
    // A plain OK for a pull, with no put before it and no value with it.
    let mut calls = Calls::<u64>::new(0, Duration::from_secs(5));
    let (call, id) = one_pull(&mut calls);
    calls.on_reply(0, &reply(id), &[], None);
    let r = calls.take(call).expect("the call is over").result;
    assert!(matches!(r, Err(KvError::Protocol(_))), "{r:?}");
    assert!(calls.check().is_err());
    // After a put that filled it (its reply following), the same reply answers it.
    let mut calls = Calls::<u64>::new(0, Duration::from_secs(5));
    let (call, id) = one_pull(&mut calls);
    calls.on_answer_put(0, slot_imm(id, true), |g| *g == 7, 0, 16);
    assert!(!calls.is_done(call));
    calls.on_reply(0, &reply(id), &[], None);
    assert!(calls.take(call).expect("finished").result.is_ok());
    // A put whose reply follows must fill the destination as a whole answer must.
    for (grant, offset, len) in [(8, 0, 16), (7, 4, 12), (7, 0, 8)] {
        let mut calls = Calls::<u64>::new(0, Duration::from_secs(5));
        let (call, id) = one_pull(&mut calls);
        calls.on_answer_put(0, slot_imm(id, true), |g| *g == grant, offset, len);
        let r = calls.take(call).expect("the call is over").result;
        assert!(matches!(r, Err(KvError::Protocol(_))), "{r:?}");
    }
    // An error needs no value: the call fails with it, the store goes on.
    let mut calls = Calls::<u64>::new(0, Duration::from_secs(5));
    let (call, id) = one_pull(&mut calls);
    let mut m = reply(id);
    m.status = status::FAILED;
    calls.on_reply(0, &m, b"no", None);
    let r = calls.take(call).expect("the call is over").result;
    assert!(
        r.is_err() && !matches!(r, Err(KvError::Protocol(_))),
        "{r:?}"
    );
    assert!(calls.check().is_ok());
}

#[test]
fn an_interruption_fails_every_live_call_as_interrupted_and_anything_else_the_rest_as_aborted() {
    for interruption in [true, false] {
        let mut calls = Calls::<u64>::new(0, Duration::from_secs(5));
        let (a, _) = one_pull(&mut calls);
        let (b, _) = one_pull(&mut calls);
        calls.fail_all(match interruption {
            true => KvError::Interrupted("ctrl-c".into()),
            false => KvError::PeerLost("server 0 died".into()),
        });
        let first = calls.take(a).expect("over").result.unwrap_err();
        let second = calls.take(b).expect("over").result.unwrap_err();
        match interruption {
            true => assert!(
                matches!(
                    (&first, &second),
                    (KvError::Interrupted(_), KvError::Interrupted(_))
                ),
                "{first:?} {second:?}"
            ),
            false => assert!(
                matches!(
                    (&first, &second),
                    (KvError::PeerLost(_), KvError::Aborted(_))
                ),
                "{first:?} {second:?}"
            ),
        }
        assert!(calls.check().is_err());
    }
}

/// A call refused because a GPU has no memory left for an output leaves every output as it
/// was: here the first output, a GPU array of its own, keeps its value while the second,
/// which shares its memory and so needs fresh memory, cannot get it.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a GPU"]
fn a_call_refused_for_a_gpu_out_of_memory_leaves_every_output_as_it_was() {
    assert!(crate::gpu_count() > 0, "this test needs a GPU");
    let d = crate::gpu(0);
    let first = NDArray::full(&[4], 5.0).on(d).unwrap();
    let second = NDArray::zeros(&[64 << 20]).on(d).unwrap();
    let _keep = second.clone();
    // The GPU filled by device copies of 1 GiB, then 64 MiB, then 1 MiB, until none is given.
    let pieces: Vec<NDArray> = [256 << 20, 16 << 20, 256 << 10]
        .iter()
        .map(|&e| NDArray::zeros(&[e]).on(d).unwrap())
        .collect();
    let mut hog = Vec::new();
    for p in &pieces {
        while let Ok(a) = p.copy_to(d) {
            hog.push(a);
        }
    }
    let mut calls = Calls::<u64>::new(0, Duration::from_secs(5));
    let reqs = [pull_16_bytes()].into();
    let call = calls.start(Instant::now(), reqs, vec![first, second].into());
    let f = calls.take(call).expect("refused at once");
    drop(hog);
    assert!(
        matches!(f.result, Err(KvError::Device(_))),
        "{:?}",
        f.result
    );
    assert_eq!(f.outputs[0].to_f64_vec(), vec![5.0; 4]);
}

/// Pushes of `key` to each of `servers` (its slices where they are several).
fn pushes(key: u64, servers: &[usize]) -> Requests {
    let req = |server: usize| {
        let mut msg = Msg::new(Op::Push);
        (msg.key, msg.start) = (key, server as u64 * 4);
        Request {
            server,
            msg,
            data: None,
            text: Vec::new(),
            dest: None,
        }
    };
    servers.iter().map(|&s| req(s)).collect()
}

/// Starts a call of `reqs`, each request sent; the call and its request ids.
fn start_sent(calls: &mut Calls<u64>, reqs: Requests) -> (CallId, Vec<u64>) {
    let call = calls.start(Instant::now(), reqs, Outputs::new());
    let mut ids = Vec::new();
    while let Some(Action::Send {
        call: c,
        req,
        token,
    }) = calls.poll_action()
    {
        calls.on_sent(c, req, None, token);
        ids.push(calls.request(c, req).expect("the request").0.msg.req_id);
    }
    (call, ids)
}

/// Starts a push of key 5 sliced over servers 0 and 1 (`sliced`) or held by server 0 alone.
fn push_of_5(calls: &mut Calls<u64>, sliced: bool) -> (CallId, Vec<u64>) {
    let servers: &[usize] = if sliced { &[0, 1] } else { &[0] };
    start_sent(calls, pushes(5, servers))
}

/// `call` failed, and the store with it, for a key whose slices may be a round apart.
fn assert_apart(calls: &mut Calls<u64>, call: CallId) {
    assert!(calls.check().is_err());
    let err = calls.take(call).expect("failed").result.unwrap_err();
    assert!(
        matches!(&err, KvError::Aborted(t) if t.contains("a round apart")),
        "{err}"
    );
}

fn reply(calls: &mut Calls<u64>, server: usize, req_id: u64, st: u16, text: &[u8]) {
    let mut m = Msg::new(Op::Reply);
    m.req_id = req_id;
    m.status = st;
    calls.on_reply(server, &m, text, None);
}

#[test]
fn a_third_push_of_a_sliced_key_in_flight_is_refused_before_it_is_sent_in_dist_sync() {
    // Each server would decide for its own slice, and one may have completed the round the
    // other still waits on: refused here, nothing is sent, and the store goes on.
    let mut calls = Calls::<u64>::new(0, Duration::from_secs(5));
    calls.set_sync(true);
    let (first, ids) = push_of_5(&mut calls, true);
    push_of_5(&mut calls, true);
    let (third, sent) = push_of_5(&mut calls, true);
    assert!(sent.is_empty(), "the third push was sent");
    let err = calls
        .take(third)
        .expect("refused at once")
        .result
        .unwrap_err();
    assert!(
        matches!(&err, KvError::Unsupported(t) if t.contains("a third push is refused")),
        "{err}"
    );
    assert!(calls.check().is_ok());
    // Once the first push's round is in (both slices answered), a third may go.
    for (server, id) in ids.into_iter().enumerate() {
        reply(&mut calls, server, id, status::OK, b"");
    }
    assert!(calls.take(first).expect("answered").result.is_ok());
    assert_eq!(push_of_5(&mut calls, true).1.len(), 2);
    // Counted by slice and answer, not by call: a call's other key still in flight (key 4,
    // its round waiting) does not keep key 5's answered slices counted.
    let mut calls = Calls::<u64>::new(0, Duration::from_secs(5));
    calls.set_sync(true);
    let mut answered = Vec::new();
    for _ in 0..2 {
        let mut reqs = pushes(5, &[0, 1]);
        reqs.extend(pushes(4, &[0]));
        let (_, ids) = start_sent(&mut calls, reqs);
        answered.extend([(0, ids[0]), (1, ids[1])]);
    }
    for (server, id) in answered {
        reply(&mut calls, server, id, status::OK, b"");
    }
    assert_eq!(push_of_5(&mut calls, true).1.len(), 2);
    // A key on one server, or a store without rounds, is left to the servers.
    for (sync, sliced) in [(true, false), (false, true)] {
        let mut calls = Calls::<u64>::new(0, Duration::from_secs(5));
        calls.set_sync(sync);
        for _ in 0..3 {
            assert!(!push_of_5(&mut calls, sliced).1.is_empty());
        }
    }
}

#[test]
fn a_slice_of_a_push_refused_by_one_server_makes_a_dist_sync_store_unusable() {
    // Server 1 refused its slice; server 0 may have taken its own into its round: the key's
    // slices may be a round apart, and nothing undoes it.
    let mut calls = Calls::<u64>::new(0, Duration::from_secs(5));
    calls.set_sync(true);
    let (call, ids) = push_of_5(&mut calls, true);
    let (other, _) = push_of_5(&mut calls, true);
    reply(&mut calls, 1, ids[1], status::NOT_TAKEN, b"no room");
    let err = calls.take(call).expect("failed").result.unwrap_err();
    assert!(
        matches!(&err, KvError::Aborted(t) if t.contains("a round apart") && t.contains("no room")),
        "{err}"
    );
    assert!(calls.take(other).expect("failed too").result.is_err());
    assert!(calls.check().is_err());
    // The same where one server failed its slice's round for a worker gone, which another
    // may complete with that worker's push.
    let mut calls = Calls::<u64>::new(0, Duration::from_secs(5));
    calls.set_sync(true);
    let (call, ids) = push_of_5(&mut calls, true);
    reply(&mut calls, 0, ids[0], status::PEER_LOST, b"worker 1 left");
    assert_apart(&mut calls, call);
    // The same where an earlier error of the call (another key's) came first.
    let mut calls = Calls::<u64>::new(0, Duration::from_secs(5));
    calls.set_sync(true);
    let mut reqs = pushes(4, &[0]);
    reqs.extend(pushes(5, &[0, 1]));
    let (call, ids) = start_sent(&mut calls, reqs);
    reply(&mut calls, 0, ids[0], status::UNKNOWN_KEY, b"");
    assert!(calls.check().is_ok());
    reply(&mut calls, 1, ids[2], status::NOT_TAKEN, b"no room");
    assert_apart(&mut calls, call);
    // Refused whole (one server), without rounds, or failed after its round (an updater's
    // error, every server's alike): the call fails and the store goes on.
    for (sync, sliced, st) in [
        (true, false, status::NOT_TAKEN),
        (false, true, status::NOT_TAKEN),
        (true, true, status::FAILED),
    ] {
        let mut calls = Calls::<u64>::new(0, Duration::from_secs(5));
        calls.set_sync(sync);
        let (call, ids) = push_of_5(&mut calls, sliced);
        reply(&mut calls, 0, ids[0], st, b"no room");
        for (server, id) in ids.into_iter().enumerate().skip(1) {
            reply(&mut calls, server, id, status::OK, b"");
        }
        let err = calls.take(call).expect("failed").result.unwrap_err();
        assert!(matches!(&err, KvError::Remote { .. }), "{err}");
        assert!(calls.check().is_ok());
    }
}
