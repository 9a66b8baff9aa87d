//! The one interface every medium implements, shaped by RDMA verbs.
//!
//! A [`Backend`] serves many peers from one thread. Its operations are posted, never waited
//! for: each one that names a [`Token`] completes exactly once, later, in
//! [`Backend::progress`], as [`Completion::Done`] or [`Completion::Failed`]. Between progress
//! calls a loop sleeps on [`Backend::fd`] after [`Backend::arm`] said nothing is pending
//! ([`wait`] does both, for several backends at once), so no wake-up is missed.
//!
//! - **Registered memory** ([`Region`]) holds its [`Storage`] alive through an `Arc`.
//! - **Grants** ([`RemoteRegion`], 32 bytes) name a range of a region for one peer to put into.
//!   [`Backend::revoke`] completes only once that peer can no longer write there.
//! - **Two-sided messages**: a small body, optionally with a range of a region as data. The
//!   receiver gets the body in place and the data lent ([`Lent`]); over shared memory, data from
//!   a region of [`Backend::alloc`] is not copied at all, and the receiver's release is the
//!   sender's completion. A full link answers [`Sent::WouldBlock`].
//! - **One-sided puts** into a granted range, notified at the receiver with an immediate of
//!   [`IMM_BITS`] bits (RDMA's WRITE_WITH_IMM carries 32: the rest name the grant), posted in
//!   chains and pushed out by [`Backend::flush`].

use std::fmt;
use std::ops::Range;
use std::os::fd::BorrowedFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::TransportError;

/// The width of a put's immediate: a WRITE_WITH_IMM carries 32 bits, and a backend may use
/// the other `32 - IMM_BITS` to name the grant written, so that one work request is the whole
/// put. A wider immediate is refused.
pub const IMM_BITS: u32 = 20;

/// Refuses an immediate wider than [`IMM_BITS`].
pub(crate) fn check_imm(imm: u32) -> Result<(), TransportError> {
    if imm >> IMM_BITS != 0 {
        return Err(TransportError::Refused(format!(
            "an immediate of {imm:#x}: a put's immediate has {IMM_BITS} bits"
        )));
    }
    Ok(())
}

/// Connections a backend keeps in their handshake at once: beyond these, a new one is closed
/// at once (connections that say nothing cost a listener nothing more).
pub(crate) const MAX_PENDING: usize = 64;

/// A listener's accept that failed for want of resources (EMFILE, ENFILE, ENOBUFS): the
/// connections wait in the backlog, and an edge-triggered poll will not say so again, so the
/// accept is tried again after a pause instead of the listener falling silent.
#[derive(Default)]
pub(crate) struct AcceptRetry(Option<Instant>);

impl AcceptRetry {
    /// An accept failed: try again in a while.
    pub(crate) fn failed(&mut self) {
        self.0 = Some(Instant::now() + Duration::from_millis(100));
    }

    /// Whether it is time to try again (once).
    pub(crate) fn due(&mut self) -> bool {
        if self.0.is_some_and(|t| Instant::now() >= t) {
            self.0 = None;
            return true;
        }
        false
    }
}

/// What every backend checks of a put before it posts anything: the immediate's width, the
/// source range, the grant's kind (where the backend's grants have one) and that the put lies
/// inside the grant.
pub(crate) fn check_put(
    src: &Region,
    range: &Range<usize>,
    dst: &RemoteRegion,
    kind: Option<u32>,
    offset: usize,
    imm: u32,
) -> Result<(), TransportError> {
    check_imm(imm)?;
    src.check_range(range)?;
    let len = range.len();
    if kind.is_some_and(|k| k != dst.kind)
        || offset.checked_add(len).is_none_or(|e| e as u64 > dst.len)
    {
        return Err(TransportError::Refused(format!(
            "a put of {len} bytes at {offset} into {dst:?}"
        )));
    }
    Ok(())
}

/// A peer of a backend, as that backend numbers it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerId(pub u32);

impl fmt::Display for PeerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "peer {}", self.0)
    }
}

/// The caller's name for a posted operation, handed back when it completes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Token(pub u64);

pub use crate::memory::{DmaBuf, Mem, Storage};
pub(crate) use crate::region::{fresh_id, Place};
pub use crate::region::{Access, Region, RemoteRegion, REMOTE_LEN};

