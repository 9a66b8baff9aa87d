//! What the processes of a job tell their launcher (kvrun) over a channel of its own, named by
//! `KVSTORE_REPORT` (an address kvrun listens on): that a process took its role, the transport
//! a worker reaches each server by, and every second a worker's calls and bytes so far. Lines
//! of text; the first proves the job's secret. Best effort: a report that cannot be written is
//! dropped, and nothing of the job ever waits on the launcher.

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use crate::auth;

/// The variable that names the launcher's address.
pub const VAR: &str = "KVSTORE_REPORT";

const LABEL: &[u8] = b"kvstore report v1";

/// The bytes of the launcher's nonce ([`challenge`]).
pub const NONCE: usize = auth::NONCE;

/// A fresh nonce for [`challenge`], from the kernel's generator.
pub fn nonce() -> std::io::Result<[u8; NONCE]> {
    auth::random::<NONCE>()
}

/// The line the launcher writes first: a fresh nonce, which the process's proof covers (a
/// proof seen on the wire proves nothing on another connection).
pub fn challenge(nonce: &[u8; auth::NONCE]) -> String {
    format!("kvstore-report-nonce {}", auth::hex(nonce))
}

/// The first line a process writes, answering [`challenge`]: it knows `secret`.
pub fn hello(secret: &str, nonce: &[u8; auth::NONCE]) -> String {
    format!(
        "kvstore-report {}",
        auth::hex(&auth::plain_mac(
            secret.as_bytes(),
            &[LABEL, nonce].concat()
        ))
    )
}

/// Whether `line` is [`hello`] for `secret` and `nonce` (compared in constant time).
pub fn check_hello(secret: &str, nonce: &[u8; auth::NONCE], line: &str) -> bool {
    line.strip_prefix("kvstore-report ")
        .and_then(auth::unhex::<{ auth::MAC }>)
        .is_some_and(|got| auth::plain_check(secret.as_bytes(), &[LABEL, nonce].concat(), &got))
}

/// One report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Report {
    /// A process took its role (`"server"`, `"worker"`) with this rank.
    Joined {
        /// The role.
        role: String,
        /// The rank.
        rank: usize,
    },
    /// How worker `rank` reaches each server.
    Transports {
        /// The worker.
        rank: usize,
        /// "server 0 shm, server 1 tcp", ...
        text: String,
    },
    /// A process's metrics at its end (`role` "server" or "worker"): JSON, and Prometheus's
    /// text format with its lines joined by `;`.
    Metrics {
        /// The role.
        role: String,
        /// The rank.
        rank: usize,
        /// The metrics as one JSON object.
        json: String,
        /// The metrics in Prometheus's text format, lines joined by `;`.
        prometheus: String,
    },
    /// Worker `rank`'s calls completed and bytes moved (pushed and pulled) so far.
    Progress {
        /// The worker.
        rank: usize,
        /// Calls completed.
        calls: u64,
        /// Bytes of values pushed and pulled.
        bytes: u64,
    },
}

impl Report {
    /// The report as one line (no newline).
    pub fn line(&self) -> String {
        match self {
            Report::Joined { role, rank } => format!("joined {role} {rank}"),
            Report::Transports { rank, text } => format!("transports {rank} {text}"),
            Report::Progress { rank, calls, bytes } => format!("progress {rank} {calls} {bytes}"),
            Report::Metrics {
                role,
                rank,
                json,
                prometheus,
            } => format!("metrics {role} {rank} {json}\tprometheus {prometheus}"),
        }
    }

    /// A report from its line; `None` for anything else.
    pub fn parse(line: &str) -> Option<Report> {
        let mut w = line.splitn(3, ' ');
        let kind = w.next()?;
        let a = w.next()?;
        let rest = w.next();
        match kind {
            "joined" if matches!(a, "server" | "worker") => Some(Report::Joined {
                role: a.to_string(),
                rank: rest?.parse().ok()?,
            }),
            "transports" => Some(Report::Transports {
                rank: a.parse().ok()?,
                text: rest?.to_string(),
            }),
            "metrics" if matches!(a, "server" | "worker") => {
                let (rank, rest) = rest?.split_once(' ')?;
                let (json, prom) = rest.split_once("\tprometheus ")?;
                Some(Report::Metrics {
                    role: a.to_string(),
                    rank: rank.parse().ok()?,
                    json: json.to_string(),
                    prometheus: prom.to_string(),
                })
            }
            "progress" => {
                let (c, b) = rest?.split_once(' ')?;
                Some(Report::Progress {
                    rank: a.parse().ok()?,
                    calls: c.parse().ok()?,
                    bytes: b.parse().ok()?,
                })
            }
            _ => None,
        }
    }
}

static LINK: OnceLock<Mutex<Option<TcpStream>>> = OnceLock::new();
static CALLS: AtomicU64 = AtomicU64::new(0);
static BYTES: AtomicU64 = AtomicU64::new(0);

/// Connects to the launcher at `addr` (once per process), proving `secret`.
pub(crate) fn start(addr: Option<SocketAddr>, secret: &str) {
    LINK.get_or_init(|| Mutex::new(addr.and_then(|a| connect(a, secret))));
}

