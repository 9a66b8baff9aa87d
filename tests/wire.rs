//! The distributed store against raw peers written to the wire protocol: squatters, links that
//! claim another rank, claims of memory, unread answers, other jobs; batches are in
//! wire_batches.rs. The jobs themselves, with real workers, are in dist.rs.

mod util;

use std::time::Duration;

use util::finish;
use util::raw::*;

#[test]
fn a_squatter_at_the_schedulers_address_learns_nothing_and_is_refused() {
    // A process listening where the scheduler should be: the hello it gets carries no secret,
    // and when it cannot prove the secret the node stops, saying so.
    use kvstore::protocol::{Msg, Op};
    use kvstore_transport::tcp::blocking::{read_frame, write_frame};
    use kvstore_transport::FrameHeader;
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let worker = std::process::Command::new(util::bin("examples/dist_check"))
        .args(["seed", "dist_sync"])
        .env("DMLC_ROLE", "worker")
        .env("DMLC_PS_ROOT_URI", "127.0.0.1")
        .env("DMLC_PS_ROOT_PORT", port.to_string())
        .env("DMLC_NUM_SERVER", "1")
        .env("DMLC_NUM_WORKER", "1")
        .env("KVSTORE_SECRET", util::SECRET)
        .env("KVSTORE_TIMEOUT", "10")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Bounded: a worker that never connects fails the test, not hangs it.
    l.set_nonblocking(true).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut s = loop {
        match l.accept() {
            Ok((s, _)) => break s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                assert!(
                    std::time::Instant::now() < deadline,
                    "the worker never connected"
                );
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => panic!("accept: {e}"),
        }
    };
    s.set_nonblocking(false).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let (_, hello) = read_frame(&mut s, 1 << 20, Some(deadline)).unwrap();
    let secret = util::SECRET.as_bytes();
    assert!(
        !hello.windows(secret.len()).any(|w| w == secret),
        "the hello carries the secret"
    );
    let bogus = format!("{}\n{}", "ab".repeat(16), "cd".repeat(32));
    write_frame(
        &mut s,
        &FrameHeader::new(Msg::new(Op::Challenge).encode(), bogus.len() as u64),
        bogus.as_bytes(),
    )
    .unwrap();
    // The node sends no proof to a scheduler that did not prove itself.
    let after = read_frame(&mut s, 1 << 20, Some(deadline));
    assert!(after.is_err(), "the node went on: {after:?}");
    let (code, out) = finish(worker, Duration::from_secs(20));
    assert_ne!(code, Some(0), "{out}");
    assert!(out.contains("does not know this job's secret"), "{out}");
}