/// Data lent by a backend for the length of a callback: the bytes a message carried. Over
/// shared memory they may lie in the sender's pages, so they are read by copy, or through a raw
/// pointer, never as a slice.
pub struct Lent<'a> {
    ptr: *const u8,
    len: usize,
    hold: Option<&'a HoldSlot>,
    _life: std::marker::PhantomData<&'a [u8]>,
}

/// What lets a callback keep a message's data past the callback ([`Lent::hold`]): the
/// message's number, what keeps its memory mapped, and whether the callback took it.
pub(crate) struct HoldSlot {
    pub(crate) id: u64,
    pub(crate) keep: Arc<dyn std::any::Any + Send + Sync>,
    pub(crate) taken: std::cell::Cell<bool>,
}

/// A received message's data kept past its callback ([`Lent::hold`]): its memory stays mapped
/// while this lives, and the sender does not get it back (nor write it, by the send's
/// contract) until the backend is given this back ([`Backend::release`]) or the peer is gone.
/// The sender's pages: read by copy or through the raw pointer only, as [`Lent`]'s.
pub struct Held {
    id: u64,
    ptr: usize,
    len: usize,
    _keep: Arc<dyn std::any::Any + Send + Sync>,
}

impl Held {
    /// The first byte, valid for reads of [`Held::len`] bytes while this lives.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr as *const u8
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub(crate) fn id(&self) -> u64 {
        self.id
    }
}

impl<'a> Lent<'a> {
    pub(crate) fn new(ptr: *const u8, len: usize) -> Lent<'a> {
        Lent {
            ptr,
            len,
            hold: None,
            _life: std::marker::PhantomData,
        }
    }

    /// Data that a callback may keep past itself ([`Lent::hold`]).
    pub(crate) fn holdable(ptr: *const u8, len: usize, slot: &'a HoldSlot) -> Lent<'a> {
        Lent {
            ptr,
            len,
            hold: Some(slot),
            _life: std::marker::PhantomData,
        }
    }

    /// Keeps the data past the callback, where the backend can (the sender's pages over shared
    /// memory; not a buffer the backend reuses for the next message): the sender gets the
    /// memory back only once the [`Held`] is given to [`Backend::release`]. `None` where it
    /// cannot, or the data is held already.
    pub fn hold(&self) -> Option<Held> {
        let slot = self.hold?;
        if slot.taken.replace(true) {
            return None;
        }
        Some(Held {
            id: slot.id,
            ptr: self.ptr as usize,
            len: self.len,
            _keep: slot.keep.clone(),
        })
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The first byte, valid for reads of [`Lent::len`] bytes during the callback.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }

    /// Copies `dst.len()` bytes out, from `off`.
    pub fn read(&self, off: usize, dst: &mut [u8]) -> Result<(), TransportError> {
        if off.checked_add(dst.len()).is_none_or(|e| e > self.len) {
            return Err(TransportError::Refused(format!(
                "{} bytes at {off} of {} lent",
                dst.len(),
                self.len
            )));
        }
        // SAFETY: in bounds of what the backend lent, valid for the callback (`'a`); a copy, so
        // no reference covers bytes the sender might write.
        unsafe { crate::copy::copy_any(self.ptr.add(off), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// All the bytes, copied.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len];
        let _ = self.read(0, &mut v);
        v
    }
}

/// Whether a send or put was taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use]
pub enum Sent {
    /// Posted; it completes in a later [`Backend::progress`].
    Posted,
    /// The link is full: nothing was posted; try again after progress.
    WouldBlock,
}

/// What [`Backend::progress`] reports.
pub enum Completion<'a> {
    /// A peer connected to this backend's listener.
    Connected {
        /// Its number.
        peer: PeerId,
    },
    /// A two-sided message.
    Recv {
        /// From whom.
        peer: PeerId,
        /// Its body, lent in place.
        body: &'a [u8],
        /// Its data, if it had any.
        data: Option<Lent<'a>>,
    },
    /// A peer put `len` bytes at `offset` into the range granted as `grant`, and they are in
    /// place.
    Put {
        /// From whom.
        peer: PeerId,
        /// The grant's number ([`RemoteRegion::id`]).
        grant: u64,
        /// Where in the granted range.
        offset: usize,
        /// How many bytes.
        len: usize,
        /// The sender's immediate.
        imm: u32,
    },
    /// A posted operation is complete: its memory is the caller's again.
    Done(Token),
    /// A posted operation failed.
    Failed(Token, TransportError),
    /// A peer is gone; every operation it had pending fails.
    Lost {
        /// Which.
        peer: PeerId,
        /// Why.
        error: TransportError,
    },
}

impl fmt::Debug for Completion<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Completion::Connected { peer } => write!(f, "Connected({peer})"),
            Completion::Recv { peer, body, data } => write!(
                f,
                "Recv({peer}, {} byte body, {:?} bytes of data)",
                body.len(),
                data.as_ref().map(|d| d.len())
            ),
            Completion::Put {
                peer,
                grant,
                offset,
                len,
                imm,
            } => write!(
                f,
                "Put({peer}, grant {grant}, {len} at {offset}, imm {imm})"
            ),
            Completion::Done(t) => write!(f, "Done({})", t.0),
            Completion::Failed(t, e) => write!(f, "Failed({}, {e})", t.0),
            Completion::Lost { peer, error } => write!(f, "Lost({peer}, {error})"),
        }
    }
}

