//! A process's place in a job, read from its environment.
//!
//! MXNet's variables are accepted as they are: `DMLC_ROLE` (`worker`, `server`, `scheduler`),
//! `DMLC_PS_ROOT_URI`, `DMLC_PS_ROOT_PORT`, `DMLC_NUM_SERVER`, `DMLC_NUM_WORKER`, and
//! `DMLC_NODE_HOST` (the address this node advertises). Ours:
//!
//! | variable | meaning | default |
//! | --- | --- | --- |
//! | `KVSTORE_SECRET` | the job's secret (16 bytes or more), which every connection proves it knows without sending it | kvrun draws one; else `KVSTORE_SECRET_FILE` |
//! | `KVSTORE_SECRET_FILE` | a file holding the secret (yours, mode 0600), as ssh keys are kept | `~/.kvstore/secret`, made (random) when absent |
//! | `KVSTORE_RANK` | the rank this process asks for (the launcher sets it) | by arrival |
//! | `KVSTORE_TIMEOUT` | seconds any blocking wait may take | 120 |
//! | `KVSTORE_BIGARRAY_BOUND` (or `MXNET_KVSTORE_BIGARRAY_BOUND`) | elements above which a tensor is sliced over all servers | 1000000 |
//! | `KVSTORE_MAX_MESSAGE` | largest payload accepted, bytes | 8 GiB |
//! | `KVSTORE_TRANSPORT` | `auto`, `tcp`, `shm` or `rdma` | `auto` |
//! | `KVSTORE_RDMA_DEVICE`, `KVSTORE_RDMA_PORT` | the RDMA device (`mlx5_0`, `rxe0`) and its port | the first, 1 |
//! | `KVSTORE_RDMA_GID_INDEX` | a fixed GID index | the RoCE v2 GID of the address that reaches the peer |
//! | `KVSTORE_RDMA_SL`, `KVSTORE_RDMA_TC` | service level, traffic class | 0, 0 |
//! | `KVSTORE_RDMA_WRITE_IMM` | `0`: a put that fills its grant goes as an eager SEND (8 KiB or less) or WRITEs and a notice, not as one WRITE_WITH_IMM | 1 |
//!
//! # Under mpirun or srun
//! Without `DMLC_ROLE`, a process started by Open MPI's or MPICH's `mpirun` or by Slurm's
//! `srun` takes its place from their variables, the first found of
//! `OMPI_COMM_WORLD_RANK`/`_SIZE`, `PMI_RANK`/`PMI_SIZE` (an mpiexec inside a Slurm job sets
//! them) and `SLURM_PROCID`/`SLURM_NTASKS`. The rule: with `KVSTORE_NUM_SERVERS` = S
//! (default 1), rank 0 is the scheduler, ranks 1..=S the servers, the rest the workers
//! (so a job of N ranks has N - 1 - S workers). The scheduler is found at
//! `KVSTORE_ROOT_URI` if set, else at the first host of Slurm's node list, else on loopback when
//! every rank runs on one host (`OMPI_COMM_WORLD_LOCAL_SIZE` = `OMPI_COMM_WORLD_SIZE`); its port
//! is `KVSTORE_ROOT_PORT`, else derived from the launcher's job id. The secret is never derived
//! from anything guessable: it is `KVSTORE_SECRET`, or the per-user secret file (on a cluster,
//! the shared home directory gives every host the same one; where it does not, set
//! `KVSTORE_SECRET` or `KVSTORE_SECRET_FILE`).

use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

use crate::{KvError, Result};

