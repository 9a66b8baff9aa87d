//! What a worker's calls send: each key's value cut into the slices its servers hold, and
//! where each answer lands. Blocking calls are a call in flight plus a wait.

use rustc_hash::FxHashMap;
use std::sync::Arc;

use crate::args::List;
use crate::local::sum_into;
use crate::net::Medium;
use crate::protocol::shard::{placement, Part};
use crate::protocol::{Msg, Op, MAX_NDIM};
use crate::worker::calls::{CallId, Finished, Outputs, Request, Requests};
use crate::worker::{DistWorker, KeyInfo};
use crate::{Key, KvError, NDArray, Result};

/// A call in flight. It is claimed by [`DistWorker::wait`]; one dropped unclaimed lets the
/// store discard its result once it is over.
#[derive(Debug)]
pub(crate) struct Ticket {
    id: CallId,
    claim: Arc<()>,
}

pub(crate) fn data_msg(op: Op, info: &KeyInfo, part: &Part) -> Msg {
    let mut m = Msg::new(op);
    m.key = info.id;
    m.dtype = info.dtype;
    m.ndim = info.shape.len() as u8;
    for (d, s) in m.shape.iter_mut().zip(&info.shape) {
        *d = *s as u64;
    }
    m.total = info.shape.iter().product::<usize>() as u64;
    m.start = part.start;
    m.len = part.len;
    m
}

/// The bytes of a value that a part of its key covers.
pub(crate) fn byte_range(p: &Part, es: usize) -> std::ops::Range<usize> {
    p.start as usize * es..(p.start + p.len) as usize * es
}

/// Requests carrying values, slice by slice: `(key, value, output its answer goes to)`.
pub(crate) fn value_requests<'a>(
    op: Op,
    items: impl Iterator<Item = (&'a KeyInfo, NDArray, Option<usize>)>,
) -> Requests {
    let mut reqs = Requests::new();
    for (info, value, dest) in items {
        let es = info.dtype.size();
        for p in &info.parts {
            reqs.push(Request {
                server: p.server,
                msg: data_msg(op, info, p),
                data: Some((value.clone(), byte_range(p, es))),
                text: Vec::new(),
                dest: dest.map(|d| (d, byte_range(p, es))),
            });
        }
    }
    reqs
}

/// Requests pulling each key into the output of the same index.
pub(crate) fn pull_requests<'a>(infos: impl Iterator<Item = &'a KeyInfo>) -> Requests {
    let mut reqs = Requests::new();
    for (i, info) in infos.enumerate() {
        let es = info.dtype.size();
        for p in &info.parts {
            reqs.push(Request {
                server: p.server,
                msg: data_msg(Op::Pull, info, p),
                data: None,
                text: Vec::new(),
                dest: Some((i, byte_range(p, es))),
            });
        }
    }
    reqs
}

/// Moves an output out of the caller's hands for the length of a call.
fn take_array(a: &mut NDArray) -> NDArray {
    let dtype = a.dtype();
    std::mem::replace(a, NDArray::placeholder(dtype))
}

/// Gives staged outputs ([`DistWorker::stage`]) back to their places, filled with what the
/// call pulled if it succeeded (`ok`); the store's memory stays with whoever holds it.
fn unstage(outputs: &mut [NDArray], staged: Vec<(usize, NDArray)>, ok: bool) {
    for (i, mut lent) in staged {
        if let Some(o) = outputs.get_mut(i) {
            if ok {
                kvstore_transport::copy::copy(lent.as_bytes_mut(), o.as_bytes());
            }
            *o = lent;
        }
    }
}

/// After a key's first output was filled, copies it into the key's other outputs.
fn copy_to_other_outputs(pairs: &mut [(Key, List<&mut NDArray>)]) {
    // One key with one output (the common call) has nothing to copy.
    if let [(_, list)] = pairs {
        if list.len() <= 1 {
            return;
        }
    }
    let mut filled: FxHashMap<Key, NDArray> = FxHashMap::default();
    for (k, list) in pairs.iter_mut() {
        let Some((first, rest)) = list.split_first_mut() else {
            continue;
        };
        let src = filled.entry(k.clone()).or_insert_with(|| (**first).clone());
        if !first.shares_storage_with(src) {
            kvstore_transport::copy::copy(first.as_bytes_mut(), src.as_bytes());
        }
        for o in rest {
            kvstore_transport::copy::copy(o.as_bytes_mut(), src.as_bytes());
        }
    }
}