/// Refuses a message body longer than `max` bytes.
pub(crate) fn check_body(len: usize, max: usize) -> Result<(), TransportError> {
    if len > max {
        return Err(TransportError::Refused(format!(
            "a body of {len} bytes (at most {max})"
        )));
    }
    Ok(())
}

/// Reports completed tokens, then lost peers; returns how many.
pub(crate) fn deliver(
    done: &mut std::collections::VecDeque<(Token, Option<TransportError>)>,
    lost: &mut std::collections::VecDeque<(PeerId, TransportError)>,
    on: &mut dyn FnMut(Completion<'_>),
) -> usize {
    let n = done.len() + lost.len();
    if n == 0 {
        return 0;
    }
    for (t, err) in done.drain(..) {
        match err {
            None => on(Completion::Done(t)),
            Some(e) => on(Completion::Failed(t, e)),
        }
    }
    for (peer, error) in lost.drain(..) {
        on(Completion::Lost { peer, error });
    }
    n
}

/// A transport for many peers, driven from one thread. See the module documentation.
pub trait Backend: Send {
    /// `"tcp"` or `"shm"`.
    fn name(&self) -> &'static str;

    /// This backend's identity, unique in the process: a [`Region`] serves only the backend
    /// with its [`Region::backend_id`].
    fn id(&self) -> u64;

    /// The largest message body.
    fn max_body(&self) -> usize;

    /// Registers memory for sends, puts and grants.
    fn register(&mut self, mem: Arc<dyn Storage>) -> Result<Region, TransportError>;

    /// New zeroed memory that this medium moves best, for `access`: over shared memory, pool
    /// pages a peer reads in place ([`Access::Send`]), or landing pages a peer puts into
    /// ([`Access::Land`]).
    fn alloc(&mut self, len: usize, access: Access) -> Result<Region, TransportError>;

    /// Whether a send of `r`'s data goes by reference (the receiver reads it where it lies),
    /// which no put into a peer's memory can beat.
    fn sends_in_place(&self, _r: &Region) -> bool {
        false
    }

    /// Grants `peer` the right to put into `range` of `r`.
    ///
    /// # Safety
    /// Until the grant is revoked (its token done) or forgotten, the caller reads the range only
    /// after a [`Completion::Put`] into it and before the protocol above lets the peer write
    /// again, and never writes it.
    unsafe fn grant(
        &mut self,
        peer: PeerId,
        r: &Region,
        range: Range<usize>,
    ) -> Result<RemoteRegion, TransportError>;

    /// Fences a grant: `token` completes once `peer` can no longer write there (done), or fails
    /// if that cannot be known (a peer that closed its socket but still lives); the backend
    /// then keeps the memory alive for good.
    fn revoke(
        &mut self,
        peer: PeerId,
        grant: &RemoteRegion,
        token: Token,
    ) -> Result<(), TransportError>;

    /// Drops a grant without a fence, for a protocol in which the peer puts into it once and
    /// that put has been seen.
    fn forget(&mut self, peer: PeerId, grant: &RemoteRegion);

    /// Gives back a message's data a callback held ([`Lent::hold`]): its sender gets the
    /// memory back. Nothing where the peer is gone. (A backend that lends nothing to hold has
    /// nothing to give back.)
    fn release(&mut self, peer: PeerId, held: Held) {
        let _ = (peer, held);
    }

    /// Sends `body` (at most [`Backend::max_body`] bytes) and, optionally, `data` with a token
    /// that completes when the data's memory is the caller's again.
    ///
    /// # Safety
    /// The caller does not write the data's range until its token completes.
    unsafe fn send(
        &mut self,
        peer: PeerId,
        body: &[u8],
        data: Option<(&Region, Range<usize>, Token)>,
    ) -> Result<Sent, TransportError>;

    /// Puts `range` of `src` at `offset` of the peer's granted `dst`, notifying it with `imm`
    /// (below `1 << IMM_BITS`).
    ///
    /// # Safety
    /// The caller does not write `src`'s range until `token` completes.
    #[allow(clippy::too_many_arguments)]
    unsafe fn put(
        &mut self,
        peer: PeerId,
        src: &Region,
        range: Range<usize>,
        dst: &RemoteRegion,
        offset: usize,
        imm: u32,
        token: Token,
    ) -> Result<Sent, TransportError>;

    /// Pushes out what was posted since the last flush.
    fn flush(&mut self) -> Result<(), TransportError>;

    /// Before sleeping on [`Backend::fd`]: `false` if there is work already (do not sleep).
    fn arm(&mut self) -> Result<bool, TransportError>;

    /// The descriptor that becomes readable when there is work for [`Backend::progress`].
    fn fd(&self) -> BorrowedFd<'_>;

    /// Does what can be done without blocking and reports it; returns how many completions.
    fn progress(&mut self, on: &mut dyn FnMut(Completion<'_>)) -> Result<usize, TransportError>;

    /// Closes the link to `peer` (its pending operations fail).
    fn close(&mut self, peer: PeerId);

    /// Stops taking messages from `peer` (`true`), or takes them again: while paused, what the
    /// peer sends waits in the link, and once the link is full the peer's sends would block.
    /// Backpressure for a receiver that cannot keep up with one peer.
    fn pause(&mut self, peer: PeerId, paused: bool);

    /// `peer` proved itself to the owner (the job's handshake): the limits a backend was asked
    /// to keep on it until then are lifted: the size of the data its messages may bring (a
    /// peer accepted by TCP or RDMA), and any access of its own to this process's memory
    /// (RDMA, a peer accepted or connected to: its queue pair takes no READ or WRITE before
    /// this, whatever key it names). Nothing where no limit was asked for. Until this, the
    /// owner sends such a peer no two messages in a row: the peer's credits then all come back
    /// in its messages, never by a WRITE that its queue pair would refuse. An error: the peer
    /// cannot be given what it proved it may have (lost, or the device refused); its link
    /// should be closed.
    fn trust(&mut self, _peer: PeerId) -> Result<(), TransportError> {
        Ok(())
    }
}

/// Sleeps until one of `backends` has work or `timeout` passes: arms each, and sleeps only if
/// all of them said nothing is pending.
pub fn wait(backends: &mut [&mut dyn Backend], timeout: Duration) -> Result<(), TransportError> {
    for b in backends.iter_mut() {
        b.flush()?;
        if !b.arm()? {
            return Ok(());
        }
    }
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let mut fds: Vec<PollFd<'_>> = backends
        .iter()
        .map(|b| PollFd::from_borrowed_fd(b.fd(), PollFlags::IN))
        .collect();
    let ts = Timespec {
        tv_sec: timeout.as_secs() as i64,
        tv_nsec: timeout.subsec_nanos() as i64,
    };
    match poll(&mut fds, Some(&ts)) {
        Ok(_) => Ok(()),
        Err(e) if e == rustix::io::Errno::INTR => Ok(()),
        Err(e) => Err(std::io::Error::from(e).into()),
    }
}
