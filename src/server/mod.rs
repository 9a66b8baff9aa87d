//! The server process: a mio loop that moves frames between sockets and [`ServerState`].

mod conn;
pub(crate) mod state;

use std::io;
use std::net::{SocketAddr, TcpListener};
use std::time::{Duration, Instant};

use kvstore_transport::tcp::{FrameReader, FrameSink, OutQueue};
use kvstore_transport::{FrameHeader, TransportError};
use mio::net::{TcpListener as MioListener, TcpStream};
use mio::{Events, Interest, Poll, Token};

use crate::config::Config;
use crate::protocol::{Msg, Op};
use crate::roles::join;
use crate::server::state::{Input, Out, Payload, PeerId, ServerState};
use crate::shm_link::{self as shm, ServerLink};
use crate::{DType, KvError, NDArray, Result};

const LISTENER: Token = Token(0);
const SCHEDULER: Token = Token(1);
const FIRST_CONN: usize = 2;
/// Tokens of the shared-memory listener and links (two each: socket, doorbell).
const SHM_LISTENER: Token = Token(1 << 30);
const SHM_TOKENS: usize = (1 << 30) + 1;
/// Peer ids of shared-memory links in the state machine.
const SHM_PEER: usize = 1 << 29;
/// How long the loop keeps polling the rings after the last descriptor before it sleeps.
const SPIN: Duration = Duration::from_micros(200);
use crate::server::conn::{read_conn, refuse, Conn, ConnFields, MAX_BACKLOG, MAX_CONTROL};

fn drop_link(poll: &Poll, links: &mut [Option<ServerLink>], k: usize, state: &mut ServerState) {
    if let Some(l) = links.get_mut(k).and_then(Option::take) {
        let reg = poll.registry();
        let _ = reg.deregister(&mut mio::unix::SourceFd(&std::os::fd::AsRawFd::as_raw_fd(
            &l.sock,
        )));
        let _ = reg.deregister(&mut mio::unix::SourceFd(&std::os::fd::AsRawFd::as_raw_fd(
            &l.doorbell,
        )));
    }
    state.forget_peer(SHM_PEER + k);
}

/// One descriptor from a worker on this host: the payload is read where it lies in the worker's
/// pool; a region outside the pool, or not allocated, is refused with an error answer. An
/// unreadable descriptor closes the channel.
fn handle_desc(
    state: &mut ServerState,
    peer: PeerId,
    l: &mut ServerLink,
    slot: &[u8; kvstore_shm::SLOT],
) -> Result<()> {
    let d = shm::decode(slot)?;
    let m = d.msg;
    let refuse = |state: &mut ServerState, why: String| {
        let mut r = m;
        r.op = Op::Reply;
        r.status = crate::protocol::status::FAILED;
        state.outbox.push(Out {
            to: peer,
            msg: r,
            payload: Payload::Text(why.into_bytes()),
        });
    };
    if !matches!(
        m.op,
        Op::Init | Op::Push | Op::PushPull | Op::Pull | Op::SetOptimizer | Op::SetUpdater
    ) {
        return Err(KvError::Protocol(format!("{:?} over shared memory", m.op)));
    }
    let mut empty = NDArray::zeros_dtype(&[0], DType::U8);
    let pages = if d.payload_len == 0 {
        None
    } else {
        let Some(src) = d.src else {
            refuse(state, "a payload without a region".into());
            return Ok(());
        };
        let (len, dtype) = if m.op.carries_data() {
            if m.data_bytes() != Some(d.payload_len) {
                refuse(state, "payload length does not match the message".into());
                return Ok(());
            }
            (m.len as usize, m.dtype)
        } else {
            if d.payload_len > MAX_CONTROL {
                refuse(state, "oversized control payload".into());
                return Ok(());
            }
            (d.payload_len as usize, DType::U8)
        };
        match l.view(src, len, dtype) {
            Ok(v) => Some(v),
            Err(e) => {
                refuse(state, format!("bad descriptor: {e}"));
                return Ok(());
            }
        }
    };
    if matches!(m.op, Op::Pull | Op::PushPull) {
        let in_pool = d
            .dst
            .filter(|r| Some(r.len as u64) == m.data_bytes() && l.pool.check(*r).is_ok())
            .map(shm::Dest::Pool);
        // Or straight into the worker's memory, where the host allows it (checked at attach).
        let in_worker = d
            .dst_addr
            .filter(|&(_, len)| l.cma && Some(len as u64) == m.data_bytes())
            .map(|(a, len)| shm::Dest::Addr(a, len));
        match in_pool.or(in_worker) {
            Some(to) => {
                l.pulls.insert(m.req_id, to);
            }
            None => {
                refuse(
                    state,
                    "bad descriptor: no valid destination for the answer".into(),
                );
                return Ok(());
            }
        }
    }
    match &pages {
        Some(p) => state.handle(peer, l.worker, &m, Input::Peer(p)),
        None => state.handle(peer, l.worker, &m, Input::Owned(&mut empty)),
    }
    Ok(())
}

