//! A process's place in a job, read from its environment.
//!
//! MXNet's variables are accepted as they are: `DMLC_ROLE` (`worker`, `server`, `scheduler`),
//! `DMLC_PS_ROOT_URI`, `DMLC_PS_ROOT_PORT`, `DMLC_NUM_SERVER`, `DMLC_NUM_WORKER`, and
//! `DMLC_NODE_HOST` (the address this node advertises). Ours:
//!
//! | variable | meaning | default |
//! | --- | --- | --- |
//! | `KVSTORE_SECRET` | the job secret every connection must present | empty |
//! | `KVSTORE_RANK` | the rank this process asks for (the launcher sets it) | by arrival |
//! | `KVSTORE_TIMEOUT` | seconds any blocking wait may take | 120 |
//! | `KVSTORE_BIGARRAY_BOUND` (or `MXNET_KVSTORE_BIGARRAY_BOUND`) | elements above which a tensor is sliced over all servers | 1000000 |
//! | `KVSTORE_MAX_MESSAGE` | largest payload accepted, bytes | 8 GiB |

use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

use crate::{KvError, Result};

/// A process role.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Rendezvous, barriers, shutdown.
    Scheduler,
    /// Holds a shard of the keys and runs the updater.
    Server,
    /// Runs the user's training code.
    Worker,
}

/// Everything a process needs to join a job.
#[derive(Clone, Debug)]
pub struct Config {
    /// This process's role.
    pub role: Role,
    /// The scheduler's address.
    pub root: SocketAddr,
    /// Number of servers.
    pub num_servers: usize,
    /// Number of workers.
    pub num_workers: usize,
    /// The job secret.
    pub secret: String,
    /// The rank asked for, if any.
    pub rank_hint: Option<u32>,
    /// The address this node advertises to its peers, if set.
    pub node_host: Option<String>,
    /// The bound of every blocking wait.
    pub timeout: Duration,
    /// Tensors with more elements are sliced over all servers.
    pub bigarray_bound: usize,
    /// Largest payload accepted.
    pub max_message: u64,
}

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

fn need(name: &str) -> Result<String> {
    var(name).ok_or_else(|| {
        KvError::Config(format!(
            "{name} is not set: start distributed jobs with kvrun (or set DMLC_ROLE, \
             DMLC_PS_ROOT_URI, DMLC_PS_ROOT_PORT, DMLC_NUM_SERVER, DMLC_NUM_WORKER)"
        ))
    })
}

fn parse<T: std::str::FromStr>(name: &str, v: &str) -> Result<T> {
    v.trim()
        .parse()
        .map_err(|_| KvError::Config(format!("{name}={v:?} is not a valid number")))
}

impl Config {
    /// Reads the configuration from the environment.
    pub fn from_env() -> Result<Config> {
        let role = match need("DMLC_ROLE")?.as_str() {
            "worker" => Role::Worker,
            "server" => Role::Server,
            "scheduler" => Role::Scheduler,
            other => {
                return Err(KvError::Config(format!(
                    "DMLC_ROLE={other:?}; expected worker, server or scheduler"
                )))
            }
        };
        let host = need("DMLC_PS_ROOT_URI")?;
        let port: u16 = parse("DMLC_PS_ROOT_PORT", &need("DMLC_PS_ROOT_PORT")?)?;
        let root = (host.as_str(), port)
            .to_socket_addrs()
            .map_err(|e| KvError::Config(format!("DMLC_PS_ROOT_URI={host:?}: {e}")))?
            .next()
            .ok_or_else(|| KvError::Config(format!("DMLC_PS_ROOT_URI={host:?} has no address")))?;
        let num_servers: usize = parse("DMLC_NUM_SERVER", &need("DMLC_NUM_SERVER")?)?;
        let num_workers: usize = parse("DMLC_NUM_WORKER", &need("DMLC_NUM_WORKER")?)?;
        if num_servers == 0 || num_workers == 0 {
            return Err(KvError::Config(
                "a job needs at least one server and one worker".into(),
            ));
        }
        let timeout_s: f64 = match var("KVSTORE_TIMEOUT") {
            Some(v) => parse("KVSTORE_TIMEOUT", &v)?,
            None => 120.0,
        };
        if !(timeout_s > 0.0 && timeout_s.is_finite()) {
            return Err(KvError::Config("KVSTORE_TIMEOUT must be positive".into()));
        }
        let bound =
            match var("KVSTORE_BIGARRAY_BOUND").or_else(|| var("MXNET_KVSTORE_BIGARRAY_BOUND")) {
                Some(v) => parse("KVSTORE_BIGARRAY_BOUND", &v)?,
                None => 1_000_000,
            };
        let max_message = match var("KVSTORE_MAX_MESSAGE") {
            Some(v) => parse("KVSTORE_MAX_MESSAGE", &v)?,
            None => 8 << 30,
        };
        Ok(Config {
            role,
            root,
            num_servers,
            num_workers,
            secret: var("KVSTORE_SECRET").unwrap_or_default(),
            rank_hint: var("KVSTORE_RANK")
                .map(|v| parse("KVSTORE_RANK", &v))
                .transpose()?,
            node_host: var("DMLC_NODE_HOST"),
            timeout: Duration::from_secs_f64(timeout_s),
            bigarray_bound: bound,
            max_message,
        })
    }
}

/// Compares secrets in time independent of where they differ.
pub(crate) fn secret_matches(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
