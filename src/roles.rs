//! Which role this process plays in a distributed job (from `DMLC_ROLE`, through
//! [`Config`]), and joining the job at the scheduler.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvstore_transport::tcp::blocking::{read_frame, write_frame};
use kvstore_transport::FrameHeader;

use crate::auth;
use crate::config::{Config, Role};
use crate::protocol::{Msg, Op};
use crate::{net, scheduler, server, worker};

/// What the scheduler told a node at rendezvous.
#[derive(Clone, Debug)]
pub(crate) struct Roster {
    pub rank: usize,
    pub num_workers: usize,
    pub num_servers: usize,
    pub servers: Vec<SocketAddr>,
    /// Each server's host identity ([`net::host_id`]), to find the ones on this host.
    pub server_hosts: Vec<String>,
    /// Each server's RDMA listener, if it has an active RDMA device.
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub server_rdma: Vec<Option<SocketAddr>>,
    /// The job's servers and workers on this node's host, itself included (at least 1), so
    /// that waits know when the job's processes outnumber the cores.
    pub local_processes: usize,
    /// The tokens of the workers' ranks ([`crate::auth`]): a worker's own (one), or every
    /// worker's in rank order (a server's); unmasked.
    pub tokens: Vec<[u8; auth::MAC]>,
    /// Each server's shared-memory socket name (random, drawn by the server).
    pub server_shm: Vec<Option<String>>,
}

pub(crate) fn parse_roster(text: &str, mask: &[u8; auth::MAC]) -> crate::Result<Roster> {
    let bad = || crate::KvError::Protocol(format!("malformed roster {text:?}"));
    let mut lines = text.lines();
    let head: Vec<usize> = lines
        .next()
        .ok_or_else(bad)?
        .split_whitespace()
        .map(|w| w.parse().map_err(|_| bad()))
        .collect::<crate::Result<_>>()?;
    let (rank, num_workers, num_servers, local_processes) = match head[..] {
        [r, w, s] => (r, w, s, 1),
        [r, w, s, l] => (r, w, s, l.max(1)),
        _ => return Err(bad()),
    };
    let mut servers = Vec::new();
    let mut server_hosts = Vec::new();
    let mut server_rdma = Vec::new();
    let mut server_shm = Vec::new();
    let mut tokens = Vec::new();
    for l in lines {
        let mut w = l.split_whitespace();
        let first = w.next().ok_or_else(bad)?;
        if first == "token" {
            let t = w
                .next()
                .and_then(auth::unhex::<{ auth::MAC }>)
                .ok_or_else(bad)?;
            tokens.push(auth::xor(&t, mask));
            continue;
        }
        servers.push(first.parse().map_err(|_| bad())?);
        server_hosts.push(w.next().unwrap_or("-").to_string());
        server_rdma.push(match w.next() {
            None | Some("-") => None,
            Some(a) => Some(a.parse().map_err(|_| bad())?),
        });
        server_shm.push(w.next().filter(|n| *n != "-").map(str::to_string));
    }
    if servers.len() != num_servers {
        return Err(bad());
    }
    Ok(Roster {
        rank,
        num_workers,
        num_servers,
        servers,
        server_hosts,
        server_rdma,
        local_processes,
        tokens,
        server_shm,
    })
}

/// The longest time between a process's heartbeats.
pub(crate) const MAX_HEARTBEAT: Duration = Duration::from_secs(5);

/// How often a process tells the scheduler it lives: an eighth of the job's timeout, within
/// 0.25 to 5 s.
pub(crate) fn heartbeat_every(timeout: Duration) -> Duration {
    (timeout / 8).clamp(Duration::from_millis(250), MAX_HEARTBEAT)
}

/// How long the scheduler waits for a heartbeat before it takes the process for stopped or
/// hung and aborts the job naming it: three heartbeats (15 s at the default timeout).
pub(crate) fn liveness(timeout: Duration) -> Duration {
    heartbeat_every(timeout) * 3
}

