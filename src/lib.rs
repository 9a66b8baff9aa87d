//! kvstore: a parameter server with the semantics of Apache MXNet's KVStore.
//!
//! ```
//! use kvstore::{create, cpu, NDArray};
//! let shape = [2, 3];
//! let mut kv = create("local").unwrap();
//! kv.init(3, &(NDArray::ones(&shape) * 2.0)).unwrap();
//! // A list of values for one key is summed, then assigned.
//! let b: Vec<NDArray> = (0..4).map(|i| NDArray::ones(&shape).on(cpu(i)).unwrap()).collect();
//! kv.push(3, &b).unwrap();
//! let mut a = NDArray::zeros(&shape);
//! kv.pull(3, &mut a).unwrap();
//! assert_eq!(a.to_string(), "[[4. 4. 4.]\n [4. 4. 4.]]");
//! ```
//!
//! Store types: `local` and `device` (one process), `dist_sync` and `dist_async` (scheduler,
//! servers and workers as separate processes, started by `kvrun`, configured by [`Config`]).
//!
//! Inside, a distributed job is: [`scheduler`] (rendezvous), `server` (an I/O loop around the
//! server's state machine, which owns a shard of the keys), `worker` (the store a program
//! uses), `protocol` (what a message means, which server holds which part of a key), and
//! `net` (the transports of `kvstore-transport` that the worker's and server's loops drive).
#![deny(missing_docs)]

mod args;
#[cfg(not(feature = "internals"))]
mod auth;
/// The handshake's proofs, for the test suite's raw peers only (feature `internals`).
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod auth;
mod compress;
mod config;
mod dtype;
mod error;
mod format;
/// The fuzzers' entry points (feature `internals`): not an API.
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod fuzz;
mod gpu;
mod local;
mod logging;
pub mod metrics;
mod ndarray;
mod net;
#[cfg(not(feature = "internals"))]
mod ops;
/// The aggregation kernels, for their benchmark only (feature `internals`): not an API (they
/// take lengths on trust).
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod ops;
mod optimizer;
#[cfg(test)]
mod pair;
mod prioritized;
#[cfg(not(feature = "internals"))]
mod protocol;
/// The wire protocol, for the test suite's raw peers only (feature `internals`): not an API.
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod protocol;
mod rdma;
mod registry;
/// kvrun's end of the channel on which a job's processes report to it: the launcher's, not an
/// API.
#[doc(hidden)]
pub mod report;
mod roles;
mod rows;
pub mod scheduler;
mod secret;
mod server;
mod storage;
mod store;
mod worker;

pub use args::{Key, Keys, Outputs, Values};
pub use compress::Compression;
pub use config::{Config, RdmaSettings, Role, TransportChoice, MAX_TIMEOUT_S};
pub use dtype::{cpu, gpu, DType, Device, Element};
pub use error::{KvError, Result};
pub use gpu::{gpu_count, CUDA_BUILT};
pub use logging::{init_logging, DEFAULT_FILTER};

/// Whether this build has the RDMA transport (the `rdma` feature).
pub const RDMA_BUILT: bool = cfg!(feature = "rdma");
pub use ndarray::NDArray;
pub use optimizer::{LrScheduler, Multiplied, Optimizer, OptimizerUpdater};
pub use prioritized::Prioritized;
pub use registry::{register_updater, register_updater_factory, SharedUpdater, UpdaterFactory};
pub use roles::{run_role, run_role_if_not_worker};
pub use store::{create, KVStore, Pending, Updater, TYPES};
