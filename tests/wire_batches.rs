//! Batches against raw peers written to the wire protocol: a batch is answered entry by
//! entry, a malformed one closes its link, a packed push is judged by its packed size.

mod util;

use std::time::Duration;

use util::raw::*;
/// A batch as a worker writes it: a header (entries, data bytes), then each entry's length
/// and header.
fn batch_body(entries: &[kvstore::protocol::Msg], data_len: u64, count: u64) -> Vec<u8> {
    let mut h = kvstore::protocol::Msg::new(kvstore::protocol::Op::Batch);
    h.key = count;
    h.total = data_len;
    h.len = data_len;
    let mut body = h.encode().to_vec();
    for m in entries {
        body.extend_from_slice(&(kvstore_transport::META_LEN as u32).to_le_bytes());
        body.extend_from_slice(&m.encode());
    }
    body
}

/// Reads answer batches until `n` answers came: (request id, status, value bytes if any).
fn read_answers(s: &mut std::net::TcpStream, n: usize) -> Vec<(u64, u16, Option<Vec<u8>>)> {
    use kvstore::protocol::{flags, Msg, Op};
    use kvstore_transport::{tcp::blocking::read_frame, META_LEN};
    let mut out = Vec::new();
    while out.len() < n {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        let (_, payload) = read_frame(s, 1 << 20, Some(deadline)).unwrap();
        let h = Msg::decode(payload[..META_LEN].try_into().unwrap()).unwrap();
        assert_eq!(h.op, Op::Batch);
        let body_len = payload.len() - h.len as usize;
        let (mut at, mut data) = (META_LEN, body_len);
        for _ in 0..h.key {
            let len = u32::from_le_bytes(payload[at..at + 4].try_into().unwrap()) as usize;
            let m = Msg::decode(payload[at + 4..at + 4 + META_LEN].try_into().unwrap()).unwrap();
            at += 4 + len;
            let value = (m.flags & flags::DATA != 0).then(|| {
                let n = m.data_bytes().unwrap() as usize;
                data += n;
                payload[data - n..data].to_vec()
            });
            out.push((m.req_id, m.status, value));
        }
        assert_eq!((at, data), (body_len, payload.len()));
    }
    out
}

#[test]
fn a_batch_is_answered_entry_by_entry_and_a_malformed_one_closes_its_link() {
    use kvstore::protocol::{status, Op};
    let mut job = util::ManualJob::start_some(1, 0, 1, &["seed", "dist_sync"], &[]);
    let j = raw_join(job.port);
    let mut s = raw_hello(&j.server, j.rank, &j.token).expect("the server's acknowledgement");
    let msg = |op: Op, key: u64, id: u64| f32_msg(op, key, 4, id);
    let floats = |v: [f32; 4]| v.iter().flat_map(|f| f.to_le_bytes()).collect::<Vec<u8>>();
    send_msg(
        &mut s,
        &msg(Op::Init, 1, 1).encode(),
        Some(&floats([1.0, 2.0, 3.0, 4.0])),
    )
    .unwrap();
    assert_eq!(read_msg(&mut s).status, status::OK);
    // A pull, a pull of an unknown key, then a push: answered in order, the pull before the
    // push, the unknown key with its error and nothing else refused.
    let entries = [
        msg(Op::Pull, 1, 2),
        msg(Op::Pull, 99, 3),
        msg(Op::Push, 1, 4),
    ];
    let push = floats([10.0, 20.0, 30.0, 40.0]);
    send_msg(&mut s, &batch_body(&entries, 16, 3), Some(&push)).unwrap();
    let answers = read_answers(&mut s, 3);
    assert_eq!(
        answers,
        vec![
            (2, status::OK, Some(floats([1.0, 2.0, 3.0, 4.0]))),
            (3, status::UNKNOWN_KEY, None),
            (4, status::OK, None),
        ]
    );
    let entries = [msg(Op::Pull, 1, 5), msg(Op::PushPull, 1, 6)];
    send_msg(&mut s, &batch_body(&entries, 16, 2), Some(&push)).unwrap();
    let answers = read_answers(&mut s, 2);
    assert_eq!(answers[0], (5, status::OK, Some(push.clone())));
    assert_eq!(answers[1].2, Some(push.clone()));
    // A batch claiming three entries that holds two: the server closes the link.
    send_msg(&mut s, &batch_body(&entries[..2], 16, 3), Some(&push)).unwrap();
    assert_closed(&mut s);
    // A batch whose valid push comes before a malformed entry (a flag a batched request may
    // not carry) is judged whole: its link closes, and the push counted nowhere.
    let mut s = raw_hello(&j.server, j.rank, &j.token).expect("the rank's link again");
    let mut bad = msg(Op::Pull, 1, 8);
    bad.flags = kvstore::protocol::flags::SLOT;
    let entries = [msg(Op::Push, 1, 7), bad];
    send_msg(
        &mut s,
        &batch_body(&entries, 16, 2),
        Some(&floats([7.0; 4])),
    )
    .unwrap();
    assert_closed(&mut s);
    let mut s = raw_hello(&j.server, j.rank, &j.token).expect("the rank's link again");
    send_msg(&mut s, &batch_body(&[msg(Op::Pull, 1, 9)], 0, 1), None).unwrap();
    assert_eq!(read_answers(&mut s, 1), vec![(9, status::OK, Some(push))]);
    drop(j.sched);
    job.kill_all();
}

