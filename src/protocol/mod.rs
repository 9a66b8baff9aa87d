//! The kvstore wire protocol: what a frame's metadata means.
//!
//! ```text
//! meta (112 bytes, little-endian):
//! 0 op u16 | 2 status u16 | 4 dtype u8 | 5 ndim u8 | 6 flags u16 | 8 sender u32 | 12 aux u32
//! 16 request id u64 | 24 key u64 | 32 total elements u64 | 40 range start u64 | 48 range length u64
//! 56 shape: 7 x u64
//! ```
//! A data frame's payload is `range length` elements of `dtype`, raw, or with [`flags::PACKED`]
//! (a push of float32 values, 2-bit compressed: [`crate::Compression`]) their packed form, its
//! threshold's bits in `aux` (0 otherwise); a control frame's payload is short text
//! (addresses, names, error messages), or an optimizer: its parameters' f64 words (kind first;
//! 8, or 9 for centered RMSProp), the length of its extras and they (its scheduler,
//! `begin_num_update`, `multi_precision`), then 24 bytes per key of its multipliers (the key's
//! number, `lr_mult`, `wd_mult`).
//!
//! Receive slots ([`flags::SLOT`]): a server's reply to a push may grant the worker a slot (the
//! grant follows the header) that its next push of the same key slice is put into, once; that
//! push is then one put whose immediate is the request id ([`slot_imm`]), and for a pushpull
//! also a message with [`flags::SLOT`] set, carrying the pull's destination and no data.

pub(crate) mod batch;
pub mod shard;

use kvstore_transport::{RemoteRegion, META_LEN, REMOTE_LEN};

use crate::{DType, KvError, Result};

/// Most dimensions a shape may have on the wire.
pub const MAX_NDIM: usize = 7;

/// What a frame asks for or answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
pub enum Op {
    /// First frame on every connection: role, rank hint; payload: the initiator's nonce, then
    /// (to the scheduler) address, host and RDMA listener ([`crate::auth`]).
    Hello = 1,
    /// The hello was accepted.
    HelloAck = 2,
    /// Scheduler to node: rank and the cluster (text payload).
    Roster = 3,
    /// Worker to scheduler: arrived at a barrier.
    Barrier = 4,
    /// Scheduler to workers: every worker has arrived.
    BarrierDone = 5,
    /// Worker to scheduler: done with the job.
    Finish = 6,
    /// Scheduler to servers: the job is over.
    Shutdown = 7,
    /// Scheduler to all: a process failed; text payload says which.
    Abort = 8,
    /// Worker to server: create a key (slice) with this value.
    Init = 9,
    /// Worker to server: push a value (slice).
    Push = 10,
    /// Worker to server: pull a value (slice).
    Pull = 11,
    /// Worker to server: push, and answer with the value after the update.
    PushPull = 12,
    /// Server to worker: the answer to a request (same request id); error text if status != 0.
    Reply = 13,
    /// Worker to server: run this built-in optimizer (payload: its f64 words, kind first, then its multipliers);
    /// with `key` 1, add these multipliers (payload: them alone) to the optimizer it runs.
    SetOptimizer = 14,
    /// Worker to server: run the registered updater of this name (payload: the name).
    SetUpdater = 15,
    /// Worker to server: leaving cleanly.
    Bye = 16,
    /// Many requests to one server, or many answers to one worker ([`batch`]).
    Batch = 17,
    /// The responder's answer to a hello: its nonce and its proof of the secret.
    Challenge = 18,
    /// The initiator's proof of the secret (and of its rank's token).
    Proof = 19,
    /// Node to scheduler: this process lives ([`crate::roles`]'s heartbeat).
    Heartbeat = 20,
    /// Worker to server: its built-in optimizer's state, answered into the request's grant:
    /// `key` 0 snapshots it and answers its length (8 bytes), `key` 1 answers the snapshot
    /// (`len` bytes).
    States = 21,
    /// Worker to server: replace the built-in optimizer's state (data: the bytes a
    /// [`Op::States`] answered).
    LoadStates = 22,
}

