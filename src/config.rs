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
//! them) and `SLURM_PROCID`/`SLURM_NTASKS`. The rule: with `KVSTORE_NUM_SERVERS` = S (or
//! MXNet's `DMLC_NUM_SERVER`; default 1), rank 0 is the scheduler, ranks 1..=S the servers, the
//! rest the workers (so a job of N ranks has N - 1 - S workers, which `DMLC_NUM_WORKER`, where
//! set, must be). The scheduler is found at
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
    /// The network interface whose address this node advertises (MXNet's `DMLC_INTERFACE`),
    /// where `node_host` does not name one.
    pub interface: Option<String>,
    /// Whether the job's processes span several hosts, where the launcher says (mpirun,
    /// srun); `None` where it does not.
    pub spans_hosts: Option<bool>,
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

/// A variable of the process environment; one that is not UTF-8 is read lossily (so that its
/// parse fails naming it, where it would pass for unset).
fn env_var(name: &str) -> Option<String> {
    std::env::var_os(name).map(|v| v.to_string_lossy().into_owned())
}

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

/// The most processes a job may have (as kvrun's).
const MAX_PROCESSES: usize = 65536;

/// A port, from `name`: 1 to 65535.
fn port(name: &str, v: &str) -> Result<u16> {
    match v.trim().parse::<u16>() {
        Ok(p) if p > 0 => Ok(p),
        _ => Err(KvError::Config(format!(
            "{name}={v:?} is not a port (1 to 65535)"
        ))),
    }
}

/// A count of processes, from `name`: at most [`MAX_PROCESSES`].
fn processes(name: &str, v: &str) -> Result<usize> {
    let n: usize = parse(name, v)?;
    if n > MAX_PROCESSES {
        return Err(KvError::Config(format!(
            "{name}={n}: a job has at most {MAX_PROCESSES} processes"
        )));
    }
    Ok(n)
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
    spans_hosts: Option<bool>,
    /// The launcher's id of the job, where the scheduler's port was derived from it.
    job: Option<String>,
}

fn place(env: Lookup) -> Result<Place> {
    if let Some(role) = get(env, "DMLC_ROLE") {
        let role = dmlc_role(&role)?;
        let host = need(env, "DMLC_PS_ROOT_URI")?;
        let port = port("DMLC_PS_ROOT_PORT", &need(env, "DMLC_PS_ROOT_PORT")?)?;
        return Ok(Place {
            role,
            root: resolve(&host, port, "DMLC_PS_ROOT_URI")?,
            num_servers: processes("DMLC_NUM_SERVER", &need(env, "DMLC_NUM_SERVER")?)?,
            num_workers: processes("DMLC_NUM_WORKER", &need(env, "DMLC_NUM_WORKER")?)?,
            rank_hint: get(env, "KVSTORE_RANK")
                .map(|v| parse("KVSTORE_RANK", &v))
                .transpose()?,
            spans_hosts: None,
            job: None,
        });
    }
    let Some((l, s, role, hint)) = launched(env)? else {
        return Err(need(env, "DMLC_ROLE")
            .err()
            .unwrap_or(KvError::Config("DMLC_ROLE".into())));
    };
    let named = |name: &'static str| get(env, name).map(|v| (v, name));
    // Slurm's own ranks run on the step's nodes; another launcher inside an allocation runs
    // on the job's (its own step's variables are its daemons').
    let list = match l.launcher {
        "slurm" => named("SLURM_STEP_NODELIST").or_else(|| named("SLURM_JOB_NODELIST")),
        _ => named("SLURM_JOB_NODELIST"),
    }
    .or_else(|| named("SLURM_NODELIST"));
    let (host, from) = match named("KVSTORE_ROOT_URI").or_else(|| named("DMLC_PS_ROOT_URI")) {
        Some(h) => h,
        None => match list {
            Some((list, name)) if l.all_local != Some(true) => {
                let first = first_slurm_host(&list).ok_or_else(|| {
                    KvError::Config(format!("cannot read the Slurm node list {name}={list:?}"))
                })?;
                (first, name)
            }
            _ if l.all_local == Some(true) => ("127.0.0.1".to_string(), "the launcher"),
            _ => {
                return Err(KvError::Config(format!(
                    "{} ranks span several hosts: set KVSTORE_ROOT_URI to rank 0's host \
                     (e.g. mpirun -x KVSTORE_ROOT_URI=<host of rank 0>)",
                    l.launcher
                )))
            }
        },
    };
    let given = named("KVSTORE_ROOT_PORT").or_else(|| named("DMLC_PS_ROOT_PORT"));
    let port_given = given.is_some();
    let port = match given {
        Some((p, name)) => port(name, &p)?,
        None => match &l.job_id {
            Some(j) => port_from_job(j),
            None => {
                return Err(KvError::Config(format!(
                    "{} gives no job id to derive the scheduler's port from: set \
                     KVSTORE_ROOT_PORT (the same in every rank)",
                    l.launcher
                )))
            }
        },
    };
    Ok(Place {
        role,
        root: resolve(&host, port, from)?,
        num_servers: s,
        num_workers: l.size - 1 - s,
        rank_hint: Some(hint as u32),
        spans_hosts: l.all_local.map(|local| !local),
        job: if port_given { None } else { l.job_id },
    })
}

