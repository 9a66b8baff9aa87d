//! kvstore: a parameter server with the semantics of Apache MXNet's KVStore.
//!
//! ```
//! use kvstore::{create, cpu, NDArray};
//! let shape = [2, 3];
//! let mut kv = create("local").unwrap();
//! kv.init(3, &(NDArray::ones(&shape) * 2.0)).unwrap();
//! // A list of values for one key is summed, then assigned.
//! let b: Vec<NDArray> = (0..4).map(|i| NDArray::ones(&shape).on(cpu(i))).collect();
//! kv.push(3, &b).unwrap();
//! let mut a = NDArray::zeros(&shape);
//! kv.pull(3, &mut a).unwrap();
//! assert_eq!(a.to_string(), "[[4. 4. 4.]\n [4. 4. 4.]]");
//! ```
//!
//! Store types: `local` and `device` (one process), `dist_sync` and `dist_async` (scheduler,
//! servers and workers as separate processes, started by `kvrun`; see [`dist`]).
#![deny(missing_docs)]

mod args;
mod config;
pub mod dist;
mod dtype;
mod error;
mod format;
mod local;
mod ndarray;
pub mod ops;
mod optimizer;
mod registry;
mod store;

pub use args::{Key, Keys, Outputs, Values};
pub use dtype::{cpu, gpu, DType, Device, Element};
pub use error::{KvError, Result};
pub use ndarray::NDArray;
pub use optimizer::{Optimizer, OptimizerUpdater};
pub use registry::{register_updater, SharedUpdater};
pub use store::{create, KVStore, Updater, TYPES};
