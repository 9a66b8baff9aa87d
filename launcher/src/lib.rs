//! `kvrun`, the job launcher: runs the scheduler in-process, starts S servers and W workers of
//! the user's program with their roles in the environment (MXNet's `DMLC_*` variables), prefixes
//! their output with role and rank, and stops the whole job when any process fails or on
//! Ctrl-C, leaving no process behind.
#![deny(missing_docs)]

mod child;
pub mod doctor;
pub mod hosts;
mod output;
pub mod shepherd;
mod supervise;
mod view;
use supervise::{supervise, Ended};

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use clap::Parser;
use kvstore::scheduler::{run_scheduler, SchedulerOptions};

pub use child::{shell_quote, Child, RoleName};
pub use hosts::{Host, MapBy};

/// The command line of `kvrun`.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "kvrun",
    version,
    about = "Run a kvstore job: a scheduler, S servers and W workers of PROGRAM",
    override_usage = "kvrun -n WORKERS -s SERVERS [OPTIONS] [--] PROGRAM [ARGS]...",
    after_help = "Exit status: 0 when every process ended with 0; when one fails, the first \
                  failure's own status, as mpirun gives it (128 + n for a process killed by \
                  signal n); 1 when kvrun ends the job itself (its timeout, servers that \
                  outlive the grace period, the scheduler's error); 128 + n when kvrun is \
                  stopped by signal n (130 on Ctrl-C, 143 on SIGTERM); 2 for a wrong \
                  command line or a program that cannot be started."
)]
pub struct Options {
    /// Number of worker processes.
    #[arg(short = 'n', long = "workers", value_name = "WORKERS", value_parser = clap::value_parser!(u32).range(1..))]
    pub workers: u32,
    /// Number of server processes.
    #[arg(short = 's', long = "servers", value_name = "SERVERS", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub servers: u32,
    /// Address the scheduler listens on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// Port the scheduler listens on (0: any free port).
    #[arg(long, default_value_t = 0)]
    pub port: u16,
    /// Seconds any blocking wait of the job may take [default: $KVSTORE_TIMEOUT, else 120].
    #[arg(long)]
    pub timeout: Option<f64>,
    /// Seconds the servers get to exit after the workers are done.
    #[arg(long, default_value_t = 30.0, value_parser = seconds)]
    pub grace: f64,
    /// Print a line every SECS seconds while the job runs: calls and bytes so far, and the
    /// slowest worker.
    #[arg(long, value_name = "SECS", value_parser = seconds)]
    pub progress: Option<f64>,
    /// Collect every process's metrics at the end of the job into FILE.
    #[arg(long, value_name = "FILE")]
    pub stats: Option<PathBuf>,
    /// The format of --stats: json or prometheus (the text format).
    #[arg(long, default_value = "json", value_parser = ["json", "prometheus"])]
    pub stats_format: String,
    /// Environment variables to set for every process (NAME=VALUE or NAME to pass ours on).
    #[arg(short = 'x', value_name = "VAR[=VALUE]")]
    pub env: Vec<String>,
    /// Hosts to run on, `host[:slots]` comma separated (mpirun's -H).
    #[arg(
        short = 'H',
        long = "hosts",
        value_name = "HOSTS",
        conflicts_with = "hostfile"
    )]
    pub hosts: Option<String>,
    /// A hostfile in mpirun's format: `host slots=N` per line.
    #[arg(long, value_name = "FILE")]
    pub hostfile: Option<PathBuf>,
    /// Fill each host's slots first (slot) or go round the hosts (node).
    #[arg(long, value_enum, default_value_t = MapBy::Slot)]
    pub map_by: MapBy,
    /// Allow more processes than slots.
    #[arg(long)]
    pub oversubscribe: bool,
    /// The ssh command (and its options) that starts remote processes.
    #[arg(long, default_value = "ssh -o BatchMode=yes -o ConnectTimeout=10")]
    pub ssh: String,
    /// The address remote processes reach the scheduler at (default: this host's address on
    /// the route to the first remote host).
    #[arg(long, value_name = "ADDR")]
    pub scheduler_host: Option<IpAddr>,
    /// The program every process runs, then its arguments: everything from PROGRAM on is the
    /// program's, as with mpirun (`kvrun -n 2 ./bench -s 8` passes `-s 8` to bench).
    #[arg(
        required = true,
        num_args = 1..,
        trailing_var_arg = true,
        value_name = "PROGRAM [ARGS]"
    )]
    pub command: Vec<String>,
}

impl Options {
    /// The program every process runs.
    pub fn program(&self) -> &Path {
        Path::new(self.command.first().map_or("", String::as_str))
    }

