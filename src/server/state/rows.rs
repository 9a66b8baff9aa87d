//! Pulls of part of a slice (`row_sparse_pull`'s runs of rows): which requests name one, and
//! what they get.

use super::Payload;
use crate::protocol::{Msg, Op};
use crate::NDArray;

/// Whether `m` names elements `start..start + len` of the slice exactly, or (a pull) a run of
/// at least one element inside it.
pub(super) fn names(m: &Msg, start: u64, len: u64) -> bool {
    let exact = m.start == start && m.len == len;
    let inside = m.op == Op::Pull
        && m.len > 0
        && m.start >= start
        && m.start.checked_add(m.len).is_some_and(|e| e <= start + len);
    exact || inside
}

/// What a pull of `m` gets from `stored`, the slice starting at element `start` (which `m`
/// names, [`names`]): the whole value (a copy-on-write clone), or a copy of its run.
pub(super) fn pulled(stored: &NDArray, start: u64, m: &Msg) -> Result<Payload, String> {
    if m.start == start && m.len == stored.size() as u64 {
        return Ok(Payload::Array(stored.clone()));
    }
    let es = stored.dtype().size();
    let from = (m.start - start) as usize * es;
    let bytes = stored
        .as_bytes()
        .get(from..from + m.len as usize * es)
        .ok_or_else(|| format!("elements {}..+{} are not held here", m.start, m.len))?;
    NDArray::from_bytes(&[m.len as usize], stored.dtype(), bytes)
        .map(Payload::Array)
        .map_err(|e| e.to_string())
}