/// The longest timeout a job takes, in seconds (30 days): any blocking wait of the job is
/// bounded by it, and deadlines computed from it stay far from the clock's limits.
pub const MAX_TIMEOUT_S: f64 = 30.0 * 24.0 * 3600.0;

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
    /// Which transport a worker uses for servers on its host (`KVSTORE_TRANSPORT`).
    pub transport: TransportChoice,
    /// Bytes of a worker's shared-memory pool (`KVSTORE_SHM_POOL`; reserved, touched as used).
    pub shm_pool_bytes: usize,
    /// Bytes a server may hold in receive slots, which workers put their pushes into
    /// (`KVSTORE_SLOT_BYTES`); pushes beyond it go as messages.
    pub slot_bytes: usize,
    /// Which RDMA device, port and paths (`KVSTORE_RDMA_*`), where RDMA is built.
    pub rdma: RdmaSettings,
    /// The log filter: `KVSTORE_LOG`, else `RUST_LOG` (see [`crate::init_logging`]).
    pub log: Option<String>,
    /// Where the launcher listens for reports (`KVSTORE_REPORT`, see [`crate::report`]).
    pub report: Option<SocketAddr>,
}

/// The RDMA variables (`KVSTORE_RDMA_DEVICE`, `_PORT`, `_GID_INDEX`, `_SL`, `_TC`,
/// `_WRITE_IMM`), as NCCL's
/// `NCCL_IB_HCA` or UCX's `UCX_NET_DEVICES` choose a NIC.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RdmaSettings {
    /// The device; the first one if unset.
    pub device: Option<String>,
    /// The device's port; 1 if unset.
    pub port: Option<u8>,
    /// A fixed GID index; unset: the RoCE v2 GID of the address that reaches the peer.
    pub gid_index: Option<u32>,
    /// Service level.
    pub service_level: u8,
    /// Traffic class (RoCE: DSCP and ECN).
    pub traffic_class: u8,
    /// Whether a put that fills its grant is one WRITE_WITH_IMM; unset: the backend's
    /// default (yes).
    pub write_imm: Option<bool>,
}

/// Which transport a worker uses for servers on its host (`KVSTORE_TRANSPORT`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportChoice {
    /// Shared memory where the server is on this host, TCP otherwise (the default).
    Auto,
    /// TCP everywhere.
    Tcp,
    /// Shared memory, and an error if a server is not on this host.
    Shm,
    /// RDMA to every server (on this host too, through the device's loopback), and an error
    /// naming the reason for a pair that cannot use it. Needs the `rdma` cargo feature.
    Rdma,
}

/// Where variables come from: the process environment, or a table in tests.
type Lookup<'a> = &'a dyn Fn(&str) -> Option<String>;

fn get(env: Lookup, name: &str) -> Option<String> {
    env(name).filter(|v| !v.is_empty())
}

fn need(env: Lookup, name: &str) -> Result<String> {
    get(env, name).ok_or_else(|| {
        KvError::Config(format!(
            "{name} is not set: start distributed jobs with kvrun, mpirun or srun (or set \
             DMLC_ROLE, DMLC_PS_ROOT_URI, DMLC_PS_ROOT_PORT, DMLC_NUM_SERVER, DMLC_NUM_WORKER)"
        ))
    })
}

/// A variable's value parsed, if it is set.
fn opt<T: std::str::FromStr>(env: Lookup, name: &str) -> Result<Option<T>> {
    get(env, name).map(|v| parse(name, &v)).transpose()
}

fn parse<T: std::str::FromStr>(name: &str, v: &str) -> Result<T> {
    v.trim()
        .parse()
        .map_err(|_| KvError::Config(format!("{name}={v:?} is not a valid number")))
}

/// A process's rank among `size`, as an external launcher gave it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LauncherRank {
    /// Which launcher: `"openmpi"`, `"pmi"` (MPICH's hydra and others) or `"slurm"`.
    pub launcher: &'static str,
    /// This process's rank.
    pub rank: usize,
    /// The number of processes.
    pub size: usize,
    /// Whether every rank runs on this host, when the launcher says.
    pub all_local: Option<bool>,
    /// An identifier of the job, when the launcher gives one.
    pub job_id: Option<String>,
}

