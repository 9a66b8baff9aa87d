//! What a store can say about itself: its transports, copies, counts and placement.

use super::{Inner, KVStore};

impl KVStore {
    /// Whether the servers on this host write pull answers of 32 KiB and more straight into
    /// this process's memory (cross-memory writes, where the host allows it): then such a pull
    /// into any output is one copy (smaller answers land in shared pages and are copied here;
    /// values of 32 KiB and more that a server keeps in its pool are read from there). False
    /// for local stores and over TCP.
    pub fn cross_memory(&self) -> bool {
        match &self.inner {
            Inner::Local(_) => false,
            Inner::Dist(d) => d.cross_memory(),
        }
    }

    /// `(copies, bytes)` of tensor bytes this store's transports made in this process.
    /// Over shared memory, pushing an array from [`KVStore::alloc`] makes none and pushing
    /// another array one; a pull is one copy (the server's into the output, or this process's
    /// out of the server's pages). Small values batched with others (many keys in one call)
    /// are copied into the batch and out of its answer, over either transport. Zero for local
    /// stores; over TCP, only the batches' copies.
    pub fn transport_copies(&self) -> (u64, u64) {
        match &self.inner {
            Inner::Local(_) => (0, 0),
            Inner::Dist(d) => d.transport_copies(),
        }
    }

    /// How many pushes (of key slices) this store put straight into a server's receive slot,
    /// rather than sending them as messages: every push of a slice after its first, while the
    /// servers' slot budgets (`KVSTORE_SLOT_BYTES`) have room, except where the medium moves
    /// the data by reference anyway (an array from [`KVStore::alloc`] over shared memory).
    /// Zero for local stores.
    pub fn slot_puts(&self) -> u64 {
        match &self.inner {
            Inner::Local(_) => 0,
            Inner::Dist(d) => d.slot_puts(),
        }
    }

    /// How many requests (of key slices) this store sent in batches: the small pushes, pulls
    /// and pushpulls of one call to one server go as one message (values of at most 16 KiB,
    /// two or more to a server). Zero for local stores.
    pub fn batched_requests(&self) -> u64 {
        match &self.inner {
            Inner::Local(_) => 0,
            Inner::Dist(d) => d.batched(),
        }
    }

    /// What this store counted: its calls, and its requests, bytes and call latencies per
    /// server, per transport and per range of keys (all zero for a local store). See
    /// [`crate::metrics`]; `kvrun --stats` collects every process's at the end of a job.
    pub fn metrics(&self) -> crate::metrics::Metrics {
        match &self.inner {
            Inner::Local(_) => crate::metrics::Metrics::default(),
            Inner::Dist(d) => d.metrics(),
        }
    }

    /// Where each key lives in a distributed store: its slices, as (server, first element,
    /// elements), sorted by key (empty for a local store). [`KVStore::placement_map`] prints it.
    pub fn placement(&self) -> crate::metrics::Placement {
        match &self.inner {
            Inner::Local(_) => Vec::new(),
            Inner::Dist(d) => d.placement(),
        }
    }

    /// [`KVStore::placement`] as text, a line per key: `key 3: server 1 [0, 600000)`.
    pub fn placement_map(&self) -> String {
        let mut out = String::new();
        for (k, parts) in self.placement() {
            let p: Vec<String> = parts
                .iter()
                .map(|p| format!("server {} [{}, {})", p.server, p.start, p.start + p.len))
                .collect();
            out.push_str(&format!("key {k}: {}\n", p.join(", ")));
        }
        out
    }

    /// Where the servers of a distributed store listen, by rank (empty for local stores).
    /// For diagnostics and tools.
    pub fn server_addrs(&self) -> Vec<std::net::SocketAddr> {
        match &self.inner {
            Inner::Local(_) => Vec::new(),
            Inner::Dist(d) => d.server_addrs().to_vec(),
        }
    }

    /// The transport this worker uses to reach each server, by rank: `"shm"` for servers on
    /// this host (unless `KVSTORE_TRANSPORT=tcp`), `"tcp"` otherwise; empty for local stores.
    pub fn transports(&self) -> Vec<&'static str> {
        match &self.inner {
            Inner::Local(_) => Vec::new(),
            Inner::Dist(d) => d.transports(),
        }
    }
}