/// A link to the launcher at `a` that proved `secret`, within about a second; `None` where
/// it cannot be had in that time.
fn connect(a: SocketAddr, secret: &str) -> Option<TcpStream> {
    let mut s = TcpStream::connect_timeout(&a, Duration::from_secs(1)).ok()?;
    s.set_write_timeout(Some(Duration::from_millis(200))).ok()?;
    s.set_nodelay(true).ok()?;
    // The launcher's nonce: one short line, within a second in all (a peer that
    // trickles bytes is not waited for byte by byte).
    let deadline = std::time::Instant::now() + Duration::from_secs(1);
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    while line.len() < 128 && !line.ends_with(b"\n") {
        let left = deadline.checked_duration_since(std::time::Instant::now())?;
        s.set_read_timeout(Some(left.max(Duration::from_millis(1))))
            .ok()?;
        std::io::Read::read_exact(&mut s, &mut b).ok()?;
        line.push(b[0]);
    }
    let line = std::str::from_utf8(&line).ok()?.trim_end();
    let nonce = auth::unhex::<{ auth::NONCE }>(line.strip_prefix("kvstore-report-nonce ")?)?;
    writeln!(s, "{}", hello(secret, &nonce)).ok()?;
    Some(s)
}

/// Sends a report, if the launcher listens.
pub(crate) fn send(r: &Report) {
    let Some(link) = LINK.get() else { return };
    let mut g = link.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(s) = g.as_mut() {
        if writeln!(s, "{}", r.line()).is_err() {
            *g = None;
        }
    }
}

/// Sends a process's metrics at its end: `json`, and `prometheus(labels)`, its text format
/// with the process's labels.
pub(crate) fn send_metrics(
    role: &str,
    rank: usize,
    json: String,
    prometheus: impl FnOnce(&str) -> String,
) {
    if !listening() {
        return;
    }
    let labels = format!("role=\"{role}\",rank=\"{rank}\"");
    send(&Report::Metrics {
        role: role.into(),
        rank,
        json,
        prometheus: prometheus(&labels).trim_end().replace('\n', ";"),
    });
}

/// Whether the launcher listens.
pub(crate) fn listening() -> bool {
    LINK.get()
        .is_some_and(|l| l.lock().unwrap_or_else(|p| p.into_inner()).is_some())
}

/// A worker's call completed, moving `bytes` of values.
pub(crate) fn count_call(bytes: u64) {
    CALLS.fetch_add(1, Ordering::Relaxed);
    BYTES.fetch_add(bytes, Ordering::Relaxed);
}

/// Sends worker `rank`'s progress every second from a thread of its own, while the launcher
/// listens.
pub(crate) fn progress_every_second(rank: usize) {
    if !listening() {
        return;
    }
    let _ = std::thread::Builder::new()
        .name("kvstore-report".into())
        .spawn(move || {
            let mut last = (u64::MAX, 0);
            while listening() {
                std::thread::sleep(Duration::from_secs(1));
                let now = (CALLS.load(Ordering::Relaxed), BYTES.load(Ordering::Relaxed));
                if now != last {
                    send(&Report::Progress {
                        rank,
                        calls: now.0,
                        bytes: now.1,
                    });
                    last = now;
                }
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A listener that sends its nonce a byte every 300 ms is given up on within about a
    /// second in all; before, each byte had a second of its own (up to 128 s).
    #[test]
    fn a_launcher_that_trickles_its_nonce_is_not_waited_for() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            for b in b"kvstore-report-nonce 00" {
                if s.write_all(&[*b]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(300));
            }
        });
        let t0 = std::time::Instant::now();
        assert!(connect(a, "s").is_none());
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
        t.join().unwrap();
    }

    #[test]
    fn reports_round_trip_and_garbage_is_refused() {
        for r in [
            Report::Joined {
                role: "worker".into(),
                rank: 3,
            },
            Report::Transports {
                rank: 1,
                text: "server 0 shm, server 1 tcp".into(),
            },
            Report::Progress {
                rank: 0,
                calls: 12,
                bytes: 1 << 40,
            },
            Report::Metrics {
                role: "server".into(),
                rank: 1,
                json: "{\"rounds\":3}".into(),
                prometheus: "a 1;b 2".into(),
            },
        ] {
            assert_eq!(Report::parse(&r.line()), Some(r));
        }
        for bad in [
            "",
            "joined",
            "joined scheduler 0",
            "progress 1 2",
            "progress x 1 2",
            "x 1 2",
        ] {
            assert_eq!(Report::parse(bad), None, "{bad:?}");
        }
        let (n, m) = ([7u8; auth::NONCE], [8u8; auth::NONCE]);
        let h = hello("a secret of enough bytes", &n);
        assert!(check_hello("a secret of enough bytes", &n, &h));
        assert!(!check_hello("another secret entirely!", &n, &h));
        // A proof is good for its own nonce only: seen once, it cannot be replayed.
        assert!(!check_hello("a secret of enough bytes", &m, &h));
        assert!(!check_hello(
            "a secret of enough bytes",
            &n,
            "kvstore-report 00"
        ));
        assert_eq!(
            challenge(&n).strip_prefix("kvstore-report-nonce "),
            Some(auth::hex(&n).as_str())
        );
    }
}
