use std::io;

/// Why a transport operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// The frame does not start with the protocol's magic number.
    #[error("bad magic {0:#010x}: not a kvstore peer")]
    BadMagic(u32),
    /// The peer speaks another protocol version.
    #[error("protocol version {got}, expected {expected}")]
    VersionSkew {
        /// The version the peer sent.
        got: u16,
        /// Ours.
        expected: u16,
    },
    /// A payload longer than the receiver accepts.
    #[error("payload of {len} bytes exceeds the limit of {max}")]
    Oversize {
        /// The announced length.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// The receiver has no place for this payload (its length or purpose is wrong).
    #[error("refused frame: {0}")]
    Refused(String),
    /// The peer closed the connection.
    #[error("connection closed by peer")]
    Closed,
    /// The connection closed in the middle of a frame.
    #[error("connection closed in the middle of a frame ({got} of {want} bytes)")]
    Truncated {
        /// Bytes received.
        got: usize,
        /// Bytes expected.
        want: usize,
    },
    /// A blocking operation ran out of time.
    #[error("timed out: {0}")]
    Timeout(String),
    /// An I/O error.
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
    /// A shared-memory failure (bad descriptor, exhausted pool, corrupt segment).
    #[error("shared memory: {0}")]
    Shm(#[from] kvstore_shm::ShmError),
    /// An RDMA verbs failure (no device, a refused registration, a failed queue pair), with
    /// its cause and, where there is one, the fix.
    #[error("rdma: {0}")]
    Rdma(String),
    /// The peer process is gone.
    #[error("peer lost: {0}")]
    PeerLost(String),
}