/// A thread that tells the scheduler, every [`heartbeat_every`], that this process lives. A
/// process that stops (SIGSTOP, a hang) stops its heartbeat with it, and the scheduler aborts
/// the job naming it within [`liveness`]; a process busy in its own code still beats. Dropped:
/// the beats stop.
pub(crate) struct Heartbeat {
    stop: Arc<AtomicBool>,
    /// Held by whoever writes a frame to the scheduler, so that frames never interleave.
    lock: Arc<Mutex<()>>,
}

impl Heartbeat {
    /// Beats every `every` on a clone of `sched`, each write given `writes` at most.
    fn start(sched: &TcpStream, every: Duration, writes: Duration) -> std::io::Result<Heartbeat> {
        let mut s = sched.try_clone()?;
        let stop = Arc::new(AtomicBool::new(false));
        let lock = Arc::new(Mutex::new(()));
        let (halt, write) = (stop.clone(), lock.clone());
        std::thread::Builder::new()
            .name("kvstore-heartbeat".into())
            .spawn(move || {
                let h = FrameHeader::new(Msg::new(Op::Heartbeat).encode(), 0);
                loop {
                    // Short sleeps, so that a stop is seen soon.
                    let until = Instant::now() + every;
                    while let Some(left) = until.checked_duration_since(Instant::now()) {
                        if halt.load(Ordering::Relaxed) {
                            return;
                        }
                        std::thread::sleep(left.min(Duration::from_millis(50)));
                    }
                    if halt.load(Ordering::Relaxed) {
                        return;
                    }
                    let _g = write.lock().unwrap_or_else(|p| p.into_inner());
                    let mut w = Patient(&mut s, Instant::now() + writes);
                    if write_frame(&mut w, &h, &[]).is_err() {
                        return;
                    }
                }
            })?;
        Ok(Heartbeat { stop, lock })
    }

    /// The lock that orders writes to the scheduler.
    pub(crate) fn lock(&self) -> Arc<Mutex<()>> {
        self.lock.clone()
    }

    /// Holds off the heartbeat while this thread writes a frame to the scheduler.
    pub(crate) fn write_lock(&self) -> MutexGuard<'_, ()> {
        self.lock.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// A socket's writes that wait for room until a deadline, whether the socket blocks or not:
/// a server reads the scheduler without blocking, and the flag is the socket's, shared with
/// the heartbeat's clone of it (whose writes would otherwise fail at once on a full buffer,
/// and the scheduler take a live server for lost).
struct Patient<'a, W>(&'a mut W, Instant);

