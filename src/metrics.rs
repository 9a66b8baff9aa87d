//! What a store counts: per server, per transport and per range of keys (a bounded number of
//! ranges, whatever the number of keys), and a server's rounds. Read with `KVStore::metrics`;
//! kvrun collects every process's at the end of a job (`kvrun --stats`), as JSON or in
//! Prometheus's text format.

use std::collections::BTreeMap;
use std::fmt::Write;

use hdrhistogram::Histogram;

/// Latencies in microseconds, from 1 µs to an hour, 3 significant digits.
#[derive(Clone)]
pub struct Latency(Histogram<u64>);

impl Default for Latency {
    fn default() -> Self {
        Latency(Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("valid bounds"))
    }
}

impl std::fmt::Debug for Latency {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Latency(n={}, p50={} us)",
            self.count(),
            self.quantile_us(0.5)
        )
    }
}

impl Latency {
    /// Records one latency.
    pub fn record(&mut self, d: std::time::Duration) {
        let us = (d.as_micros() as u64).clamp(1, 3_600_000_000);
        let _ = self.0.record(us);
    }

    /// How many were recorded.
    pub fn count(&self) -> u64 {
        self.0.len()
    }

    /// The latency at quantile `q` (0..=1), microseconds (0 when none was recorded).
    pub fn quantile_us(&self, q: f64) -> u64 {
        if self.0.is_empty() {
            0
        } else {
            self.0.value_at_quantile(q)
        }
    }

    fn add(&mut self, other: &Latency) {
        let _ = self.0.add(&other.0);
    }

    fn json(&self) -> String {
        format!(
            "{{\"count\":{},\"p50_us\":{},\"p90_us\":{},\"p99_us\":{},\"max_us\":{}}}",
            self.count(),
            self.quantile_us(0.5),
            self.quantile_us(0.9),
            self.quantile_us(0.99),
            if self.0.is_empty() { 0 } else { self.0.max() }
        )
    }
}

/// A worker's traffic with one server (or over one transport, or for one range of keys).
#[derive(Clone, Debug, Default)]
pub struct Traffic {
    /// Requests (a key, or its slice on one server, in one call).
    pub requests: u64,
    /// Pushes among them (push and pushpull).
    pub pushes: u64,
    /// Pulls among them (pull and pushpull).
    pub pulls: u64,
    /// Bytes of values pushed.
    pub bytes_pushed: u64,
    /// Bytes of values pulled.
    pub bytes_pulled: u64,
    /// The latency of the calls these requests were in.
    pub latency: Latency,
}

impl Traffic {
    fn add(&mut self, o: &Traffic) {
        self.requests += o.requests;
        self.pushes += o.pushes;
        self.pulls += o.pulls;
        self.bytes_pushed += o.bytes_pushed;
        self.bytes_pulled += o.bytes_pulled;
        self.latency.add(&o.latency);
    }

    fn json(&self) -> String {
        format!(
            "{{\"requests\":{},\"pushes\":{},\"pulls\":{},\"bytes_pushed\":{},\"bytes_pulled\":{},\"latency\":{}}}",
            self.requests,
            self.pushes,
            self.pulls,
            self.bytes_pushed,
            self.bytes_pulled,
            self.latency.json()
        )
    }
}

/// The range of key numbers `[2^i - 1, 2^(i+1) - 1)` a key falls in: at most 65 ranges.
pub fn key_range(id: u64) -> (u64, u64) {
    let i = 63 - (id.saturating_add(1)).leading_zeros() as u64;
    let lo = (1u64 << i) - 1;
    let hi = if i >= 63 {
        u64::MAX
    } else {
        (1u64 << (i + 1)) - 1
    };
    (lo, hi)
}

/// A worker's counts (all zero for a local store).
#[derive(Clone, Debug, Default)]
pub struct Metrics {
    /// Calls completed.
    pub calls: u64,
    /// Calls that failed.
    pub failed: u64,
    /// Per server, by rank.
    pub servers: Vec<Traffic>,
    /// Per transport (`shm`, `tcp`, `rdma`).
    pub transports: BTreeMap<&'static str, Traffic>,
    /// Per range of key numbers (strings are numbered in the order they were first used).
    pub key_ranges: BTreeMap<(u64, u64), Traffic>,
    /// Copies of tensor bytes this process's transports made: count, bytes.
    pub copies: (u64, u64),
    /// Pushes put straight into a server's receive slot.
    pub slot_puts: u64,
    /// Requests sent in batches.
    pub batched: u64,
}

