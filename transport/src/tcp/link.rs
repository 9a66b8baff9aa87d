//! A TCP peer's link: the frames queued for it (written with `writev` straight from the
//! caller's memory) and the sink that takes its frames apart (a message into one buffer, a put
//! straight into the granted memory).

use rustc_hash::FxHashMap;
use std::collections::VecDeque;
use std::io;
use std::ops::Range;

use mio::net::TcpStream;

use super::{FrameReader, FrameSink, OutQueue, Payload};
use crate::frame::{FrameHeader, META_LEN};
use crate::{Completion, Lent, PeerId, Region, Token, TransportError};

pub(super) const MSG: u8 = 1;
pub(super) const PUT: u8 = 2;
/// The largest message body.
pub const MAX_BODY: usize = 64 * 1024;

/// What follows a frame's header: a body of its own, and data in registered memory, with the
/// token that completes once the frame is in the kernel.
pub(super) struct Out {
    pub(super) body: Vec<u8>,
    pub(super) data: Option<(Region, Range<usize>)>,
    pub(super) token: Option<Token>,
}

impl Payload for Out {
    fn parts(&self) -> [&[u8]; 2] {
        [&self.body, data_slice(&self.data)]
    }
}

/// The bytes of a queued frame's data. Safe to view: the caller of `send`/`put` promised not to
/// write them until the token completes, and the region holds the storage alive.
pub(super) fn data_slice(d: &Option<(Region, Range<usize>)>) -> &[u8] {
    match d {
        // SAFETY: the range was checked against the region when posted; the storage is valid
        // and unwritten while queued (the caller's side of `send`/`put`).
        Some((r, range)) => unsafe {
            std::slice::from_raw_parts(r.mem.ptr().add(range.start), range.len())
        },
        None => &[],
    }
}

#[derive(Default)]
pub(crate) struct Rx {
    pub(super) buf: Vec<u8>,
    pub(super) scratch: Vec<u8>,
    pub(super) kind: u8,
    pub(super) body_len: usize,
    pub(super) has_data: bool,
    /// The message's data is read and dropped (its admission said so): it is delivered
    /// without it.
    pub(super) drop_data: bool,
    /// The put in progress: grant, offset, immediate, and whether the grant is live.
    pub(super) put: Option<(u64, usize, u32, bool)>,
}

pub(super) struct Peer {
    pub(super) stream: TcpStream,
    pub(super) reader: FrameReader,
    pub(super) rx: Rx,
    pub(super) out: OutQueue<Out>,
    /// Not read while set (backpressure).
    pub(super) paused: bool,
    /// A caller was told "would block" (its queue full) and has not been woken since to try
    /// again.
    pub(super) starved: bool,
}

pub(crate) struct Grant {
    pub(super) peer: PeerId,
    pub(super) region: Region,
    pub(super) range: Range<usize>,
}

pub(super) fn meta(kind: u8, has_data: bool, word: u32, grant: u64, offset: u64) -> [u8; META_LEN] {
    let mut m = [0u8; META_LEN];
    m[0] = kind;
    m[1] = has_data as u8;
    m[4..8].copy_from_slice(&word.to_le_bytes());
    m[8..16].copy_from_slice(&grant.to_le_bytes());
    m[16..24].copy_from_slice(&offset.to_le_bytes());
    m
}

/// The header of a put frame as this backend writes it, `len` bytes into grant `grant` at
/// `offset` with immediate `imm`: for tools and tests that play a peer by hand.
pub fn put_frame_header(grant: u64, offset: u64, imm: u32, len: usize) -> [u8; crate::HEADER_LEN] {
    crate::FrameHeader::new(meta(PUT, true, imm, grant, offset), len as u64).encode()
}

pub(super) fn word(m: &[u8; META_LEN], r: Range<usize>) -> u64 {
    let mut b = [0u8; 8];
    b[..r.len()].copy_from_slice(&m[r]);
    u64::from_le_bytes(b)
}

/// Writes what `p` has queued until the socket would block; written frames' tokens are done.
pub(super) fn write_out(
    p: &mut Peer,
    done: &mut VecDeque<(Token, Option<TransportError>)>,
) -> io::Result<()> {
    p.out.flush_each(&mut p.stream, |o| {
        if let Some(t) = o.token {
            done.push_back((t, None));
        }
    })?;
    Ok(())
}

pub(crate) struct Sink<'a> {
    pub(crate) peer: PeerId,
    pub(crate) rx: &'a mut Rx,
    pub(crate) grants: &'a FxHashMap<u64, Grant>,
    pub(crate) next_grant: u64,
    pub(crate) on: &'a mut dyn FnMut(Completion<'_>),
    pub(crate) n: &'a mut usize,
    /// Bytes this peer may still deliver in this progress call, so that one busy peer cannot
    /// keep the caller from answering (and from pausing it).
    pub(crate) budget: usize,
    /// Judges a message's body before its data is taken ([`crate::TcpBackend::set_admission`]).
    pub(crate) admit: Option<&'a mut Admission>,
}

/// Judges a message by its body and the bytes of data it brings, before they are read:
/// `Ok(true)` takes the data; `Ok(false)` reads the data and drops it, delivering the message
/// without it (for its owner to answer with an error: a well-formed request it cannot take);
/// an error refuses the message and closes the link.
pub type Admission = dyn FnMut(PeerId, &[u8], usize) -> Result<bool, String> + Send;

/// The largest receive buffer a link keeps between messages.
const KEEP: usize = 4 << 20;

