//! A server's TCP connections from workers: frames go to the state machine, and reading
//! pauses while a connection's unsent answers are over [`MAX_BACKLOG`] (backpressure).

use kvstore_transport::tcp::{FrameReader, FrameSink, OutQueue};
use kvstore_transport::{FrameHeader, TransportError};
use mio::net::TcpStream;
use mio::Poll;

use crate::config::secret_matches;
use crate::protocol::{Msg, Op};
use crate::server::state::{Input, Out, Payload, PeerId, ServerState};
use crate::{DType, NDArray};

/// Largest control payload (hello, names, optimizer parameters, error text).
pub(super) const MAX_CONTROL: u64 = 64 * 1024;
/// Bytes of answers a connection may have waiting to be sent before the server stops reading
/// its requests (backpressure); it reads again once they are below half of this.
pub(super) const MAX_BACKLOG: usize = 64 << 20;

pub(super) struct Conn {
    pub(super) stream: TcpStream,
    pub(super) reader: FrameReader,
    pub(super) out: OutQueue<Payload>,
}

/// Hands frames of one connection to the state machine.
pub(super) struct ConnSink<'a> {
    pub(super) state: &'a mut ServerState,
    pub(super) peer: PeerId,
    pub(super) conn: &'a mut ConnFields,
    pub(super) secret: &'a [u8],
    pub(super) taken: &'a mut Vec<bool>,
    /// Bytes of answers this connection may still queue before reading pauses.
    pub(super) budget: usize,
}

/// The parts of a connection the sink needs (the reader and stream are borrowed apart).
pub(super) struct ConnFields {
    /// The worker rank, once the hello was accepted.
    pub(super) worker: Option<usize>,
    pub(super) bye: bool,
    /// Receive buffer for payloads, reused from frame to frame.
    pub(super) scratch: NDArray,
    pub(super) cur: Option<Msg>,
    /// Reading is paused until the answers queued for this connection drain.
    pub(super) paused: bool,
}

pub(super) fn refuse(why: impl Into<String>) -> TransportError {
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
                let before = self.state.outbox.len();
                self.state
                    .handle(self.peer, w, &m, Input::Owned(&mut self.conn.scratch));
                let queued: usize = self.state.outbox[before..]
                    .iter()
                    .filter(|o| o.to == self.peer)
                    .map(|o| kvstore_transport::HEADER_LEN + o.payload.bytes().len())
                    .sum();
                self.budget = self.budget.saturating_sub(queued);
            }
        }
        Ok(())
    }

    fn wants_more(&self) -> bool {
        self.budget > 0
    }
}

/// Takes what a connection has sent, until it would block or its queued answers reach
/// [`MAX_BACKLOG`] (then it is paused); closes it on an error or end of stream.
pub(super) fn read_conn(
    poll: &Poll,
    conns: &mut [Option<(Conn, ConnFields)>],
    slot: usize,
    state: &mut ServerState,
    secret: &[u8],
    taken: &mut Vec<bool>,
) {
    let Some(Some((c, f))) = conns.get_mut(slot) else {
        return;
    };
    let budget = MAX_BACKLOG.saturating_sub(c.out.pending_bytes());
    let mut sink = ConnSink {
        state,
        peer: slot,
        conn: f,
        secret,
        taken,
        budget,
    };
    let res = c.reader.read_from(&mut c.stream, &mut sink);
    let paused = sink.budget == 0;
    let Err(e) = res else {
        f.paused = paused;
        return;
    };
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