    /// The program's arguments.
    pub fn args(&self) -> &[String] {
        self.command.get(1..).unwrap_or(&[])
    }
}

/// A number of seconds on the command line: finite and not negative.
fn seconds(v: &str) -> Result<f64, String> {
    match v.trim().parse::<f64>() {
        Ok(t) if (0.0..1e9).contains(&t) => Ok(t),
        _ => Err(format!("{v:?} is not a number of seconds")),
    }
}

/// Why `-x` may not set `name`, where it is a variable kvrun gives every process itself (a
/// value of the user's would reach some processes and not kvrun's scheduler).
fn managed(name: &str) -> Option<&'static str> {
    match name {
        "KVSTORE_TIMEOUT" => Some(" (use --timeout)"),
        "DMLC_NUM_WORKER" => Some(" (use -n)"),
        "DMLC_NUM_SERVER" => Some(" (use -s)"),
        "DMLC_PS_ROOT_URI" | "DMLC_PS_ROOT_PORT" => {
            Some(" (use --host, --port or --scheduler-host)")
        }
        "KVSTORE_SECRET" | "DMLC_ROLE" | "KVSTORE_RANK" => Some(" (a new one for every job)"),
        n if n == kvstore::report::VAR => Some(""),
        _ => None,
    }
}

/// The ssh sessions to one host kvrun lets log in at once (below sshd's default MaxStartups
/// of 10, past which it drops new ones at random).
const SSH_LOGINS: usize = 8;

/// A random job secret, from the kernel's generator.
pub fn make_secret() -> std::io::Result<String> {
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut b)?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// `n` and a noun, plural where it is.
fn count(n: u32, noun: &str) -> String {
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{n} {noun}s")
    }
}

fn say(msg: &str) {
    // Not `eprintln!`, which panics where stderr is closed (`kvrun ... 2>&1 | head -1`): a
    // panic here would skip stopping the job's processes.
    // One write: a line of kvrun's is never split by a process's output (stdout and stderr
    // merged into one file, as a batch system's log is).
    let line = format!("kvrun: {msg}\n");
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}

/// Whether `sig` was ignored (`SIG_IGN`) when kvrun started.
fn ignored_at_start(sig: libc::c_int) -> bool {
    // SAFETY: sigaction with a null new action only reads the current one into `old`, which
    // is zeroed plain data of the right type.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        libc::sigaction(sig, std::ptr::null(), &mut old) == 0 && old.sa_sigaction == libc::SIG_IGN
    }
}

/// Takes SIGCHLD back to its default, first thing (`main`, before a job or `doctor`): a parent
/// that ignores it (exec keeps that) would have the kernel reap kvrun's children before kvrun
/// learns how they ended, and the job's processes would inherit it.
pub fn child_signal_default() {
    // SAFETY: the default disposition installs no handler; no thread runs yet.
    unsafe { libc::signal(libc::SIGCHLD, libc::SIG_DFL) };
}

/// Runs a job; returns the exit status kvrun should exit with.
pub fn run(opts: &Options) -> i32 {
    match run_job(opts) {
        Ok(code) => code,
        Err(e) => {
            say(&e);
            2
        }
    }
}

/// The job's timeout: `--timeout`, else `KVSTORE_TIMEOUT` in kvrun's environment, else 120 s.
fn timeout(opts: &Options) -> Result<f64, String> {
    let t = match (opts.timeout, std::env::var("KVSTORE_TIMEOUT")) {
        (Some(t), _) => t,
        (None, Ok(v)) if !v.is_empty() => v
            .trim()
            .parse()
            .map_err(|_| format!("KVSTORE_TIMEOUT={v:?} is not a number of seconds"))?,
        (None, Err(std::env::VarError::NotUnicode(v))) => {
            return Err(format!("KVSTORE_TIMEOUT={v:?} is not a number of seconds"))
        }
        _ => 120.0,
    };
    if !(t > 0.0 && t <= kvstore::MAX_TIMEOUT_S) {
        return Err(format!(
            "--timeout must be a positive number of seconds, at most {} (30 days)",
            kvstore::MAX_TIMEOUT_S
        ));
    }
    Ok(t)
}

/// The log filter of kvrun's environment (`KVSTORE_LOG`, else `RUST_LOG`): kvrun's own
/// scheduler logs with it, and every process of the job gets it.
fn log_filter() -> Option<(&'static str, String)> {
    ["KVSTORE_LOG", "RUST_LOG"].into_iter().find_map(|k| {
        std::env::var(k)
            .ok()
            .filter(|v| !v.is_empty())
            .map(|v| (k, v))
    })
}

