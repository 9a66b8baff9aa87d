//! A call's note, for its metrics and the launcher's progress reports: where its requests
//! went, what they moved and when it started; counted when it ends, or, for a call whose
//! ticket was dropped, when a later call finds it over.

use std::sync::Arc;

use crate::protocol::Op;
use crate::worker::calls::Request;
use crate::worker::DistWorker;

/// Where a call's requests went, what they moved and when it started, for its metrics and
/// the launcher's progress reports.
pub(crate) struct Note {
    start: std::time::Instant,
    /// The routes ([`crate::metrics::Tally::route`]) its requests took, each once.
    routes: Vec<usize>,
    /// Bytes of values sent and answered.
    bytes: u64,
}

impl DistWorker {
    /// Drops the results of calls that are over and whose tickets are gone (their outputs
    /// with them), counting each call as it is found over.
    pub(super) fn reap_dropped(&mut self) {
        if self.claims.is_empty() {
            return;
        }
        let staged = &mut self.staged;
        let noted = &mut self.noted;
        let mut ended = Vec::new();
        self.claims.retain(|(id, claim)| {
            if Arc::strong_count(claim) == 1 && self.net.calls.is_done(*id) {
                let ok = self.net.calls.take(*id).is_some_and(|f| f.result.is_ok());
                staged.remove(id);
                ended.extend(noted.remove(id).map(|n| (n, ok)));
                return false;
            }
            true
        });
        for (n, ok) in ended {
            self.noted_end(n, ok, false);
        }
    }

    /// Counts a call's requests, and notes it for [`DistWorker::noted_end`].
    pub(super) fn note(&mut self, reqs: &[Request], start: std::time::Instant) -> Note {
        // The list of an ended call's note is reused: no allocation per call.
        let mut n = self.spare_notes.pop().unwrap_or_else(|| Note {
            start,
            routes: Vec::new(),
            bytes: 0,
        });
        n.start = start;
        n.routes.clear();
        n.bytes = 0;
        for r in reqs {
            let medium = self.net.servers.get(r.server).map(|a| a.medium);
            let route = self
                .metrics
                .route(crate::metrics::Route::new(r.server, medium, r.msg.key));
            // Pushes and pulls of values (an init, a saved state, are neither).
            let op = r.msg.op;
            let sent = r.data.as_ref().map(|(_, b)| b.len() as u64);
            let answered = r.dest.as_ref().map(|(_, b)| b.len() as u64);
            let push = sent.filter(|_| matches!(op, Op::Push | Op::PushPull));
            let pull = answered.filter(|_| matches!(op, Op::Pull | Op::PushPull));
            n.bytes += push.unwrap_or(0) + pull.unwrap_or(0);
            self.metrics.request(route, push, pull);
            if !n.routes.contains(&route) {
                n.routes.push(route);
            }
        }
        n
    }

    /// A noted call ended: counted, and, where it succeeded, its values' bytes are progress
    /// for the launcher's reports (a failed call moved nothing the job can use).
    /// `timed`: the call ended just now (else its end is not known: one whose ticket was
    /// dropped, found over later, is counted with no latency).
    pub(super) fn noted_end(&mut self, n: Note, ok: bool, timed: bool) {
        let took = timed.then(|| n.start.elapsed());
        self.metrics.call(ok, took, &n.routes);
        if ok {
            crate::report::count_call(n.bytes);
        }
        if self.spare_notes.len() < 64 {
            self.spare_notes.push(n);
        }
    }
}