impl Op {
    fn from_u16(v: u16) -> Option<Op> {
        use Op::*;
        Some(match v {
            1 => Hello,
            2 => HelloAck,
            3 => Roster,
            4 => Barrier,
            5 => BarrierDone,
            6 => Finish,
            7 => Shutdown,
            8 => Abort,
            9 => Init,
            10 => Push,
            11 => Pull,
            12 => PushPull,
            13 => Reply,
            21 => States,
            22 => LoadStates,
            14 => SetOptimizer,
            15 => SetUpdater,
            16 => Bye,
            17 => Batch,
            18 => Challenge,
            19 => Proof,
            20 => Heartbeat,
            _ => return None,
        })
    }

    /// Whether the payload of this op is tensor data of the header's dtype and range.
    pub fn carries_data(self) -> bool {
        matches!(self, Op::Init | Op::Push | Op::PushPull | Op::LoadStates)
    }
}

/// Error codes of a [`Op::Reply`] with a non-zero status.
pub mod status {
    /// Success.
    pub const OK: u16 = 0;
    /// Any other failure; the payload says what.
    pub const FAILED: u16 = 1;
    /// The key is not initialised.
    pub const UNKNOWN_KEY: u16 = 2;
    /// The key is already initialised.
    pub const DOUBLE_INIT: u16 = 3;
    /// Wrong shape, range or dtype.
    pub const MISMATCH: u16 = 4;
    /// A peer of the server was lost.
    pub const PEER_LOST: u16 = 5;
    /// A `dist_sync` push refused before it counted in its key's round (a third push of the
    /// key in flight, or one the server had no room for): nothing of it was taken. Where the
    /// key is sliced, another server may have taken its slice. (Other refusals before a push
    /// counts keep their codes: a malformed or mismatched request, or a value lost, which
    /// every server refuses alike or whose pulls fail from then on.)
    pub const NOT_TAKEN: u16 = 6;

    /// The error a server's answer with a non-zero status stands for.
    pub(crate) fn to_error(status: u16, key: u64, server: usize, text: String) -> crate::KvError {
        use crate::KvError;
        let key = crate::Key::Int(key as i64);
        match status {
            UNKNOWN_KEY => KvError::UnknownKey(key),
            DOUBLE_INIT => KvError::DoubleInit(key),
            PEER_LOST => KvError::PeerLost(format!("server {server}: {text}")),
            _ => KvError::Remote {
                server,
                message: text,
            },
        }
    }
}

/// Bits of [`Msg::flags`].
pub mod flags {
    /// On a push or pushpull: its data was put into the worker's receive slot. On a reply: a
    /// receive slot for the next push of this key slice follows the header.
    pub const SLOT: u16 = 1;
    /// On a reply: the value rides with it, by reference to pages of the server that the
    /// worker maps read-only (shared memory); the worker copies it into the destination it
    /// granted, which the server then never writes.
    pub const DATA: u16 = 2;
    /// On a push or pushpull of float32 values: its data is their 2-bit packed form
    /// ([`crate::Compression`]), whose threshold is [`super::Msg::aux`]. An answer's value is
    /// never packed.
    pub const PACKED: u16 = 4;
    /// Every bit a message may carry.
    pub const ALL: u16 = SLOT | DATA | PACKED;
}

/// The bit of a put's immediate that says a message follows; the bits below it are the
/// request id (a put's immediate has [`kvstore_transport::IMM_BITS`] bits). A worker's slot put:
/// the message is a pushpull's, with its destination. A server's answer put: the reply follows
/// (it gives a receive slot, or an error); without the bit the put is the whole answer.
pub const IMM_FOLLOWS: u32 = 1 << (kvstore_transport::IMM_BITS - 1);

/// Request ids stay below this, so that a slot put's immediate carries them whole (a worker
/// never reuses one still in flight).
pub const MAX_REQ_ID: u64 = IMM_FOLLOWS as u64;