impl DistWorker {
    /// Rank 0's value is stored; then every worker waits at a barrier (as MXNet does).
    pub(crate) fn init(&mut self, pairs: &[(Key, List<&NDArray>)]) -> Result<()> {
        self.checked()?;
        for (i, (k, vs)) in pairs.iter().enumerate() {
            if self.keys.contains_key(k) || vs.len() > 1 || pairs[..i].iter().any(|(p, _)| p == k) {
                return Err(KvError::DoubleInit(k.clone()));
            }
            if vs[0].shape().len() > MAX_NDIM {
                return Err(KvError::Unsupported(format!(
                    "key {k}: {} dimensions; the wire carries at most {MAX_NDIM}",
                    vs[0].shape().len()
                )));
            }
        }
        let mut infos = Vec::with_capacity(pairs.len());
        for (k, vs) in pairs {
            let id = self.key_id(k);
            let total = vs[0].size() as u64;
            infos.push(KeyInfo {
                id,
                shape: vs[0].shape().to_vec(),
                dtype: vs[0].dtype(),
                parts: placement(id, total, self.num_servers, self.cfg.bigarray_bound),
            });
        }
        let mut result = Ok(());
        if self.rank == 0 {
            let mut reqs = Requests::new();
            for ((_, vs), info) in pairs.iter().zip(&infos) {
                let es = info.dtype.size();
                for p in &info.parts {
                    reqs.push(Request {
                        server: p.server,
                        msg: data_msg(Op::Init, info, p),
                        data: Some((vs[0].clone(), byte_range(p, es))),
                        text: Vec::new(),
                        dest: None,
                    });
                }
            }
            result = self.run(reqs, &mut []);
        }
        // Every worker waits, so no one pushes or pulls a key before rank 0 has stored it.
        let barrier = self.barrier();
        result?;
        barrier?;
        for ((k, _), info) in pairs.iter().zip(infos) {
            self.keys.insert(k.clone(), info);
        }
        let new: Vec<&Key> = pairs.iter().map(|(k, _)| k).collect();
        self.mults_of_new_keys(&new)
    }

    fn check_values(&self, pairs: &[(Key, List<&NDArray>)]) -> Result<()> {
        for (k, vs) in pairs {
            let info = self.info(k)?;
            for v in vs {
                if v.shape() != info.shape.as_slice() {
                    return Err(KvError::ShapeMismatch {
                        key: k.clone(),
                        expected: info.shape.clone(),
                        got: v.shape().to_vec(),
                    });
                }
                if v.dtype() != info.dtype {
                    return Err(KvError::DTypeMismatch {
                        key: k.clone(),
                        expected: info.dtype,
                        got: v.dtype(),
                    });
                }
            }
            if self.optimizer.is_some() {
                // What the servers' optimizer would refuse, refused before any key of the
                // call is sent (as a local store refuses it before any key is updated).
                crate::optimizer::check_float(k, info.dtype)?;
            }
        }
        Ok(())
    }

    fn check_output(&self, k: &Key, o: &NDArray) -> Result<()> {
        let info = self.info(k)?;
        if o.shape() != info.shape.as_slice() {
            return Err(KvError::ShapeMismatch {
                key: k.clone(),
                expected: info.shape.clone(),
                got: o.shape().to_vec(),
            });
        }
        if o.dtype() != info.dtype {
            return Err(KvError::DTypeMismatch {
                key: k.clone(),
                expected: info.dtype,
                got: o.dtype(),
            });
        }
        Ok(())
    }

    /// The stored value's shape and dtype.
    pub(crate) fn meta(&self, k: &Key) -> Result<(Vec<usize>, crate::DType)> {
        let info = self.info(k)?;
        Ok((info.shape.clone(), info.dtype))
    }

