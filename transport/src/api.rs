//! The transport interface.

use std::time::Instant;

use crate::TransportError;

/// A region of memory one side exposed for the peer to put into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegionHandle {
    /// Where the region is, as its owner's transport names it (a pool offset, a table index).
    pub key: u64,
    /// Its length in bytes.
    pub len: u64,
}

impl RegionHandle {
    /// 16 bytes, to send to the peer.
    pub fn to_bytes(self) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&self.key.to_le_bytes());
        b[8..].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// The handle in 16 bytes from [`RegionHandle::to_bytes`].
    pub fn from_bytes(b: &[u8]) -> Option<RegionHandle> {
        let key = u64::from_le_bytes(b.get(..8)?.try_into().ok()?);
        let len = u64::from_le_bytes(b.get(8..16)?.try_into().ok()?);
        Some(RegionHandle { key, len })
    }
}

/// What arrived.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// A two-sided message of `len` bytes (in the caller's buffer) with `tag`.
    Message {
        /// The sender's tag.
        tag: u64,
        /// Bytes received.
        len: usize,
    },
    /// The peer put `len` bytes at `offset` into the local region `region` and notified with
    /// `imm`; the bytes are already in place.
    Put {
        /// The immediate value.
        imm: u64,
        /// The local region written.
        region: RegionHandle,
        /// Where in it.
        offset: usize,
        /// How many bytes.
        len: usize,
    },
}

/// A connected pair of processes.
///
/// Small messages travel inline (eager); a put writes straight into memory the peer exposed
/// and then notifies it (rendezvous). Every wait ends at its deadline; a peer that is gone is
/// an error, never a hang.
pub trait Transport: Send {
    /// `"tcp"` or `"shm"`.
    fn name(&self) -> &'static str;

    /// Sends a two-sided message.
    fn send(&mut self, tag: u64, payload: &[u8], deadline: Instant) -> Result<(), TransportError>;

    /// Waits for the next message or put notification; a message's payload goes into `buf`
    /// (which must be large enough).
    fn recv(&mut self, buf: &mut [u8], deadline: Instant) -> Result<Event, TransportError>;

    /// Exposes a new local region of `len` bytes for the peer to put into.
    fn expose(&mut self, len: usize) -> Result<RegionHandle, TransportError>;

    /// Gives back a local exposed region (the peer must no longer put into it).
    fn release(&mut self, region: RegionHandle) -> Result<(), TransportError>;

    /// Puts `data` into the peer's region `remote` at `offset`, then notifies with `imm`.
    fn put(
        &mut self,
        remote: RegionHandle,
        offset: usize,
        data: &[u8],
        imm: u64,
        deadline: Instant,
    ) -> Result<(), TransportError>;

    /// Copies bytes out of a local exposed region.
    fn read_region(
        &self,
        region: RegionHandle,
        offset: usize,
        out: &mut [u8],
    ) -> Result<(), TransportError>;
}
