//! kvrun on clusters: hosts over ssh (network namespaces with their own sshd, made here), and
//! jobs started by a real mpirun. Tests that cannot run here say so and are skipped.

mod util;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use util::{bin, run_limited, skip, Run};

fn have(cmd: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {cmd}")])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

#[test]
fn a_job_under_real_mpirun_takes_its_roles_from_open_mpi() {
    if !have("mpirun") {
        return skip("mpirun is not installed (apt-get install openmpi-bin)");
    }
    // 5 ranks, 2 servers: rank 0 scheduler, ranks 1-2 servers, ranks 3-4 workers 0-1.
    let mut cmd = Command::new("mpirun");
    cmd.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .args([
            "--oversubscribe",
            "-np",
            "5",
            "-x",
            "KVSTORE_NUM_SERVERS=2",
            "-x",
            "KVSTORE_TIMEOUT=30",
        ])
        .arg(bin("examples/dist_check"))
        .args(["seed", "dist_sync"]);
    let r = run_limited(&mut cmd, Duration::from_secs(90));
    assert_eq!(r.code, Some(0), "{}", r.all());
    for rank in 0..2 {
        assert!(
            r.stdout.contains(&format!("seed ok rank {rank} of 2")),
            "{}",
            r.all()
        );
        assert!(
            r.stdout.contains(&format!("rank {rank} reaches server 1")),
            "{}",
            r.all()
        );
    }
}

/// Two test hosts (network namespaces with sshd), removed again on drop. One set at a time
/// in this process: their names come from its pid.
struct Hosts {
    dir: PathBuf,
    script: PathBuf,
    _one: std::sync::MutexGuard<'static, ()>,
}

static ONE_SET: std::sync::Mutex<()> = std::sync::Mutex::new(());

impl Hosts {
    /// The hosts, or `None` (the test said why it skips) where this machine cannot make them:
    /// not root, or without iproute2 and OpenSSH's server.
    fn up_or_skip() -> Option<Hosts> {
        if !is_root() {
            skip("network namespaces need root");
            return None;
        }
        for tool in ["ip", "ssh", "ssh-keygen", "/usr/sbin/sshd"] {
            if !have(tool) {
                skip(&format!(
                    "{tool} is not installed (apt-get install iproute2 openssh-server)"
                ));
                return None;
            }
        }
        Hosts::up()
            .map_err(|e| skip(&format!("cannot create network namespaces here: {e}")))
            .ok()
    }

    fn up() -> Result<Hosts, String> {
        let one = ONE_SET.lock().unwrap_or_else(|p| p.into_inner());
        let dir = PathBuf::from(format!("/tmp/kvh{}", std::process::id() % 1_000_000));
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/support/hosts.sh");
        let _ = std::fs::remove_dir_all(&dir);
        let hosts = Hosts {
            dir,
            script,
            _one: one,
        };
        let out = Command::new(&hosts.script)
            .args([Path::new("up"), &hosts.dir, Path::new("2")])
            .output()
            .map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).into_owned());
        }
        Ok(hosts)
    }

    fn addrs(&self) -> Vec<String> {
        std::fs::read_to_string(self.dir.join("hostfile"))
            .unwrap()
            .lines()
            .map(|l| l.split_whitespace().next().unwrap().to_string())
            .collect()
    }

    fn ssh(&self) -> String {
        format!(
            "ssh -i {} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o BatchMode=yes \
             -o LogLevel=ERROR -o ConnectTimeout=5",
            self.dir.join("key").display()
        )
    }

    /// Processes left in the namespaces, other than sshd.
    fn leftovers(&self) -> Vec<String> {
        let mut left = Vec::new();
        for ns in std::fs::read_to_string(self.dir.join("namespaces"))
            .unwrap()
            .lines()
        {
            let out = Command::new("ip")
                .args(["netns", "pids", ns])
                .output()
                .unwrap();
            for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
                if comm.trim() != "sshd" && !comm.is_empty() {
                    left.push(format!("{ns}: {pid} {}", comm.trim()));
                }
            }
        }
        left
    }

    /// Waits up to 10 s for every job process to be gone from the hosts.
    fn assert_clean(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.leftovers().is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
        }
        assert!(
            self.leftovers().is_empty(),
            "left behind: {:?}",
            self.leftovers()
        );
    }

    fn kvrun(
        &self,
        hostfile_or_hosts: &[&str],
        w: u32,
        s: u32,
        program: &Path,
        args: &[&str],
    ) -> Run {
        let mut cmd = Command::new(bin("kvrun"));
        cmd.args([
            "-n",
            &w.to_string(),
            "-s",
            &s.to_string(),
            "--timeout",
            "30",
            "--ssh",
            &self.ssh(),
        ])
        .args(hostfile_or_hosts)
        .arg("--")
        .arg(program)
        .args(args);
        run_limited(&mut cmd, Duration::from_secs(120))
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        let _ = Command::new(&self.script)
            .arg("down")
            .arg(&self.dir)
            .status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn a_job_runs_across_hosts_over_ssh_and_failures_stop_it_everywhere() {
    let Some(hosts) = Hosts::up_or_skip() else {
        return;
    };
    let addrs = hosts.addrs();
    let hostfile = hosts.dir.join("hostfile");
    let hf = hostfile.to_str().unwrap();
    let check = bin("examples/dist_check");

    // Slots fill in order: server 0 and worker 0 on the first host, workers 1-2 on the second.
    let r = hosts.kvrun(&["--hostfile", hf], 3, 1, &check, &["seed", "dist_sync"]);
    assert_eq!(r.code, Some(0), "{}", r.all());
    for (rank, host) in [(0, &addrs[0]), (1, &addrs[1]), (2, &addrs[1])] {
        let ok = format!("[{host}:worker {rank}] seed ok rank {rank} of 3");
        assert!(r.stdout.contains(&ok), "missing {ok:?}\n{}", r.all());
        // A worker on the server's host uses shared memory; one on another host, TCP.
        let via = format!(
            "[{host}:worker {rank}] rank {rank} reaches server 0 at {}:",
            addrs[0]
        );
        let line = r
            .stdout
            .lines()
            .find(|l| l.starts_with(&via))
            .unwrap_or_else(|| panic!("{via}\n{}", r.all()));
        let want = if *host == addrs[0] {
            "via shm"
        } else {
            "via tcp"
        };
        assert!(line.ends_with(want), "{line}");
    }

    // kvrun doctor on these hosts: both reachable with the program, TCP between them.
    let doctor = |args: &[&str], ssh: &str| {
        let mut cmd = Command::new(bin("kvrun"));
        cmd.arg("doctor")
            .args(args)
            .args(["--ssh", ssh])
            .arg(&check);
        util::run_limited(&mut cmd, Duration::from_secs(60))
    };
    let d = doctor(&["--hostfile", hf], &hosts.ssh());
    assert_eq!(d.code, Some(0), "{}", d.all());
    for a in &addrs {
        assert!(
            d.stdout.contains(&format!("ok {a}: reachable")),
            "{}",
            d.all()
        );
    }
    let pair = format!("pair {} - {}: tcp", addrs[0], addrs[1]);
    assert!(d.stdout.contains(&pair), "{}", d.all());
    // One host unreachable (an address nobody answers on), one with a low memlock limit: the
    // doctor says so, with the fix, and fails.
    let low = hosts.dir.join("lowlock-ssh");
    std::fs::write(
        &low,
        format!(
            "#!/bin/sh\nh=\"$1\"; shift\nexec {} \"$h\" \"ulimit -l 64 && $*\"\n",
            hosts.ssh()
        ),
    )
    .unwrap();
    let mut perm = std::fs::metadata(&low).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o755);
    std::fs::set_permissions(&low, perm).unwrap();
    let list = format!("{},10.255.255.1", addrs[1]);
    let d = doctor(&["-H", &list], low.to_str().unwrap());
    assert_eq!(d.code, Some(1), "{}", d.all());
    assert!(
        d.stdout
            .contains("FAIL 10.255.255.1: not reachable over ssh")
            && d.stdout.contains("fix: set up key-based login"),
        "{}",
        d.all()
    );
    let memlock = format!("{}: memlock limit 64 KiB", addrs[1]);
    assert!(d.stdout.contains(&memlock), "{}", d.all());

    // The main job across hosts, by node.
    let r = hosts.kvrun(
        &[
            "--hostfile",
            hf,
            "--map-by",
            "node",
            "-x",
            "TRAIN_OUTPUTS=2048",
        ],
        2,
        2,
        &bin("examples/train"),
        &[],
    );
    assert_eq!(r.code, Some(0), "{}", r.all());
    assert!(r.stdout.contains("reached the known answer"), "{}", r.all());

    // A remote process dies: the job stops, every host is cleaned up.
    let r = hosts.kvrun(&["--hostfile", hf], 3, 1, &check, &["die", "dist_sync"]);
    // Its own status, as ssh passes on a SIGABRT: 128 + 6.
    assert_eq!(r.code, Some(134), "{}", r.all());
    assert!(
        r.stderr.contains(&format!("worker 1 on {}", addrs[1])),
        "{}",
        r.all()
    );
    let r = hosts.kvrun(
        &["--hostfile", hf],
        3,
        1,
        Path::new("/bin/sh"),
        &["-c", "if [ $DMLC_ROLE = worker ] && [ $KVSTORE_RANK = 2 ]; then sleep 1; exit 3; fi; sleep 60; echo never"],
    );
    assert_eq!(r.code, Some(3), "{}", r.all());
    assert!(
        r.stderr.contains("worker 2") && r.stderr.contains("status 3"),
        "{}",
        r.all()
    );
    hosts.assert_clean();

    // A program missing on the hosts.
    let r = hosts.kvrun(
        &["--hostfile", hf],
        1,
        1,
        Path::new("/no/such/program"),
        &[],
    );
    assert_eq!(r.code, Some(127), "{}", r.all());
    assert!(r.stderr.contains("not found there"), "{}", r.all());

    // A host that cannot be reached.
    let net = std::fs::read_to_string(hosts.dir.join("net")).unwrap();
    let dead = format!("{}.99", net.trim());
    let list = format!("{dead},{}", addrs[0]);
    let r = hosts.kvrun(
        &["-H", &list, "--map-by", "node"],
        1,
        1,
        &check,
        &["seed", "dist_sync"],
    );
    assert_eq!(r.code, Some(255), "{}", r.all());
    assert!(
        r.stderr.contains(&format!("server 0 on {dead}")) && r.stderr.contains("ssh failed"),
        "{}",
        r.all()
    );
    hosts.assert_clean();
}

