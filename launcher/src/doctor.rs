//! `kvrun doctor`: a preflight of the hosts of a job, before the job. For every host it checks
//! what a job needs there and says how to fix what is missing; for every pair of hosts, the
//! transport their processes would use and why. It exits non-zero when the job would fail.

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use clap::Parser;

use crate::hosts::{self, Host};

/// A line of the report on stdout. Not `println!`, which panics where stdout is closed
/// (`kvrun doctor ... | head -1`): the other hosts are checked all the same, and the exit
/// status still says whether the job would fail.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write;
        let _ = writeln!(std::io::stdout().lock(), $($arg)*);
    }};
}

/// The command line of `kvrun doctor`.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "kvrun doctor",
    about = "Check the hosts of a job before running it: ssh, the program, ports, limits, \
             shared memory, RDMA, and the transport of every pair"
)]
pub struct DoctorOptions {
    /// Hosts, `host[:slots]` comma separated (mpirun's -H) [default: this host].
    #[arg(short = 'H', long = "hosts", conflicts_with = "hostfile")]
    pub hosts: Option<String>,
    /// A hostfile in mpirun's format.
    #[arg(long, value_name = "FILE")]
    pub hostfile: Option<PathBuf>,
    /// The ssh command (and its options) that reaches remote hosts.
    #[arg(long, default_value = "ssh -o BatchMode=yes -o ConnectTimeout=10")]
    pub ssh: String,
    /// The scheduler's port, if the job will fix one (0: any free port).
    #[arg(long, default_value_t = 0)]
    pub port: u16,
    /// The program the job will run, checked on every host.
    pub program: PathBuf,
}

/// What one host reported.
#[derive(Debug, Default)]
struct Facts {
    reachable: Option<String>,
    program: bool,
    memlock_kib: Option<u64>,
    ptrace_scope: Option<u32>,
    /// The user the probe (and so the job) runs as.
    uid: Option<u32>,
    rdma: Vec<String>,
}