fn run_job(opts: &Options) -> Result<i32, String> {
    let job_timeout = timeout(opts)?;
    // A --stats file that cannot be written is said now, not after the job (one made here
    // goes again if the job never gets to write it).
    let mut stats_made = None;
    if let Some(path) = &opts.stats {
        let existed = path.exists();
        std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(path)
            .map_err(|e| format!("--stats {}: {e}", path.display()))?;
        stats_made = (!existed).then(|| view::MadeFile(Some(path.clone())));
    }
    raise_open_files();
    let log = log_filter();
    kvstore::init_logging(log.as_ref().map(|(_, v)| v.as_str()));
    let stop = Arc::new(AtomicBool::new(false));
    // Which signal stopped kvrun, for its status (set before `stop`, so it is read after).
    let stopped_by = Arc::new(AtomicUsize::new(0));
    for sig in [
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGHUP,
    ] {
        // A hang-up ignored when kvrun started stays ignored, as `nohup kvrun ...` means it
        // (SIGINT and SIGTERM stop the job whatever: a script's background job starts with
        // SIGINT ignored, and `kill -INT` still ends it, as mpirun's).
        if sig == signal_hook::consts::SIGHUP && ignored_at_start(sig) {
            continue;
        }
        signal_hook::flag::register_usize(sig, stopped_by.clone(), sig as usize)
            .and_then(|_| signal_hook::flag::register(sig, stop.clone()))
            .map_err(|e| format!("signal handler: {e}"))?;
    }
    let mut forwarded = supervise::Forwarded::register()?;
    let hosts = match (&opts.hosts, &opts.hostfile) {
        (Some(list), _) => hosts::parse_host_list(list)?,
        (None, Some(f)) => {
            let text = std::fs::read_to_string(f).map_err(|e| format!("{}: {e}", f.display()))?;
            hosts::parse_hostfile(&text)?
        }
        (None, None) => vec![Host {
            name: "localhost".into(),
            slots: (opts.servers as usize).saturating_add(opts.workers as usize),
        }],
    };
    let placement = hosts::place(
        &hosts,
        opts.servers as usize,
        opts.workers as usize,
        opts.map_by,
        opts.oversubscribe,
    )?;
    let remote: Vec<Option<&str>> = hosts
        .iter()
        .map(|h| (!hosts::is_local(&h.name)).then_some(h.name.as_str()))
        .collect();
    let first_remote = remote.iter().flatten().next().copied();
    let ssh: Vec<String> = opts.ssh.split_whitespace().map(str::to_string).collect();

    let secret = make_secret().map_err(|e| format!("cannot make a job secret: {e}"))?;
    // Remote processes need an address they can reach: `--scheduler-host`, else `--host` where
    // it names one, else this host's address on the route to the first remote host, listening
    // on every address of that family.
    let advertise = match first_remote {
        None => None,
        Some(_) if opts.scheduler_host.is_some() => opts.scheduler_host,
        Some(_) if !opts.host.is_loopback() && !opts.host.is_unspecified() => Some(opts.host),
        Some(h) => Some(route_to(h)?),
    };
    let bind = match advertise {
        Some(IpAddr::V6(_)) if opts.host.is_loopback() => IpAddr::from([0u16; 8]),
        Some(_) if opts.host.is_loopback() => IpAddr::from([0, 0, 0, 0]),
        _ => opts.host,
    };
    let listener = TcpListener::bind(SocketAddr::new(bind, opts.port))
        .map_err(|e| format!("cannot listen on {bind}:{}: {e}", opts.port))?;
    let mut root = listener.local_addr().map_err(|e| e.to_string())?;
    if let Some(ip) = advertise {
        root.set_ip(ip);
    }
    let sched_opts = SchedulerOptions {
        num_workers: opts.workers as usize,
        num_servers: opts.servers as usize,
        secret: secret.clone(),
        timeout: Duration::from_secs_f64(job_timeout),
    };
    // The processes' reports come to a listener of kvrun's own, beside the scheduler's.
    let (report_at, mut view) = view::listen(
        bind,
        secret.clone(),
        (opts.workers as usize, opts.servers as usize),
        opts.progress,
    )
    .map_err(|e| format!("cannot listen for reports on {bind}: {e}"))?;
    let report_at = SocketAddr::new(root.ip(), report_at.port());
    let (sched_tx, sched_rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = sched_tx.send(run_scheduler(listener, &sched_opts));
    });

    let mut env: Vec<(String, String)> = vec![
        ("DMLC_PS_ROOT_URI".into(), root.ip().to_string()),
        ("DMLC_PS_ROOT_PORT".into(), root.port().to_string()),
        ("DMLC_NUM_SERVER".into(), opts.servers.to_string()),
        ("DMLC_NUM_WORKER".into(), opts.workers.to_string()),
        ("KVSTORE_SECRET".into(), secret),
        (kvstore::report::VAR.into(), report_at.to_string()),
        ("KVSTORE_TIMEOUT".into(), job_timeout.to_string()),
    ];
    if let Some((k, v)) = log {
        env.push((k.to_string(), v));
    }
    for x in &opts.env {
        let name = x.split_once('=').map_or(x.as_str(), |(k, _)| k);
        // A name: not empty, without white space or NUL (anything else an environment holds,
        // `BASH_FUNC_f%%` too, passes).
        if name.is_empty() || name.chars().any(|c| c.is_whitespace() || c == '\0') {
            return Err(format!(
                "-x {x}: {name:?} is not a variable's name (empty, or with white space)"
            ));
        }
        if let Some(why) = managed(name) {
            return Err(format!("-x {name}: kvrun sets {name} itself{why}"));
        }
        match x.split_once('=') {
            Some((k, v)) => env.push((k.to_string(), v.to_string())),
            None => match std::env::var(x) {
                Ok(v) => env.push((x.clone(), v)),
                Err(std::env::VarError::NotUnicode(_)) => {
                    return Err(format!(
                        "-x {x}: its value in kvrun's environment is not UTF-8"
                    ))
                }
                Err(_) => return Err(format!("-x {x}: not set in kvrun's environment")),
            },
        }
    }

    let mut shepherd =
        shepherd::Shepherd::start().map_err(|e| format!("cannot start the shepherd: {e}"))?;
    let mut children: Vec<Child> = Vec::new();
    // Starting the processes is bounded by the job's timeout, as everything after it is.
    let start_deadline = Instant::now() + Duration::from_secs_f64(job_timeout);
    for (role, h) in placement {
        if let Some(host) = remote[h] {
            // sshd drops new connections at random beyond 10 not yet logged in (its
            // MaxStartups): at most 8 of a host's are let log in at once.
            let logging_in = |cs: &mut [Child]| {
                let mine = cs.iter_mut().filter(|c| c.host.as_deref() == Some(host));
                mine.map(|c| c.logging_in() as usize).sum::<usize>()
            };
            while logging_in(&mut children) >= SSH_LOGINS && !stop.load(Ordering::Relaxed) {
                if Instant::now() >= start_deadline {
                    child::stop_all(&mut children);
                    child::flush_output(&mut children, Duration::from_secs_f64(job_timeout), &stop);
                    shepherd.done();
                    say(&format!(
                        "{SSH_LOGINS} ssh sessions to {host} were still logging in when the \
                         job's timeout ({job_timeout} s) ended: check ssh to it (kvrun doctor)"
                    ));
                    return Ok(1);
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        if stop.load(Ordering::Relaxed) {
            // Interrupted while starting: what started is stopped, nothing more starts.
            say("interrupted: stopping every process");
            child::stop_all(&mut children);
            child::flush_output(&mut children, Duration::from_secs_f64(job_timeout), &stop);
            shepherd.done();
            return Ok(supervise::stopped_status(&stopped_by));
        }
        match Child::spawn(role, remote[h], &ssh, opts.program(), opts.args(), &env) {
            Ok(c) => {
                shepherd.watch(c.pid);
                children.push(c);
            }
            Err(e) => {
                child::stop_all(&mut children);
                shepherd.done();
                let what = match remote[h] {
                    Some(host) => format!(
                        "{} on {host} via {}",
                        opts.program().display(),
                        ssh.first().map_or("ssh", String::as_str)
                    ),
                    None => opts.program().display().to_string(),
                };
                return Err(format!("cannot start {role} ({what}): {e}"));
            }
        }
    }

    let places: Vec<String> = hosts
        .iter()
        .map(|h| match remote.iter().flatten().find(|r| **r == h.name) {
            Some(r) => r.to_string(),
            None => "this host".to_string(),
        })
        .collect();
    let mut places_once: Vec<String> = Vec::new();
    for p in places {
        if !places_once.contains(&p) {
            places_once.push(p);
        }
    }
    say(&format!(
        "{} and {} of {} on {}; scheduler at {root}; timeout of each wait {job_timeout} s",
        count(opts.workers, "worker"),
        count(opts.servers, "server"),
        opts.program().display(),
        places_once.join(", ")
    ));
    let started = Instant::now();
    let ended = supervise(
        &mut children,
        (&stop, &stopped_by),
        &mut forwarded,
        &sched_rx,
        opts,
        &mut view,
    );
    if let Some(path) = &opts.stats {
        // The last reports come as the processes end (a remote one's on a link of its own,
        // which may be later than ssh's end): each process that joined is waited for, 2 s
        // at most.
        let until = Instant::now() + Duration::from_secs(2);
        view.update(&children, |_| {});
        while !view.missing_metrics().is_empty() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(20));
            view.update(&children, |_| {});
        }
        let text = if opts.stats_format == "prometheus" {
            view.prometheus()
        } else {
            view.stats_json()
        };
        let missing = view.missing_metrics();
        let missing = match missing.is_empty() {
            true => String::new(),
            false => format!("; none came from {}", missing.join(", ")),
        };
        if let Some(m) = stats_made.take() {
            m.keep();
        }
        match std::fs::write(path, text) {
            Ok(()) => say(&format!("metrics written to {}{missing}", path.display())),
            Err(e) => say(&format!("cannot write {}: {e}", path.display())),
        }
    }
    // Every process ended with status 0: the job's status is 0, as mpirun's would be, and
    // the last line says whether the scheduler saw the job through.
    let then = match ended {
        Ended::Status(0) => Some(""),
        Ended::Status(_) => None,
        Ended::SchedulerWaiting { any_joined: false } => Some("; the scheduler saw no job"),
        Ended::SchedulerWaiting { any_joined: true } => {
            Some("; the scheduler had not seen the job end")
        }
    };
    if let Some(then) = then {
        let of = if then.is_empty() {
            "the scheduler, "
        } else {
            ""
        };
        say(&format!(
            "done in {:.2} s: {of}{} and {} ended with status 0{then}",
            started.elapsed().as_secs_f64(),
            count(opts.servers, "server"),
            count(opts.workers, "worker"),
        ));
    }
    let code = match ended {
        Ended::Status(c) => c,
        Ended::SchedulerWaiting { .. } => 0,
    };
    child::stop_all(&mut children);
    child::flush_output(&mut children, Duration::from_secs_f64(job_timeout), &stop);
    shepherd.done();
    Ok(code)
}