#[test]
fn many_processes_on_one_host_all_start_over_ssh() {
    // sshd drops new connections at random beyond 10 not yet logged in (its MaxStartups
    // 10:30:100): kvrun keeps at most 8 of a host's ssh connections in their login at once.
    let Some(hosts) = Hosts::up_or_skip() else {
        return;
    };
    let first = hosts.addrs()[0].clone();
    let list = format!("{first}:24");
    let r = hosts.kvrun(
        &["-H", &list],
        23,
        1,
        Path::new("/bin/sh"),
        &["-c", "echo \"up $DMLC_ROLE $KVSTORE_RANK\""],
    );
    assert_eq!(r.code, Some(0), "{}", r.all());
    for w in 0..23 {
        assert!(
            r.stdout.contains(&format!("up worker {w}\n")),
            "{w}\n{}",
            r.all()
        );
    }
    assert!(r.stdout.contains("up server 0\n"), "{}", r.all());
    hosts.assert_clean();
}

#[test]
fn a_remote_program_that_leaves_a_process_behind_ends_with_its_job() {
    // A worker whose program starts a process in the background, which holds the output the
    // ssh session carries, and ends: the session ends with the program (what it left is
    // stopped, as kvrun stops a local program's process group), so kvrun returns, and
    // nothing of the job is left on the host.
    let Some(hosts) = Hosts::up_or_skip() else {
        return;
    };
    let first = hosts.addrs()[0].clone();
    let list = format!("{first}:2");
    let r = hosts.kvrun(
        &["-H", &list],
        1,
        1,
        Path::new("/bin/sh"),
        &["-c", "sleep 600 & echo \"up $DMLC_ROLE\""],
    );
    assert_eq!(r.code, Some(0), "{}", r.all());
    assert!(r.stdout.contains("up worker\n"), "{}", r.all());
    assert!(r.elapsed < Duration::from_secs(60), "{:?}", r.elapsed);
    hosts.assert_clean();
}