/// The immediate of a slot put for request `req_id` (below [`MAX_REQ_ID`]); `follows`: a
/// message comes after it.
pub fn slot_imm(req_id: u64, follows: bool) -> u32 {
    (req_id as u32 & (IMM_FOLLOWS - 1)) | if follows { IMM_FOLLOWS } else { 0 }
}

/// Node roles as carried in a hello.
pub mod role {
    /// A server.
    pub const SERVER: u64 = 1;
    /// A worker.
    pub const WORKER: u64 = 2;
}

/// Decoded frame metadata.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Msg {
    /// The operation.
    pub op: Op,
    /// 0, or an error code of a reply.
    pub status: u16,
    /// The element type of a data payload.
    pub dtype: DType,
    /// Dimensions used in `shape`.
    pub ndim: u8,
    /// Bits of [`flags`].
    pub flags: u16,
    /// The sender's rank (or a rank hint in a hello).
    pub sender: u32,
    /// With [`flags::PACKED`]: the compression's threshold, as `f32` bits; else 0.
    pub aux: u32,
    /// Request id, echoed by the reply.
    pub req_id: u64,
    /// The key (or the role in a hello).
    pub key: u64,
    /// Elements of the whole tensor.
    pub total: u64,
    /// First element of the slice this frame is about.
    pub start: u64,
    /// Elements in the slice.
    pub len: u64,
    /// The whole tensor's shape (first `ndim` entries).
    pub shape: [u64; MAX_NDIM],
}

