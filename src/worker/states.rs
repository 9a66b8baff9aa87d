//! The servers' optimizer state, saved to a worker's file and loaded back
//! (`KVStore::save_optimizer_states` for distributed stores).

use crate::optimizer::{is_dumped, mark_dumped};
use crate::protocol::{Msg, Op};
use crate::worker::calls::Request;
use crate::worker::DistWorker;
use crate::{DType, KvError, NDArray, Result};

/// The first bytes of a distributed store's saved optimizer state.
const MAGIC: &[u8; 8] = b"KVDSTAT2";

/// A request about `len` bytes of optimizer state at server `server` (`step`: see
/// [`Op::States`]).
fn request(op: Op, server: usize, step: u64, len: usize, data: Option<NDArray>) -> Request {
    let mut m = Msg::new(op);
    m.dtype = DType::U8;
    m.ndim = 1;
    m.shape[0] = len as u64;
    m.total = len as u64;
    m.key = step;
    m.len = len as u64;
    let dest = data.is_none().then_some((server, 0..len));
    Request {
        server,
        msg: m,
        data: data.map(|d| (d, 0..len)),
        text: Vec::new(),
        dest,
    }
}

impl DistWorker {
    /// The keys as the servers know them: each key's name, number on the wire, dtype, shape
    /// and slices. A state saved under one layout means nothing under another.
    fn layout(&self) -> String {
        let mut keys: Vec<_> = self.keys.iter().collect();
        keys.sort_by_key(|(_, info)| info.id);
        let mut out = String::new();
        for (k, info) in keys {
            let parts: Vec<String> = info
                .parts
                .iter()
                .map(|p| format!("{}:{}+{}", p.server, p.start, p.len))
                .collect();
            out.push_str(&format!(
                "{k:?} {} {} {:?} {}\n",
                info.id,
                info.dtype,
                info.shape,
                parts.join(",")
            ));
        }
        out
    }

    /// Every server's optimizer state, as one file's bytes: each server snapshots its state,
    /// says how long it is, and puts it into this worker's memory.
    /// With `dump`, each server's part carries its optimizer (`optimizer::mark_dumped`).
    pub(crate) fn save_states(&mut self, dump: bool) -> Result<Vec<u8>> {
        let n = self.num_servers;
        let mut lens: Vec<NDArray> = (0..n)
            .map(|_| NDArray::zeros_dtype(&[8], DType::U8))
            .collect();
        let reqs = (0..n).map(|s| request(Op::States, s, 0, 8, None)).collect();
        self.run(reqs, &mut lens.iter_mut().collect::<Vec<_>>())?;
        let mut sizes = Vec::with_capacity(n);
        for l in &lens {
            let b: [u8; 8] = l.as_bytes().try_into().map_err(|_| {
                KvError::Protocol("a server's optimizer state length is not 8 bytes".into())
            })?;
            sizes.push(
                usize::try_from(u64::from_le_bytes(b)).map_err(|_| {
                    KvError::Protocol("a server's optimizer state is too long".into())
                })?,
            );
        }
        let mut states: Vec<NDArray> = sizes
            .iter()
            .map(|&len| NDArray::try_zeros_dtype(&[len], DType::U8))
            .collect::<Result<_>>()?;
        let reqs = sizes
            .iter()
            .enumerate()
            .map(|(s, &len)| request(Op::States, s, 1, len, None))
            .collect();
        self.run(reqs, &mut states.iter_mut().collect::<Vec<_>>())?;
        if dump && !states.iter_mut().all(|st| mark_dumped(st.as_bytes_mut())) {
            return Err(KvError::Protocol(
                "a server's optimizer state does not start as saved states do".into(),
            ));
        }
        let mut out = MAGIC.to_vec();
        out.extend_from_slice(&(n as u64).to_le_bytes());
        let layout = self.layout();
        out.extend_from_slice(&(layout.len() as u64).to_le_bytes());
        out.extend_from_slice(layout.as_bytes());
        for st in &states {
            out.extend_from_slice(&(st.nbytes() as u64).to_le_bytes());
            out.extend_from_slice(st.as_bytes());
        }
        Ok(out)
    }

    /// Gives each server its part of what [`DistWorker::save_states`] saved (a job with as
    /// many servers, running the same kind of optimizer).
    /// `true` where the parts carry their optimizer, which then replaced the servers'.
    pub(crate) fn load_states(&mut self, bytes: &[u8]) -> Result<bool> {
        let bad = |why: &str| KvError::Config(format!("optimizer states: {why}"));
        let rest = bytes
            .strip_prefix(MAGIC)
            .ok_or_else(|| bad("not a distributed store's saved optimizer states"))?;
        let (n, mut rest) = take_u64(rest).ok_or_else(|| bad("truncated"))?;
        if n != self.num_servers as u64 {
            return Err(bad(&format!(
                "saved by a job with {n} servers, loaded into one with {}",
                self.num_servers
            )));
        }
        let (len, r) = take_u64(rest).ok_or_else(|| bad("truncated"))?;
        let len = usize::try_from(len).map_err(|_| bad("truncated"))?;
        let saved = r.get(..len).ok_or_else(|| bad("truncated"))?;
        if saved != self.layout().as_bytes() {
            return Err(bad(
                "saved by a job whose keys differ (their names, the order they were \
                 initialised in, their shapes or dtypes, or how they are sliced over the \
                 servers)",
            ));
        }
        rest = &r[len..];
        let mut parts = Vec::with_capacity(self.num_servers);
        for _ in 0..self.num_servers {
            let (len, r) = take_u64(rest).ok_or_else(|| bad("truncated"))?;
            let len = usize::try_from(len).map_err(|_| bad("truncated"))?;
            if len > r.len() {
                return Err(bad("truncated"));
            }
            parts.push(NDArray::from_bytes(&[len], DType::U8, &r[..len])?);
            rest = &r[len..];
        }
        if !rest.is_empty() {
            return Err(bad("bytes after the last server's part"));
        }
        let dumped = parts.iter().filter(|p| is_dumped(p.as_bytes())).count();
        if dumped != 0 && dumped != parts.len() {
            return Err(bad(
                "some servers' parts carry their optimizer and some do not",
            ));
        }
        let reqs = parts
            .into_iter()
            .enumerate()
            .map(|(s, p)| {
                let len = p.nbytes();
                request(Op::LoadStates, s, 0, len, Some(p))
            })
            .collect();
        self.run(reqs, &mut [])?;
        Ok(dumped != 0)
    }
}

fn take_u64(b: &[u8]) -> Option<(u64, &[u8])> {
    let (h, t) = b.split_first_chunk::<8>()?;
    Some((u64::from_le_bytes(*h), t))
}
