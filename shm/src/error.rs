use std::io;

/// Why a shared-memory operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ShmError {
    /// A system call failed.
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
    /// An offset or length outside the segment or the pool.
    #[error("out of bounds: {0}")]
    OutOfBounds(String),
    /// The segment does not hold what it should (bad magic, version, sizes, ring indices).
    #[error("corrupt segment: {0}")]
    Corrupt(String),
    /// A region that is not (or no longer) allocated.
    #[error("region {offset}+{len} is not allocated")]
    NotAllocated {
        /// Offset in the segment.
        offset: usize,
        /// Length in bytes.
        len: usize,
    },
    /// No run of free pages is long enough.
    #[error("pool exhausted: no {0} bytes free")]
    Exhausted(usize),
    /// A wait ran out of time.
    #[error("timed out")]
    Timeout,
    /// A write into a segment this process maps read-only (a peer's pool).
    #[error("segment is mapped read-only here")]
    ReadOnly,
}

impl From<rustix::io::Errno> for ShmError {
    fn from(e: rustix::io::Errno) -> Self {
        ShmError::Io(e.into())
    }
}