impl Metrics {
    /// One request of a call to `server` over `transport`, for key number `key`.
    pub(crate) fn request(
        &mut self,
        server: usize,
        transport: &'static str,
        key: u64,
        push: Option<u64>,
        pull: Option<u64>,
    ) {
        if self.servers.len() <= server {
            self.servers.resize_with(server + 1, Traffic::default);
        }
        let one = |t: &mut Traffic| {
            t.requests += 1;
            if let Some(b) = push {
                t.pushes += 1;
                t.bytes_pushed += b;
            }
            if let Some(b) = pull {
                t.pulls += 1;
                t.bytes_pulled += b;
            }
        };
        one(&mut self.servers[server]);
        one(self.transports.entry(transport).or_default());
        one(self.key_ranges.entry(key_range(key)).or_default());
    }

    /// A call ended, after `took`, having sent requests to `servers` over `transports` for
    /// keys in `ranges` ([`key_range`]).
    pub(crate) fn call(
        &mut self,
        ok: bool,
        took: std::time::Duration,
        servers: &[usize],
        transports: &[&str],
        ranges: &[(u64, u64)],
    ) {
        self.calls += 1;
        if !ok {
            self.failed += 1;
        }
        for &s in servers {
            if let Some(t) = self.servers.get_mut(s) {
                t.latency.record(took);
            }
        }
        for t in transports {
            if let Some(t) = self.transports.get_mut(*t) {
                t.latency.record(took);
            }
        }
        for r in ranges {
            if let Some(t) = self.key_ranges.get_mut(r) {
                t.latency.record(took);
            }
        }
    }

    /// Everything together.
    pub fn total(&self) -> Traffic {
        let mut t = Traffic::default();
        for s in &self.servers {
            t.add(s);
        }
        t
    }

    /// The counts as one JSON object.
    pub fn to_json(&self) -> String {
        let servers: Vec<String> = self.servers.iter().map(Traffic::json).collect();
        let transports: Vec<String> = self
            .transports
            .iter()
            .map(|(k, t)| format!("\"{k}\":{}", t.json()))
            .collect();
        let ranges: Vec<String> = self
            .key_ranges
            .iter()
            .map(|((lo, hi), t)| format!("\"{lo}-{hi}\":{}", t.json()))
            .collect();
        format!(
            "{{\"calls\":{},\"failed\":{},\"copies\":{},\"bytes_copied\":{},\"slot_puts\":{},\"batched\":{},\"servers\":[{}],\"transports\":{{{}}},\"key_ranges\":{{{}}}}}",
            self.calls,
            self.failed,
            self.copies.0,
            self.copies.1,
            self.slot_puts,
            self.batched,
            servers.join(","),
            transports.join(","),
            ranges.join(",")
        )
    }

    /// The counts in Prometheus's text format, each series labelled with `labels`
    /// (`role="worker",rank="0"`).
    pub fn to_prometheus(&self, labels: &str) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "kvstore_calls_total{{{labels}}} {}", self.calls);
        let _ = writeln!(
            out,
            "kvstore_calls_failed_total{{{labels}}} {}",
            self.failed
        );
        let _ = writeln!(out, "kvstore_copies_total{{{labels}}} {}", self.copies.0);
        let _ = writeln!(
            out,
            "kvstore_copied_bytes_total{{{labels}}} {}",
            self.copies.1
        );
        let mut series = |by: &str, name: &str, t: &Traffic| {
            let l = format!("{labels},{by}=\"{name}\"");
            let _ = writeln!(out, "kvstore_requests_total{{{l}}} {}", t.requests);
            let _ = writeln!(out, "kvstore_pushed_bytes_total{{{l}}} {}", t.bytes_pushed);
            let _ = writeln!(out, "kvstore_pulled_bytes_total{{{l}}} {}", t.bytes_pulled);
            for (q, v) in [("0.5", 0.5), ("0.99", 0.99)] {
                let _ = writeln!(
                    out,
                    "kvstore_call_latency_us{{{l},quantile=\"{q}\"}} {}",
                    t.latency.quantile_us(v)
                );
            }
        };
        for (i, t) in self.servers.iter().enumerate() {
            series("server", &i.to_string(), t);
        }
        for (name, t) in &self.transports {
            series("transport", name, t);
        }
        for ((lo, hi), t) in &self.key_ranges {
            series("keys", &format!("{lo}-{hi}"), t);
        }
        out
    }
}

