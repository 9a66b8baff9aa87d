//! The server process: a mio loop that moves frames between sockets and [`ServerState`].

use std::io;
use std::net::{SocketAddr, TcpListener};
use std::time::{Duration, Instant};

use kvstore_transport::tcp::{FrameReader, FrameSink, OutQueue};
use kvstore_transport::{FrameHeader, TransportError};
use mio::net::{TcpListener as MioListener, TcpStream};
use mio::{Events, Interest, Poll, Token};

use super::proto::{Msg, Op};
use super::server_state::{Out, Payload, PeerId, ServerState};
use super::{join, Config};
use crate::config::secret_matches;
use crate::{DType, KvError, NDArray, Result};

const LISTENER: Token = Token(0);
const SCHEDULER: Token = Token(1);
const FIRST_CONN: usize = 2;
/// Largest control payload (hello, names, optimizer parameters, error text).
const MAX_CONTROL: u64 = 64 * 1024;

struct Conn {
    stream: TcpStream,
    reader: FrameReader,
    out: OutQueue<Payload>,
}

/// Hands frames of one connection to the state machine.
struct ConnSink<'a> {
    state: &'a mut ServerState,
    peer: PeerId,
    conn: &'a mut ConnFields,
    secret: &'a [u8],
    taken: &'a mut Vec<bool>,
}

/// The parts of a connection the sink needs (the reader and stream are borrowed apart).
struct ConnFields {
    /// The worker rank, once the hello was accepted.
    worker: Option<usize>,
    bye: bool,
    /// Receive buffer for payloads, reused from frame to frame.
    scratch: NDArray,
    cur: Option<Msg>,
}

fn refuse(why: impl Into<String>) -> TransportError {
    TransportError::Refused(why.into())
}

impl FrameSink for ConnSink<'_> {
    fn on_header(&mut self, h: &FrameHeader) -> std::result::Result<(), TransportError> {
        let m = Msg::decode(&h.meta).map_err(|e| refuse(e.to_string()))?;
        let authed = self.conn.worker.is_some();
        if authed == (m.op == Op::Hello) {
            return Err(refuse(if authed {
                "second hello on a connection"
            } else {
                "the first frame must be a hello"
            }));
        }
        let control = |len: u64| {
            if len > MAX_CONTROL {
                Err(refuse(format!("{:?} with {len} bytes of payload", m.op)))
            } else {
                Ok(())
            }
        };
        match m.op {
            op if op.carries_data() => {
                if m.data_bytes() != Some(h.payload_len) {
                    return Err(refuse(format!(
                        "{:?} of {} {} elements with {} bytes of payload",
                        m.op, m.len, m.dtype, h.payload_len
                    )));
                }
                self.conn.scratch.reset_as(&[m.len as usize], m.dtype);
            }
            Op::Hello | Op::SetOptimizer | Op::SetUpdater | Op::Bye => {
                control(h.payload_len)?;
                self.conn
                    .scratch
                    .reset_as(&[h.payload_len as usize], DType::U8);
            }
            Op::Pull => {
                if h.payload_len != 0 {
                    return Err(refuse("a pull has no payload"));
                }
                self.conn.scratch.reset_as(&[0], DType::U8);
            }
            other => return Err(refuse(format!("a server does not take {other:?}"))),
        }
        self.conn.cur = Some(m);
        Ok(())
    }

    fn payload_dest(&mut self, _h: &FrameHeader) -> &mut [u8] {
        self.conn.scratch.as_bytes_mut()
    }

    fn on_frame(&mut self, _h: &FrameHeader) -> std::result::Result<(), TransportError> {
        let Some(m) = self.conn.cur.take() else {
            return Err(refuse("frame without header"));
        };
        match m.op {
            Op::Hello => {
                let payload = self.conn.scratch.as_bytes();
                let secret = payload.split(|&b| b == b'\n').next().unwrap_or(&[]);
                if !secret_matches(secret, self.secret) {
                    return Err(refuse("wrong job secret"));
                }
                let w = m.sender as usize;
                if w >= self.taken.len() || self.taken[w] {
                    return Err(refuse(format!("worker rank {w} is invalid or taken")));
                }
                self.taken[w] = true;
                self.conn.worker = Some(w);
                let mut ack = Msg::new(Op::HelloAck);
                ack.req_id = m.req_id;
                self.state.outbox.push(Out {
                    to: self.peer,
                    msg: ack,
                    payload: Payload::None,
                });
            }
            Op::Bye => self.conn.bye = true,
            _ => {
                let w = self.conn.worker.unwrap_or(usize::MAX);
                self.state.handle(self.peer, w, &m, &mut self.conn.scratch);
            }
        }
        Ok(())
    }
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
    let roster = join(cfg, &mut sched_std, super::proto::role::SERVER, Some(addr))?;
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

    let mut state = ServerState::new(num_workers, sync);
    let mut conns: Vec<Option<(Conn, ConnFields)>> = Vec::new();
    let mut taken = vec![false; num_workers];
    let secret = cfg.secret.as_bytes().to_vec();
    let mut outcome: Option<Result<()>> = None;
    let mut stop_by: Option<Instant> = None;

    loop {
        let timeout = Duration::from_millis(200);
        if let Err(e) = poll.poll(&mut events, Some(timeout)) {
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e.into());
            }
        }
        for ev in events.iter() {
            match ev.token() {
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
                    let Some(Some((c, f))) = conns.get_mut(slot) else {
                        continue;
                    };
                    let mut closed: Option<TransportError> = None;
                    if ev.is_readable() || ev.is_read_closed() {
                        let mut sink = ConnSink {
                            state: &mut state,
                            peer: slot,
                            conn: f,
                            secret: &secret,
                            taken: &mut taken,
                        };
                        if let Err(e) = c.reader.read_from(&mut c.stream, &mut sink) {
                            closed = Some(e);
                        }
                    }
                    if let Some(e) = closed {
                        if let Some(w) = f.worker {
                            taken[w] = false;
                            if !f.bye {
                                let why = match e {
                                    TransportError::Closed | TransportError::Truncated { .. } => {
                                        format!("worker {w} disconnected")
                                    }
                                    other => format!("connection of worker {w} closed: {other}"),
                                };
                                state.worker_lost(&why);
                            }
                        }
                        let _ = poll.registry().deregister(&mut c.stream);
                        state.forget_peer(slot);
                        conns[slot] = None;
                    }
                }
            }
        }
        // Route the state machine's answers, then write what can be written.
        for o in state.outbox.drain(..) {
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
            if c.out.flush(&mut c.stream, |p| p.bytes()).is_err() {
                let _ = poll.registry().deregister(&mut c.stream);
                conns[slot] = None;
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
