//! A peer written to the wire protocol by hand, as the tests that play a worker (wire.rs,
//! wire_batches.rs) need one: frames, the handshakes with the scheduler and a server.

use std::time::Duration;

/// Writes one message as the TCP backend frames it: a body, then optionally data.
pub fn send_msg(
    s: &mut std::net::TcpStream,
    body: &[u8],
    data: Option<&[u8]>,
) -> std::io::Result<()> {
    use std::io::Write;
    let h = kvstore_transport::tcp::msg_frame_header(body.len(), data.map(|d| d.len()));
    s.write_all(&h)?;
    s.write_all(body)?;
    if let Some(d) = data {
        s.write_all(d)?;
    }
    Ok(())
}

/// Reads one message frame from a server and decodes its header.
pub fn read_msg(s: &mut std::net::TcpStream) -> kvstore::protocol::Msg {
    use kvstore_transport::tcp::blocking::read_frame;
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let (_, body) = read_frame(s, 1 << 20, Some(deadline)).unwrap();
    let meta: [u8; kvstore_transport::META_LEN] =
        body[..kvstore_transport::META_LEN].try_into().unwrap();
    kvstore::protocol::Msg::decode(&meta).unwrap()
}

/// A worker played by the test over raw frames: it joins, connects to server 0, and then only
/// writes. Returns the stream to the server.
pub fn raw_worker(port: u16) -> std::net::TcpStream {
    let j = raw_join(port);
    let server = raw_hello(&j.server, j.rank, &j.token).expect("the server's acknowledgement");
    // The scheduler connection stays open for the job's life (closing it is leaving).
    std::mem::forget(j.sched);
    server
}

/// A worker's place in a job, as a raw peer got it from the scheduler.
pub struct Joined {
    pub sched: std::net::TcpStream,
    pub server: String,
    pub rank: usize,
    pub token: [u8; kvstore::auth::MAC],
}

/// Joins a job as a worker over raw frames: the handshake with the scheduler, then the roster.
pub fn raw_join(port: u16) -> Joined {
    raw_join_saying(port, "-\n-\n-\n-", true)
}

/// [`raw_join`], with `rest` as the hello's lines after its nonce (address, host, RDMA, shared
/// memory, beat period), beating every 200 ms if `beats`.
pub fn raw_join_saying(port: u16, rest: &str, beats: bool) -> Joined {
    use kvstore::auth;
    use kvstore::protocol::{role, Msg, Op};
    use kvstore_transport::tcp::blocking::{read_frame, write_frame};
    use kvstore_transport::FrameHeader;
    let mut m = Msg::new(Op::Hello);
    m.key = role::WORKER;
    let secret = super::SECRET.as_bytes();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let mut sched = loop {
        match std::net::TcpStream::connect(("127.0.0.1", port)) {
            Ok(s) => break s,
            Err(_) if std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20))
            }
            Err(e) => panic!("no scheduler: {e}"),
        }
    };
    // The scheduler speaks plain frames: the handshake, then the roster.
    let nonce = auth::random::<{ auth::NONCE }>().unwrap();
    let payload = format!("{}\n{rest}", auth::hex(&nonce));
    write_frame(
        &mut sched,
        &FrameHeader::new(m.encode(), payload.len() as u64),
        payload.as_bytes(),
    )
    .unwrap();
    let (_, challenge) = read_frame(&mut sched, 1 << 20, Some(deadline)).unwrap();
    let challenge = String::from_utf8(challenge).unwrap();
    let theirs = auth::unhex::<{ auth::NONCE }>(challenge.lines().next().unwrap()).unwrap();
    let claim = auth::hello_claim(m.key, m.sender, rest);
    let proof = auth::proof(&[secret], auth::Side::Initiator, &nonce, &theirs, &claim);
    write_frame(
        &mut sched,
        &FrameHeader::new(Msg::new(Op::Proof).encode(), proof.len() as u64),
        &proof,
    )
    .unwrap();
    let (_, roster) = read_frame(&mut sched, 1 << 20, Some(deadline)).unwrap();
    let roster = String::from_utf8(roster).unwrap();
    let addr = roster
        .lines()
        .nth(1)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap();
    let token = roster
        .lines()
        .find_map(|l| l.strip_prefix("token "))
        .and_then(auth::unhex::<{ auth::MAC }>)
        .unwrap();
    let token = auth::xor(&token, &auth::token_mask(secret, &nonce, &theirs));
    let rank: usize = roster.split_whitespace().next().unwrap().parse().unwrap();
    // A live process beats: without it the scheduler takes this peer for stopped.
    let mut beat = sched.try_clone().unwrap();
    if beats {
        std::thread::spawn(move || loop {
            std::thread::sleep(Duration::from_millis(200));
            let h = FrameHeader::new(Msg::new(Op::Heartbeat).encode(), 0);
            if write_frame(&mut beat, &h, &[]).is_err() {
                return;
            }
        });
    }
    Joined {
        sched,
        server: addr.to_string(),
        rank,
        token,
    }
}

