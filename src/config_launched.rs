//! Roles taken from an external launcher's ranks (mpirun, mpiexec, srun): which launcher
//! started this process, its rank among how many, and the role that rank gives.

use super::{get, parse, Lookup, Role, MAX_PROCESSES};
use crate::{KvError, Result};

/// A process's rank among `size`, as an external launcher gave it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LauncherRank {
    /// Which launcher: `"openmpi"`, `"pmi"` (MPICH's hydra and others), `"mvapich"` or
    /// `"slurm"`.
    pub launcher: &'static str,
    /// This process's rank.
    pub rank: usize,
    /// The number of processes.
    pub size: usize,
    /// Whether every rank runs on this host, when the launcher says.
    pub all_local: Option<bool>,
    /// An identifier of the job, when the launcher gives one.
    pub job_id: Option<String>,
    /// The variables the rank and the size came from (for errors).
    pub vars: (&'static str, &'static str),
}

fn launcher_rank(env: Lookup) -> Result<Option<LauncherRank>> {
    let pair = |r: &'static str, s: &'static str| -> Result<Option<(usize, usize, _)>> {
        match (get(env, r), get(env, s)) {
            (Some(a), Some(b)) => Ok(Some((parse(r, &a)?, parse(s, &b)?, (r, s)))),
            _ => Ok(None),
        }
    };
    let count = |name: &str| get(env, name).and_then(|v| v.trim().parse::<usize>().ok());
    // Slurm's job and step, where a launcher inside an allocation gives no id of its own.
    let slurm_job = || {
        get(env, "SLURM_JOB_ID")
            .or_else(|| get(env, "SLURM_JOBID"))
            .map(|j| format!("{j}.{}", get(env, "SLURM_STEP_ID").unwrap_or_default()))
    };
    let found = if let Some((rank, size, vars)) =
        pair("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")?
    {
        LauncherRank {
            launcher: "openmpi",
            rank,
            size,
            all_local: count("OMPI_COMM_WORLD_LOCAL_SIZE").map(|l| l == size),
            job_id: get(env, "OMPI_MCA_ess_base_jobid").or_else(|| get(env, "PMIX_NAMESPACE")),
            vars,
        }
    } else if let Some((rank, size, vars)) = match pair("PMI_RANK", "PMI_SIZE")? {
        // srun's own tasks under Slurm's pmi2 plugin have PMI's variables too, the same as
        // Slurm's: read as srun's (the step's nodes), below.
        Some(p)
            if pair("SLURM_PROCID", "SLURM_NTASKS")
                .ok()
                .flatten()
                .map(|s| (s.0, s.1))
                == Some((p.0, p.1)) =>
        {
            None
        }
        Some(p) => Some(p),
        None => pair("PMI_ID", "PMI_SIZE")?,
    } {
        // MPICH's hydra (PMI_ID where it gives the PMI port), Intel MPI, and Slurm's pmi2,
        // which name the job PMI_KVSNAME, PMIX_NAMESPACE or PMI_JOBID, or not at all.
        LauncherRank {
            launcher: "pmi",
            rank,
            size,
            all_local: count("MPI_LOCALNRANKS").map(|l| l == size),
            job_id: get(env, "PMI_KVSNAME")
                .or_else(|| get(env, "PMIX_NAMESPACE"))
                .or_else(|| get(env, "PMI_JOBID"))
                .or_else(slurm_job),
            vars,
        }
    } else if let Some((rank, size, vars)) = pair("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE")? {
        LauncherRank {
            launcher: "mvapich",
            rank,
            size,
            all_local: count("MV2_COMM_WORLD_LOCAL_SIZE").map(|l| l == size),
            job_id: slurm_job(),
            vars,
        }
    } else if let Some((rank, size, vars)) = pair("SLURM_PROCID", "SLURM_NTASKS")? {
        // The step's nodes: srun may run a step on some of the job's.
        let nodes = get(env, "SLURM_STEP_NUM_NODES")
            .or_else(|| get(env, "SLURM_NNODES"))
            .or_else(|| get(env, "SLURM_JOB_NUM_NODES"));
        LauncherRank {
            launcher: "slurm",
            rank,
            size,
            all_local: nodes.map(|n| n.trim() == "1"),
            job_id: slurm_job(),
            vars,
        }
    } else {
        return Ok(None);
    };
    let (rv, sv) = found.vars;
    if found.size == 0 || found.size > MAX_PROCESSES {
        return Err(KvError::Config(format!(
            "{sv}={}: a job has 1 to {MAX_PROCESSES} processes",
            found.size
        )));
    }
    if found.rank >= found.size {
        return Err(KvError::Config(format!(
            "{rv}={} is not a rank of {sv}={} processes",
            found.rank, found.size
        )));
    }
    Ok(Some(found))
}

/// The role an external launcher's rank gives (rank 0 the scheduler, 1..=S the servers, the
/// rest the workers) and its rank among its kind, with the launcher's rank and S.
pub(super) fn launched(env: Lookup) -> Result<Option<(LauncherRank, usize, Role, usize)>> {
    let Some(l) = launcher_rank(env)? else {
        return Ok(None);
    };
    // The servers: KVSTORE_NUM_SERVERS, or MXNet's DMLC_NUM_SERVER (the two must agree).
    let (s, from): (usize, &str) =
        match (get(env, "KVSTORE_NUM_SERVERS"), get(env, "DMLC_NUM_SERVER")) {
            (Some(v), Some(d)) => {
                let (v, d): (usize, usize) = (
                    parse("KVSTORE_NUM_SERVERS", &v)?,
                    parse("DMLC_NUM_SERVER", &d)?,
                );
                if v != d {
                    return Err(KvError::Config(format!(
                        "KVSTORE_NUM_SERVERS={v} and DMLC_NUM_SERVER={d} disagree"
                    )));
                }
                (v, "KVSTORE_NUM_SERVERS")
            }
            (Some(v), None) => (parse("KVSTORE_NUM_SERVERS", &v)?, "KVSTORE_NUM_SERVERS"),
            (None, Some(d)) => (parse("DMLC_NUM_SERVER", &d)?, "DMLC_NUM_SERVER"),
            (None, None) => (1, "KVSTORE_NUM_SERVERS"),
        };
    if s == 0 || s.checked_add(2).is_none_or(|need| l.size < need) {
        return Err(KvError::Config(format!(
            "{} started {} processes; a job with {s} server(s) needs at least {} (scheduler, \
             servers, one worker): set {from} or start more ranks",
            l.launcher,
            l.size,
            s.saturating_add(2)
        )));
    }
    // MXNet's DMLC_NUM_WORKER, where set, must be what the ranks make.
    if let Some(w) = get(env, "DMLC_NUM_WORKER") {
        let w: usize = parse("DMLC_NUM_WORKER", &w)?;
        if w != l.size - 1 - s {
            return Err(KvError::Config(format!(
                "DMLC_NUM_WORKER={w}, but {} started {} processes: with {s} server(s) and the \
                 scheduler, {} are workers",
                l.launcher,
                l.size,
                l.size - 1 - s
            )));
        }
    }
    let (role, hint) = match l.rank {
        0 => (Role::Scheduler, 0),
        r if r <= s => (Role::Server, r - 1),
        r => (Role::Worker, r - 1 - s),
    };
    Ok(Some((l, s, role, hint)))
}