/// Where unwanted bytes (a put into a revoked grant, data its admission dropped) are read,
/// 64 KiB at a time.
fn drain(scratch: &mut Vec<u8>, want: usize) -> &mut [u8] {
    let n = want.clamp(1, 64 * 1024);
    if scratch.len() < n {
        scratch.resize(n, 0);
    }
    &mut scratch[..n]
}

/// Bytes of frames taken from one peer per progress call.
pub(super) const READ_BUDGET: usize = 8 << 20;

impl FrameSink for Sink<'_> {
    fn wants_more(&self) -> bool {
        self.budget > 0
    }

    fn on_header(&mut self, h: &FrameHeader) -> Result<(), TransportError> {
        let len = h.payload_len as usize;
        self.budget = self.budget.saturating_sub(len.max(1) + crate::HEADER_LEN);
        self.rx.kind = h.meta[0];
        match h.meta[0] {
            MSG => {
                let body = word(&h.meta, 4..8) as usize;
                if body > len || body > MAX_BODY {
                    return Err(TransportError::Refused(format!(
                        "a body of {body} bytes in a frame of {len}"
                    )));
                }
                self.rx.body_len = body;
                self.rx.has_data = h.meta[1] != 0;
                self.rx.drop_data = false;
                if !self.rx.has_data && body != len {
                    return Err(TransportError::Refused(format!(
                        "a frame of {len} bytes with a body of {body} and no data"
                    )));
                }
                // Grown as the bytes arrive (`payload_dest`): a claim alone costs nothing.
                self.rx.buf.clear();
            }
            PUT => {
                let (grant, offset) = (word(&h.meta, 8..16), word(&h.meta, 16..24) as usize);
                let imm = word(&h.meta, 4..8) as u32;
                // No sender makes a wider immediate (RDMA could not carry it).
                crate::backend::check_imm(imm)?;
                let live = match self.grants.get(&grant) {
                    Some(g) if g.peer == self.peer => {
                        if offset.checked_add(len).is_none_or(|e| e > g.range.len()) {
                            return Err(TransportError::Refused(format!(
                                "a put of {len} bytes at {offset} into a grant of {}",
                                g.range.len()
                            )));
                        }
                        true
                    }
                    Some(_) => {
                        return Err(TransportError::Refused(format!(
                            "a put into grant {grant}, which is another peer's"
                        )))
                    }
                    // Revoked or forgotten: read into scratch, report nothing. A grant never
                    // issued is a protocol error.
                    _ if grant < self.next_grant => false,
                    _ => return Err(TransportError::Refused(format!("unknown grant {grant}"))),
                };
                self.rx.put = Some((grant, offset, imm, live));
            }
            k => return Err(TransportError::Refused(format!("frame kind {k}"))),
        }
        Ok(())
    }

    fn payload_dest(
        &mut self,
        h: &FrameHeader,
        got: usize,
        want: usize,
    ) -> Result<&mut [u8], TransportError> {
        Ok(match (self.rx.kind, self.rx.put) {
            (PUT, Some((grant, offset, _, true))) => match self.grants.get(&grant) {
                // SAFETY: the grant is live, so its caller promised not to touch the range
                // (`Backend::grant`); the bounds were checked in `on_header` (`got + want` is
                // within the payload); the region holds the storage alive for the call.
                Some(g) => unsafe {
                    std::slice::from_raw_parts_mut(
                        g.region.mem.ptr().add(g.range.start + offset + got),
                        want,
                    )
                },
                // Revoked in the middle of the frame: the rest is read and dropped.
                None => {
                    self.rx.put = Some((grant, offset, 0, false));
                    drain(&mut self.rx.scratch, want)
                }
            },
            (PUT, _) => drain(&mut self.rx.scratch, want),
            _ => {
                // The body first, then (once its owner admitted it) the data: a message is
                // judged by what it says before any memory is taken for what it brings.
                let body = self.rx.body_len;
                if got < body {
                    crate::tcp::grow_into(&mut self.rx.buf, got, want.min(body - got))
                } else {
                    if got == body && self.rx.has_data {
                        if let Some(admit) = self.admit.as_mut() {
                            let data = h.payload_len as usize - body;
                            self.rx.drop_data = !admit(self.peer, &self.rx.buf[..body], data)
                                .map_err(TransportError::Refused)?;
                        }
                    }
                    if self.rx.drop_data {
                        drain(&mut self.rx.scratch, want)
                    } else {
                        crate::tcp::grow_into(&mut self.rx.buf, got, want)
                    }
                }
            }
        })
    }

    fn on_frame(&mut self, h: &FrameHeader) -> Result<(), TransportError> {
        *self.n += 1;
        match (self.rx.kind, self.rx.put.take()) {
            (PUT, Some((grant, offset, imm, true))) if self.grants.contains_key(&grant) => {
                (self.on)(Completion::Put {
                    peer: self.peer,
                    grant,
                    offset,
                    len: h.payload_len as usize,
                    imm,
                })
            }
            (PUT, _) => *self.n -= 1,
            _ => {
                let (body, data) = self.rx.buf.split_at(self.rx.body_len);
                let data = (self.rx.has_data && !self.rx.drop_data)
                    .then(|| Lent::new(data.as_ptr(), data.len()));
                (self.on)(Completion::Recv {
                    peer: self.peer,
                    body,
                    data,
                });
                // A large message's buffer is not kept for the next ones.
                if self.rx.buf.capacity() > KEEP {
                    self.rx.buf = Vec::new();
                }
            }
        }
        Ok(())
    }
}