fn launcher_rank(env: Lookup) -> Result<Option<LauncherRank>> {
    let pair = |r: &str, s: &str| -> Result<Option<(usize, usize)>> {
        match (get(env, r), get(env, s)) {
            (Some(a), Some(b)) => Ok(Some((parse(r, &a)?, parse(s, &b)?))),
            _ => Ok(None),
        }
    };
    if let Some((rank, size)) = pair("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")? {
        let local = get(env, "OMPI_COMM_WORLD_LOCAL_SIZE").and_then(|v| v.parse::<usize>().ok());
        return Ok(Some(LauncherRank {
            launcher: "openmpi",
            rank,
            size,
            all_local: local.map(|l| l == size),
            job_id: get(env, "OMPI_MCA_ess_base_jobid").or_else(|| get(env, "PMIX_NAMESPACE")),
        }));
    }
    if let Some((rank, size)) = pair("PMI_RANK", "PMI_SIZE")? {
        let local = get(env, "MPI_LOCALNRANKS").and_then(|v| v.parse::<usize>().ok());
        return Ok(Some(LauncherRank {
            launcher: "pmi",
            rank,
            size,
            all_local: local.map(|l| l == size),
            job_id: get(env, "PMI_KVSNAME").or_else(|| get(env, "PMIX_NAMESPACE")),
        }));
    }
    if let Some((rank, size)) = pair("SLURM_PROCID", "SLURM_NTASKS")? {
        let nodes = get(env, "SLURM_NNODES").or_else(|| get(env, "SLURM_JOB_NUM_NODES"));
        let job = get(env, "SLURM_JOB_ID").or_else(|| get(env, "SLURM_JOBID"));
        return Ok(Some(LauncherRank {
            launcher: "slurm",
            rank,
            size,
            all_local: nodes.map(|n| n.trim() == "1"),
            job_id: job.map(|j| format!("{j}.{}", get(env, "SLURM_STEP_ID").unwrap_or_default())),
        }));
    }
    Ok(None)
}

/// The first host of a Slurm node list: `node[03-05,9],gpu1` gives `node03`.
pub fn first_slurm_host(list: &str) -> Option<String> {
    let list = list.trim();
    let (prefix, rest) = match list.find(['[', ',']) {
        None => return (!list.is_empty()).then(|| list.to_string()),
        Some(i) if list.as_bytes()[i] == b',' => return Some(list[..i].to_string()),
        Some(i) => (&list[..i], &list[i + 1..]),
    };
    let first = rest.split([',', ']']).next()?;
    let start = first.split('-').next()?;
    (!start.is_empty()).then(|| format!("{prefix}{start}"))
}

/// FNV-1a of the job id, mapped to a port in 20000..60000.
fn port_from_job(job: &str) -> u16 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in job.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    20000 + (h % 40000) as u16
}

fn resolve(host: &str, port: u16, name: &str) -> Result<SocketAddr> {
    (host, port)
        .to_socket_addrs()
        .map_err(|e| KvError::Config(format!("{name}={host:?}: {e}")))?
        .next()
        .ok_or_else(|| KvError::Config(format!("{name}={host:?} has no address")))
}

/// Role, root address and job shape: from `DMLC_*`, or adopted from an external launcher.
struct Place {
    role: Role,
    root: SocketAddr,
    num_servers: usize,
    num_workers: usize,
    rank_hint: Option<u32>,
}