#[test]
fn a_link_can_claim_only_the_rank_its_process_was_given() {
    // Two workers played here: each proves the secret, but a link that claims the other's
    // rank (with its own token) is closed; each then claims its own.
    let mut job = util::ManualJob::start_some(2, 0, 1, &["seed", "dist_sync"], &[]);
    // The roster comes once both have joined: they join at once.
    let port = job.port;
    let other = std::thread::spawn(move || raw_join(port));
    let a = raw_join(port);
    let b = other.join().unwrap();
    assert_ne!(a.rank, b.rank);
    let stolen = raw_hello(&a.server, b.rank, &a.token);
    assert!(stolen.is_err(), "a link took worker {}'s rank", b.rank);
    let forged = raw_hello(&a.server, a.rank, &[0u8; kvstore::auth::MAC]);
    assert!(forged.is_err(), "a link without the rank's token was taken");
    // Kept open: a worker's link that closes without a goodbye ends the job.
    let _own_a = raw_hello(&a.server, a.rank, &a.token).expect("its own rank");
    let _own_b = raw_hello(&b.server, b.rank, &b.token).expect("its own rank");
    drop((a, b));
    job.kill_all();
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[test]
fn a_message_is_judged_by_its_header_before_its_data_takes_memory() {
    // A proven worker sends a push for a key the server never stored, claiming 512 MiB of
    // data, and sends 32 MiB of it: the data is read and dropped as it comes, and the
    // server's memory grows by neither what was claimed nor what was sent.
    use kvstore::protocol::Op;
    use std::io::Write;
    let mut job = util::ManualJob::start_some(1, 0, 1, &["seed", "dist_sync"], &[]);
    let mut s = raw_worker(job.port);
    let base = rss_kib(job.servers[0].id());
    const N: u64 = 128 << 20; // f32: 512 MiB
    let body = f32_msg(Op::Push, 99, N, 1).encode();
    s.write_all(&kvstore_transport::tcp::msg_frame_header(
        body.len(),
        Some(N as usize * 4),
    ))
    .unwrap();
    s.write_all(&body).unwrap();
    let chunk = vec![0u8; 1 << 20];
    for _ in 0..32 {
        s.write_all(&chunk).unwrap();
    }
    std::thread::sleep(Duration::from_millis(500));
    let grew = rss_kib(job.servers[0].id()).saturating_sub(base);
    assert!(
        grew < 16 * 1024,
        "the server grew by {grew} KiB after 32 MiB sent"
    );
    job.kill_all();
}

#[test]
fn a_push_that_does_not_fit_its_key_gets_its_typed_error_and_the_link_serves_on() {
    // Over TCP as over shared memory: a push of a key this server does not hold, or of
    // another size than the key's, is answered with its error (its data read and dropped),
    // and the same link's next request is served.
    use kvstore::protocol::{status, Op};
    let mut job = util::ManualJob::start_some(1, 0, 1, &["seed", "dist_sync"], &[]);
    let mut s = raw_worker(job.port);
    let floats = |v: &[f32]| v.iter().flat_map(|f| f.to_le_bytes()).collect::<Vec<u8>>();
    let init = f32_msg(Op::Init, 1, 4, 1);
    send_msg(&mut s, &init.encode(), Some(&floats(&[1.0, 2.0, 3.0, 4.0]))).unwrap();
    assert_eq!(read_msg(&mut s).status, status::OK);
    let unknown = f32_msg(Op::Push, 99, 1 << 20, 2);
    send_msg(&mut s, &unknown.encode(), Some(&vec![0u8; 4 << 20])).unwrap();
    let r = read_msg(&mut s);
    assert_eq!((r.req_id, r.status), (2, status::UNKNOWN_KEY));
    let longer = f32_msg(Op::Push, 1, 6, 3);
    send_msg(&mut s, &longer.encode(), Some(&floats(&[9.0; 6]))).unwrap();
    let r = read_msg(&mut s);
    assert_eq!((r.req_id, r.status), (3, status::MISMATCH));
    let push = f32_msg(Op::Push, 1, 4, 4);
    send_msg(&mut s, &push.encode(), Some(&floats(&[5.0; 4]))).unwrap();
    let r = read_msg(&mut s);
    assert_eq!((r.req_id, r.status), (4, status::OK));
    job.kill_all();
}

#[test]
fn answers_a_worker_does_not_read_do_not_grow_the_server() {
    use kvstore::protocol::Op;
    const N: u64 = 256 * 1024; // 1 MiB of f32
    let mut job = util::ManualJob::start_some(1, 0, 1, &["seed", "dist_sync"], &[]);
    let mut s = raw_worker(job.port);
    let data = |op: Op, id: u64| f32_msg(op, 1, N, id);
    // A grant the server puts each answer into (the TCP backend's kind, number 1, N floats):
    // the worker never reads them.
    let mut grant = [0u8; 32];
    grant[0] = 1;
    grant[8] = 1;
    grant[24..32].copy_from_slice(&(N * 4).to_le_bytes());
    let payload = vec![0u8; N as usize * 4];
    send_msg(&mut s, &data(Op::Init, 1).encode(), Some(&payload)).unwrap();
    assert_eq!(read_msg(&mut s).status, 0);
    let base = rss_kib(job.servers[0].id());
    // 300 rounds of 1 MiB pushpulls whose answers are never read: each answer is a distinct
    // version of the value. The writer blocks once the server stops reading.
    let mut w = s.try_clone().unwrap();
    let sent = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = sent.clone();
    std::thread::spawn(move || {
        for i in 0..300 {
            let mut body = data(Op::PushPull, 2 + i).encode().to_vec();
            body.extend_from_slice(&grant);
            if send_msg(&mut w, &body, Some(&payload)).is_err() {
                return;
            }
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    });
    // Let the writer go as far as the server lets it.
    let mut last = usize::MAX;
    loop {
        std::thread::sleep(Duration::from_millis(1500));
        let now = sent.load(std::sync::atomic::Ordering::SeqCst);
        if now == last || now == 300 {
            break;
        }
        last = now;
    }
    let grown_mib = rss_kib(job.servers[0].id()).saturating_sub(base) / 1024;
    let rounds = sent.load(std::sync::atomic::Ordering::SeqCst);
    println!("{rounds} rounds sent, server grew by {grown_mib} MiB");
    job.kill_all();
    // The server holds at most 64 MiB of unsent answers (and a few socket buffers' worth).
    assert!(
        rounds < 300,
        "the server read all 300 rounds without its answers being read"
    );
    assert!(
        grown_mib < 128,
        "server memory grew by {grown_mib} MiB after {rounds} unread 1 MiB answers"
    );
}

#[test]
fn a_process_of_another_job_is_refused() {
    // Workers with the wrong secret never join: the rendezvous times out with an error.
    let port = util::free_port();
    let mk = |role: &str, secret: &str| {
        let mut c = std::process::Command::new(util::bin("examples/dist_check"));
        c.args(["seed", "dist_sync"])
            .env("DMLC_ROLE", role)
            .env("DMLC_PS_ROOT_URI", "127.0.0.1")
            .env("DMLC_PS_ROOT_PORT", port.to_string())
            .env("DMLC_NUM_SERVER", "1")
            .env("DMLC_NUM_WORKER", "1")
            .env("KVSTORE_SECRET", format!("{secret}-and-some-more-bytes"))
            .env("KVSTORE_TIMEOUT", "3")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        c.spawn().unwrap()
    };
    let sched = mk("scheduler", "right");
    let server = mk("server", "right");
    let worker = mk("worker", "wrong");
    let (code, out) = finish(worker, Duration::from_secs(20));
    assert_ne!(code, Some(0), "{out}");
    assert!(
        out.contains("does not know this job's secret (another job's, or not a kvstore scheduler)"),
        "{out}"
    );
    let (code, out) = finish(sched, Duration::from_secs(20));
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("registered"), "{out}");
    // The server, which proved the secret, waited for a worker that never came: an error.
    let (code, out) = finish(server, Duration::from_secs(20));
    assert_ne!(code, Some(0), "{out}");
}

#[test]
fn a_server_whose_scheduler_stops_answering_ends_naming_it() {
    // The scheduler answers each of a server's beats; stopped (SIGSTOP), it answers none, and
    // the server, which would otherwise wait for a shutdown for good, ends with an error
    // naming it within three of its beats (1 s each at its timeout of 8 s, long enough that a
    // loaded machine's stall is not taken for a stop; the scheduler's, and the raw worker's,
    // which does not beat, stay long).
    let mut job = util::ManualJob::start_servers_with(
        1,
        0,
        1,
        &["seed", "dist_sync"],
        &[],
        &[("KVSTORE_TIMEOUT", "8")],
    );
    std::thread::sleep(Duration::from_secs(2));
    if let Ok(Some(_)) = job.servers[0].try_wait() {
        let server = job.servers.remove(0);
        panic!("{:?}", util::finish(server, Duration::from_secs(5)));
    }
    let _s = raw_worker(job.port);
    // The job is running: the server serves, the scheduler answers its beats.
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        job.servers[0].try_wait().unwrap().is_none(),
        "the server ended early"
    );
    let sched = job
        .scheduler
        .as_ref()
        .expect("the scheduler")
        .id()
        .to_string();
    std::process::Command::new("kill")
        .args(["-STOP", &sched])
        .status()
        .unwrap();
    let server = job.servers.remove(0);
    let (code, out) = util::finish(server, Duration::from_secs(60));
    std::process::Command::new("kill")
        .args(["-CONT", &sched])
        .status()
        .unwrap();
    job.kill_all();
    assert_ne!(code, Some(0), "{out}");
    assert!(
        out.contains("lost the scheduler: no heartbeat for 3.0 s"),
        "{out}"
    );
}