/// A role by `DMLC_ROLE`'s name for it.
fn dmlc_role(v: &str) -> Result<Role> {
    match v.trim() {
        "worker" => Ok(Role::Worker),
        "server" => Ok(Role::Server),
        "scheduler" => Ok(Role::Scheduler),
        other => Err(KvError::Config(format!(
            "DMLC_ROLE={other:?}; expected worker, server or scheduler"
        ))),
    }
}

impl Config {
    /// Whether the scheduler's address is 127.0.0.1 or ::1, as a job on this host alone names
    /// it (a host's own name may resolve to another loopback address, 127.0.1.1 on Debian, in
    /// a job across hosts).
    pub fn root_is_this_host_alone(&self) -> bool {
        self.root.ip() == std::net::Ipv4Addr::LOCALHOST
            || self.root.ip() == std::net::Ipv6Addr::LOCALHOST
    }

    /// Reads the configuration from the environment.
    /// This process's role, as `DMLC_ROLE` names it or an external launcher's rank gives it
    /// (mpirun, srun), without reading the rest (`None` if neither says, or says wrongly:
    /// [`Config::from_env`] says what).
    pub fn role_from_env() -> Option<Role> {
        let env: Lookup = &env_var;
        match get(env, "DMLC_ROLE") {
            Some(r) => dmlc_role(&r).ok(),
            None => launched(env).ok().flatten().map(|(_, _, role, _)| role),
        }
    }

    /// Reads the configuration from the process environment.
    pub fn from_env() -> Result<Config> {
        Config::from_lookup(&env_var)
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
        // (A server's landing pool adds to it: a bound keeps the sum a size.)
        if slot_bytes > 1 << 40 {
            return Err(KvError::Config(format!(
                "KVSTORE_SLOT_BYTES={slot_bytes} is above 2^40 bytes"
            )));
        }
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
            // Where the scheduler's port was derived from the launcher's job id, the id goes
            // into the secret every connection proves: a process of another of the user's
            // jobs whose derived port collides fails to join, as one with another secret does.
            // (A port that is set leaves the secret as it is: ranks a launcher gave different
            // ids, such as those an ssh launcher starts outside Slurm's step, still meet.)
            secret: {
                let s = crate::secret::resolve(
                    get(env, "KVSTORE_SECRET"),
                    get(env, "KVSTORE_SECRET_FILE"),
                    get(env, "HOME"),
                )?;
                match &p.job {
                    Some(j) => format!("{s}\njob {j}"),
                    None => s,
                }
            },
            rank_hint: p.rank_hint,
            node_host: get(env, "DMLC_NODE_HOST"),
            interface: get(env, "DMLC_INTERFACE"),
            spans_hosts: p.spans_hosts,
            timeout: Duration::from_secs_f64(timeout_s),
            bigarray_bound: bound,
            max_message,
        })
    }
}

#[path = "config_launched.rs"]
mod launched;
use launched::launched;

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
