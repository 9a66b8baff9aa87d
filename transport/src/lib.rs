//! Transports for kvstore: one interface, [`Backend`], shaped by RDMA verbs, and its backends.
//!
//! A backend moves *messages* (a small body, and data lent to the receiver) and *puts* (bytes
//! written straight into memory the peer granted, notified with a 32-bit immediate) between
//! the processes of a job. It knows nothing of keys or tensors.
//!
//! - [`backend`]: the interface: registered memory, grants, messages, puts, completions, and
//!   sleeping on several backends at once ([`wait`]).
//! - [`tcp`]: framing on TCP ([`frame`], an incremental reader, a `writev` queue) and
//!   [`TcpBackend`].
//! - [`shm`]: [`ShmBackend`], on the shared-memory primitives of `kvstore-shm`.
//!
//! One conformance suite (`tests/conformance.rs`) runs over every backend.
#![deny(missing_docs)]

pub mod backend;
pub mod copy;
mod error;
pub mod frame;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzz;
mod memory;
#[cfg(feature = "rdma")]
pub mod rdma;
mod region;
pub mod shm;
mod table;
pub mod tcp;

pub use backend::{
    wait, Access, Backend, Completion, DmaBuf, Held, Lent, Mem, PeerId, Region, RemoteRegion, Sent,
    Storage, Token, IMM_BITS, REMOTE_LEN,
};
pub use error::TransportError;
pub use frame::{FrameHeader, HEADER_LEN, META_LEN};
#[cfg(feature = "rdma")]
pub use rdma::{RdmaBackend, RdmaConfig};
pub use shm::{PeerProcess, SendPages, ShmBackend, ShmConfig};
pub use tcp::TcpBackend;