/// Where a slice of a key lives: a server, and the key's elements `start..start + len`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slice {
    /// The server's rank.
    pub server: usize,
    /// The first element.
    pub start: u64,
    /// How many elements.
    pub len: u64,
}

/// Every key and its slices, sorted by key.
pub type Placement = Vec<(crate::Key, Vec<Slice>)>;

/// A server's counts.
#[derive(Clone, Debug, Default)]
pub struct ServerMetrics {
    /// Sync rounds completed (or async pushes applied).
    pub rounds: u64,
    /// Pushes received.
    pub pushes: u64,
    /// Pulls answered (pull and pushpull).
    pub pulls: u64,
    /// Bytes of values received.
    pub bytes_in: u64,
    /// Bytes of values answered.
    pub bytes_out: u64,
    /// Pushes that waited for the other workers' pushes of their round (stragglers).
    pub waited: u64,
}

impl ServerMetrics {
    /// The counts as one JSON object.
    pub fn to_json(&self) -> String {
        format!(
            "{{\"rounds\":{},\"pushes\":{},\"pulls\":{},\"bytes_in\":{},\"bytes_out\":{},\"waited\":{}}}",
            self.rounds, self.pushes, self.pulls, self.bytes_in, self.bytes_out, self.waited
        )
    }

    /// The counts in Prometheus's text format, labelled with `labels`.
    pub fn to_prometheus(&self, labels: &str) -> String {
        let mut out = String::new();
        for (name, v) in [
            ("rounds", self.rounds),
            ("pushes", self.pushes),
            ("pulls", self.pulls),
            ("bytes_in", self.bytes_in),
            ("bytes_out", self.bytes_out),
            ("pushes_waited", self.waited),
        ] {
            let _ = writeln!(out, "kvstore_server_{name}_total{{{labels}}} {v}");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_ranges_are_few_and_cover_every_number() {
        assert_eq!(key_range(0), (0, 1));
        assert_eq!(key_range(1), (1, 3));
        assert_eq!(key_range(2), (1, 3));
        assert_eq!(key_range(3), (3, 7));
        assert_eq!(key_range(u64::MAX).0, (1 << 63) - 1);
        let ranges: std::collections::BTreeSet<_> =
            (0..1_000_000u64).step_by(7).map(key_range).collect();
        assert!(ranges.len() <= 21, "{}", ranges.len());
    }

    #[test]
    fn counts_add_up_and_print() {
        let mut m = Metrics::default();
        m.request(1, "shm", 5, Some(40), Some(40));
        m.request(0, "tcp", 900, Some(8), None);
        m.call(
            true,
            std::time::Duration::from_micros(30),
            &[0, 1],
            &["shm", "tcp"],
            &[key_range(5), key_range(900)],
        );
        let t = m.total();
        assert_eq!((t.requests, t.pushes, t.pulls), (2, 2, 1));
        assert_eq!((t.bytes_pushed, t.bytes_pulled), (48, 40));
        assert_eq!(m.servers[1].latency.count(), 1);
        assert_eq!(m.key_ranges.len(), 2);
        let j = m.to_json();
        assert!(
            j.starts_with("{\"calls\":1,") && j.contains("\"shm\":{\"requests\":1"),
            "{j}"
        );
        let p = m.to_prometheus("role=\"worker\",rank=\"0\"");
        assert!(
            p.contains("kvstore_requests_total{role=\"worker\",rank=\"0\",server=\"1\"} 1"),
            "{p}"
        );
    }
}
