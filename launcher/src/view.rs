//! The job as kvrun shows it while it runs, from what its processes report over a listener of
//! kvrun's own ([`kvstore::report`]): which processes took their roles, the transport of every
//! worker-server pair once known, and (with `--progress`) a heartbeat line.

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::io::{BufRead, BufReader, Read};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use kvstore::report::{challenge, check_hello, Report};

use crate::child::{Child, RoleName};

/// The longest report line read (after the proof): a server's metrics grow with the workers
/// it serves, about 660 bytes each, so this holds a server's of some 6,000 workers.
const MAX_LINE: u64 = 4 << 20;

/// What the processes said so far.
pub(crate) struct View {
    rx: mpsc::Receiver<Report>,
    workers: usize,
    servers: usize,
    joined: HashSet<(String, usize)>,
    transports: BTreeMap<usize, String>,
    progress: BTreeMap<usize, (u64, u64)>,
    said_transports: bool,
    started: Instant,
    every: Option<Duration>,
    next_beat: Instant,
    /// Children seen ended, and when, until they are judged (a last report may be in flight).
    ended: BTreeMap<String, Instant>,
    warned: HashSet<String>,
    /// Each process's metrics at its end, by (role, rank): JSON, and Prometheus's text.
    metrics: BTreeMap<(String, usize), (String, String)>,
}

/// Listens on `ip` for the job's reports, checking each connection's proof of `secret`. At
/// most a few connections more than the job has processes are served at once (each process
/// reports over one), so that strangers cannot run kvrun, and its scheduler, out of threads
/// or descriptors.
pub(crate) fn listen(
    ip: IpAddr,
    secret: String,
    (workers, servers): (usize, usize),
    every: Option<f64>,
) -> std::io::Result<(SocketAddr, View)> {
    let l = TcpListener::bind(SocketAddr::new(ip, 0))?;
    let addr = l.local_addr()?;
    let (tx, rx) = mpsc::channel();
    let most = workers + servers + 16;
    let open = Arc::new(AtomicUsize::new(0));
    // Connections that have not proven themselves yet, oldest first: when every place is
    // taken, the oldest gives its place to the newest (a process proves itself at once), so
    // that a stranger's idle connections cannot keep the job's reports out.
    let unproven: Unproven = Arc::new(Mutex::new(VecDeque::new()));
    std::thread::Builder::new()
        .name("kvrun-reports".into())
        .spawn(move || {
            for (id, s) in (0u64..).zip(l.incoming().flatten()) {
                if open.load(Ordering::Relaxed) >= most {
                    let oldest = lock(&unproven).pop_front();
                    match oldest {
                        // Its thread reads the end, and leaves.
                        Some((_, old)) => drop(old.shutdown(std::net::Shutdown::Both)),
                        None => continue,
                    }
                }
                let Ok(clone) = s.try_clone() else {
                    continue;
                };
                lock(&unproven).push_back((id, clone));
                open.fetch_add(1, Ordering::Relaxed);
                let (tx, secret, done) = (tx.clone(), secret.clone(), open.clone());
                let mine = unproven.clone();
                let spawned = std::thread::Builder::new()
                    .name("kvrun-report".into())
                    .spawn(move || {
                        let proven = || lock(&mine).retain(|(i, _)| *i != id);
                        read_reports(s, &secret, &tx, &proven);
                        proven();
                        done.fetch_sub(1, Ordering::Relaxed);
                    });
                if spawned.is_err() {
                    // No thread: the connection was dropped with the closure, unread.
                    lock(&unproven).retain(|(i, _)| *i != id);
                    open.fetch_sub(1, Ordering::Relaxed);
                }
            }
        })?;
    let now = Instant::now();
    let every = every.filter(|s| *s > 0.0).map(Duration::from_secs_f64);
    Ok((
        addr,
        View {
            rx,
            workers,
            servers,
            joined: HashSet::new(),
            transports: BTreeMap::new(),
            progress: BTreeMap::new(),
            said_transports: false,
            started: now,
            every,
            next_beat: now + every.unwrap_or_default(),
            ended: BTreeMap::new(),
            warned: HashSet::new(),
            metrics: BTreeMap::new(),
        },
    ))
}