fn place(env: Lookup) -> Result<Place> {
    if let Some(role) = get(env, "DMLC_ROLE") {
        let role = match role.as_str() {
            "worker" => Role::Worker,
            "server" => Role::Server,
            "scheduler" => Role::Scheduler,
            other => {
                return Err(KvError::Config(format!(
                    "DMLC_ROLE={other:?}; expected worker, server or scheduler"
                )))
            }
        };
        let host = need(env, "DMLC_PS_ROOT_URI")?;
        let port: u16 = parse("DMLC_PS_ROOT_PORT", &need(env, "DMLC_PS_ROOT_PORT")?)?;
        return Ok(Place {
            role,
            root: resolve(&host, port, "DMLC_PS_ROOT_URI")?,
            num_servers: parse("DMLC_NUM_SERVER", &need(env, "DMLC_NUM_SERVER")?)?,
            num_workers: parse("DMLC_NUM_WORKER", &need(env, "DMLC_NUM_WORKER")?)?,
            rank_hint: get(env, "KVSTORE_RANK")
                .map(|v| parse("KVSTORE_RANK", &v))
                .transpose()?,
        });
    }
    let Some(l) = launcher_rank(env)? else {
        return Err(need(env, "DMLC_ROLE")
            .err()
            .unwrap_or(KvError::Config("DMLC_ROLE".into())));
    };
    let s: usize = match get(env, "KVSTORE_NUM_SERVERS") {
        Some(v) => parse("KVSTORE_NUM_SERVERS", &v)?,
        None => 1,
    };
    if s == 0 || l.size < s + 2 {
        return Err(KvError::Config(format!(
            "{} started {} processes; a job with {s} server(s) needs at least {} (scheduler, \
             servers, one worker): set KVSTORE_NUM_SERVERS or start more ranks",
            l.launcher,
            l.size,
            s + 2
        )));
    }
    let (role, hint) = match l.rank {
        0 => (Role::Scheduler, 0),
        r if r <= s => (Role::Server, r - 1),
        r => (Role::Worker, r - 1 - s),
    };
    let host = match get(env, "KVSTORE_ROOT_URI").or_else(|| get(env, "DMLC_PS_ROOT_URI")) {
        Some(h) => h,
        None => match get(env, "SLURM_JOB_NODELIST").or_else(|| get(env, "SLURM_NODELIST")) {
            Some(list) if l.all_local != Some(true) => {
                first_slurm_host(&list).ok_or_else(|| {
                    KvError::Config(format!("cannot read the Slurm node list {list:?}"))
                })?
            }
            _ if l.all_local == Some(true) => "127.0.0.1".to_string(),
            _ => {
                return Err(KvError::Config(format!(
                    "{} ranks span several hosts: set KVSTORE_ROOT_URI to rank 0's host \
                     (e.g. mpirun -x KVSTORE_ROOT_URI=<host of rank 0>)",
                    l.launcher
                )))
            }
        },
    };
    let port = match get(env, "KVSTORE_ROOT_PORT").or_else(|| get(env, "DMLC_PS_ROOT_PORT")) {
        Some(p) => parse("KVSTORE_ROOT_PORT", &p)?,
        None => match &l.job_id {
            Some(j) => port_from_job(j),
            None => {
                return Err(KvError::Config(format!(
                    "{} gives no job id: set KVSTORE_ROOT_PORT",
                    l.launcher
                )))
            }
        },
    };
    Ok(Place {
        role,
        root: resolve(&host, port, "KVSTORE_ROOT_URI")?,
        num_servers: s,
        num_workers: l.size - 1 - s,
        rank_hint: Some(hint as u32),
    })
}

impl Config {
    /// Reads the configuration from the environment.
    /// The role `DMLC_ROLE` names, without reading the rest (`None` if unset or unknown).
    pub fn role_from_env() -> Option<Role> {
        match std::env::var("DMLC_ROLE").as_deref() {
            Ok("server") => Some(Role::Server),
            Ok("scheduler") => Some(Role::Scheduler),
            Ok("worker") => Some(Role::Worker),
            _ => None,
        }
    }

    /// Reads the configuration from the process environment.
    pub fn from_env() -> Result<Config> {
        Config::from_lookup(&|name| std::env::var(name).ok())
    }