/// Raises the soft limit of open files to the hard one, as mpirun does: kvrun holds two or
/// three pipes a process (a soft limit of 1024 ran out near 300 remote processes), and the
/// processes it starts inherit the room.
fn raise_open_files() {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let mut l = getrlimit(Resource::Nofile);
    // An unlimited hard limit: Linux's most (nr_open's default).
    let most = l.maximum.unwrap_or(1 << 20);
    if l.current.is_some_and(|c| c < most) {
        l.current = Some(most);
        // Where it cannot be raised, it stays; running out is then an error that says so.
        let _ = setrlimit(Resource::Nofile, l);
    }
}

/// This host's address on the route to `host` (no packet is sent: a UDP socket is connected).
fn route_to(host: &str) -> Result<IpAddr, String> {
    use std::net::{ToSocketAddrs, UdpSocket};
    let target = (hosts::without_user(host), 22)
        .to_socket_addrs()
        .map_err(|e| {
            format!(
                "cannot resolve {host} ({e}) to find this host's address toward it: name that \
                 address with --scheduler-host"
            )
        })?
        .next()
        .ok_or_else(|| format!("{host} has no address"))?;
    let any: SocketAddr = if target.is_ipv4() {
        "0.0.0.0:0".parse().map_err(|_| "address")?
    } else {
        "[::]:0".parse().map_err(|_| "address")?
    };
    let s = UdpSocket::bind(any).map_err(|e| e.to_string())?;
    s.connect(target)
        .map_err(|e| format!("no route to {host}: {e}"))?;
    Ok(s.local_addr().map_err(|e| e.to_string())?.ip())
}

/// A process that failed: whether a signal likely ended it, how it ended in words, and its
/// status as the job's (`child::exit_code`).
struct Failure {
    signal: bool,
    what: String,
    code: i32,
}

impl Failure {
    fn of(c: &Child, status: &std::process::ExitStatus) -> Failure {
        let remote = c.host.is_some();
        Failure {
            signal: child::likely_signal(status, remote).is_some(),
            what: format!("{} {}", c.name(), child::describe(status, remote)),
            code: child::exit_code(status),
        }
    }

    /// Adds the failures among `children` that `failed` does not hold yet, in the order seen.
    fn collect(children: &mut [Child], failed: &mut Vec<Failure>) {
        for c in children.iter_mut() {
            if let Some(status) = c.poll() {
                if !status.success() {
                    let f = Failure::of(c, &status);
                    if !failed.iter().any(|g| g.what == f.what) {
                        failed.push(f);
                    }
                }
            }
        }
    }
}
