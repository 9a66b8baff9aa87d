//! The configuration's tests: variables of every launcher, the secret's checks.

use super::*;
use std::collections::HashMap;

/// The configuration of these variables, with a job secret unless they name one.
fn cfg(vars: &[(&str, &str)]) -> Result<Config> {
    let mut m: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    if !m.contains_key("KVSTORE_SECRET_FILE") && !m.contains_key("HOME") {
        m.entry("KVSTORE_SECRET".into())
            .or_insert_with(|| "a-test-secret-of-24-bytes".into());
    }
    Config::from_lookup(&|k| m.get(k).cloned())
}

#[test]
fn the_secret_is_never_empty_short_or_readable_by_others() {
    let base = [
        ("DMLC_ROLE", "worker"),
        ("DMLC_PS_ROOT_URI", "127.0.0.1"),
        ("DMLC_PS_ROOT_PORT", "9000"),
        ("DMLC_NUM_SERVER", "1"),
        ("DMLC_NUM_WORKER", "1"),
    ];
    let with = |extra: &[(&str, &str)]| {
        let mut v = base.to_vec();
        v.extend_from_slice(extra);
        cfg(&v)
    };
    let short = with(&[("KVSTORE_SECRET", "guessable")]).unwrap_err();
    assert!(short.to_string().contains("KVSTORE_SECRET"), "{short}");
    // Bytes that are not UTF-8 (as the environment's are read, each a U+FFFD of 3 bytes) are
    // refused: 6 such bytes passed for 18, and secrets of other such bytes were alike.
    let huge = with(&[("KVSTORE_SLOT_BYTES", "18446744073709551615")]).unwrap_err();
    assert!(huge.to_string().contains("KVSTORE_SLOT_BYTES"), "{huge}");
    let lossy = "\u{FFFD}".repeat(6);
    let e = with(&[("KVSTORE_SECRET", &lossy)]).unwrap_err();
    assert!(e.to_string().contains("not UTF-8"), "{e}");
    let dir = std::env::temp_dir().join(format!("kvstore-secret-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let home = dir.display().to_string();
    // No secret anywhere: one is made in ~/.kvstore, 0600, and read back the same.
    let a = with(&[("HOME", &home)]).unwrap().secret;
    let b = with(&[("HOME", &home)]).unwrap().secret;
    assert_eq!(a, b);
    assert!(a.len() >= 32);
    let file = dir.join(".kvstore/secret");
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&file).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    // A file others may read is refused, naming the fix.
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let f = file.display().to_string();
    let e = with(&[("KVSTORE_SECRET_FILE", &f)]).unwrap_err();
    assert!(e.to_string().contains("chmod 600"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
    // None at all, and no home: a clear error naming how to set one.
    let mut v = base.to_vec();
    v.push(("KVSTORE_SECRET_FILE", "/nonexistent/kvstore-secret"));
    assert!(cfg(&v).is_err());
}

#[test]
fn mxnet_variables() {
    let c = cfg(&[
        ("DMLC_ROLE", "server"),
        ("DMLC_PS_ROOT_URI", "127.0.0.1"),
        ("DMLC_PS_ROOT_PORT", "9091"),
        ("DMLC_NUM_SERVER", "2"),
        ("DMLC_NUM_WORKER", "3"),
    ])
    .unwrap();
    assert_eq!(c.role, Role::Server);
    assert_eq!(c.root.port(), 9091);
    assert_eq!((c.num_servers, c.num_workers), (2, 3));
    assert!(cfg(&[("DMLC_ROLE", "boss")]).is_err());
    let e = cfg(&[]).err().unwrap().to_string();
    assert!(e.contains("DMLC_ROLE"), "{e}");
}

#[test]
fn slurm_ranks_follow_the_documented_rule() {
    let base = [
        ("SLURM_NTASKS", "6"),
        ("SLURM_JOB_ID", "4242"),
        ("SLURM_STEP_ID", "0"),
        ("SLURM_NNODES", "3"),
        ("SLURM_JOB_NODELIST", "localhost,node[02-03]"),
        ("KVSTORE_NUM_SERVERS", "2"),
    ];
    let at = |rank: &str| {
        let mut v = base.to_vec();
        v.push(("SLURM_PROCID", rank));
        cfg(&v).unwrap()
    };
    let c0 = at("0");
    assert_eq!(c0.role, Role::Scheduler);
    assert_eq!((c0.num_servers, c0.num_workers), (2, 3));
    assert!(c0.root.ip().is_loopback(), "first host of the node list");
    let c2 = at("2");
    assert_eq!((c2.role, c2.rank_hint), (Role::Server, Some(1)));
    let c5 = at("5");
    assert_eq!((c5.role, c5.rank_hint), (Role::Worker, Some(2)));
    assert_eq!(
        c0.root.port(),
        c5.root.port(),
        "every rank derives the same port"
    );
    assert_eq!(c0.secret, c5.secret);
    let mut small = base.to_vec();
    small[0] = ("SLURM_NTASKS", "3");
    small.push(("SLURM_PROCID", "0"));
    assert!(
        cfg(&small).is_err(),
        "3 ranks cannot hold a scheduler, 2 servers and a worker"
    );
}

#[test]
fn a_launchers_job_id_is_part_of_the_secret_so_two_jobs_never_meet() {
    // Two of a user's jobs on one host, one secret (~/.kvstore's), ports derived from their
    // ids: where the ports collide, their processes still prove different secrets.
    let rank = |job: &str, rank: &str, port: Option<&str>| {
        let mut vars = vec![
            ("OMPI_COMM_WORLD_RANK", rank),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
            ("OMPI_MCA_ess_base_jobid", job),
        ];
        vars.extend(port.map(|p| ("KVSTORE_ROOT_PORT", p)));
        cfg(&vars).unwrap()
    };
    let (a0, a3, b3) = (
        rank("77", "0", None),
        rank("77", "3", None),
        rank("78", "3", None),
    );
    assert_eq!(a0.secret, a3.secret, "one job's ranks agree");
    assert_ne!(
        a3.secret, b3.secret,
        "another job's rank proves another secret"
    );
    // A port that is set is the user's to keep apart: the secret is as given, so ranks a
    // launcher gave different ids still meet.
    let (c0, d3) = (rank("77", "0", Some("7001")), rank("78", "3", Some("7001")));
    assert_eq!(c0.secret, d3.secret);
    assert_eq!(c0.secret, "a-test-secret-of-24-bytes");
    // kvrun's jobs have a secret of their own each: theirs is taken as it is.
    let k = cfg(&[
        ("DMLC_ROLE", "worker"),
        ("DMLC_PS_ROOT_URI", "127.0.0.1"),
        ("DMLC_PS_ROOT_PORT", "9000"),
        ("DMLC_NUM_SERVER", "1"),
        ("DMLC_NUM_WORKER", "1"),
    ])
    .unwrap();
    assert_eq!(k.secret, "a-test-secret-of-24-bytes");
}

#[test]
fn mxnets_names_of_the_shape_count_under_a_launcher_too() {
    let ranks = |extra: &[(&'static str, &'static str)]| {
        let mut vars = vec![
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "5"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "5"),
            ("OMPI_MCA_ess_base_jobid", "77"),
        ];
        vars.extend_from_slice(extra);
        cfg(&vars)
    };
    // DMLC_NUM_SERVER as KVSTORE_NUM_SERVERS: 2 servers, so rank 3 is worker 0 of 2.
    let c = ranks(&[("DMLC_NUM_SERVER", "2")]).unwrap();
    assert_eq!((c.role, c.num_servers, c.num_workers), (Role::Worker, 2, 2));
    let c = ranks(&[("DMLC_NUM_SERVER", "2"), ("DMLC_NUM_WORKER", "2")]).unwrap();
    assert_eq!((c.num_servers, c.num_workers), (2, 2));
    for (extra, says) in [
        (
            &[("DMLC_NUM_SERVER", "2"), ("KVSTORE_NUM_SERVERS", "1")][..],
            "disagree",
        ),
        (&[("DMLC_NUM_WORKER", "4")][..], "3 are workers"),
    ] {
        let e = ranks(extra).expect_err("refused").to_string();
        assert!(e.contains(says), "{e}");
    }
}

#[test]
fn open_mpi_and_pmi_ranks() {
    let c = cfg(&[
        ("OMPI_COMM_WORLD_RANK", "1"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
        ("OMPI_MCA_ess_base_jobid", "77"),
    ])
    .unwrap();
    assert_eq!((c.role, c.num_servers, c.num_workers), (Role::Server, 1, 2));
    assert!(c.root.ip().is_loopback());
    let spread = cfg(&[
        ("OMPI_COMM_WORLD_RANK", "1"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ("OMPI_MCA_ess_base_jobid", "77"),
    ]);
    assert!(spread
        .err()
        .unwrap()
        .to_string()
        .contains("KVSTORE_ROOT_URI"));
    // MPICH's or Intel MPI's mpiexec inside a Slurm allocation: its ranks, not the step's.
    let p = cfg(&[
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "1"),
        ("PMI_RANK", "3"),
        ("PMI_SIZE", "4"),
        ("KVSTORE_ROOT_URI", "127.0.0.1"),
        ("KVSTORE_ROOT_PORT", "7000"),
    ])
    .unwrap();
    assert_eq!(
        (p.role, p.rank_hint, p.root.port()),
        (Role::Worker, Some(1), 7000)
    );
}

#[test]
fn slurm_node_lists() {
    assert_eq!(
        first_slurm_host("node[03-05,9],gpu1").as_deref(),
        Some("node03")
    );
    assert_eq!(first_slurm_host("a,b").as_deref(), Some("a"));
    assert_eq!(first_slurm_host("single").as_deref(), Some("single"));
    assert_eq!(first_slurm_host("n[7]").as_deref(), Some("n7"));
    assert_eq!(first_slurm_host(""), None);
}

#[test]
fn a_timeout_past_thirty_days_is_refused() {
    let with = |t: &'static str| {
        cfg(&[
            ("DMLC_ROLE", "worker"),
            ("DMLC_PS_ROOT_URI", "127.0.0.1"),
            ("DMLC_PS_ROOT_PORT", "9091"),
            ("DMLC_NUM_SERVER", "1"),
            ("DMLC_NUM_WORKER", "1"),
            ("KVSTORE_TIMEOUT", t),
        ])
    };
    assert!(with("2592000").is_ok());
    for t in ["2592001", "1e19", "1e20", "inf", "0", "-1"] {
        let Err(e) = with(t) else {
            panic!("KVSTORE_TIMEOUT={t} was taken")
        };
        let e = e.to_string();
        assert!(e.contains("KVSTORE_TIMEOUT"), "{t}: {e}");
    }
}

#[test]
fn srun_ranks_find_rank_0_on_the_steps_first_node() {
    // A step on some of the job's nodes: rank 0 runs on the step's first node, not the job's
    // (which need not even resolve here).
    let c = cfg(&[
        ("SLURM_PROCID", "2"),
        ("SLURM_NTASKS", "3"),
        ("SLURM_JOB_ID", "9"),
        ("SLURM_STEP_ID", "1"),
        ("SLURM_NNODES", "4"),
        ("SLURM_STEP_NUM_NODES", "2"),
        ("SLURM_JOB_NODELIST", "no-such-host-[7-10]"),
        ("SLURM_STEP_NODELIST", "localhost,no-such-host-10"),
    ])
    .unwrap();
    assert!(c.root.ip().is_loopback());
    assert_eq!((c.role, c.spans_hosts), (Role::Worker, Some(true)));
    // A host that does not resolve is named with the variable it came from.
    let e = cfg(&[
        ("SLURM_PROCID", "2"),
        ("SLURM_NTASKS", "3"),
        ("SLURM_JOB_ID", "9"),
        ("SLURM_NNODES", "4"),
        ("SLURM_JOB_NODELIST", "no-such-host-[7-10]"),
    ])
    .unwrap_err()
    .to_string();
    assert!(e.contains("SLURM_JOB_NODELIST"), "{e}");
    // srun's tasks under Slurm's pmi2 plugin, which sets PMI's variables the same as
    // Slurm's: still the step's nodes.
    let c = cfg(&[
        ("SLURM_PROCID", "2"),
        ("SLURM_NTASKS", "3"),
        ("PMI_RANK", "2"),
        ("PMI_SIZE", "3"),
        ("PMI_JOBID", "55"),
        ("SLURM_JOB_ID", "9"),
        ("SLURM_STEP_NUM_NODES", "2"),
        ("SLURM_JOB_NODELIST", "no-such-host-[7-10]"),
        ("SLURM_STEP_NODELIST", "localhost,no-such-host-10"),
    ])
    .unwrap();
    assert!(c.root.ip().is_loopback());
    assert_eq!((c.role, c.spans_hosts), (Role::Worker, Some(true)));
}

#[test]
fn mpich_pmi2_and_mvapich_launches_are_read() {
    let pmi = |extra: &[(&'static str, &'static str)]| {
        let mut v = vec![("PMI_SIZE", "3"), ("MPI_LOCALNRANKS", "3")];
        v.extend_from_slice(extra);
        cfg(&v)
    };
    // Hydra names no job (no PMI_KVSNAME): PMI_JOBID (Slurm's pmi2), else Slurm's job and
    // step, give the port; PMI_ID is hydra's rank where it gives a PMI port.
    let a = pmi(&[("PMI_RANK", "0"), ("PMI_JOBID", "55")]).unwrap();
    let b = pmi(&[("PMI_ID", "2"), ("PMI_JOBID", "55")]).unwrap();
    assert_eq!((a.role, b.role), (Role::Scheduler, Role::Worker));
    assert_eq!(a.root, b.root);
    let c = pmi(&[
        ("PMI_RANK", "1"),
        ("SLURM_JOB_ID", "8"),
        ("SLURM_STEP_ID", "0"),
    ])
    .unwrap();
    assert_eq!(c.role, Role::Server);
    let e = pmi(&[("PMI_RANK", "1")]).unwrap_err().to_string();
    assert!(e.contains("KVSTORE_ROOT_PORT"), "{e}");
    let m = cfg(&[
        ("MV2_COMM_WORLD_RANK", "1"),
        ("MV2_COMM_WORLD_SIZE", "3"),
        ("MV2_COMM_WORLD_LOCAL_SIZE", "3"),
        ("KVSTORE_ROOT_PORT", "7100"),
    ])
    .unwrap();
    assert_eq!(
        (m.role, m.root.port(), m.spans_hosts),
        (Role::Server, 7100, Some(false))
    );
}

#[test]
fn launchers_roles_are_read_without_the_rest() {
    let env: HashMap<&str, &str> = [
        ("OMPI_COMM_WORLD_RANK", "1"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("KVSTORE_NUM_SERVERS", "2"),
    ]
    .into();
    let lookup = |k: &str| env.get(k).map(|v| v.to_string());
    let (_, s, role, hint) = launched(&lookup).unwrap().unwrap();
    assert_eq!((s, role, hint), (2, Role::Server, 0));
}

#[test]
fn hostile_counts_ranks_and_ports_are_refused_naming_their_variable() {
    let slurm =
        |procid: &'static str, ntasks: &'static str, extra: &[(&'static str, &'static str)]| {
            let mut v = vec![
                ("SLURM_PROCID", procid),
                ("SLURM_NTASKS", ntasks),
                ("SLURM_JOB_ID", "1"),
                ("SLURM_NNODES", "1"),
            ];
            v.extend_from_slice(extra);
            cfg(&v).unwrap_err().to_string()
        };
    for (e, var) in [
        (
            slurm("0", "4", &[("KVSTORE_NUM_SERVERS", "18446744073709551615")]),
            "servers",
        ),
        (slurm("9", "4", &[]), "SLURM_PROCID"),
        (slurm("0", "0", &[]), "SLURM_NTASKS"),
        (slurm("0", "100000", &[]), "SLURM_NTASKS"),
        (
            slurm("0", "4", &[("DMLC_PS_ROOT_PORT", "0")]),
            "DMLC_PS_ROOT_PORT",
        ),
        (
            slurm("0", "4", &[("KVSTORE_ROOT_PORT", "70000")]),
            "KVSTORE_ROOT_PORT",
        ),
    ] {
        assert!(e.contains(var), "{var}: {e}");
    }
    let dmlc = |n: &'static str, port: &'static str| {
        cfg(&[
            ("DMLC_ROLE", "worker"),
            ("DMLC_PS_ROOT_URI", "127.0.0.1"),
            ("DMLC_PS_ROOT_PORT", port),
            ("DMLC_NUM_SERVER", "1"),
            ("DMLC_NUM_WORKER", n),
        ])
    };
    assert!(dmlc("2", "9000").is_ok());
    let e = dmlc("18446744073709551615", "9000")
        .unwrap_err()
        .to_string();
    assert!(e.contains("DMLC_NUM_WORKER"), "{e}");
    let e = dmlc("2", "0").unwrap_err().to_string();
    assert!(e.contains("DMLC_PS_ROOT_PORT"), "{e}");
}