    /// Requests carrying each key's value (the sum of its list, for a list), slice by slice;
    /// `dest(i)` is the output that the answer for the `i`th key goes to, if any.
    fn value_requests(
        &mut self,
        op: Op,
        pairs: &[(Key, List<&NDArray>)],
        dest: impl Fn(usize) -> Option<usize>,
    ) -> Result<Requests> {
        let mut values: List<NDArray> = List::with_capacity(pairs.len());
        for (k, vs) in pairs {
            values.push(if vs.len() > 1 {
                let m = self
                    .merge
                    .entry(k.clone())
                    .or_insert_with(|| NDArray::zeros_dtype(vs[0].shape(), vs[0].dtype()));
                sum_into(m, vs, true)?; // grouped: as MXNet's CPU reduce
                m.clone()
            } else {
                vs[0].clone()
            });
        }
        if let Some(c) = self
            .compression
            .filter(|_| matches!(op, Op::Push | Op::PushPull))
        {
            let keys: Vec<&Key> = pairs.iter().map(|(k, _)| k).collect();
            // A push the call machine would refuse is refused before it is packed: packing
            // moves the key's residual, which a refused push must leave as it was.
            for k in &keys {
                let info = &self.keys[*k];
                let starts = info.parts.iter().map(|p| p.start);
                if let Some(e) = (info.parts.len() > 1)
                    .then(|| self.net.calls.third_push(info.id, starts))
                    .flatten()
                {
                    return Err(e);
                }
            }
            return self.packed_requests(c, op, &keys, values.into_vec(), dest);
        }
        let items = pairs
            .iter()
            .zip(values)
            .enumerate()
            .map(|(i, ((k, _), v))| (&self.keys[k], v, dest(i)));
        Ok(value_requests(op, items))
    }

    /// Runs a call to its end; the outputs are the caller's again afterwards, whatever happened.
    pub(crate) fn run(&mut self, reqs: Requests, outs: &mut [&mut NDArray]) -> Result<()> {
        self.checked()?;
        let mut owned: Outputs = outs.iter_mut().map(|o| take_array(o)).collect();
        let staged = self.stage(&mut owned);
        let now = std::time::Instant::now();
        let note = self.note(&reqs, now);
        let n = reqs.len();
        let id = self.net.start(now, reqs, owned, self.priority);
        tracing::debug!("call {}: {n} requests", id.0);
        let Finished {
            result,
            mut outputs,
        } = self.net.wait(id);
        tracing::debug!(
            "call {}: {}",
            id.0,
            if result.is_ok() { "done" } else { "failed" }
        );
        self.noted_end(note, result.is_ok(), true);
        // (Calls whose tickets were dropped may have ended during the wait.)
        self.reap_dropped();
        unstage(&mut outputs, staged, result.is_ok());
        for (o, a) in outs.iter_mut().zip(outputs) {
            **o = a;
        }
        result.map_err(|e| self.explain(e))
    }

    /// Swaps the outputs a caller lent ([`NDArray::from_raw_parts`]) for the store's own
    /// memory where a server would write them directly and only its answer could stop it (an
    /// RDMA link); [`unstage`] copies them back. Over shared memory and TCP such outputs are
    /// written by this process only (the backends never grant them to a peer), in place.
    fn stage(&self, outputs: &mut [NDArray]) -> Vec<(usize, NDArray)> {
        if !self.net.servers.iter().any(|a| a.medium == Medium::Rdma) {
            return Vec::new();
        }
        outputs
            .iter_mut()
            .enumerate()
            .filter(|(_, o)| o.is_external())
            .map(|(i, o)| {
                let own = NDArray::zeros_dtype(o.shape(), o.dtype());
                (i, std::mem::replace(o, own))
            })
            .collect()
    }

    pub(crate) fn push(&mut self, pairs: &[(Key, List<&NDArray>)]) -> Result<()> {
        self.checked()?;
        self.check_values(pairs)?;
        let reqs = self.value_requests(Op::Push, pairs, |_| None)?;
        self.run(reqs, &mut [])
    }