/// The report connections not yet proven, by their number: a clone of each, to end it by.
type Unproven = Arc<Mutex<VecDeque<(u64, TcpStream)>>>;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// One process's reports: kvrun's nonce, its proof of the secret over it (within 5 s in
/// all; `proven` is told), then report lines; anything else ends the connection.
fn read_reports(mut s: TcpStream, secret: &str, tx: &mpsc::Sender<Report>, proven: &dyn Fn()) {
    use std::io::Write;
    let Ok(nonce) = kvstore::report::nonce() else {
        return;
    };
    let _ = s.set_write_timeout(Some(Duration::from_secs(5)));
    if writeln!(s, "{}", challenge(&nonce)).is_err() {
        return;
    }
    // The proof's line, read against one deadline (a byte now and then does not stretch it).
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut first = Vec::new();
    let mut chunk = [0u8; 256];
    while !first.contains(&b'\n') {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || first.len() > 256 || s.set_read_timeout(Some(left)).is_err() {
            return;
        }
        match s.read(&mut chunk) {
            Ok(0) | Err(_) => return,
            Ok(n) => first.extend_from_slice(&chunk[..n]),
        }
    }
    let Some(at) = first.iter().position(|&b| b == b'\n') else {
        return;
    };
    let ok =
        std::str::from_utf8(&first[..at]).is_ok_and(|l| check_hello(secret, &nonce, l.trim_end()));
    if !ok {
        return;
    }
    proven();
    let _ = s.set_read_timeout(None);
    // What came after the proof's line is read first.
    let rest = first[at + 1..].to_vec();
    let mut r = BufReader::new(std::io::Cursor::new(rest).chain(s));
    let mut line = String::new();
    loop {
        line.clear();
        match r.by_ref().take(MAX_LINE).read_line(&mut line) {
            Ok(n) if n > 0 && line.ends_with('\n') => match Report::parse(line.trim_end()) {
                Some(rep) => {
                    if tx.send(rep).is_err() {
                        return;
                    }
                }
                None => return,
            },
            _ => return,
        }
    }
}

fn key(role: &RoleName) -> (String, usize) {
    match role {
        RoleName::Server(r) => ("server".into(), *r),
        RoleName::Worker(r) => ("worker".into(), *r),
    }
}

impl View {
    /// Takes in the reports that came, and says what there is to say now: the transports once
    /// every worker gave them, a heartbeat when one is due, and a warning for a process that
    /// ended without taking its role.
    pub(crate) fn update(&mut self, children: &[Child], say: impl Fn(&str)) {
        while let Ok(r) = self.rx.try_recv() {
            // Ranks outside the job are no process of it.
            let within = |role: &str, rank: usize| match role {
                "server" => rank < self.servers,
                _ => rank < self.workers,
            };
            let fits = match &r {
                Report::Joined { role, rank } | Report::Metrics { role, rank, .. } => {
                    within(role, *rank)
                }
                Report::Transports { rank, .. } | Report::Progress { rank, .. } => {
                    within("worker", *rank)
                }
            };
            if !fits {
                continue;
            }
            match r {
                Report::Joined { role, rank } => {
                    self.joined.insert((role, rank));
                }
                Report::Transports { rank, text } => {
                    self.transports.insert(rank, text);
                }
                Report::Progress { rank, calls, bytes } => {
                    self.progress.insert(rank, (calls, bytes));
                }
                Report::Metrics {
                    role,
                    rank,
                    json,
                    prometheus,
                } => {
                    self.metrics.insert((role, rank), (json, prometheus));
                }
            }
        }
        if !self.said_transports && self.workers > 0 && self.transports.len() >= self.workers {
            self.said_transports = true;
            let all: Vec<String> = self
                .transports
                .iter()
                .map(|(r, t)| format!("worker {r}: {t}"))
                .collect();
            say(&format!("transports: {}", all.join("; ")));
        }
        if let Some(every) = self.every {
            let now = Instant::now();
            if now >= self.next_beat {
                // From now, not from the last due time: beats missed while the processes
                // started (slow logins) are not made up in a burst.
                self.next_beat = now + every;
                say(&self.heartbeat());
            }
        }
        self.warn_unjoined(children, false, say);
    }

