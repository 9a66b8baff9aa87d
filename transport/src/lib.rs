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
#![deny(missing_docs)]

mod error;
pub mod frame;
pub mod tcp;

pub use error::TransportError;
pub use frame::{FrameHeader, HEADER_LEN, META_LEN};