    /// Reads the configuration from `env` (a name-to-value lookup).
    pub fn from_lookup(env: &dyn Fn(&str) -> Option<String>) -> Result<Config> {
        let p = place(env)?;
        if p.num_servers == 0 || p.num_workers == 0 {
            return Err(KvError::Config(
                "a job needs at least one server and one worker".into(),
            ));
        }
        let timeout_s: f64 = match get(env, "KVSTORE_TIMEOUT") {
            Some(v) => parse("KVSTORE_TIMEOUT", &v)?,
            None => 120.0,
        };
        if !(timeout_s > 0.0 && timeout_s <= MAX_TIMEOUT_S) {
            return Err(KvError::Config(format!(
                "KVSTORE_TIMEOUT must be positive and at most {MAX_TIMEOUT_S} s (30 days)"
            )));
        }
        let bound = match get(env, "KVSTORE_BIGARRAY_BOUND")
            .or_else(|| get(env, "MXNET_KVSTORE_BIGARRAY_BOUND"))
        {
            Some(v) => parse("KVSTORE_BIGARRAY_BOUND", &v)?,
            None => 1_000_000,
        };
        let max_message = match get(env, "KVSTORE_MAX_MESSAGE") {
            Some(v) => parse("KVSTORE_MAX_MESSAGE", &v)?,
            None => 8 << 30,
        };
        let transport = match get(env, "KVSTORE_TRANSPORT").as_deref() {
            None | Some("") | Some("auto") => TransportChoice::Auto,
            Some("tcp") => TransportChoice::Tcp,
            Some("shm") => TransportChoice::Shm,
            Some("rdma") if cfg!(feature = "rdma") => TransportChoice::Rdma,
            Some("rdma") => {
                return Err(KvError::Config(
                    "KVSTORE_TRANSPORT=rdma, but this build has no RDMA: build with \
                     `--features rdma` (it needs libibverbs-dev libclang-dev pkg-config)"
                        .into(),
                ))
            }
            Some(other) => {
                return Err(KvError::Config(format!(
                    "KVSTORE_TRANSPORT={other:?}; expected auto, tcp, shm or rdma"
                )))
            }
        };
        let rdma = RdmaSettings {
            device: get(env, "KVSTORE_RDMA_DEVICE"),
            port: opt(env, "KVSTORE_RDMA_PORT")?,
            gid_index: opt(env, "KVSTORE_RDMA_GID_INDEX")?,
            service_level: opt(env, "KVSTORE_RDMA_SL")?.unwrap_or(0),
            traffic_class: opt(env, "KVSTORE_RDMA_TC")?.unwrap_or(0),
            write_imm: opt::<u8>(env, "KVSTORE_RDMA_WRITE_IMM")?.map(|v| v != 0),
        };
        let shm_pool_bytes = match get(env, "KVSTORE_SHM_POOL") {
            Some(v) => parse("KVSTORE_SHM_POOL", &v)?,
            None => 1usize << 30,
        };
        let slot_bytes = match get(env, "KVSTORE_SLOT_BYTES") {
            Some(v) => parse("KVSTORE_SLOT_BYTES", &v)?,
            None => 256usize << 20,
        };
        Ok(Config {
            transport,
            rdma,
            shm_pool_bytes,
            slot_bytes,
            log: get(env, "KVSTORE_LOG").or_else(|| get(env, "RUST_LOG")),
            report: match get(env, crate::report::VAR) {
                Some(v) if !v.is_empty() => Some(v.parse().map_err(|_| {
                    KvError::Config(format!("{}={v:?} is not an address", crate::report::VAR))
                })?),
                _ => None,
            },
            role: p.role,
            root: p.root,
            num_servers: p.num_servers,
            num_workers: p.num_workers,
            secret: crate::secret::resolve(
                get(env, "KVSTORE_SECRET"),
                get(env, "KVSTORE_SECRET_FILE"),
                get(env, "HOME"),
            )?,
            rank_hint: p.rank_hint,
            node_host: get(env, "DMLC_NODE_HOST"),
            timeout: Duration::from_secs_f64(timeout_s),
            bigarray_bound: bound,
            max_message,
        })
    }
}

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