impl<W: std::io::Write> std::io::Write for Patient<'_, W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        use std::io::ErrorKind::{Interrupted, TimedOut, WouldBlock};
        loop {
            match self.0.write(buf) {
                Err(e) if matches!(e.kind(), WouldBlock | TimedOut | Interrupted) => {
                    if Instant::now() >= self.1 {
                        return Err(std::io::Error::new(
                            TimedOut,
                            "the scheduler's link is full",
                        ));
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                r => return r,
            }
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush()
    }
}

/// The longest a write to the scheduler (the hello, heartbeats, a barrier, the goodbye) may
/// block: a stopped scheduler's buffers fill, and a write that blocked for good would hold the
/// lock every other write to it waits for. (One that times out halfway ends the heartbeat, and
/// the scheduler then takes this process for lost: the scheduler did not read for 10 s.)
const SCHEDULER_WRITES: Duration = Duration::from_secs(10);

/// Says hello to the scheduler (a mutual challenge-response over the job's secret, which
/// never travels: [`crate::auth`]) and waits for the roster.
pub(crate) fn join(
    cfg: &Config,
    sched: &mut TcpStream,
    role: u64,
    addr: Option<SocketAddr>,
    rdma: Option<SocketAddr>,
    shm: Option<&str>,
) -> crate::Result<(Roster, Heartbeat)> {
    let writes = cfg.timeout.min(SCHEDULER_WRITES);
    let bound_writes = |s: &TcpStream| s.set_write_timeout(Some(writes));
    bound_writes(sched)?;
    let mut hello = Msg::new(Op::Hello);
    hello.key = role;
    hello.sender = cfg.rank_hint.unwrap_or(u32::MAX);
    // A nonce; then this node's address (a worker has none), its host, its RDMA listener,
    // its shared-memory socket, and its heartbeat period in ms (the scheduler judges its
    // silence by it).
    let dash = |a: Option<SocketAddr>| a.map_or_else(|| "-".to_string(), |a| a.to_string());
    let rest = format!(
        "{}\n{}\n{}\n{}\n{}",
        dash(addr),
        net::host_id(),
        dash(rdma),
        shm.unwrap_or("-"),
        heartbeat_every(cfg.timeout).as_millis()
    );
    let claim = auth::hello_claim(role, hello.sender, &rest);
    // This process took its role: the launcher hears so (if it listens).
    crate::report::start(cfg.report, &cfg.secret);
    if let Some(rank) = cfg.rank_hint {
        let role = if role == crate::protocol::role::SERVER {
            "server"
        } else {
            "worker"
        };
        crate::report::send(&crate::report::Report::Joined {
            role: role.into(),
            rank: rank as usize,
        });
    }
    let deadline = Instant::now() + cfg.timeout;
    let read = |sched: &mut TcpStream| {
        read_frame(sched, 1 << 20, Some(deadline)).map_err(|e| match e {
            kvstore_transport::TransportError::Closed => crate::KvError::PeerLost(
                "the scheduler closed the connection (a wrong job secret, or the job is full)"
                    .into(),
            ),
            kvstore_transport::TransportError::Timeout(_) => crate::KvError::Timeout {
                what: "the rendezvous".into(),
                secs: cfg.timeout.as_secs_f64(),
            },
            other => other.into(),
        })
    };
    // The scheduler proves it knows the secret before this node proves it does. A connection
    // it dropped before answering the hello (it makes room for new connections by dropping
    // the oldest that said nothing yet: a flood of a stranger's can take this one, said but
    // not yet read) is made again, until the job's timeout; what it drops later is final.
    let (nonce, h, text) = loop {
        let nonce = auth::random::<{ auth::NONCE }>()?;
        let payload = format!("{}\n{rest}", auth::hex(&nonce));
        let said = write_frame(
            sched,
            &FrameHeader::new(hello.encode(), payload.len() as u64),
            payload.as_bytes(),
        )
        .map_err(crate::KvError::from)
        .and_then(|()| read(sched));
        match said {
            Ok((h, text)) => break (nonce, h, text),
            Err(crate::KvError::PeerLost(_) | crate::KvError::Transport(_))
                if Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(20));
                let left = deadline.saturating_duration_since(Instant::now());
                *sched = kvstore_transport::tcp::connect_retry(cfg.root, left)?;
                sched.set_nodelay(true)?;
                bound_writes(sched)?;
            }
            Err(e) => return Err(e),
        }
    };
    let m = Msg::decode(&h.meta)?;
    let text = String::from_utf8_lossy(&text).into_owned();
    let theirs = match m.op {
        Op::Challenge => {
            let mut l = text.lines();
            let n = l.next().and_then(auth::unhex::<{ auth::NONCE }>);
            let p = l.next().and_then(auth::unhex::<{ auth::MAC }>);
            let key: &[&[u8]] = &[cfg.secret.as_bytes()];
            match (n, p) {
                (Some(n), Some(p))
                    if auth::check(key, auth::Side::Responder, &nonce, &n, &claim, &p) =>
                {
                    n
                }
                _ => {
                    return Err(crate::KvError::PeerLost(format!(
                        "the scheduler at {} does not know this job's secret (another job's, \
                         or not a kvstore scheduler)",
                        cfg.root
                    )))
                }
            }
        }
        // The scheduler proves itself before it says anything else: what an unproven peer
        // says is not taken for the job's word.
        other => {
            return Err(crate::KvError::PeerLost(format!(
                "the scheduler at {} answered {other:?} before proving it knows this job's \
                 secret (not this job's scheduler)",
                cfg.root
            )))
        }
    };
    let proof = auth::proof(
        &[cfg.secret.as_bytes()],
        auth::Side::Initiator,
        &nonce,
        &theirs,
        &claim,
    );
    let mut m = Msg::new(Op::Proof);
    m.key = role;
    write_frame(
        sched,
        &FrameHeader::new(m.encode(), auth::MAC as u64),
        &proof,
    )?;
    // From here on this process beats, the rendezvous wait included.
    let beat = Heartbeat::start(sched, heartbeat_every(cfg.timeout), writes)?;
    // (A server's beats are answered, from now on: those answers are not the roster.)
    let (m, text) = loop {
        let (h, text) = read(sched)?;
        let m = Msg::decode(&h.meta)?;
        if m.op != Op::Heartbeat {
            break (m, text);
        }
    };
    let text = String::from_utf8_lossy(&text).into_owned();
    match m.op {
        Op::Roster => Ok((
            parse_roster(
                &text,
                &auth::token_mask(cfg.secret.as_bytes(), &nonce, &theirs),
            )?,
            beat,
        )),
        Op::Abort => Err(crate::KvError::Aborted(text)),
        other => Err(crate::KvError::Protocol(format!(
            "expected a roster, got {other:?}"
        ))),
    }
}