    pub(crate) fn pushpull(
        &mut self,
        pairs: &[(Key, List<&NDArray>)],
        outs: &mut [(Key, List<&mut NDArray>)],
    ) -> Result<()> {
        self.checked()?;
        self.check_values(pairs)?;
        for (k, list) in outs.iter() {
            if !pairs.iter().any(|(p, _)| p == k) {
                return Err(KvError::UnknownKey(k.clone()));
            }
            for o in list {
                self.check_output(k, o)?;
            }
        }
        // Each key's answer goes to its first output.
        let mut firsts: Vec<&mut NDArray> = Vec::new();
        let mut first_of: FxHashMap<Key, usize> = FxHashMap::default();
        for (k, list) in outs.iter_mut() {
            if let Some(first) = list.first_mut() {
                if !first_of.contains_key(k) {
                    first_of.insert(k.clone(), firsts.len());
                    firsts.push(&mut **first);
                }
            }
        }
        let dest: Vec<Option<usize>> = pairs
            .iter()
            .map(|(k, _)| first_of.get(k).copied())
            .collect();
        let reqs = self.value_requests(Op::PushPull, pairs, |i| dest[i])?;
        let res = self.run(reqs, &mut firsts);
        drop(firsts);
        res?;
        copy_to_other_outputs(outs);
        Ok(())
    }

    pub(crate) fn pull(&mut self, pairs: &mut [(Key, List<&mut NDArray>)]) -> Result<()> {
        self.checked()?;
        for (k, list) in pairs.iter() {
            for o in list {
                self.check_output(k, o)?;
            }
        }
        let with_outputs = pairs.iter().filter(|(_, list)| !list.is_empty());
        let reqs = pull_requests(with_outputs.map(|(k, _)| &self.keys[k]));
        let mut firsts: List<&mut NDArray> = pairs
            .iter_mut()
            .filter_map(|(_, list)| list.first_mut().map(|f| &mut **f))
            .collect();
        let res = self.run(reqs, &mut firsts);
        drop(firsts);
        res?;
        copy_to_other_outputs(pairs);
        Ok(())
    }

    /// Pulls the rows `runs` of `k`'s value (`row` elements each; `out` is checked to fit the
    /// value, [`crate::KVStore::row_sparse_pull`]) into `out`, zeroing the other rows: one
    /// request per run and server holding part of it, each moving only those rows' bytes.
    pub(crate) fn row_sparse_pull(
        &mut self,
        k: &Key,
        out: &mut NDArray,
        row: usize,
        runs: &[std::ops::Range<usize>],
    ) -> Result<()> {
        self.checked()?;
        let info = self.info(k)?;
        let es = info.dtype.size();
        let mut reqs = Requests::new();
        for r in runs {
            let (a, b) = ((r.start * row) as u64, (r.end * row) as u64);
            for p in &info.parts {
                let (start, end) = (a.max(p.start), b.min(p.start + p.len));
                if start >= end {
                    continue;
                }
                let part = Part {
                    server: p.server,
                    start,
                    len: end - start,
                };
                reqs.push(Request {
                    server: p.server,
                    msg: data_msg(Op::Pull, info, &part),
                    data: None,
                    text: Vec::new(),
                    dest: Some((0, byte_range(&part, es))),
                });
            }
        }
        // The rows not pulled read as zero, as in MXNet's row-sparse result made dense.
        out.as_bytes_mut().fill(0);
        if reqs.is_empty() {
            return Ok(());
        }
        self.run(reqs, &mut [out])
    }

    /// Rank 0 (`every`: each rank) sends `op` with `payload` to every server; then every
    /// worker waits at a barrier.
    pub(crate) fn broadcast(&mut self, op: Op, payload: &[u8], every: bool) -> Result<()> {
        self.broadcast_msg(Msg::new(op), payload, every)
    }

