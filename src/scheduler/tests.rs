//! The scheduler's own tests.

use super::*;
use std::io::Read;

/// This process's threads named as the scheduler names a connection's reader.
fn link_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|d| {
            d.filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
                .filter(|c| c.trim() == "kvstore-sched-l")
                .count()
        })
        .unwrap_or(0)
}

#[test]
fn idle_connections_cost_no_thread_and_are_dropped() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let at = listener.local_addr().unwrap();
    let opts = SchedulerOptions {
        num_workers: 1,
        num_servers: 1,
        secret: "s".into(),
        timeout: Duration::from_secs(8),
    };
    let t = std::thread::spawn(move || run_scheduler(listener, &opts));
    // 200 connections that never say a hello.
    let idle: Vec<_> = (0..200)
        .filter_map(|_| std::net::TcpStream::connect(at).ok())
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    // No thread is spent on a connection that has not proven the secret.
    let n = link_threads();
    assert_eq!(n, 0, "{n} reader threads for 200 idle connections");
    assert!(
        n <= 1 + 1 + 16,
        "{n} reader threads for 200 idle connections"
    );
    // Past the hello deadline every one of them is closed, and its thread gone.
    std::thread::sleep(HELLO_WITHIN + Duration::from_secs(1));
    assert_eq!(link_threads(), 0);
    let closed = idle
        .into_iter()
        .filter(|s| {
            let _ = s.set_read_timeout(Some(Duration::from_millis(100)));
            matches!((&mut &*s).read(&mut [0u8; 1]), Ok(0) | Err(_))
        })
        .count();
    assert_eq!(closed, 200);
    // The rendezvous times out as it would have (no node came).
    assert!(t.join().unwrap().is_err());
}

#[test]
fn rank_hints_are_honoured_where_they_can_be_and_the_rest_go_by_arrival() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let at = l.local_addr().unwrap();
    let node = |hint: Option<u32>| Node {
        role: role::WORKER,
        hint,
        addr: None,
        host: "h".into(),
        rdma: None,
        shm: None,
        mask: [0; auth::MAC],
        writer: Arc::new(std::sync::Mutex::new(TcpStream::connect(at).unwrap())),
        rank: 99,
        done: false,
    };
    let mut nodes = BTreeMap::new();
    // A hint taken twice, none, one out of range: before, any of these gave every node its
    // arrival order, the good hints too.
    for (i, h) in [Some(2), Some(2), None, Some(7)].into_iter().enumerate() {
        nodes.insert(i, node(h));
    }
    assign_ranks(&[0, 1, 2, 3], &mut nodes);
    let ranks: Vec<usize> = (0..4).map(|i| nodes[&i].rank).collect();
    assert_eq!(ranks, [2, 0, 1, 3]);
}

/// A scheduler for no workers (or no servers) is refused at once: it would wait forever for
/// a finish no worker sends.
#[test]
fn a_job_of_no_workers_or_no_servers_is_refused() {
    for (w, s) in [(0, 1), (1, 0)] {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let opts = SchedulerOptions {
            num_workers: w,
            num_servers: s,
            secret: "s".into(),
            timeout: Duration::from_secs(8),
        };
        let e = run_scheduler(listener, &opts).unwrap_err();
        assert!(
            matches!(&e, KvError::Config(t) if t.contains("a worker and a server")),
            "{e}"
        );
    }
}