/// Runs this process's role if it is not a worker (and exits the process when the role ends);
/// returns a connected worker otherwise.
pub(crate) fn start_worker_or_run_role(sync: bool) -> crate::Result<worker::DistWorker> {
    let cfg = Config::from_env()?;
    crate::init_logging(cfg.log.as_deref());
    match cfg.role {
        Role::Worker => worker::DistWorker::connect(cfg, sync),
        role => {
            let name = if role == Role::Server {
                "server"
            } else {
                "scheduler"
            };
            exit_with(run_other_role(&cfg, sync), name)
        }
    }
}

/// Runs a server or scheduler role to the end of the job.
fn run_other_role(cfg: &Config, sync: bool) -> crate::Result<()> {
    match cfg.role {
        Role::Worker => Ok(()),
        Role::Server => server::run_server(cfg, sync),
        Role::Scheduler => {
            // A job on this host alone names it 127.0.0.1 (or ::1): listened on there. Any
            // other root is listened on at every address, as ps-lite's scheduler does: the
            // name may resolve here to an address other hosts cannot reach (Debian maps a
            // host's own name to 127.0.1.1), or to none of this host's (NAT).
            let any: std::net::IpAddr = match cfg.root {
                SocketAddr::V4(_) => std::net::Ipv4Addr::UNSPECIFIED.into(),
                SocketAddr::V6(_) => std::net::Ipv6Addr::UNSPECIFIED.into(),
            };
            let at = match cfg.root_is_this_host_alone() {
                true => cfg.root,
                false => SocketAddr::new(any, cfg.root.port()),
            };
            let listener = TcpListener::bind(at).map_err(|e| {
                crate::KvError::Config(format!(
                    "the scheduler cannot listen at {at}: {e} (another job's, or a port in \
                     use: set KVSTORE_ROOT_PORT)"
                ))
            })?;
            let opts = scheduler::SchedulerOptions {
                num_workers: cfg.num_workers,
                num_servers: cfg.num_servers,
                secret: cfg.secret.clone(),
                timeout: cfg.timeout,
            };
            scheduler::run_scheduler(listener, &opts)
        }
    }
}

/// Runs the server or scheduler role that `DMLC_ROLE` names until the job ends, and says which
/// ran; `Ok(None)` in a worker or where no role is set. Unlike [`crate::create`] it returns
/// instead of exiting the process, for a host that ends the process its own way (the Python
/// package raises `SystemExit`). An error is the role's failure.
pub fn run_role(sync: bool) -> crate::Result<Option<Role>> {
    match Config::role_from_env() {
        Some(role @ (Role::Server | Role::Scheduler)) => {
            let cfg = Config::from_env()?;
            crate::init_logging(cfg.log.as_deref());
            run_other_role(&cfg, sync)?;
            Ok(Some(role))
        }
        _ => Ok(None),
    }
}

