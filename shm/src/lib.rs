//! Shared-memory primitives for kvstore: bytes and pages only.
//!
//! - [`Segment`]: an anonymous shared mapping (`memfd_create` + `mmap`). It has no name, so
//!   nothing is left under `/dev/shm` when a process crashes; other processes get it by
//!   descriptor passing ([`send_fds`] / [`recv_fds`], `SCM_RIGHTS` over a Unix socket).
//! - [`Ring`]: a single-producer single-consumer ring of fixed-size descriptors.
//! - [`Pool`]: pages handed out in contiguous runs by one process and freed by any, through a
//!   lock-free bitmap in the segment; descriptors naming pages outside the pool or not
//!   allocated are refused.
//! - [`Wake`]: spin briefly, then sleep on a futex in the segment; wakers make a system call
//!   only when the other side sleeps.
//! - [`Channel`]: a segment holding two rings, their wake words and a pool: what one pair of
//!   processes needs to talk.
//!
//! Every `unsafe` block is in `segment`, where the mapping is read and written.
#![deny(missing_docs)]

mod channel;
mod error;
mod fdpass;
mod pool;
mod ring;
mod segment;
mod wake;

pub use channel::{Channel, ChannelConfig, Side};
pub use error::ShmError;
pub use fdpass::{recv_fds, send_fds};
pub use pool::{Pool, Region};
pub use ring::{Ring, SLOT};
pub use segment::Segment;
pub use wake::{doorbell, drain_doorbell, Wake};
