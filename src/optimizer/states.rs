//! Saved optimizer states: MXNet's `save_optimizer_states` and `load_optimizer_states`, in
//! kvstore's own format (the optimizer, its multipliers and scheduler, then each key's state).

use rustc_hash::FxHashMap;

use super::wire::read_words;
use super::{mults, schedule, write_extras, KeyState, Mults, Optimizer, OptimizerUpdater, Reader};
use crate::{DType, Key, KvError, NDArray, Result};

/// The first bytes of saved optimizer states (version 5: the update counts of keys without
/// state follow the keys' states;
/// 4: `multi_precision` and Nadam's momentum schedule after the scheduler, and three arrays
/// of moments and a master copy per key, where 3 had two arrays;
/// 3: the optimizer's per-key multipliers, then its scheduler and the count
/// it began from, follow its parameters; files of versions 4, 3, 2, without the scheduler, and
/// 1, without the multipliers either, still load).
const STATES_MAGIC: &[u8; 8] = b"KVOPTST5";
/// The first bytes of saved states that carry the optimizer too (MXNet's `dump_optimizer`):
/// loading them replaces the optimizer, its multipliers and its scheduler with the saved ones.
const DUMPED_MAGIC: &[u8; 8] = b"KVOPTSD5";
/// Earlier versions' magics (states, dumped).
const MAGICS_1: [&[u8; 8]; 2] = [b"KVOPTST1", b"KVOPTSD1"];
const MAGICS_2: [&[u8; 8]; 2] = [b"KVOPTST2", b"KVOPTSD2"];
const MAGICS_3: [&[u8; 8]; 2] = [b"KVOPTST3", b"KVOPTSD3"];
const MAGICS_4: [&[u8; 8]; 2] = [b"KVOPTST4", b"KVOPTSD4"];

/// Marks saved states (`OptimizerUpdater::save_states`) as carrying their optimizer; `false`
/// where `bytes` are not such states.
pub(crate) fn mark_dumped(bytes: &mut [u8]) -> bool {
    match bytes.get_mut(..8) {
        Some(head) if head == STATES_MAGIC => {
            head.copy_from_slice(DUMPED_MAGIC);
            true
        }
        _ => false,
    }
}

/// Whether saved states carry their optimizer ([`mark_dumped`]).
pub(crate) fn is_dumped(bytes: &[u8]) -> bool {
    [
        DUMPED_MAGIC,
        MAGICS_4[1],
        MAGICS_3[1],
        MAGICS_2[1],
        MAGICS_1[1],
    ]
    .iter()
    .any(|m| bytes.starts_with(*m))
}

impl OptimizerUpdater {
    /// The per-key state (momentum, moments, step counts) as bytes, for
    /// [`OptimizerUpdater::load_states`]: MXNet's `save_optimizer_states`.
    pub fn save_states(&self) -> Vec<u8> {
        let mut out = STATES_MAGIC.to_vec();
        for w in self.opt.encode() {
            out.extend_from_slice(&w.to_le_bytes());
        }
        self.mults.save(&mut out);
        write_extras(&mut out, self.schedule.as_ref(), self.begin_num_update);
        out.push(u8::from(self.multi_precision));
        out.extend_from_slice(&self.m_schedule.to_le_bytes());
        let mut keys: Vec<&Key> = self.state.keys().collect();
        keys.sort();
        out.extend_from_slice(&(keys.len() as u64).to_le_bytes());
        for k in keys {
            let st = &self.state[k];
            mults::write_key(&mut out, k);
            out.extend_from_slice(&st.t.to_le_bytes());
            for v in [&st.m, &st.v, &st.d] {
                out.extend_from_slice(&(v.size() as u64).to_le_bytes());
                // On a GPU, the moments (and the master copy, below) are read through their
                // host mirror.
                for x in v.as_slice::<f64>().unwrap_or_default() {
                    out.extend_from_slice(&x.to_le_bytes());
                }
            }
            // The master copy's float32 values, each a float64 exactly.
            out.extend_from_slice(&(st.master.size() as u64).to_le_bytes());
            for x in st.master.as_slice::<f32>().unwrap_or_default() {
                out.extend_from_slice(&f64::from(*x).to_le_bytes());
            }
        }
        // The counts of keys whose state a load without the optimizer took away, so that a
        // file saved with the optimizer brings them back too.
        let mut counted: Vec<(&Key, &u64)> = self.counts.iter().collect();
        counted.sort();
        out.extend_from_slice(&(counted.len() as u64).to_le_bytes());
        for (k, t) in counted {
            mults::write_key(&mut out, k);
            out.extend_from_slice(&t.to_le_bytes());
        }
        out
    }

    /// [`OptimizerUpdater::save_states`] with the optimizer itself (MXNet's
    /// `dump_optimizer=True`): loading them replaces the optimizer, and its multipliers, with
    /// the saved ones.
    pub fn save_states_and_optimizer(&self) -> Vec<u8> {
        let mut out = self.save_states();
        mark_dumped(&mut out);
        out
    }

