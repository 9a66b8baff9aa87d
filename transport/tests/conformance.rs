//! One suite, written once against the `Transport` trait, run over every transport.

use std::net::TcpListener;
use std::time::{Duration, Instant};

use kvstore_shm::ChannelConfig;
use kvstore_transport::{
    Event, RegionHandle, ShmListener, ShmPair, TcpPair, Transport, TransportError,
};

type Pair = (Box<dyn Transport>, Box<dyn Transport>);

fn tcp_pair() -> Pair {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let t = std::thread::spawn(move || TcpPair::accept(&l).unwrap());
    let a = TcpPair::connect(addr, Duration::from_secs(5)).unwrap();
    (Box::new(a), Box::new(t.join().unwrap()))
}

fn shm_pair() -> Pair {
    let name = format!(
        "conformance-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    );
    let l = ShmListener::bind(&name).unwrap();
    let t = std::thread::spawn(move || l.accept().unwrap());
    let cfg = ChannelConfig {
        ring_slots: 32,
        page_size: 4096,
        pages: 1024,
    };
    let a = ShmPair::connect(&name, cfg, Duration::from_secs(5)).unwrap();
    (Box::new(a), Box::new(t.join().unwrap()))
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(10)
}

fn messages_of_every_size_arrive_in_order(p: Pair) {
    let (mut a, mut b) = p;
    let sizes = [0usize, 1, 4, 200, 201, 4096, 100_000, 1 << 20];
    let t = std::thread::spawn(move || {
        let mut buf = vec![0u8; 1 << 20];
        for (i, &n) in sizes.iter().enumerate() {
            match b.recv(&mut buf, soon()).unwrap() {
                Event::Message { tag, len } => {
                    assert_eq!((tag, len), (i as u64, n));
                    assert!(buf[..n]
                        .iter()
                        .enumerate()
                        .all(|(j, &x)| x == (j % 251) as u8 ^ i as u8));
                }
                other => panic!("{other:?}"),
            }
        }
        b.send(99, b"done", soon()).unwrap();
        b
    });
    for (i, &n) in sizes.iter().enumerate() {
        let data: Vec<u8> = (0..n).map(|j| (j % 251) as u8 ^ i as u8).collect();
        a.send(i as u64, &data, soon()).unwrap();
    }
    let mut buf = [0u8; 16];
    assert_eq!(
        a.recv(&mut buf, soon()).unwrap(),
        Event::Message { tag: 99, len: 4 }
    );
    t.join().unwrap();
}

fn puts_land_in_the_exposed_region(p: Pair) {
    let (mut a, mut b) = p;
    let region = b.expose(64 * 1024).unwrap();
    b.send(0, &region.to_bytes(), soon()).unwrap();
    let mut hb = [0u8; 16];
    let Event::Message { len: 16, .. } = a.recv(&mut hb, soon()).unwrap() else {
        panic!()
    };
    let remote = RegionHandle::from_bytes(&hb).unwrap();
    let data: Vec<u8> = (0..5000u32).map(|i| (i * 7) as u8).collect();
    a.put(remote, 1000, &data, 42, soon()).unwrap();
    let mut none = [0u8; 0];
    match b.recv(&mut none, soon()).unwrap() {
        Event::Put {
            imm,
            region: r,
            offset,
            len,
        } => {
            assert_eq!((imm, offset, len), (42, 1000, 5000));
            let mut out = vec![0u8; 5000];
            b.read_region(r, offset, &mut out).unwrap();
            assert_eq!(out, data);
        }
        other => panic!("{other:?}"),
    }
    assert!(
        a.put(remote, 64 * 1024 - 10, &data, 1, soon()).is_err(),
        "beyond the region"
    );
}

fn bad_handles_are_refused(p: Pair) {
    let (mut a, _b) = p;
    let bogus = RegionHandle {
        key: 12345,
        len: 100,
    };
    let r = a.put(bogus, 0, b"x", 0, soon());
    // TCP learns of it on the receiving side; shared memory checks the pool at once.
    if a.name() == "shm" {
        assert!(r.is_err());
    }
    let mut out = [0u8; 4];
    assert!(a.read_region(bogus, 0, &mut out).is_err());
}

fn a_lost_peer_is_an_error_not_a_hang(p: Pair) {
    let (mut a, b) = p;
    drop(b);
    let start = Instant::now();
    let mut buf = [0u8; 16];
    let e = a
        .recv(&mut buf, Instant::now() + Duration::from_secs(20))
        .unwrap_err();
    assert!(
        matches!(e, TransportError::Closed | TransportError::PeerLost(_)),
        "{e}"
    );
    assert!(start.elapsed() < Duration::from_secs(5));
}

fn a_silent_peer_times_out(p: Pair) {
    let (mut a, _b) = p;
    let mut buf = [0u8; 16];
    let e = a
        .recv(&mut buf, Instant::now() + Duration::from_millis(150))
        .unwrap_err();
    assert!(matches!(e, TransportError::Timeout(_)), "{e}");
}

macro_rules! suite {
    ($($name:ident),*) => {
        mod tcp { $( #[test] fn $name() { super::$name(super::tcp_pair()); } )* }
        mod shm { $( #[test] fn $name() { super::$name(super::shm_pair()); } )* }
    };
}

suite!(
    messages_of_every_size_arrive_in_order,
    puts_land_in_the_exposed_region,
    bad_handles_are_refused,
    a_lost_peer_is_an_error_not_a_hang,
    a_silent_peer_times_out
);
