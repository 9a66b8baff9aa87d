use super::*;
use crate::protocol::status;
use crate::shm_link::WorkerPool;
use kvstore_shm::{send_fds, Channel, ChannelConfig, Region};
use std::os::fd::AsFd;

/// A server's end of a channel from a worker made in this process.
fn link(pool: &WorkerPool) -> (Channel, ServerLink) {
    let (w, s) = std::os::unix::net::UnixStream::pair().unwrap();
    let cfg = ChannelConfig {
        ring_slots: 16,
        page_size: 4096,
        pages: 1,
    };
    let chan = Channel::create("test", cfg).unwrap();
    let bell = |_| {
        rustix::event::eventfd(
            0,
            rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
        )
        .unwrap()
    };
    let (a, b) = (bell(0), bell(1));
    let npages = pool.pool.capacity() / pool.pool.page_size();
    // A canary in this process: the server side checks cross-memory writes on it.
    let canary: &'static mut [u8; 8] = Box::leak(Box::new([0u8; 8]));
    let hello = format!(
        "kvstore-shm-store-3\nsecret\n0\n{npages}\n{}\n{}",
        pool.pool.page_size(),
        canary.as_ptr() as usize
    );
    send_fds(
        &w,
        hello.as_bytes(),
        &[chan.segment().fd(), pool.seg.fd(), a.as_fd(), b.as_fd()],
    )
    .unwrap();
    let l = shm::accept(s, "secret", 1).unwrap();
    (chan, l)
}

fn push(key: u64, len: u64) -> Msg {
    let mut m = Msg::new(Op::Init);
    m.key = key;
    m.dtype = DType::F32;
    m.total = len;
    m.len = len;
    m.req_id = key;
    m
}

#[test]
fn a_full_answer_ring_queues_answers_and_never_blocks_the_server() {
    let pool = WorkerPool::create(1 << 20).unwrap();
    let (worker_end, mut l) = link(&pool);
    let t = Instant::now();
    for id in 0..3000u64 {
        let mut m = Msg::new(Op::Reply);
        m.req_id = id;
        l.answer(&m, &[], &[]).unwrap();
    }
    // No wait for the worker: the ring took 16, the rest are queued in order.
    assert!(t.elapsed() < Duration::from_secs(5));
    assert_eq!(l.backlog.len(), 3000 - 16);
    assert!(l.backlogged(), "requests of this worker wait now");
    let mut slot = [0u8; kvstore_shm::SLOT];
    let mut got = Vec::new();
    while got.len() < 3000 {
        while worker_end.try_recv(&mut slot).unwrap() {
            got.push(shm::decode(&slot).unwrap().msg.req_id);
        }
        l.flush().unwrap();
    }
    assert_eq!(got, (0..3000).collect::<Vec<u64>>());
    assert!(l.backlog.is_empty() && !l.backlogged());
}

#[test]
fn descriptors_outside_the_pool_or_at_freed_pages_are_refused_not_followed() {
    let pool = WorkerPool::create(1 << 20).unwrap();
    let (_chan, mut l) = link(&pool);
    let mut state = ServerState::new(1, true);
    let good = pool.pool.alloc(16).unwrap();
    pool.seg.write(good.offset, &[0u8; 16]).unwrap();
    let freed = pool.pool.alloc(16).unwrap();
    pool.pool.free(freed).unwrap();
    let cases = [
        (
            1,
            Region {
                offset: 1 << 40,
                len: 16,
            },
        ),
        (
            2,
            Region {
                offset: good.offset + 1,
                len: 16,
            },
        ),
        (3, freed),
        (
            4,
            Region {
                offset: good.offset,
                len: 8,
            },
        ), // shorter than the message
        (5, good),
    ];
    for (key, r) in cases {
        let d = shm::encode(&push(key, 4), 16, Some(r), None, &[]);
        handle_desc(&mut state, SHM_PEER, &mut l, &d).unwrap();
    }
    let replies: Vec<(u64, u16)> = state
        .outbox
        .iter()
        .map(|o| (o.msg.req_id, o.msg.status))
        .collect();
    assert_eq!(
        replies,
        vec![
            (1, status::FAILED),
            (2, status::FAILED),
            (3, status::FAILED),
            (4, status::FAILED),
            (5, status::OK)
        ]
    );
    assert!(state.stored(1).is_none() && state.stored(3).is_none());
    assert_eq!(
        state.stored(5).unwrap().to_vec::<f32>().unwrap(),
        vec![0.0; 4]
    );
    // A pull must name a destination of the right size inside the pool.
    let mut pull = push(5, 4);
    pull.op = Op::Pull;
    pull.req_id = 6;
    let d = shm::encode(
        &pull,
        0,
        None,
        Some(Region {
            offset: 1 << 40,
            len: 16,
        }),
        &[],
    );
    handle_desc(&mut state, SHM_PEER, &mut l, &d).unwrap();
    assert_eq!(
        state.outbox.last().map(|o| o.msg.status),
        Some(status::FAILED)
    );
    // Garbage is not a descriptor: the channel is closed, not followed.
    assert!(handle_desc(&mut state, SHM_PEER, &mut l, &[0x55; kvstore_shm::SLOT]).is_err());
}
