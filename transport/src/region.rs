//! Registered memory ([`Region`]) and the grants that name a range of it for a peer
//! ([`RemoteRegion`]).

use std::fmt;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::{Storage, TransportError};

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// A fresh number, unique in this process (backend and region identities).
pub(crate) fn fresh_id() -> u64 {
    NEXT_ID.fetch_add(1, Ordering::Relaxed)
}

/// Where a region's bytes lie, as its backend knows them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Place {
    /// Private memory of this process.
    Local,
    /// Pages of the backend's shared pool, at this offset of its segment (peers read them,
    /// and can never write them).
    Pool(usize),
    /// Landing pages, at this offset of the backend's landing segment: peers it granted a
    /// range write there.
    Landing(usize),
}

/// What peers may do with memory a backend allocates, as the access flags of a verbs memory
/// region say it: memory that peers write is kept apart from memory they only read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Peers may read it (a send by reference) but can never write it: over shared memory,
    /// pages of a pool that peers can map only read-only. A grant of it is written by the
    /// kernel on the peer's behalf (a cross-memory write) or lands in landing pages first.
    Send,
    /// Peers may put into ranges of it that are granted to them: receive slots.
    Land,
}

/// Memory registered with one backend. Clones share the registration; the storage lives as long
/// as any clone (and any operation that uses it).
#[derive(Clone)]
pub struct Region {
    pub(crate) id: u64,
    pub(crate) backend: u64,
    pub(crate) mem: Arc<dyn Storage>,
    pub(crate) place: Place,
}

impl fmt::Debug for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Region")
            .field("id", &self.id)
            .field("len", &self.len())
            .field("place", &self.place)
            .finish()
    }
}

impl Region {
    pub(crate) fn new(backend: u64, mem: Arc<dyn Storage>, place: Place) -> Region {
        Region {
            id: fresh_id(),
            backend,
            mem,
            place,
        }
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.mem.len()
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The identity of the backend it is registered with ([`crate::Backend::id`]).
    pub fn backend_id(&self) -> u64 {
        self.backend
    }

    /// The storage it holds alive.
    pub fn storage(&self) -> &Arc<dyn Storage> {
        &self.mem
    }

    /// Copies bytes out, from `off`.
    ///
    /// # Safety
    /// No peer writes the range meanwhile (it is not granted, or the protocol above says the
    /// peer is done with it).
    pub unsafe fn read(&self, off: usize, dst: &mut [u8]) -> Result<(), TransportError> {
        self.check(off, dst.len())?;
        // SAFETY: in bounds; the storage is valid (its contract); no peer writes (ours).
        unsafe { crate::copy::copy_any(self.mem.ptr().add(off), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Copies `src` in, at `off`.
    ///
    /// # Safety
    /// No backend reads or writes the range meanwhile (no send or put from it is in flight, and
    /// it is not granted).
    pub unsafe fn write(&self, off: usize, src: &[u8]) -> Result<(), TransportError> {
        self.check(off, src.len())?;
        // SAFETY: in bounds; valid storage; nothing else touches the range (ours).
        unsafe { crate::copy::copy_any(src.as_ptr(), self.mem.ptr().add(off), src.len()) };
        Ok(())
    }

    pub(crate) fn check(&self, off: usize, len: usize) -> Result<(), TransportError> {
        if off.checked_add(len).is_none_or(|e| e > self.len()) {
            return Err(TransportError::Refused(format!(
                "{len} bytes at {off} are outside a region of {}",
                self.len()
            )));
        }
        Ok(())
    }

    /// Refuses a region registered with another backend than `backend`.
    pub(crate) fn check_owner(&self, backend: u64) -> Result<(), TransportError> {
        if self.backend == backend {
            Ok(())
        } else {
            Err(TransportError::Refused(
                "a region of another backend".into(),
            ))
        }
    }

    pub(crate) fn check_range(&self, r: &Range<usize>) -> Result<(), TransportError> {
        if r.start > r.end {
            return Err(TransportError::Refused(format!("an inverted range {r:?}")));
        }
        self.check(r.start, r.end - r.start)
    }
}

/// The size of a [`RemoteRegion`] on the wire.
pub const REMOTE_LEN: usize = 32;

/// A range of a peer's memory granted to this process: what it needs to put there (a grant
/// number, an address or offset, a key, a length), in [`REMOTE_LEN`] bytes to send in a message.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct RemoteRegion {
    pub(crate) kind: u32,
    /// The medium's key for the range (RDMA's rkey; 0 elsewhere).
    pub(crate) key: u32,
    pub(crate) id: u64,
    pub(crate) addr: u64,
    pub(crate) len: u64,
}

impl fmt::Debug for RemoteRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "grant {} ({} bytes)", self.id, self.len)
    }
}

impl RemoteRegion {
    /// The grant's number, which its owner sees in [`crate::Completion::Put`].
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len as usize
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Its bytes, to send.
    pub fn to_bytes(&self) -> [u8; REMOTE_LEN] {
        let mut b = [0u8; REMOTE_LEN];
        b[0..4].copy_from_slice(&self.kind.to_le_bytes());
        b[4..8].copy_from_slice(&self.key.to_le_bytes());
        b[8..16].copy_from_slice(&self.id.to_le_bytes());
        b[16..24].copy_from_slice(&self.addr.to_le_bytes());
        b[24..32].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Decodes [`RemoteRegion::to_bytes`]; `None` if `b` is short. What it names is checked
    /// when it is used, never trusted.
    pub fn from_bytes(b: &[u8]) -> Option<RemoteRegion> {
        let u = |r: Range<usize>| Some(u64::from_le_bytes(b.get(r)?.try_into().ok()?));
        Some(RemoteRegion {
            kind: u32::from_le_bytes(b.get(0..4)?.try_into().ok()?),
            key: u32::from_le_bytes(b.get(4..8)?.try_into().ok()?),
            id: u(8..16)?,
            addr: u(16..24)?,
            len: u(24..32)?,
        })
    }
}
