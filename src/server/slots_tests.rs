use super::*;
use crate::protocol::{slot_imm, status};
use crate::DType;

fn push(op: Op, key: u64, len: u64, req: u64) -> Msg {
    let mut m = Msg::new(op);
    m.key = key;
    m.dtype = DType::F32;
    m.total = len;
    m.len = len;
    m.req_id = req;
    m
}

fn reply(m: &Msg, st: u16) -> Msg {
    let mut r = *m;
    r.op = Op::Reply;
    r.status = st;
    r
}

/// Memory is a number, a grant is (buffer memory, peer).
type T = Slots<u32, (u32, PeerId)>;

/// Gives `peer` the credit that the reply to `m` may carry, making and granting buffers as a
/// loop does (memory numbered from 100, grant numbers `mem * 10 + peer`); the grant, if any.
fn credit(s: &mut T, peer: PeerId, domain: Domain, m: &Msg) -> Option<(u32, PeerId)> {
    let (id, mem) = match s.credit(peer, domain, &reply(m, status::OK)) {
        Credit::None => return None,
        Credit::Granted(g) => return Some(g),
        Credit::Grant(id, mem) => (id, mem),
        Credit::Make(bytes) => {
            let mem = 100 + s.bufs.iter().flatten().count() as u32;
            assert_eq!(bytes, m.data_bytes().unwrap() as usize);
            (s.made(mem, domain, bytes), mem)
        }
    };
    s.granted(peer, id, grant_no(mem, peer), (mem, peer));
    Some((mem, peer))
}

fn grant_no(mem: u32, peer: PeerId) -> u64 {
    mem as u64 * 10 + peer as u64
}

fn put(s: &mut T, g: (u32, PeerId), req: u64, follows: bool) -> Result<Option<Msg>, String> {
    let (a, id, mem) = s.on_put(g.1, grant_no(g.0, g.1), 0, 40, slot_imm(req, follows))?;
    assert_eq!(*mem, g.0);
    // The loop gives the buffer back once its data was read (a no-op while it waits for its
    // message).
    s.give_back(id);
    Ok(match a {
        PutAction::Push(m) => Some(m),
        PutAction::Wait => None,
    })
}

#[test]
fn a_first_push_earns_a_credit_whose_put_is_a_push_and_earns_the_next() {
    let mut s = T::new(1000);
    let m = push(Op::Push, 7, 10, 1);
    s.on_push(3, &m);
    let g = credit(&mut s, 3, 0, &m).expect("a credit");
    assert_eq!(s.used(), 40);
    let p = put(&mut s, g, 2, false).unwrap().expect("a push");
    assert_eq!((p.op, p.key, p.len, p.req_id), (Op::Push, 7, 10, 2));
    // The credit is spent: a second put is refused; the reply to the put gives a new one,
    // for the same buffer (free again, and already granted).
    assert!(put(&mut s, g, 3, false).is_err());
    assert_eq!(credit(&mut s, 3, 0, &p), Some(g));
    assert!(put(&mut s, g, 3, false).is_ok());
    assert_eq!(s.used(), 40);
    // A reply that failed, or to a request that brought no push, carries nothing.
    let m2 = push(Op::Push, 8, 10, 9);
    s.on_push(3, &m2);
    assert_eq!(s.credit(3, 0, &reply(&m2, status::FAILED)), Credit::None);
    assert_eq!(s.credit(3, 0, &reply(&m2, status::OK)), Credit::None);
}

#[test]
fn workers_taking_turns_share_one_buffer_and_the_budget_bounds_those_in_use() {
    // Room for one buffer of the slice.
    let mut s = T::new(40);
    let m = push(Op::Push, 1, 10, 1);
    s.on_push(0, &m);
    s.on_push(1, &m);
    let a = credit(&mut s, 0, 0, &m).expect("a credit");
    // Worker 1 finds the only buffer credited to worker 0: no room, no credit.
    assert_eq!(credit(&mut s, 1, 0, &m), None);
    // Worker 0's put is summed on arrival: the buffer is free, and worker 1's next reply
    // credits it, granted to worker 1 now.
    let p = put(&mut s, a, 2, false).unwrap().unwrap();
    let m1 = push(Op::Push, 1, 10, 7);
    s.on_push(1, &m1);
    let b = credit(&mut s, 1, 0, &m1).expect("the shared buffer");
    assert_eq!(b, (a.0, 1));
    assert_eq!(s.used(), 40);
    // Worker 0 waits its turn; its own grant of the buffer does not let it put.
    assert_eq!(credit(&mut s, 0, 0, &p), None);
    assert!(put(&mut s, a, 3, false).is_err());
    assert!(put(&mut s, b, 8, false).is_ok());
    let m0 = push(Op::Push, 1, 10, 4);
    s.on_push(0, &m0);
    assert_eq!(credit(&mut s, 0, 0, &m0), Some(a), "its old grant, again");
}