/// The shell script run on each host: one `key value` line per fact. (`KVRUN_SYSFS` and
/// `KVRUN_PROC` name another sysfs and procfs root, for tests.)
const PROBE: &str = r#"
case "$1" in
  */*) if [ -f "$1" ] && [ -x "$1" ]; then echo "program yes"; else echo "program no"; fi ;;
  *) if command -v "$1" >/dev/null 2>&1; then echo "program yes"; else echo "program no"; fi ;;
esac
echo "memlock $(ulimit -l)"
echo "ptrace $(cat "${KVRUN_PROC:-/proc}"/sys/kernel/yama/ptrace_scope 2>/dev/null || echo -)"
echo "uid $(id -u)"
sys="${KVRUN_SYSFS:-/sys}"
for d in "$sys"/class/infiniband/*; do
  [ -d "$d" ] || continue
  for p in "$d"/ports/*; do
    gid=-; mtu=-
    # In the order of their index (a glob puts 10 before 2): the first RoCE v2 one, else the
    # first usable.
    for n in $(ls "$p/gids" 2>/dev/null | sort -n); do
      g="$p/gids/$n"
      [ -f "$g" ] || continue
      v=$(cat "$g" 2>/dev/null)
      case "$v" in ""|0000:0000:0000:0000:0000:0000:0000:0000|fe80:*) continue;; esac
      t=$(cat "$p/gid_attrs/types/$n" 2>/dev/null | tr ' ' '_')
      case "$t" in *v2*) ;; *) [ "$gid" = - ] || continue;; esac
      gid="$n:$v:${t:-?}"; mtu=-
      nd=$(cat "$p/gid_attrs/ndevs/$n" 2>/dev/null)
      [ -n "$nd" ] && mtu=$(cat "$sys/class/net/$nd/mtu" 2>/dev/null || echo -)
      case "$t" in *v2*) break;; esac
    done
    echo "rdma $(basename "$d") port $(basename "$p") $(cat "$p/state" 2>/dev/null | tr -d ' ') $(cat "$p/link_layer" 2>/dev/null) gid $gid mtu $mtu"
  done
done
"#;

/// Runs the probe on `host` (locally when it is this host).
fn probe(host: &str, ssh: &[String], program: &str) -> Facts {
    let local = hosts::is_local(host);
    let (mut cmd, script) = if local {
        let mut c = Command::new("sh");
        c.args(["-c", PROBE, "kvrun-doctor", program]);
        (c, String::new())
    } else {
        // The script goes on stdin, the login shell (POSIX or csh) sees only words; it runs in
        // the directory the job's processes start in (`child::remote_command`).
        let cwd = std::env::current_dir()
            .map(|d| d.to_string_lossy().into_owned())
            .unwrap_or_else(|_| ".".into());
        let mut c = Command::new(&ssh[0]);
        c.args(&ssh[1..]).arg(host).arg(format!(
            "exec sh -s {} {}",
            crate::child::remote_word(&cwd),
            crate::child::remote_word(program)
        ));
        let decode = crate::child::decode_words!();
        (c, format!("{decode}cd \"$1\" 2>/dev/null; shift\n{PROBE}"))
    };
    // The local probe runs in a group of its own, killed whole at the limit; ssh stays in
    // kvrun's, where it can ask at the terminal (a host key, a password: from a background
    // group it would be stopped), and its remote side ends with the connection.
    let out = run_bounded(&mut cmd, script.as_bytes(), Duration::from_secs(60), local);
    let mut f = Facts::default();
    let out = match out {
        Ok(o) if o.status.success() => o,
        Ok(o) => {
            f.reachable = Some(format!(
                "{} ({})",
                String::from_utf8_lossy(&o.stderr).trim(),
                o.status
            ));
            return f;
        }
        Err(e) => {
            f.reachable = Some(format!("cannot run {}: {e}", ssh[0]));
            return f;
        }
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let (k, v) = line.split_once(' ').unwrap_or((line, ""));
        match k {
            "program" => f.program = v == "yes",
            "memlock" => {
                f.memlock_kib = Some(if v == "unlimited" {
                    u64::MAX
                } else {
                    v.parse().unwrap_or(0)
                })
            }
            "ptrace" => f.ptrace_scope = v.parse().ok(),
            "uid" => f.uid = v.parse().ok(),
            "rdma" => f.rdma.push(v.to_string()),
            _ => {}
        }
    }
    f
}

/// Whether a host has an active RDMA port.
fn rdma_active(f: &Facts) -> bool {
    f.rdma.iter().any(|r| r.contains("ACTIVE"))
}

/// Checks every host and pair; prints the findings; the exit status.
pub fn run(opts: &DoctorOptions) -> i32 {
    let hosts: Vec<Host> = match (&opts.hosts, &opts.hostfile) {
        (Some(list), _) => match hosts::parse_host_list(list) {
            Ok(h) => h,
            Err(e) => return fail(&e),
        },
        (None, Some(path)) => match std::fs::read_to_string(path)
            .map_err(|e| format!("{}: {e}", path.display()))
            .and_then(|t| hosts::parse_hostfile(&t))
        {
            Ok(h) => h,
            Err(e) => return fail(&e),
        },
        (None, None) => vec![Host {
            name: "localhost".into(),
            slots: 1,
        }],
    };
    let ssh: Vec<String> = opts.ssh.split_whitespace().map(str::to_string).collect();
    if ssh.is_empty() {
        return fail("--ssh is empty");
    }
    let program = opts.program.display().to_string();
    let rdma_built = kvstore::RDMA_BUILT;
    let mut problems = 0;
    // Hosts (by index) whose memlock limit is too low for RDMA, with the limit in KiB.
    let mut low_memlock = Vec::new();
    let mut facts = Vec::new();
    if opts.port != 0 {
        match std::net::TcpListener::bind(("0.0.0.0", opts.port)) {
            Ok(_) => say!("ok: the scheduler's port {} is free here", opts.port),
            Err(e) => {
                problems += 1;
                say!(
                    "FAIL: the scheduler's port {} cannot be bound here ({e}); fix: choose \
                     another --port, or 0 for any free one",
                    opts.port
                );
            }
        }
    }
    for h in &hosts {
        let f = probe(&h.name, &ssh, &program);
        let name = &h.name;
        if let Some(why) = &f.reachable {
            problems += 1;
            say!(
                "FAIL {name}: not reachable over ssh: {why}; fix: set up key-based login \
                 (ssh-copy-id {name}) and check `{} {name} true`",
                opts.ssh
            );
            facts.push(f);
            continue;
        }
        say!("ok {name}: reachable");
        if f.program {
            say!("ok {name}: {program} is there and executable");
        } else {
            problems += 1;
            say!(
                "FAIL {name}: {program} is missing or not executable there; fix: install it at \
                 the same path on every host (or share the directory)"
            );
        }
        match f.memlock_kib {
            Some(k) if k >= 64 * 1024 => say!("ok {name}: memlock limit {}", kib(k)),
            // Too low for RDMA: a problem only where a pair of hosts would use it (below).
            Some(k) if rdma_built && rdma_active(&f) => low_memlock.push((facts.len(), k)),
            Some(k) => say!(
                "note {name}: memlock limit {} (RDMA would need more: `ulimit -l unlimited`)",
                kib(k)
            ),
            None => say!("note {name}: memlock limit unknown"),
        }
        // Yama: at 1 a process may write only its descendants' memory, and a job's processes
        // are siblings; at 2 only with CAP_SYS_PTRACE (root); at 3 never (until a reboot).
        let root = f.uid == Some(0);
        match f.ptrace_scope {
            None => say!("ok {name}: cross-memory writes allowed (no Yama)"),
            Some(0) => say!("ok {name}: cross-memory writes allowed (ptrace_scope 0)"),
            Some(s @ (1 | 2)) if root => {
                say!("ok {name}: cross-memory writes allowed to root (ptrace_scope {s})")
            }
            Some(s @ (1 | 2)) => say!(
                "note {name}: kernel.yama.ptrace_scope is {s}: cross-memory writes between a \
                 job's processes are refused (they are not each other's descendants), so \
                 shared-memory pulls take one more copy; fix: sysctl kernel.yama.ptrace_scope=0"
            ),
            Some(s) => say!(
                "note {name}: kernel.yama.ptrace_scope is {s}: cross-memory writes are refused \
                 to every process until a reboot, so shared-memory pulls take one more copy"
            ),
        }
        if f.rdma.is_empty() {
            say!("ok {name}: no RDMA device (TCP between hosts)");
        } else {
            for r in &f.rdma {
                say!("ok {name}: RDMA {}", describe_rdma(r));
            }
            if !rdma_built {
                say!(
                    "note {name}: this kvrun is built without RDMA (cargo build --features \
                     kvstore/rdma): its jobs use TCP between hosts"
                );
            }
        }
        facts.push(f);
    }
    let pair = |i: usize, j: usize| {
        let (fa, fb) = (&facts[i], &facts[j]);
        if i == j || hosts::is_local(&hosts[i].name) && hosts::is_local(&hosts[j].name) {
            ("shm", "the same host: shared memory")
        } else if !rdma_built {
            ("tcp", "RDMA is not built into this kvrun")
        } else if rdma_active(fa) && rdma_active(fb) {
            ("rdma", "both have an active RDMA port")
        } else {
            ("tcp", "not both have an active RDMA port")
        }
    };
    for (i, a) in hosts.iter().enumerate() {
        for (j, b) in hosts.iter().enumerate().skip(i) {
            let (t, why) = pair(i, j);
            say!("pair {} - {}: {t} ({why})", a.name, b.name);
        }
    }
    for (i, k) in low_memlock {
        let name = &hosts[i].name;
        if (0..hosts.len()).any(|j| pair(i, j).0 == "rdma") {
            problems += 1;
            say!(
                "FAIL {name}: memlock limit {} is too low for RDMA, which registers tensor \
                 memory; fix: `ulimit -l unlimited` (or memlock in /etc/security/limits.conf)",
                kib(k)
            );
        } else {
            say!(
                "note {name}: memlock limit {} (too low for RDMA, which no pair of these hosts \
                 uses)",
                kib(k)
            );
        }
    }
    if problems > 0 {
        say!("kvrun doctor: {problems} problem(s): a job on these hosts would fail");
        1
    } else {
        say!("kvrun doctor: no problem found");
        0
    }
}

/// A probe's RDMA line (`rxe0 port 1 4:ACTIVE Ethernet gid 1:<gid>:RoCE_v2 mtu 1500`) as
/// `rxe0 port 1: ACTIVE, Ethernet, GID 1 <gid> (RoCE v2), MTU 1500`.
fn describe_rdma(line: &str) -> String {
    let w: Vec<&str> = line.split_whitespace().collect();
    let get = |key: &str| {
        w.iter()
            .position(|x| *x == key)
            .and_then(|i| w.get(i + 1))
            .copied()
            .unwrap_or("-")
    };
    let (dev, port) = (w.first().copied().unwrap_or("?"), get("port"));
    let state = w
        .get(3)
        .map_or("?", |s| s.split(':').next_back().unwrap_or(s));
    let link = w.get(4).copied().unwrap_or("?");
    let gid = get("gid");
    let gid = match (gid.split_once(':'), gid.rsplit_once(':')) {
        (Some((idx, _)), Some((head, kind))) if head.len() > idx.len() => format!(
            "GID {idx} {} ({})",
            &head[idx.len() + 1..],
            kind.replace('_', " ")
        ),
        _ => "no usable GID".into(),
    };
    format!(
        "{dev} port {port}: {state}, {link}, {gid}, MTU {}",
        get("mtu")
    )
}

fn kib(k: u64) -> String {
    if k == u64::MAX {
        "unlimited".into()
    } else if k >= 1024 * 1024 {
        format!("{:.1} GiB", k as f64 / (1024.0 * 1024.0))
    } else if k >= 1024 {
        format!("{:.1} MiB", k as f64 / 1024.0)
    } else {
        format!("{k} KiB")
    }
}

fn fail(why: &str) -> i32 {
    let _ = std::io::Write::write_all(
        &mut std::io::stderr().lock(),
        format!("kvrun doctor: {why}\n").as_bytes(),
    );
    2
}

/// Runs `cmd` with `input` on its stdin, for at most `limit` in all: its output. With
/// `own_group` the command runs in a process group of its own, killed whole if the limit
/// passes while it runs (else the command alone is killed). Its
/// output is read by threads as it comes, so a process it left behind holding the pipes open
/// (an ssh master, a stray background job) holds the probe at most 2 s after the command
/// ended: what was read by then is its output.
fn run_bounded(
    cmd: &mut Command,
    input: &[u8],
    limit: Duration,
    own_group: bool,
) -> std::io::Result<Output> {
    use std::io::{Read, Write};
    use std::os::unix::process::CommandExt;
    use std::sync::{mpsc, Arc, Mutex};

    let deadline = Instant::now() + limit;
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if own_group {
        cmd.process_group(0);
    }
    let mut child = cmd.spawn()?;
    let (done, ended) = mpsc::channel();
    let read = |pipe: Option<Box<dyn Read + Send>>| {
        let got = Arc::new(Mutex::new(Vec::new()));
        let (into, done) = (Arc::clone(&got), done.clone());
        std::thread::spawn(move || {
            if let Some(mut p) = pipe {
                let mut buf = [0u8; 4096];
                // Bounded: a probe's answer is a few lines.
                while let Ok(n @ 1..) = p.read(&mut buf) {
                    let mut v = into.lock().unwrap_or_else(|e| e.into_inner());
                    if v.len() < 1 << 20 {
                        v.extend_from_slice(&buf[..n]);
                    }
                }
            }
            let _ = done.send(());
        });
        got
    };
    let stdout = read(
        child
            .stdout
            .take()
            .map(|o| Box::new(o) as Box<dyn Read + Send>),
    );
    let stderr = read(
        child
            .stderr
            .take()
            .map(|e| Box::new(e) as Box<dyn Read + Send>),
    );
    if let Some(mut i) = child.stdin.take() {
        // Written from a thread of its own: a shell that never reads its input must not hold
        // the probe past its limit. One that exits early closes it, and what it did not read
        // does not matter.
        let input = input.to_vec();
        std::thread::spawn(move || {
            let _ = i.write_all(&input);
        });
    }
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        if Instant::now() >= deadline {
            if own_group {
                // SAFETY: kill(2) with a negative pid signals the group the child leads (made
                // by `process_group(0)` above), whose id cannot be reused: the child is not
                // reaped yet. No memory is involved.
                unsafe { libc::kill(-(child.id() as libc::pid_t), libc::SIGKILL) };
            }
            let _ = child.kill();
            let _ = child.wait();
            return Err(std::io::Error::other(format!(
                "no answer in {} s",
                limit.as_secs()
            )));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let linger = Instant::now() + Duration::from_secs(2);
    for _ in 0..2 {
        if ended
            .recv_timeout(linger.saturating_duration_since(Instant::now()))
            .is_err()
        {
            break;
        }
    }
    let take =
        |v: Arc<Mutex<Vec<u8>>>| std::mem::take(&mut *v.lock().unwrap_or_else(|e| e.into_inner()));
    Ok(Output {
        status,
        stdout: take(stdout),
        stderr: take(stderr),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_probe_is_bounded_by_what_its_command_leaves_behind() {
        // The shell answers and ends, leaving a process that holds its output open for a
        // minute: the probe returns the answer within the linger, not after the minute.
        let t = Instant::now();
        let out = run_bounded(
            Command::new("sh")
                .arg("-c")
                .arg("read x; echo got $x; sleep 60 &"),
            b"hello\n",
            Duration::from_secs(30),
            true,
        )
        .unwrap();
        assert!(out.status.success());
        assert_eq!(out.stdout, b"got hello\n");
        assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());
    }

    #[test]
    fn a_probe_that_never_answers_is_killed_with_its_group() {
        // The shell neither reads its input (more than a pipe holds) nor ends, and has a
        // process in the background, which is killed with it.
        let big = vec![b'x'; 1 << 20];
        let file = std::env::temp_dir().join(format!("kvrun-doctor-test-{}", std::process::id()));
        let script = format!("sleep 60 & echo $! > {}; sleep 60", file.display());
        let err = run_bounded(
            Command::new("sh").arg("-c").arg(script),
            &big,
            Duration::from_millis(500),
            true,
        )
        .unwrap_err();
        assert!(err.to_string().contains("no answer"), "{err}");
        let pid = std::fs::read_to_string(&file).unwrap();
        let _ = std::fs::remove_file(&file);
        let stat = format!("/proc/{}/stat", pid.trim());
        let start = Instant::now();
        // Gone, or a zombie waiting for whoever inherited it to reap it.
        while std::fs::read_to_string(&stat).is_ok_and(|s| !s.contains(") Z ")) {
            assert!(start.elapsed() < Duration::from_secs(5), "{pid} lives on");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}
