//! The error type of the kvstore crate.

use crate::{DType, Key};

/// Everything a kvstore call can fail with. No public call panics but the array
/// constructors that say so (of a shape whose size overflows or cannot be allocated: their
/// `try_` forms return [`KvError::TooLarge`]); each failure is one of these.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KvError {
    /// `create` was given a name that is not a store type.
    #[error("unknown KVStore type {name:?}; valid types are: {valid}")]
    UnknownType {
        /// The name given.
        name: String,
        /// The valid names, comma separated.
        valid: String,
    },
    /// push or pull of a key that was never initialised.
    #[error("key {0} has not been initialised")]
    UnknownKey(Key),
    /// init of a key that already exists.
    #[error("key {0} is already initialised")]
    DoubleInit(Key),
    /// A value's or output's shape differs from the stored value's.
    #[error("shape mismatch for key {key}: stored {expected:?}, given {got:?}")]
    ShapeMismatch {
        /// The key.
        key: Key,
        /// The stored shape.
        expected: Vec<usize>,
        /// The shape given.
        got: Vec<usize>,
    },
    /// A value's or output's dtype differs from the stored value's.
    #[error("dtype mismatch for key {key}: stored {expected}, given {got}")]
    DTypeMismatch {
        /// The key.
        key: Key,
        /// The stored dtype.
        expected: DType,
        /// The dtype given.
        got: DType,
    },
    /// Two arrays of an arithmetic operation do not agree.
    #[error("operands do not agree: {0}")]
    Incompatible(String),
    /// Lists of keys and of values (or outputs) of different lengths.
    #[error("{keys} keys but {values} values")]
    LengthMismatch {
        /// How many keys.
        keys: usize,
        /// How many values or outputs.
        values: usize,
    },
    /// A key was given an empty list of values or outputs.
    #[error("empty list of values for key {0}")]
    EmptyValues(Key),
    /// One store takes integer keys or string keys, not both.
    #[error("a store takes integer keys or string keys, not both (key {0})")]
    MixedKeyTypes(Key),
    /// Data whose length does not match the shape.
    #[error("{len} elements do not fill shape {shape:?}")]
    BadShape {
        /// The shape asked for.
        shape: Vec<usize>,
        /// The number of elements given.
        len: usize,
    },
    /// A shape whose size in bytes does not fit in memory's address range.
    #[error("shape {shape:?} of {dtype} is too large: its size in bytes overflows, or no memory can be had for it")]
    TooLarge {
        /// The shape asked for.
        shape: Vec<usize>,
        /// The dtype.
        dtype: DType,
    },
    /// Typed access with the wrong element type.
    #[error("array holds {actual}, accessed as {asked}")]
    WrongElementType {
        /// The array's dtype.
        actual: DType,
        /// The type asked for.
        asked: DType,
    },
    /// An index outside the array.
    #[error("index {index:?} out of bounds for shape {shape:?}")]
    OutOfBounds {
        /// The index.
        index: Vec<usize>,
        /// The shape.
        shape: Vec<usize>,
    },
    /// The operation is not supported by this store type or in this role.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// The updater or optimizer failed or broke its contract.
    #[error("updater failed on key {key}: {reason}")]
    Updater {
        /// The key.
        key: Key,
        /// Why.
        reason: String,
    },
    /// A device that this process does not have (a `gpu(i)` past the GPUs there are, or any
    /// GPU in a build without the `cuda` feature), or a CUDA call that failed.
    #[error("device: {0}")]
    Device(String),
    /// The job's configuration (environment) is missing or invalid.
    #[error("configuration: {0}")]
    Config(String),
    /// A peer process went away (connection closed, process died).
    #[error("peer lost: {0}")]
    PeerLost(String),
    /// A blocking wait ran out of time.
    #[error("timed out after {secs:.1} s waiting for {what}")]
    Timeout {
        /// What was being waited for.
        what: String,
        /// How long.
        secs: f64,
    },
    /// A message that breaks the protocol (bad fields, unexpected reply).
    #[error("protocol error: {0}")]
    Protocol(String),
    /// An error reported by a remote server for this request.
    #[error("server {server} refused the request: {message}")]
    Remote {
        /// The server's rank.
        server: usize,
        /// The server's message.
        message: String,
    },
    /// The job was aborted (a process failed); the store can no longer be used.
    #[error("job aborted: {0}")]
    Aborted(String),
    /// The program interrupted a call (`KVStore::set_interrupt_check`, Ctrl-C in Python);
    /// the store refuses further calls.
    #[error("interrupted: {0}")]
    Interrupted(String),
    /// Transport failure.
    #[error(transparent)]
    Transport(#[from] kvstore_transport::TransportError),
    /// I/O failure.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
}

/// Result with [`KvError`].
pub type Result<T, E = KvError> = std::result::Result<T, E>;