    /// [`DistWorker::broadcast`] of this header.
    pub(crate) fn broadcast_msg(&mut self, msg: Msg, payload: &[u8], every: bool) -> Result<()> {
        let mut result = Ok(());
        if self.rank == 0 || every {
            let reqs: Requests = (0..self.num_servers)
                .map(|s| Request {
                    server: s,
                    msg,
                    data: None,
                    text: payload.to_vec(),
                    dest: None,
                })
                .collect();
            result = self.run(reqs, &mut []);
        }
        let b = self.barrier();
        result?;
        b
    }

    /// Starts a call and hands out its ticket (dropping the results of calls over whose
    /// tickets are gone).
    fn start(&mut self, reqs: Requests, mut outputs: Outputs) -> Ticket {
        self.reap_dropped();
        let lent = self.stage(&mut outputs);
        let now = std::time::Instant::now();
        let note = self.note(&reqs, now);
        let id = self.net.start(now, reqs, outputs, self.priority);
        self.noted.insert(id, note);
        if !lent.is_empty() {
            self.staged.insert(id, lent);
        }
        let claim = self.spare_claims.pop().unwrap_or_default();
        self.claims.push((id, claim.clone()));
        Ticket { id, claim }
    }

    /// Starts a push; its values may be changed by the caller at once (a change is a copy,
    /// the call keeps what was pushed).
    pub(crate) fn push_async(&mut self, pairs: &[(Key, List<&NDArray>)]) -> Result<Ticket> {
        self.checked()?;
        self.check_values(pairs)?;
        let reqs = self.value_requests(Op::Push, pairs, |_| None)?;
        Ok(self.start(reqs, Outputs::new()))
    }

    /// Starts a pull of each key into its output, which the call owns until it is waited for.
    pub(crate) fn pull_async(&mut self, outs: Vec<(Key, NDArray)>) -> Result<Ticket> {
        self.checked()?;
        for (k, o) in &outs {
            self.check_output(k, o)?;
        }
        let reqs = pull_requests(outs.iter().map(|(k, _)| &self.keys[k]));
        Ok(self.start(reqs, outs.into_iter().map(|(_, o)| o).collect()))
    }

    /// Starts a push of each key's values and a pull of the result into its output.
    pub(crate) fn pushpull_async(
        &mut self,
        pairs: &[(Key, List<&NDArray>)],
        outs: Vec<NDArray>,
    ) -> Result<Ticket> {
        self.checked()?;
        self.check_values(pairs)?;
        if outs.len() != pairs.len() {
            return Err(KvError::LengthMismatch {
                keys: pairs.len(),
                values: outs.len(),
            });
        }
        for ((k, _), o) in pairs.iter().zip(&outs) {
            self.check_output(k, o)?;
        }
        let reqs = self.value_requests(Op::PushPull, pairs, Some)?;
        Ok(self.start(reqs, outs.into()))
    }

    /// Waits for a call in flight; its outputs come back, filled.
    pub(crate) fn wait(&mut self, t: Ticket) -> Result<Vec<NDArray>> {
        // A held ticket's claim is kept: one with none here is another store's.
        let mine = |(id, c): &(CallId, Arc<()>)| *id == t.id && Arc::ptr_eq(c, &t.claim);
        let Some(i) = self.claims.iter().position(mine) else {
            return Err(KvError::Unsupported(
                "this call was started by another store".into(),
            ));
        };
        let (_, claim) = self.claims.swap_remove(i);
        if Arc::strong_count(&claim) == 2 && self.spare_claims.len() < 64 {
            // The ticket's is the other reference, gone at the end of this call.
            self.spare_claims.push(claim);
        }
        let Finished {
            result,
            mut outputs,
        } = self.net.wait(t.id);
        if let Some(lent) = self.staged.remove(&t.id) {
            unstage(&mut outputs, lent, result.is_ok());
        }
        if let Some(note) = self.noted.remove(&t.id) {
            self.noted_end(note, result.is_ok(), true);
        }
        result
            .map(|()| outputs.into_vec())
            .map_err(|e| self.explain(e))
    }

    /// Waits until no call of this worker is in flight.
    pub(crate) fn wait_all(&mut self) -> Result<()> {
        self.net.quiesce();
        self.net.check()
    }
}