#[test]
fn a_packed_push_is_judged_by_its_packed_size_and_answered_whole() {
    use kvstore::protocol::{flags, status, Op};
    let mut job = util::ManualJob::start_some(1, 0, 1, &["seed", "dist_sync"], &[]);
    let mut s = raw_worker(job.port);
    let floats = |v: [f32; 4]| v.iter().flat_map(|f| f.to_le_bytes()).collect::<Vec<u8>>();
    let init = f32_msg(Op::Init, 1, 4, 1);
    send_msg(&mut s, &init.encode(), Some(&floats([1.0, 2.0, 3.0, 4.0]))).unwrap();
    assert_eq!(read_msg(&mut s).status, status::OK);
    let packed = |op: Op, id: u64| {
        let mut m = f32_msg(op, 1, 4, id);
        m.flags = flags::PACKED;
        m.aux = 0.5f32.to_bits();
        m
    };
    // +t -t 0 +t: four elements in one 32-bit word.
    let push = packed(Op::Push, 2).encode();
    send_msg(&mut s, &push, Some(&[0b1110_0011, 0, 0, 0])).unwrap();
    assert_eq!(read_msg(&mut s).status, status::OK);
    // A pushpull in a batch: its answer is the whole value, assigned.
    let entries = [f32_msg(Op::Pull, 1, 4, 3), packed(Op::PushPull, 4)];
    let body = batch_body(&entries, 4, 2);
    send_msg(&mut s, &body, Some(&[0xff, 0, 0, 0])).unwrap();
    assert_eq!(
        read_answers(&mut s, 2),
        vec![
            (3, status::OK, Some(floats([0.5, -0.5, 0.0, 0.5]))),
            (4, status::OK, Some(floats([0.5; 4]))),
        ]
    );
    // A packed push bringing the value's whole size: the link is closed.
    send_msg(
        &mut s,
        &packed(Op::Push, 5).encode(),
        Some(&floats([0.0; 4])),
    )
    .unwrap();
    assert_closed(&mut s);
    job.kill_all();
}

/// The server closed the link (an end of stream or a reset), rather than staying silent: a
/// read that timed out would not say the link was closed.
fn assert_closed(s: &mut std::net::TcpStream) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    match kvstore_transport::tcp::blocking::read_frame(s, 1 << 20, Some(deadline)) {
        Err(kvstore_transport::TransportError::Closed) => {}
        Err(kvstore_transport::TransportError::Io(e))
            if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        other => panic!("the link stayed open: {other:?}"),
    }
}