/// The handshake with a server as worker `rank` with `token`: the link, or why the server
/// refused it.
pub fn raw_hello(
    addr: &str,
    rank: usize,
    token: &[u8; kvstore::auth::MAC],
) -> Result<std::net::TcpStream, String> {
    use kvstore::auth;
    use kvstore::protocol::{role, Msg, Op};
    let secret = super::SECRET.as_bytes();
    // A server speaks the TCP backend's messages: the same handshake, keyed also by the
    // rank's token.
    let mut server = std::net::TcpStream::connect(addr).unwrap();
    let mut m = Msg::new(Op::Hello);
    m.key = role::WORKER;
    m.sender = rank as u32;
    let nonce = auth::random::<{ auth::NONCE }>().unwrap();
    let mut body = m.encode().to_vec();
    body.extend_from_slice(&nonce);
    send_msg(&mut server, &body, None).unwrap();
    let (c, rest) = try_read_body(&mut server).map_err(|e| format!("no challenge: {e}"))?;
    if c.op != Op::Challenge {
        return Err(format!("answered the hello with {:?}", c.op));
    }
    let theirs: [u8; auth::NONCE] = rest[..auth::NONCE].try_into().unwrap();
    let claim = auth::worker_claim(rank);
    let proof = auth::proof(
        &[secret, token],
        auth::Side::Initiator,
        &nonce,
        &theirs,
        &claim,
    );
    let mut p = Msg::new(Op::Proof);
    p.key = role::WORKER;
    p.sender = rank as u32;
    let mut body = p.encode().to_vec();
    body.extend_from_slice(&proof);
    send_msg(&mut server, &body, None).unwrap();
    use kvstore_transport::tcp::blocking::read_frame;
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    match read_frame(&mut server, 1 << 20, Some(deadline)) {
        Ok((_, b)) if b.len() >= kvstore_transport::META_LEN => {
            let meta: [u8; kvstore_transport::META_LEN] =
                b[..kvstore_transport::META_LEN].try_into().unwrap();
            match Msg::decode(&meta) {
                Ok(a) if a.op == Op::HelloAck => Ok(server),
                other => Err(format!("answered {other:?}")),
            }
        }
        Ok(_) => Err("a short answer".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// Reads one message frame from a server: its header and the body after it.
pub fn try_read_body(
    s: &mut std::net::TcpStream,
) -> Result<(kvstore::protocol::Msg, Vec<u8>), String> {
    use kvstore_transport::tcp::blocking::read_frame;
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let (_, body) = read_frame(s, 1 << 20, Some(deadline)).map_err(|e| e.to_string())?;
    let meta: [u8; kvstore_transport::META_LEN] = body
        .get(..kvstore_transport::META_LEN)
        .and_then(|m| m.try_into().ok())
        .ok_or("a short message")?;
    let m = kvstore::protocol::Msg::decode(&meta).map_err(|e| e.to_string())?;
    Ok((m, body[kvstore_transport::META_LEN..].to_vec()))
}

/// The header of a request for a whole 1-D f32 value of `n` elements under `key`.
pub fn f32_msg(op: kvstore::protocol::Op, key: u64, n: u64, id: u64) -> kvstore::protocol::Msg {
    let mut m = kvstore::protocol::Msg::new(op);
    m.key = key;
    m.dtype = kvstore::DType::F32;
    m.ndim = 1;
    m.shape[0] = n;
    m.total = n;
    m.len = n;
    m.req_id = id;
    m
}
