//! Message transports for kvstore.
//!
//! A transport moves *messages*: a fixed-size header (whose meaning belongs to the protocol
//! above) followed by a payload of bytes that is read straight into the buffer its receiver
//! names and written with vectored I/O straight from the buffer its sender names. It knows
//! nothing of keys or tensors.
//!
//! - [`frame`]: the fixed frame header (magic, version, payload length, protocol metadata) and
//!   its validation.
//! - [`tcp`]: non-blocking framed connections on mio: an incremental frame reader that asks its
//!   sink where each payload goes, an output queue flushed with `writev`, and blocking helpers
//!   for control-plane connections.
//! - [`Transport`]: one interface for a connected pair of processes, shaped by what RDMA
//!   offers (two-sided messages, and one-sided puts into a region the peer exposed, completed by
//!   a notification carrying an immediate value), implemented by [`TcpPair`] and [`ShmPair`]
//!   and tested by one conformance suite.
#![deny(missing_docs)]

mod api;
mod error;
pub mod frame;
mod pair_shm;
mod pair_tcp;
pub mod tcp;

pub use api::{Event, RegionHandle, Transport};
pub use error::TransportError;
pub use frame::{FrameHeader, HEADER_LEN, META_LEN};
pub use pair_shm::{ShmListener, ShmPair};
pub use pair_tcp::TcpPair;