impl Msg {
    /// The receive slot a reply carries (after its header, when flagged), and the text after
    /// it; `None` if the flag promises a slot the body is too short to hold.
    pub(crate) fn reply_slot<'a>(
        &self,
        rest: &'a [u8],
    ) -> Option<(Option<RemoteRegion>, &'a [u8])> {
        if self.flags & flags::SLOT == 0 {
            return Some((None, rest));
        }
        let g = RemoteRegion::from_bytes(rest)?;
        Some((Some(g), &rest[REMOTE_LEN..]))
    }

    /// A message with every field but the op zero.
    pub fn new(op: Op) -> Msg {
        Msg {
            op,
            status: 0,
            dtype: DType::U8,
            ndim: 0,
            flags: 0,
            sender: 0,
            aux: 0,
            req_id: 0,
            key: 0,
            total: 0,
            start: 0,
            len: 0,
            shape: [0; MAX_NDIM],
        }
    }

    /// The metadata bytes.
    pub fn encode(&self) -> [u8; META_LEN] {
        let mut b = [0u8; META_LEN];
        b[0..2].copy_from_slice(&(self.op as u16).to_le_bytes());
        b[2..4].copy_from_slice(&self.status.to_le_bytes());
        b[4] = self.dtype.code();
        b[5] = self.ndim;
        b[6..8].copy_from_slice(&self.flags.to_le_bytes());
        b[8..12].copy_from_slice(&self.sender.to_le_bytes());
        b[12..16].copy_from_slice(&self.aux.to_le_bytes());
        let words = [self.req_id, self.key, self.total, self.start, self.len];
        for (i, w) in words.iter().chain(self.shape.iter()).enumerate() {
            b[16 + 8 * i..24 + 8 * i].copy_from_slice(&w.to_le_bytes());
        }
        b
    }

    /// A frame header for this message with a payload of `payload_len` bytes (the scheduler's
    /// frames).
    #[cfg(test)]
    pub fn header(&self, payload_len: usize) -> [u8; kvstore_transport::HEADER_LEN] {
        kvstore_transport::FrameHeader::new(self.encode(), payload_len as u64).encode()
    }

    /// Decodes and validates metadata.
    pub fn decode(b: &[u8; META_LEN]) -> Result<Msg> {
        let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        let u64_at = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(w)
        };
        let op = Op::from_u16(u16_at(0))
            .ok_or_else(|| KvError::Protocol(format!("unknown op {}", u16_at(0))))?;
        let dtype = DType::from_code(b[4])
            .ok_or_else(|| KvError::Protocol(format!("unknown dtype code {}", b[4])))?;
        let ndim = b[5];
        if ndim as usize > MAX_NDIM {
            return Err(KvError::Protocol(format!("ndim {ndim} > {MAX_NDIM}")));
        }
        let fl = u16_at(6);
        if fl & !flags::ALL != 0 {
            return Err(KvError::Protocol(format!("unknown flags {fl:#x}")));
        }
        let mut shape = [0u64; MAX_NDIM];
        for (i, s) in shape.iter_mut().enumerate() {
            *s = u64_at(56 + 8 * i);
        }
        let m = Msg {
            op,
            status: u16_at(2),
            dtype,
            ndim,
            flags: fl,
            sender: u32::from_le_bytes([b[8], b[9], b[10], b[11]]),
            aux: u32::from_le_bytes([b[12], b[13], b[14], b[15]]),
            req_id: u64_at(16),
            key: u64_at(24),
            total: u64_at(32),
            start: u64_at(40),
            len: u64_at(48),
            shape,
        };
        if m.start.checked_add(m.len).is_none_or(|end| end > m.total) {
            return Err(KvError::Protocol(format!(
                "range {}+{} outside a tensor of {}",
                m.start, m.len, m.total
            )));
        }
        if m.flags & flags::PACKED != 0 {
            let valid = matches!(m.op, Op::Push | Op::PushPull)
                && m.dtype == DType::F32
                && m.compression().is_some();
            if !valid {
                return Err(KvError::Protocol(format!(
                    "a packed {:?} of {} with threshold bits {:#x}",
                    m.op, m.dtype, m.aux
                )));
            }
        } else if m.aux != 0 {
            return Err(KvError::Protocol(format!("aux word {:#x} unused", m.aux)));
        }
        Ok(m)
    }

    /// The compression of a packed push ([`flags::PACKED`]).
    pub fn compression(&self) -> Option<crate::Compression> {
        if self.flags & flags::PACKED == 0 {
            return None;
        }
        crate::Compression::from_wire(self.aux)
    }

    /// Decodes the header at the front of a message body; returns it and the rest of the body
    /// (a grant, or text).
    pub fn from_body(body: &[u8]) -> Result<(Msg, &[u8])> {
        let (meta, rest) = body
            .split_first_chunk::<META_LEN>()
            .ok_or_else(|| KvError::Protocol("a message shorter than its header".into()))?;
        Ok((Msg::decode(meta)?, rest))
    }

    /// The shape carried in the message.
    #[cfg(test)]
    pub fn shape(&self) -> Vec<usize> {
        self.shape[..self.ndim as usize]
            .iter()
            .map(|&d| d as usize)
            .collect()
    }

    /// Whether this reply to a value request comes as a message after the value's put: when
    /// it gives a receive slot ([`flags::SLOT`]) or reports an error. Otherwise the put, its
    /// immediate without [`IMM_FOLLOWS`], is the whole answer.
    pub fn follows_put(&self) -> bool {
        self.flags & flags::SLOT != 0 || self.status != status::OK
    }

    /// The payload length a data frame of this message must have: the value's bytes, or their
    /// packed form's ([`flags::PACKED`]).
    pub fn data_bytes(&self) -> Option<u64> {
        if self.flags & flags::PACKED != 0 {
            return Some(crate::Compression::packed_bytes(self.len));
        }
        self.value_bytes()
    }

    /// The bytes of the value slice the message names (what an answer to it carries).
    pub fn value_bytes(&self) -> Option<u64> {
        self.len.checked_mul(self.dtype.size() as u64)
    }

    /// How a data frame's payload reads: elements and their type (bytes, when packed).
    pub fn payload_layout(&self) -> (usize, DType) {
        if self.flags & flags::PACKED != 0 {
            let n = crate::Compression::packed_bytes(self.len);
            return (usize::try_from(n).unwrap_or(usize::MAX), DType::U8);
        }
        (usize::try_from(self.len).unwrap_or(usize::MAX), self.dtype)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_every_field() {
        let mut m = Msg::new(Op::PushPull);
        m.status = 4;
        m.dtype = DType::BF16;
        m.ndim = 3;
        m.flags = flags::SLOT;
        m.sender = 7;
        m.req_id = u64::MAX - 1;
        m.key = 9973;
        m.total = 1000;
        m.start = 10;
        m.len = 990;
        m.shape[..3].copy_from_slice(&[10, 10, 10]);
        let d = Msg::decode(&m.encode()).unwrap();
        assert_eq!(d, m);
        assert_eq!(d.shape(), vec![10, 10, 10]);
        assert_eq!(d.data_bytes(), Some(1980));
    }

    /// xorshift: a small deterministic source of test cases.
    fn rng(state: &mut u64) -> u64 {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        *state
    }

    #[test]
    fn property_random_valid_messages_round_trip_and_random_bytes_never_panic() {
        let mut st = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..20_000 {
            let mut m = Msg::new(Op::from_u16((rng(&mut st) % 16 + 1) as u16).unwrap());
            m.status = (rng(&mut st) % 7) as u16;
            m.dtype = DType::ALL[(rng(&mut st) % 7) as usize];
            m.ndim = (rng(&mut st) % 8) as u8;
            m.flags = (rng(&mut st) % 4) as u16;
            m.sender = rng(&mut st) as u32;
            m.req_id = rng(&mut st);
            m.key = rng(&mut st);
            m.total = rng(&mut st) >> 1;
            m.start = rng(&mut st) % (m.total + 1);
            m.len = rng(&mut st) % (m.total - m.start + 1);
            for d in m.shape.iter_mut().take(m.ndim as usize) {
                *d = rng(&mut st) % 1000;
            }
            assert_eq!(Msg::decode(&m.encode()).unwrap(), m);
            // Any bytes at all: an answer, never a panic.
            let mut junk = [0u8; META_LEN];
            for b in junk.iter_mut() {
                *b = rng(&mut st) as u8;
            }
            if let Ok(d) = Msg::decode(&junk) {
                assert!(d.start + d.len <= d.total);
                assert_eq!(d.flags & !flags::ALL, 0);
                assert!(d.ndim as usize <= MAX_NDIM);
            }
        }
    }

    #[test]
    fn a_packed_push_names_its_threshold_and_carries_a_sixteenth() {
        let mut m = Msg::new(Op::PushPull);
        m.dtype = DType::F32;
        m.total = 100;
        m.len = 33;
        m.flags = flags::PACKED;
        m.aux = 0.25f32.to_bits();
        let d = Msg::decode(&m.encode()).unwrap();
        assert_eq!(d.compression().map(|c| c.threshold()), Some(0.25));
        assert_eq!(d.data_bytes(), Some(12));
        assert_eq!(d.value_bytes(), Some(132));
        assert_eq!(d.payload_layout(), (12, DType::U8));
        // Only pushes of float32 values, with a valid threshold, are packed.
        for bad in [
            Msg { op: Op::Pull, ..m },
            Msg { op: Op::Init, ..m },
            Msg {
                dtype: DType::F64,
                ..m
            },
            Msg { aux: 0, ..m },
            Msg {
                aux: (-1.0f32).to_bits(),
                ..m
            },
            Msg {
                aux: f32::INFINITY.to_bits(),
                ..m
            },
        ] {
            assert!(Msg::decode(&bad.encode()).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn garbage_is_refused() {
        let m = Msg::new(Op::Push);
        let mut b = m.encode();
        b[0] = 99;
        assert!(Msg::decode(&b).is_err());
        let mut b = m.encode();
        b[4] = 42;
        assert!(Msg::decode(&b).is_err());
        let mut b = m.encode();
        b[5] = 8;
        assert!(Msg::decode(&b).is_err());
        let mut b = m.encode();
        b[6] = 8;
        assert!(Msg::decode(&b).is_err());
        let mut b = m.encode();
        b[12] = 1;
        assert!(Msg::decode(&b).is_err());
        let mut bad = Msg::new(Op::Push);
        bad.total = 10;
        bad.start = 5;
        bad.len = 6;
        assert!(Msg::decode(&bad.encode()).is_err());
        bad.start = u64::MAX;
        assert!(Msg::decode(&bad.encode()).is_err());
    }
}