    /// The workers and servers that joined the job and whose metrics have not come
    /// (`worker 1`), in order.
    pub(crate) fn missing_metrics(&self) -> Vec<String> {
        let mut v: Vec<&(String, usize)> = self
            .joined
            .iter()
            .filter(|k| {
                matches!(k.0.as_str(), "worker" | "server") && !self.metrics.contains_key(*k)
            })
            .collect();
        v.sort();
        v.iter()
            .map(|(role, rank)| format!("{role} {rank}"))
            .collect()
    }

    /// Whether any process said it joined the job.
    pub(crate) fn any_joined(&self) -> bool {
        !self.joined.is_empty()
    }

    /// Warns of each process that ended without taking its role: once it ended 300 ms ago
    /// (its report of joining may come after its end), or at once where `now`.
    pub(crate) fn warn_unjoined(&mut self, children: &[Child], now: bool, say: impl Fn(&str)) {
        for c in children {
            if !c.exited() || self.joined.contains(&key(&c.role)) {
                continue;
            }
            let name = c.role.to_string();
            let seen = *self.ended.entry(name.clone()).or_insert_with(Instant::now);
            let due = now || seen.elapsed() > Duration::from_millis(300);
            if due && self.warned.insert(name.clone()) {
                say(&format!(
                    "warning: {name} (pid {}) ended without taking its role: its program \
                     never created a dist_sync or dist_async store",
                    c.pid
                ));
            }
        }
    }

    /// Every process's metrics as one JSON object: `{"workers": {"0": {...}}, "servers": ...}`.
    pub(crate) fn stats_json(&self) -> String {
        let group = |role: &str| {
            let items: Vec<String> = self
                .metrics
                .iter()
                .filter(|((r, _), _)| r == role)
                .map(|((_, rank), (json, _))| format!("\"{rank}\":{json}"))
                .collect();
            items.join(",")
        };
        format!(
            "{{\"workers\":{{{}}},\"servers\":{{{}}}}}\n",
            group("worker"),
            group("server")
        )
    }

    /// Every process's metrics in Prometheus's text format.
    pub(crate) fn prometheus(&self) -> String {
        let mut out = String::new();
        for (_, prom) in self.metrics.values() {
            for line in prom.split(';') {
                out.push_str(line);
                out.push('\n');
            }
        }
        out
    }

    /// "12.0 s: 340 rounds, 1.20 GB ...; slowest worker 1 (150 rounds)": a worker's rounds are
    /// its calls (a push, a pull, a pushpull).
    fn heartbeat(&self) -> String {
        let t = self.started.elapsed().as_secs_f64();
        if self.progress.is_empty() {
            return format!("{t:.1} s: no rounds reported yet");
        }
        let calls: u64 = self.progress.values().map(|p| p.0).sum();
        let bytes: u64 = self.progress.values().map(|p| p.1).sum();
        let mut line = format!(
            "{t:.1} s: {calls} rounds, {:.2} GB (10^9 bytes) pushed and pulled",
            bytes as f64 / 1e9
        );
        let reported = self.progress.len();
        if reported < self.workers {
            line.push_str(&format!(
                "; {} of {} workers reported",
                reported, self.workers
            ));
        } else if let Some((r, (c, _))) = self.progress.iter().min_by_key(|(_, p)| p.0) {
            line.push_str(&format!("; slowest worker {r} ({c} rounds)"));
        }
        line
    }
}

/// A file made for the job: removed when dropped, unless kept once written.
pub(crate) struct MadeFile(pub(crate) Option<std::path::PathBuf>);

impl MadeFile {
    pub(crate) fn keep(mut self) {
        self.0 = None;
    }
}

impl Drop for MadeFile {
    fn drop(&mut self) {
        if let Some(p) = &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}