#[test]
fn buffers_of_another_medium_or_size_are_not_shared() {
    let mut s = T::new(1000);
    let m = push(Op::Push, 1, 10, 1);
    s.on_push(0, &m);
    let a = credit(&mut s, 0, 0, &m).unwrap();
    put(&mut s, a, 2, false).unwrap();
    // A free buffer of domain 0 is not given to a worker over domain 1.
    s.on_push(1 << 32, &m);
    let b = credit(&mut s, 1 << 32, 1, &m).unwrap();
    assert_ne!(a.0, b.0);
    // Nor one of another size.
    let other = push(Op::Push, 2, 11, 3);
    s.on_push(0, &other);
    assert!(matches!(
        s.credit(0, 0, &reply(&other, status::OK)),
        Credit::Make(44)
    ));
}

#[test]
fn a_pushpull_put_waits_for_its_message_and_bad_puts_are_refused() {
    let mut s = T::new(1000);
    let m = push(Op::PushPull, 5, 10, 1);
    s.on_push(0, &m);
    let g = credit(&mut s, 0, 0, &m).unwrap();
    // Another worker has no grant of it; a wrong length or offset is refused.
    assert!(s
        .on_put(1, grant_no(g.0, 0), 0, 40, slot_imm(2, true))
        .is_err());
    assert!(s
        .on_put(0, grant_no(g.0, 0), 0, 39, slot_imm(2, true))
        .is_err());
    assert!(s
        .on_put(0, grant_no(g.0, 0), 4, 40, slot_imm(2, true))
        .is_err());
    assert_eq!(put(&mut s, g, 2, true), Ok(None));
    // Filled: not free, and not put into again before its message.
    assert!(put(&mut s, g, 3, true).is_err());
    let mut msg = push(Op::PushPull, 5, 10, 3);
    assert!(s.on_slot_msg(0, &msg).is_err(), "another request id");
    msg.req_id = 2;
    msg.len = 9;
    msg.total = 9;
    assert!(s.on_slot_msg(0, &msg).is_err(), "another slice");
    let msg = push(Op::PushPull, 5, 10, 2);
    let (id, mem) = s.on_slot_msg(0, &msg).expect("the slot's message");
    assert_eq!(*mem, g.0);
    assert!(s.on_slot_msg(0, &msg).is_err(), "the slot was consumed");
    // Kept (not given back): no one is credited with it, so another buffer is made.
    s.on_push(0, &msg);
    let other = credit(&mut s, 0, 0, &msg);
    assert!(other.is_some() && other != Some(g), "{other:?}");
    // Given back, it is credited again.
    s.give_back(id);
    s.on_push(5, &msg);
    assert_eq!(credit(&mut s, 5, 0, &msg), Some((g.0, 5)));
}

#[test]
fn a_lost_worker_takes_its_credited_buffers_out_and_its_grants_are_revoked() {
    let mut s = T::new(80);
    let (m, n) = (push(Op::Push, 1, 10, 1), push(Op::Push, 2, 10, 2));
    for p in [0, 1] {
        s.on_push(p, &m);
    }
    let a = credit(&mut s, 0, 0, &m).unwrap();
    let b = credit(&mut s, 1, 0, &m).unwrap();
    assert_eq!(s.used(), 80);
    // Worker 1 puts (its buffer is free); worker 0 is then credited with it too, for key 2.
    put(&mut s, b, 5, false).unwrap();
    s.on_push(0, &n);
    assert_eq!(credit(&mut s, 0, 0, &n), Some((b.0, 0)));
    // Worker 0 is lost: both buffers it holds credits for leave the pool with all their
    // grants; nothing of worker 1 is left to revoke but its grant of those.
    let d = s.drop_peer(0);
    let mut mems = d.mems.clone();
    mems.sort();
    assert_eq!(mems, vec![a.0, b.0]);
    let mut revoked = d.grants.clone();
    revoked.sort();
    assert_eq!(revoked, vec![(0, a), (0, (b.0, 0)), (1, b)]);
    assert_eq!(s.used(), 0);
    assert!(put(&mut s, b, 6, false).is_err(), "its grant is gone");
    // Room again: worker 1 gets a new buffer.
    let m1 = push(Op::Push, 1, 10, 9);
    s.on_push(1, &m1);
    assert!(credit(&mut s, 1, 0, &m1).is_some());
}

#[test]
fn a_packed_push_earns_a_slot_of_its_packed_size_whose_puts_are_packed() {
    let mut s = T::new(1000);
    let mut m = push(Op::Push, 7, 160, 1);
    m.flags = flags::PACKED;
    m.aux = 0.5f32.to_bits();
    s.on_push(3, &m);
    let g = credit(&mut s, 3, 0, &m).expect("a credit");
    assert_eq!(s.used(), 40, "160 elements packed");
    let p = put(&mut s, g, 2, false).unwrap().expect("a push");
    assert_eq!((p.flags, p.aux, p.len), (flags::PACKED, m.aux, 160));
    // A pushpull's message after its put must be packed alike.
    let g = credit(&mut s, 3, 0, &p).expect("a credit");
    assert_eq!(put(&mut s, g, 4, true).unwrap(), None);
    let mut msg = push(Op::PushPull, 7, 160, 4);
    msg.flags = flags::SLOT;
    assert!(s.on_slot_msg(3, &msg).is_err());
    msg.flags = flags::SLOT | flags::PACKED;
    msg.aux = m.aux;
    assert!(s.on_slot_msg(3, &msg).is_ok());
}