/// What the scheduler said.
enum SchedEvent {
    Shutdown,
    Abort(String),
}

struct SchedSink {
    event: Option<SchedEvent>,
    cur: Option<Msg>,
    buf: Vec<u8>,
}

impl FrameSink for SchedSink {
    fn on_header(&mut self, h: &FrameHeader) -> std::result::Result<(), TransportError> {
        let m = Msg::decode(&h.meta).map_err(|e| refuse(e.to_string()))?;
        if h.payload_len > MAX_CONTROL {
            return Err(refuse("oversized control frame"));
        }
        self.buf.resize(h.payload_len as usize, 0);
        self.cur = Some(m);
        Ok(())
    }
    fn payload_dest(&mut self, _h: &FrameHeader) -> &mut [u8] {
        &mut self.buf
    }
    fn on_frame(&mut self, _h: &FrameHeader) -> std::result::Result<(), TransportError> {
        match self.cur.take().map(|m| m.op) {
            Some(Op::Shutdown) => self.event = Some(SchedEvent::Shutdown),
            Some(Op::Abort) => {
                self.event = Some(SchedEvent::Abort(
                    String::from_utf8_lossy(&self.buf).into_owned(),
                ))
            }
            _ => {}
        }
        Ok(())
    }
}

/// Runs a server until the scheduler ends the job. `Ok` on a normal shutdown; an error if the
/// job was aborted or a peer was lost.
pub fn run_server(cfg: &Config, sync: bool) -> Result<()> {
    let mut sched_std = kvstore_transport::tcp::connect_retry(cfg.root, cfg.timeout)?;
    let ip = match &cfg.node_host {
        Some(h) => h
            .parse()
            .map_err(|_| KvError::Config(format!("DMLC_NODE_HOST={h:?} is not an IP address")))?,
        None => sched_std.local_addr()?.ip(),
    };
    let listener = TcpListener::bind(SocketAddr::new(ip, 0))?;
    let addr = listener.local_addr()?;
    let roster = join(
        cfg,
        &mut sched_std,
        crate::protocol::role::SERVER,
        Some(addr),
    )?;
    let num_workers = roster.num_workers;

    let mut poll = Poll::new()?;
    let mut events = Events::with_capacity(256);
    listener.set_nonblocking(true)?;
    let mut listener = MioListener::from_std(listener);
    poll.registry()
        .register(&mut listener, LISTENER, Interest::READABLE)?;
    sched_std.set_nonblocking(true)?;
    let mut sched = TcpStream::from_std(sched_std);
    poll.registry()
        .register(&mut sched, SCHEDULER, Interest::READABLE)?;
    let mut sched_reader = FrameReader::new(MAX_CONTROL);
    let mut sched_sink = SchedSink {
        event: None,
        cur: None,
        buf: Vec::new(),
    };

    // Workers on this host attach over shared memory through this listener.
    let shm_listener = match shm::listen(addr.port(), &cfg.secret) {
        Ok(l) => {
            l.set_nonblocking(true)?;
            let mut l = mio::net::UnixListener::from_std(l);
            poll.registry()
                .register(&mut l, SHM_LISTENER, Interest::READABLE)?;
            Some(l)
        }
        Err(e) => {
            eprintln!("kvstore server: no shared-memory listener ({e}); workers use TCP");
            None
        }
    };
    let mut links: Vec<Option<ServerLink>> = Vec::new();
    let mut last_shm = Instant::now();

    let mut state = ServerState::new(num_workers, sync);
    let mut conns: Vec<Option<(Conn, ConnFields)>> = Vec::new();
    let mut taken = vec![false; num_workers];
    let secret = cfg.secret.as_bytes().to_vec();
    let mut outcome: Option<Result<()>> = None;
    let mut stop_by: Option<Instant> = None;

    loop {
        // Answers waiting for room (in a ring, or after a resumed read) are looked at again
        // soon; a worker that reads nothing costs a wake-up per millisecond, not a spin.
        let waiting = !state.outbox.is_empty()
            || links.iter().flatten().any(|l| !l.backlog.is_empty())
            || conns.iter().flatten().any(|(_, f)| f.paused);
        let mut timeout = if waiting {
            Duration::from_millis(1)
        } else {
            Duration::from_millis(200)
        };
        let mut armed = Vec::new();
        if links.iter().any(Option::is_some) {
            if last_shm.elapsed() < SPIN {
                timeout = Duration::ZERO;
            } else {
                // Say we sleep; the workers ring the doorbell (in this poll set) when they post.
                for (k, l) in links.iter().enumerate() {
                    if let Some(l) = l {
                        match l.chan.arm_rx() {
                            Ok(true) => armed.push(k),
                            _ => timeout = Duration::ZERO,
                        }
                    }
                }
            }
        }
        let mut ring_ready = false;
        if timeout.is_zero() && armed.is_empty() && links.iter().any(Option::is_some) {
            // Spinning: watch the rings without a system call for a little while, so a
            // descriptor is taken the moment it lands (sockets are checked in between).
            let until = Instant::now() + Duration::from_micros(20);
            loop {
                ring_ready = links.iter().flatten().any(|l| l.chan.rx_pending());
                if ring_ready || Instant::now() >= until {
                    break;
                }
                std::hint::spin_loop();
            }
        }
        if ring_ready {
            events.clear();
        } else if let Err(e) = poll.poll(&mut events, Some(timeout)) {
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e.into());
            }
        }
        if timeout.is_zero()
            && !ring_ready
            && events.is_empty()
            && links.iter().flatten().count() + 1 > crate::worker::cores()
        {
            // Spinning with more processes here than cores: let a worker run meanwhile.
            std::thread::yield_now();
        }
        for k in armed {
            if let Some(Some(l)) = links.get(k) {
                let _ = l.chan.disarm_rx();
            }
        }
        for ev in events.iter() {
            match ev.token() {
                SHM_LISTENER => {
                    let Some(l) = &shm_listener else { continue };
                    while let Ok((s, _)) = l.accept() {
                        let s: std::os::unix::net::UnixStream = s.into();
                        let _ = s.set_nonblocking(false);
                        match shm::accept(s, &cfg.secret, num_workers) {
                            Ok(link) => {
                                let k = links
                                    .iter()
                                    .position(Option::is_none)
                                    .unwrap_or(links.len());
                                let reg = poll.registry();
                                let sock_fd = std::os::fd::AsRawFd::as_raw_fd(&link.sock);
                                let bell_fd = std::os::fd::AsRawFd::as_raw_fd(&link.doorbell);
                                if reg
                                    .register(
                                        &mut mio::unix::SourceFd(&sock_fd),
                                        Token(SHM_TOKENS + 2 * k),
                                        Interest::READABLE,
                                    )
                                    .and_then(|_| {
                                        reg.register(
                                            &mut mio::unix::SourceFd(&bell_fd),
                                            Token(SHM_TOKENS + 2 * k + 1),
                                            Interest::READABLE,
                                        )
                                    })
                                    .is_err()
                                {
                                    continue;
                                }
                                if k == links.len() {
                                    links.push(Some(link));
                                } else {
                                    links[k] = Some(link);
                                }
                                last_shm = Instant::now();
                            }
                            Err(e) => {
                                eprintln!("kvstore server: refused a shared-memory channel: {e}")
                            }
                        }
                    }
                }
                Token(t) if t >= SHM_TOKENS => {
                    let k = (t - SHM_TOKENS) / 2;
                    let Some(Some(l)) = links.get(k) else {
                        continue;
                    };
                    if (t - SHM_TOKENS) % 2 == 1 {
                        shm::drain(&l.doorbell);
                    } else if l.closed() {
                        // The worker's TCP connection says whether this was a clean exit.
                        drop_link(&poll, &mut links, k, &mut state);
                    }
                }
                LISTENER => loop {
                    match listener.accept() {
                        Ok((mut stream, _)) => {
                            let _ = stream.set_nodelay(true);
                            let slot = conns
                                .iter()
                                .position(Option::is_none)
                                .unwrap_or(conns.len());
                            let token = Token(FIRST_CONN + slot);
                            if poll
                                .registry()
                                .register(
                                    &mut stream,
                                    token,
                                    Interest::READABLE | Interest::WRITABLE,
                                )
                                .is_err()
                            {
                                continue;
                            }
                            let c = Conn {
                                stream,
                                reader: FrameReader::new(cfg.max_message),
                                out: OutQueue::new(),
                            };
                            let f = ConnFields {
                                worker: None,
                                bye: false,
                                scratch: NDArray::zeros_dtype(&[0], DType::U8),
                                cur: None,
                                paused: false,
                            };
                            if slot == conns.len() {
                                conns.push(Some((c, f)));
                            } else {
                                conns[slot] = Some((c, f));
                            }
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                        Err(_) => break,
                    }
                },
                SCHEDULER => {
                    let r = sched_reader.read_from(&mut sched, &mut sched_sink);
                    match sched_sink.event.take() {
                        Some(SchedEvent::Shutdown) => {
                            outcome.get_or_insert(Ok(()));
                        }
                        Some(SchedEvent::Abort(why)) => {
                            state.fail(&format!("job aborted: {why}"));
                            outcome.get_or_insert(Err(KvError::Aborted(why)));
                        }
                        None => {}
                    }
                    if let Err(e) = r {
                        if outcome.is_none() {
                            let why = format!("lost the scheduler: {e}");
                            state.fail(&why);
                            outcome = Some(Err(KvError::PeerLost(why)));
                        }
                        let _ = poll.registry().deregister(&mut sched);
                    }
                }
                Token(t) => {
                    let slot = t - FIRST_CONN;
                    let paused = matches!(conns.get(slot), Some(Some((_, f))) if f.paused);
                    if (ev.is_readable() || ev.is_read_closed()) && !paused {
                        read_conn(&poll, &mut conns, slot, &mut state, &secret, &mut taken);
                    }
                }
            }
        }
        // Descriptors from workers on this host.
        for k in 0..links.len() {
            let Some(Some(l)) = links.get_mut(k) else {
                continue;
            };
            let mut slot = [0u8; kvstore_shm::SLOT];
            while !l.backlogged() {
                match l.chan.try_recv(&mut slot) {
                    Ok(true) => {
                        last_shm = Instant::now();
                        if let Err(e) = handle_desc(&mut state, SHM_PEER + k, l, &slot) {
                            eprintln!("kvstore server: closing the shared-memory channel of worker {}: {e}", l.worker);
                            drop_link(&poll, &mut links, k, &mut state);
                            break;
                        }
                    }
                    Ok(false) => break,
                    Err(e) => {
                        eprintln!(
                            "kvstore server: corrupt channel of worker {}: {e}",
                            l.worker
                        );
                        drop_link(&poll, &mut links, k, &mut state);
                        break;
                    }
                }
            }
        }
        // Route the state machine's answers, then write what can be written.
        for o in state.outbox.drain(..) {
            if o.to >= SHM_PEER {
                let k = o.to - SHM_PEER;
                if let Some(Some(l)) = links.get_mut(k) {
                    let (data, text): (&[u8], &[u8]) = match &o.payload {
                        Payload::Array(a) => (a.as_bytes(), &[]),
                        Payload::Text(t) => (&[], t),
                        Payload::None => (&[], &[]),
                    };
                    if let Err(e) = l.answer(&o.msg, data, text) {
                        eprintln!(
                            "kvstore server: cannot answer worker {} over shared memory: {e}",
                            l.worker
                        );
                    }
                }
                continue;
            }
            if let Some(Some((c, _))) = conns.get_mut(o.to) {
                c.out.push(o.msg.header(o.payload.bytes().len()), o.payload);
            }
        }
        for slot in 0..conns.len() {
            let Some(Some((c, _))) = conns.get_mut(slot) else {
                continue;
            };
            if c.out.is_empty() {
                continue;
            }
            if c.out.flush(&mut c.stream).is_err() {
                let _ = poll.registry().deregister(&mut c.stream);
                conns[slot] = None;
            }
        }
        // Connections paused for backpressure read again once their answers drained; what
        // they had sent meanwhile is still in the socket, so it is read now, not on an event.
        for slot in 0..conns.len() {
            let resume = matches!(conns.get(slot), Some(Some((c, f)))
                if f.paused && c.out.pending_bytes() < MAX_BACKLOG / 2);
            if resume {
                read_conn(&poll, &mut conns, slot, &mut state, &secret, &mut taken);
            }
        }
        for k in 0..links.len() {
            if let Some(Some(l)) = links.get_mut(k) {
                if let Err(e) = l.flush() {
                    eprintln!(
                        "kvstore server: corrupt channel of worker {}: {e}",
                        l.worker
                    );
                    drop_link(&poll, &mut links, k, &mut state);
                }
            }
        }
        if let Some(why) = state.failed() {
            if outcome.is_none() {
                outcome = Some(Err(KvError::PeerLost(why.to_string())));
            }
        }
        if outcome.is_some() {
            let deadline = *stop_by.get_or_insert_with(|| Instant::now() + Duration::from_secs(2));
            let pending = conns.iter().flatten().any(|(c, _)| !c.out.is_empty());
            if !pending || Instant::now() >= deadline {
                return outcome.unwrap_or(Ok(()));
            }
        }
    }
}

#[cfg(test)]
mod tests;
