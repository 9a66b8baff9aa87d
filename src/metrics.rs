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
    /// Bytes of values pushed, as they travel (packed, under gradient compression).
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

/// The range of key numbers `[2^i - 1, 2^(i+1) - 1)` a key falls in: at most 64 ranges.
pub fn key_range(id: u64) -> (u64, u64) {
    range_numbered(range_number(id))
}

/// The `i` of [`key_range`]'s range for key number `id`: 0 to 63.
fn range_number(id: u64) -> u8 {
    63 - (id.saturating_add(1)).leading_zeros() as u8
}

/// The range of key numbers that [`range_number`] numbers `i`.
fn range_numbered(i: u8) -> (u64, u64) {
    let i = u64::from(i);
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
        let _ = writeln!(
            out,
            "kvstore_slot_puts_total{{{labels}}} {}",
            self.slot_puts
        );
        let _ = writeln!(out, "kvstore_batched_total{{{labels}}} {}", self.batched);
        // Each breakdown is a family of its own (`kvstore_requests_by_server_total`, ...): the
        // same requests counted under one name three times would sum to three times the truth.
        let mut series = |by: &str, name: &str, t: &Traffic| {
            let l = format!("{labels},{by}=\"{name}\"");
            let _ = writeln!(out, "kvstore_requests_by_{by}_total{{{l}}} {}", t.requests);
            let _ = writeln!(
                out,
                "kvstore_pushed_bytes_by_{by}_total{{{l}}} {}",
                t.bytes_pushed
            );
            let _ = writeln!(
                out,
                "kvstore_pulled_bytes_by_{by}_total{{{l}}} {}",
                t.bytes_pulled
            );
            for (q, v) in [("0.5", 0.5), ("0.99", 0.99)] {
                let _ = writeln!(
                    out,
                    "kvstore_call_latency_by_{by}_us{{{l},quantile=\"{q}\"}} {}",
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

/// Where one request went: its server, its transport (`None`: a server it has no link to,
/// counted as `-`) and the range of its key's number.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Route {
    server: usize,
    transport: Option<crate::net::Medium>,
    /// The number of its range of key numbers.
    range: u8,
}

impl Route {
    pub(crate) fn new(server: usize, transport: Option<crate::net::Medium>, key: u64) -> Route {
        Route {
            server,
            transport,
            range: range_number(key),
        }
    }

    fn transport_name(&self) -> &'static str {
        self.transport.map_or("-", |m| m.name())
    }
}

/// A worker's counts as its calls make them. Each request counts once, under its route; a
/// call's latency is recorded once under its route where all its requests took one (the
/// common call: one array, on one server), else once per server, transport and range it
/// reached. [`Metrics`]'s views (per server, per transport, per range) are the sums of these,
/// made when read: a call costs a route's lookup (at once where it is the last call's) and
/// one record.
#[derive(Clone, Debug, Default)]
pub(crate) struct Tally {
    calls: u64,
    failed: u64,
    routes: Vec<(Route, Traffic)>,
    /// Where each route is in `routes`.
    index: rustc_hash::FxHashMap<Route, usize>,
    /// The last route looked up.
    last: usize,
    /// The latencies of the calls that took several routes (their counts are in `routes`).
    spread: Metrics,
}

impl Tally {
    /// The number of route `r`, made on its first request.
    pub(crate) fn route(&mut self, r: Route) -> usize {
        if matches!(self.routes.get(self.last), Some((x, _)) if *x == r) {
            return self.last;
        }
        let n = self.routes.len();
        let i = *self.index.entry(r).or_insert(n);
        if i == n {
            self.routes.push((r, Traffic::default()));
        }
        self.last = i;
        i
    }

    /// One request over route `route` (a number from [`Tally::route`]), pushing and pulling
    /// so many bytes.
    pub(crate) fn request(&mut self, route: usize, push: Option<u64>, pull: Option<u64>) {
        let Some((_, t)) = self.routes.get_mut(route) else {
            return;
        };
        t.requests += 1;
        if let Some(b) = push {
            t.pushes += 1;
            t.bytes_pushed += b;
        }
        if let Some(b) = pull {
            t.pulls += 1;
            t.bytes_pulled += b;
        }
    }

    /// A call ended, after `took`, having sent requests over `routes` (numbers from
    /// [`Tally::route`], each once): its latency is recorded once in each server, transport
    /// and range it reached.
    /// A call ended, over `routes`, having taken `took` (`None`: not known, so counted with no
    /// latency).
    pub(crate) fn call(&mut self, ok: bool, took: Option<std::time::Duration>, routes: &[usize]) {
        self.calls += 1;
        if !ok {
            self.failed += 1;
        }
        let Some(took) = took else {
            return;
        };
        if let [one] = routes {
            if let Some((_, t)) = self.routes.get_mut(*one) {
                t.latency.record(took);
            }
            return;
        }
        // Several routes: each server, transport and range once, however many routes share it.
        let (table, m) = (&self.routes, &mut self.spread);
        let at = |i: usize| table.get(i).map(|(r, _)| *r);
        for (k, r) in routes.iter().enumerate() {
            let Some(r) = at(*r) else { continue };
            let (mut server, mut transport, mut range) = (true, true, true);
            for b in routes[..k].iter().filter_map(|&j| at(j)) {
                server &= b.server != r.server;
                transport &= b.transport != r.transport;
                range &= b.range != r.range;
            }
            if server {
                if m.servers.len() <= r.server {
                    m.servers.resize_with(r.server + 1, Traffic::default);
                }
                m.servers[r.server].latency.record(took);
            }
            if transport {
                let t = m.transports.entry(r.transport_name()).or_default();
                t.latency.record(took);
            }
            if range {
                let t = m.key_ranges.entry(range_numbered(r.range)).or_default();
                t.latency.record(took);
            }
        }
    }

    /// The counts per server, per transport and per range of keys.
    pub(crate) fn view(&self) -> Metrics {
        let mut m = self.spread.clone();
        m.calls = self.calls;
        m.failed = self.failed;
        for (r, t) in &self.routes {
            if m.servers.len() <= r.server {
                m.servers.resize_with(r.server + 1, Traffic::default);
            }
            m.servers[r.server].add(t);
            m.transports.entry(r.transport_name()).or_default().add(t);
            m.key_ranges
                .entry(range_numbered(r.range))
                .or_default()
                .add(t);
        }
        m
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
    /// Sync rounds whose summed push was applied (or async pushes applied).
    pub rounds: u64,
    /// Sync rounds (or async pushes) whose updater failed: the pushes were refused, and the
    /// key kept its value (or lost it, where the updater left it changed). Not in `rounds`.
    pub rounds_failed: u64,
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
    /// Counts a sync round, or an async push, as applied or as failed by its updater.
    pub(crate) fn round(&mut self, applied: bool) {
        match applied {
            true => self.rounds += 1,
            false => self.rounds_failed += 1,
        }
    }

    /// The counts as one JSON object.
    pub fn to_json(&self) -> String {
        format!(
            "{{\"rounds\":{},\"rounds_failed\":{},\"pushes\":{},\"pulls\":{},\"bytes_in\":{},\"bytes_out\":{},\"waited\":{}}}",
            self.rounds,
            self.rounds_failed,
            self.pushes,
            self.pulls,
            self.bytes_in,
            self.bytes_out,
            self.waited
        )
    }

    /// The counts in Prometheus's text format, labelled with `labels`.
    pub fn to_prometheus(&self, labels: &str) -> String {
        let mut out = String::new();
        for (name, v) in [
            ("rounds", self.rounds),
            ("rounds_failed", self.rounds_failed),
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
        use crate::net::Medium;
        let mut m = Tally::default();
        // A call over two routes, then two calls over one.
        let a = m.route(Route::new(1, Some(Medium::Shm), 5));
        let b = m.route(Route::new(0, Some(Medium::Tcp), 900));
        m.request(a, Some(40), Some(40));
        m.request(b, Some(8), None);
        let ms = |n| std::time::Duration::from_micros(n);
        m.call(true, Some(ms(30)), &[a, b]);
        for took in [10, 20] {
            let again = m.route(Route::new(1, Some(Medium::Shm), 6));
            assert_eq!(again, a, "key 6 is in key 5's range");
            m.request(again, None, Some(4));
            m.call(took == 10, Some(ms(took)), &[again]);
        }
        let v = m.view();
        assert_eq!((v.calls, v.failed), (3, 1));
        let t = v.total();
        assert_eq!((t.requests, t.pushes, t.pulls), (4, 2, 3));
        assert_eq!((t.bytes_pushed, t.bytes_pulled), (48, 48));
        // Each call's latency once in each view it reached.
        assert_eq!(v.servers[1].latency.count(), 3);
        assert_eq!(v.servers[0].latency.count(), 1);
        assert_eq!(v.transports["shm"].latency.count(), 3);
        assert_eq!(v.transports["tcp"].latency.count(), 1);
        assert_eq!(v.key_ranges[&key_range(5)].latency.count(), 3);
        assert_eq!(v.key_ranges[&key_range(900)].latency.count(), 1);
        assert_eq!(v.servers[1].latency.quantile_us(1.0), 30);
        assert_eq!(v.key_ranges.len(), 2);
        let j = v.to_json();
        assert!(
            j.starts_with("{\"calls\":3,") && j.contains("\"shm\":{\"requests\":3"),
            "{j}"
        );
        let p = v.to_prometheus("role=\"worker\",rank=\"0\"");
        assert!(
            p.contains(
                "kvstore_requests_by_server_total{role=\"worker\",rank=\"0\",server=\"1\"} 3"
            ),
            "{p}"
        );
        // Each family sums to the requests made, once.
        for by in ["server", "transport", "keys"] {
            let family = format!("kvstore_requests_by_{by}_total{{");
            let sum: u64 = p
                .lines()
                .filter(|l| l.starts_with(&family))
                .map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
                .sum();
            assert_eq!(sum, 4, "{by}: {p}");
        }
    }
}
