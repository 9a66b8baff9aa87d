//! Framed TCP connections.
//!
//! The non-blocking side ([`FrameReader`], [`OutQueue`]) is driven by the caller's mio loop; it
//! allocates nothing per message once its buffers have grown. The blocking side ([`blocking`])
//! serves control-plane connections (rendezvous, barriers) with timeouts on every wait.

mod backend;
pub mod blocking;
pub(crate) mod link;
mod reader;
mod writer;

#[cfg(feature = "rdma")]
pub(crate) use backend::liveness;
pub use backend::{msg_frame_header, TcpBackend};
pub use link::{put_frame_header, Admission, MAX_BODY};
pub use reader::{grow_into, FrameQueue, FrameReader, FrameSink};
pub use writer::{OutQueue, Payload};

use std::io;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::TransportError;

/// Connects to `addr`, retrying refused connections until `timeout` has passed (the peer may
/// not be listening yet). The stream has `TCP_NODELAY` set.
pub fn connect_retry(
    addr: SocketAddr,
    timeout: Duration,
) -> Result<std::net::TcpStream, TransportError> {
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_millis(5);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(TransportError::Timeout(format!("connecting to {addr}")));
        }
        match std::net::TcpStream::connect_timeout(&addr, left) {
            Ok(s) => {
                s.set_nodelay(true)?;
                return Ok(s);
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::ConnectionRefused | io::ErrorKind::ConnectionReset
                ) =>
            {
                std::thread::sleep(pause.min(left));
                pause = (pause * 2).min(Duration::from_millis(200));
            }
            Err(e) if e.kind() == io::ErrorKind::TimedOut => {
                return Err(TransportError::Timeout(format!("connecting to {addr}")))
            }
            Err(e) => return Err(e.into()),
        }
    }
}