#[test]
fn idle_connections_of_a_stranger_do_not_keep_a_node_from_joining() {
    // More silent connections than the scheduler keeps handshakes for: a node that joins
    // after them takes the place of one of them, not a refusal.
    let mut job = util::ManualJob::start_some(1, 0, 1, &["seed", "dist_sync"], &[]);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let idle: Vec<std::net::TcpStream> = (0..100)
        .map(|_| loop {
            match std::net::TcpStream::connect(("127.0.0.1", job.port)) {
                Ok(s) => break s,
                Err(e) if std::time::Instant::now() > deadline => panic!("{e}"),
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        })
        .collect();
    std::thread::sleep(Duration::from_millis(100));
    let _s = raw_worker(job.port);
    drop(idle);
    job.kill_all();
}

#[test]
fn a_hello_that_claims_a_beat_no_node_has_is_judged_by_the_longest_one() {
    // Each node's hello says its beat period, and the scheduler judges its silence by three
    // of them; a period past the longest any node beats (5 s) is not believed: a worker that
    // claims 2^32-1 ms and never beats is lost within 15 s, not months, and the job ends
    // naming it.
    let mut job = util::ManualJob::start_some(1, 0, 1, &["seed", "dist_sync"], &[]);
    let t0 = std::time::Instant::now();
    let j = raw_join_saying(job.port, "-\n-\n-\n-\n4294967295", false);
    let server = job.servers.remove(0);
    let (code, out) = util::finish(server, Duration::from_secs(60));
    drop(j);
    job.kill_all();
    assert_ne!(code, Some(0), "{out}");
    assert!(
        out.contains("worker 0 was lost (no heartbeat for 15.0 s"),
        "{:?}: {out}",
        t0.elapsed()
    );
}