/// Runs the server or scheduler role of this process if `DMLC_ROLE` names one, then exits the
/// process; returns at once in a worker (or when no role is set). Call it first thing in a
/// program that should not do its worker-side setup in the other roles.
pub fn run_role_if_not_worker(sync: bool) -> crate::Result<()> {
    match Config::role_from_env() {
        Some(Role::Server | Role::Scheduler) => start_worker_or_run_role(sync).map(|_| ()),
        _ => Ok(()),
    }
}

fn exit_with<T>(r: crate::Result<()>, role: &str) -> T {
    match r {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            eprintln!("kvstore {role}: {e}");
            std::process::exit(1)
        }
    }
}

#[cfg(test)]
mod tests {
    /// A heartbeat's write on a socket set non-blocking (a server's, through its clone) waits
    /// for room instead of failing at once; it gives up at its deadline.
    #[test]
    fn a_patient_write_waits_for_room_until_its_deadline() {
        use std::io::{Read, Write};
        // A Unix socket's buffer does not grow as loopback TCP's does: full stays full.
        let (mut a, mut b) = std::os::unix::net::UnixStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        // Fill the link until the kernel takes no more.
        let mut sent = 0usize;
        for size in [1 << 16, 1 << 10, 1] {
            let chunk = vec![7u8; size];
            loop {
                match a.write(&chunk) {
                    Ok(n) => sent += n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) => panic!("{e}"),
                }
            }
        }
        // Nobody reads: the deadline passes, and the write says so.
        let t = Instant::now();
        let e = super::Patient(&mut a, t + Duration::from_millis(100))
            .write_all(b"beat")
            .unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::TimedOut);
        assert!(t.elapsed() >= Duration::from_millis(100));
        // A reader drains the link a little later: the write waits and then goes through.
        let reader = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            let mut all = Vec::new();
            b.read_to_end(&mut all).unwrap();
            all
        });
        super::Patient(&mut a, Instant::now() + Duration::from_secs(30))
            .write_all(b"beat")
            .unwrap();
        drop(a);
        let all = reader.join().unwrap();
        assert_eq!(all.len(), sent + 4);
        assert_eq!(&all[sent..], b"beat");
    }

    use super::*;

    #[test]
    fn roster_parses_and_rejects_garbage() {
        let r = parse_roster(
            "1 4 2\n127.0.0.1:5000 boot/net1 10.0.0.1:7000\n127.0.0.1:5001",
            &[0; auth::MAC],
        )
        .unwrap();
        assert_eq!((r.rank, r.num_workers, r.num_servers), (1, 4, 2));
        assert_eq!(r.servers.len(), 2);
        assert_eq!(
            r.server_hosts,
            vec!["boot/net1".to_string(), "-".to_string()]
        );
        assert_eq!(
            r.server_rdma,
            vec![Some("10.0.0.1:7000".parse().unwrap()), None]
        );
        assert_eq!(r.local_processes, 1);
        assert!(parse_roster("0 1 1\n127.0.0.1:5000 boot/net1 rdma?", &[0; auth::MAC]).is_err());
        let r = parse_roster("0 1 1 5\n127.0.0.1:5000 boot/net1", &[0; auth::MAC]).unwrap();
        assert_eq!(r.local_processes, 5);
        assert!(parse_roster("1 4 2\n127.0.0.1:5000", &[0; auth::MAC]).is_err());
        assert!(parse_roster("1 4 2 3 9\n", &[0; auth::MAC]).is_err());
        assert!(parse_roster("x 4 2\n", &[0; auth::MAC]).is_err());
        assert!(parse_roster("", &[0; auth::MAC]).is_err());
        // Tokens come masked, and a server's shared-memory name after its RDMA listener.
        let t = [7u8; auth::MAC];
        let mask = [0x5a; auth::MAC];
        let text = format!(
            "0 1 1\n127.0.0.1:5000 h - abc123\ntoken {}",
            auth::hex(&auth::xor(&t, &mask))
        );
        let r = parse_roster(&text, &mask).unwrap();
        assert_eq!(r.tokens, vec![t]);
        assert_eq!(r.server_shm, vec![Some("abc123".to_string())]);
        assert!(parse_roster("0 1 1\n127.0.0.1:5000\ntoken zz", &mask).is_err());
    }
}