    /// Replaces the per-key state with what [`OptimizerUpdater::save_states`] saved, which
    /// must come from an optimizer of the same kind, keeping the update counts (Adam's step,
    /// `num_update`, Nadam's schedule) as they are, as MXNet keeps them on its optimizer; and
    /// with what [`OptimizerUpdater::save_states_and_optimizer`] saved, the optimizer too (its
    /// kind, parameters and counts): then `true`. A malformed or truncated input is an error and changes
    /// nothing.
    pub fn load_states(&mut self, bytes: &[u8]) -> Result<bool> {
        let bad = |why: &str| KvError::Config(format!("optimizer states: {why}"));
        let mut r = Reader(bytes);
        let (dumped, version) = match r.take(8).ok_or_else(|| bad("empty"))? {
            m if m == STATES_MAGIC => (false, 5),
            m if m == DUMPED_MAGIC => (true, 5),
            m if m == MAGICS_4[0] => (false, 4),
            m if m == MAGICS_4[1] => (true, 4),
            m if m == MAGICS_3[0] => (false, 3),
            m if m == MAGICS_3[1] => (true, 3),
            m if m == MAGICS_2[0] => (false, 2),
            m if m == MAGICS_2[1] => (true, 2),
            m if m == MAGICS_1[0] => (false, 1),
            m if m == MAGICS_1[1] => (true, 1),
            _ => return Err(bad("not a file of saved optimizer states")),
        };
        let words = read_words(&mut r).map_err(|_| bad("truncated, or an unknown optimizer"))?;
        let saved = Optimizer::decode(&words).map_err(|_| bad("unknown optimizer"))?;
        let saved_mults = match version {
            1 => Mults::default(),
            _ => Mults::load(&mut r).ok_or_else(|| bad("truncated multipliers"))?,
        };
        let (saved_schedule, saved_begin) = match version {
            1 | 2 => (None, 0),
            _ => schedule::read_extras(&mut r)
                .ok_or_else(|| bad("a truncated or malformed learning-rate scheduler"))?,
        };
        let (saved_mp, saved_schedule_m) = match version {
            1..=3 => (false, 1.0),
            _ => {
                let mp = match r.take(1).ok_or_else(|| bad("truncated"))? {
                    [0] => false,
                    [1] => true,
                    _ => return Err(bad("a malformed multi_precision")),
                };
                (mp, r.f64().ok_or_else(|| bad("truncated"))?)
            }
        };
        if !dumped && !saved.same_kind(&self.opt) {
            return Err(bad(&format!(
                "saved by {}, loaded into {}",
                saved.label(),
                self.opt.label()
            )));
        }
        let n = r.u64().ok_or_else(|| bad("truncated"))?;
        let mut state = FxHashMap::default();
        for _ in 0..n {
            let key = mults::read_key(&mut r).ok_or_else(|| bad("a truncated or malformed key"))?;
            let t = r.u64().ok_or_else(|| bad("truncated"))?;
            let mut vecs = [
                NDArray::placeholder(DType::F64),
                NDArray::placeholder(DType::F64),
                NDArray::placeholder(DType::F64),
                NDArray::placeholder(DType::F32),
            ];
            // Versions 1 to 3: two arrays of moments; 4: three, and the master copy.
            let kept = if version >= 4 { 4 } else { 2 };
            for (i, v) in vecs[..kept].iter_mut().enumerate() {
                let len = r.len().ok_or_else(|| bad("truncated"))?;
                let bytes = len
                    .checked_mul(8)
                    .and_then(|b| r.take(b))
                    .ok_or_else(|| bad("truncated"))?;
                let xs = bytes.chunks_exact(8).map(|b| {
                    let mut w = [0; 8];
                    w.copy_from_slice(b);
                    f64::from_le_bytes(w)
                });
                *v = if i == 3 {
                    NDArray::from_vec(&[len], xs.map(|x| x as f32).collect::<Vec<f32>>())?
                } else {
                    NDArray::from_vec(&[len], xs.collect::<Vec<f64>>())?
                };
            }
            let [m, v, d, master] = vecs;
            // Without the optimizer, the update counts stay the store's, as MXNet's stay on
            // the optimizer object (its `_index_update_count`) when only the states are
            // loaded: a key's count goes on from where it is, or from `begin_num_update`.
            let t = if dumped {
                t
            } else {
                // (A count an earlier such load kept for a key without state goes on too.)
                (self.state.get(&key).map(|s| s.t))
                    .or_else(|| self.counts.get(&key).copied())
                    .unwrap_or(self.begin_num_update)
            };
            state.insert(key, KeyState { m, v, d, master, t });
        }
        // Version 5: the counts of keys without state.
        let mut counts = FxHashMap::default();
        if version >= 5 {
            let n = r.u64().ok_or_else(|| bad("truncated"))?;
            for _ in 0..n {
                let key =
                    mults::read_key(&mut r).ok_or_else(|| bad("a truncated or malformed key"))?;
                let t = r.u64().ok_or_else(|| bad("truncated"))?;
                if state.contains_key(&key) || counts.insert(key, t).is_some() {
                    return Err(bad("a key counted twice"));
                }
            }
        }
        if !r.0.is_empty() {
            return Err(bad("bytes after the last key"));
        }
        if dumped {
            self.opt = saved;
            self.mults = saved_mults;
            self.given = saved_schedule.clone();
            self.schedule = saved_schedule;
            self.begin_num_update = saved_begin;
            self.multi_precision = saved_mp;
        }
        if dumped {
            // Nadam's schedule and the counts go with the optimizer, as in MXNet's pickle of
            // it. The most updates a key has had, as the counts saved say.
            self.m_schedule = saved_schedule_m;
            self.num_update = (state.values().map(|s| &s.t))
                .chain(counts.values())
                .fold(self.begin_num_update, |a, &t| a.max(t));
            self.counts = counts;
        } else {
            // A key the file has no state for loses its state, as in MXNet (whose states are
            // replaced whole), but not its count. The file's counts are the saving store's,
            // which a load without the optimizer does not take.
            for (k, st) in &self.state {
                if !state.contains_key(k) {
                    self.counts.insert(k.clone(), st.t);
                }
            }
            self.counts.retain(|k, _| !state.contains_key(k));
        }
        self.state = state;
        Ok(dumped)
    }
}
