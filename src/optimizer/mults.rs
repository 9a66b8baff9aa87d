//! Per-key multipliers of an optimizer's learning rate and weight decay (MXNet's
//! `Optimizer.set_lr_mult` and `set_wd_mult`, and the multipliers its `param_idx2name` implies).

use rustc_hash::FxHashMap;

use super::{Optimizer, Reader};
use crate::{Key, KvError, Result};

/// An optimizer with per-key multipliers of its learning rate and weight decay: a key's update
/// runs with `lr * lr_mult(key)` and `wd * wd_mult(key)` (1 for keys not named), as MXNet's
/// optimizers do with their `lr_mult` and `wd_mult`. Made by [`Optimizer::lr_mult`] and
/// [`Optimizer::wd_mult`]; an [`Optimizer`] converts into one with no multipliers.
///
/// ```
/// use kvstore::{create, NDArray, Optimizer};
/// let mut kv = create("local").unwrap();
/// kv.init(["w", "b"], vec![&NDArray::ones(&[2]), &NDArray::ones(&[2])]).unwrap();
/// // The bias learns twice as fast and takes no weight decay.
/// let opt = Optimizer::sgd(0.1).wd(0.5).lr_mult("b", 2.0).wd_mult("b", 0.0);
/// kv.set_optimizer(opt).unwrap();
/// kv.push(["w", "b"], vec![&NDArray::ones(&[2]), &NDArray::ones(&[2])]).unwrap();
/// let (mut w, mut b) = (NDArray::zeros(&[2]), NDArray::zeros(&[2]));
/// kv.pull(["w", "b"], vec![&mut w, &mut b]).unwrap();
/// assert_eq!(w.to_vec::<f32>().unwrap(), [0.85, 0.85]); // 1 - 0.1 * (1 + 0.5 * 1)
/// assert_eq!(b.to_vec::<f32>().unwrap(), [0.8, 0.8]); // 1 - 0.2 * 1
/// ```
///
/// It also carries what else MXNet's optimizers take beyond their rule: a learning-rate
/// scheduler ([`Optimizer::lr_scheduler`]) and the update count to start from
/// ([`Optimizer::begin_num_update`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Multiplied {
    pub(crate) opt: Optimizer,
    pub(crate) mults: Mults,
    pub(crate) schedule: Option<super::LrScheduler>,
    pub(crate) begin_num_update: u64,
    pub(crate) multi_precision: bool,
}

/// Each named key's `(lr_mult, wd_mult)`.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Mults(FxHashMap<Key, (f64, f64)>);

/// Bytes of one multiplier on the wire: the key's number, then the two factors.
const ENTRY: usize = 24;

impl From<Optimizer> for Multiplied {
    fn from(opt: Optimizer) -> Multiplied {
        Multiplied {
            opt,
            mults: Mults::default(),
            schedule: None,
            begin_num_update: 0,
            multi_precision: false,
        }
    }
}

impl Optimizer {
    /// This optimizer with `key`'s learning rate multiplied by `m` (MXNet's `lr_mult`).
    pub fn lr_mult(self, key: impl Into<Key>, m: f64) -> Multiplied {
        Multiplied::from(self).lr_mult(key, m)
    }

    /// This optimizer with `key`'s weight decay multiplied by `m` (MXNet's `wd_mult`).
    pub fn wd_mult(self, key: impl Into<Key>, m: f64) -> Multiplied {
        Multiplied::from(self).wd_mult(key, m)
    }

    /// This optimizer with MXNet's `multi_precision` on or off: with it, a float16 (or
    /// bfloat16) key keeps a float32 master copy of its weight, made at its first update; the
    /// update runs on the copy and the weight is the copy rounded.
    pub fn multi_precision(self, on: bool) -> Multiplied {
        Multiplied::from(self).multi_precision(on)
    }

    /// This optimizer with learning rate `lr` and its weight decay multiplied by `wd_m` (a
    /// key's rate, scheduled and multiplied, and its multiplier).
    pub(crate) fn tuned(&self, lr: f64, wd_m: f64) -> Optimizer {
        let mut o = self.clone().lr(lr);
        *o.common().wd *= wd_m;
        o
    }
}

impl Multiplied {
    /// The head of what a worker sends: the parameters' words (kind first), then the length of
    /// the scheduler's bytes and those bytes, `multi_precision` their last (the multipliers
    /// follow, numbered by the worker).
    pub(crate) fn encode_head(&self) -> Vec<u8> {
        let mut out: Vec<u8> = self
            .opt
            .encode()
            .iter()
            .flat_map(|w| w.to_le_bytes())
            .collect();
        let mut extras = Vec::new();
        super::write_extras(&mut extras, self.schedule.as_ref(), self.begin_num_update);
        extras.push(u8::from(self.multi_precision));
        out.extend_from_slice(&(extras.len() as u64).to_le_bytes());
        out.extend(extras);
        out
    }
}

impl Optimizer {
    /// What a worker sends: the parameters' words (kind first), the length of the schedule's bytes and
    /// those bytes ([`super::schedule::write_extras`]), then [`encode_mults`]'s entries.
    pub(crate) fn decode_with_mults(bytes: &[u8]) -> Result<Multiplied> {
        let malformed = || KvError::Protocol("malformed optimizer parameters".into());
        let mut r = Reader(bytes);
        let words = super::wire::read_words(&mut r)?;
        let extras = r.len().and_then(|n| r.take(n)).ok_or_else(malformed)?;
        let mut er = Reader(extras);
        let (schedule, begin_num_update) = super::schedule::read_extras(&mut er)
            .ok_or_else(|| KvError::Protocol("malformed learning-rate scheduler".into()))?;
        // (A head from before multi_precision ends without it: off.)
        let multi_precision = match er.0 {
            [] | [0] => false,
            [1] => true,
            _ => return Err(malformed()),
        };
        Ok(Multiplied {
            opt: Optimizer::decode(&words)?,
            mults: Mults::decode(r.0)?,
            schedule,
            begin_num_update,
            multi_precision,
        })
    }
}

impl super::OptimizerUpdater {
    /// Adds the multipliers a worker sent ([`Mults::decode`]'s bytes) to those it runs, the
    /// optimizer's parameters and state kept: those of keys initialised after the optimizer
    /// was set.
    pub(crate) fn add_mults(&mut self, bytes: &[u8]) -> Result<()> {
        let added = Mults::decode(bytes)?;
        self.mults.0.extend(added.0);
        Ok(())
    }
}

impl Multiplied {
    /// MXNet's `multi_precision` ([`Optimizer::multi_precision`]).
    pub fn multi_precision(mut self, on: bool) -> Multiplied {
        self.multi_precision = on;
        self
    }

    /// Multiplies `key`'s learning rate by `m` (replacing an earlier factor for it).
    pub fn lr_mult(mut self, key: impl Into<Key>, m: f64) -> Multiplied {
        self.mults.0.entry(key.into()).or_insert((1.0, 1.0)).0 = m;
        self
    }

    /// Multiplies `key`'s weight decay by `m` (replacing an earlier factor for it).
    pub fn wd_mult(mut self, key: impl Into<Key>, m: f64) -> Multiplied {
        self.mults.0.entry(key.into()).or_insert((1.0, 1.0)).1 = m;
        self
    }

    /// The optimizer, without the multipliers.
    pub fn optimizer(&self) -> &Optimizer {
        &self.opt
    }

    /// `key`'s factors: `(lr_mult, wd_mult)`.
    pub fn mults_of(&self, key: &Key) -> (f64, f64) {
        self.mults.of(key)
    }

    /// What `set_optimizer` refuses in an optimizer run afresh: what [`Multiplied::check`]
    /// refuses, and signSGD (Signum without momentum, which every key then runs) given `wd_lh`.
    /// (A running one may be changed so: its keys with a momentum state go on with it.)
    pub fn check_new(&self) -> Result<()> {
        self.check()?;
        if let Optimizer::Signum {
            momentum: 0.0,
            wd_lh,
            ..
        } = self.opt
        {
            if wd_lh != 0.0 {
                return Err(KvError::Unsupported(format!(
                    "Signum without momentum is signSGD, which takes no wd_lh ({wd_lh}), as \
                     MXNet's signsgd_update"
                )));
            }
        }
        Ok(())
    }

    /// What `update_optimizer` refuses: a parameter or factor that is not a finite number
    /// (as a server, and a states file, refuse it), or a scheduler or `begin_num_update` out
    /// of range.
    pub fn check(&self) -> Result<()> {
        if self.opt.encode().iter().any(|v| !v.is_finite()) {
            return Err(KvError::Unsupported(format!(
                "an optimizer's parameters must be finite numbers: {:?}",
                self.opt
            )));
        }
        for (k, (l, w)) in &self.mults.0 {
            if !(l.is_finite() && w.is_finite()) {
                return Err(KvError::Unsupported(format!(
                    "key {k}: multipliers must be finite, not lr_mult {l}, wd_mult {w}"
                )));
            }
        }
        if self.begin_num_update > super::schedule::MAX_BEGIN {
            return Err(KvError::Unsupported(format!(
                "begin_num_update {} is above 2^53",
                self.begin_num_update
            )));
        }
        match &self.schedule {
            Some(s) => s.check(),
            None => Ok(()),
        }
    }
}

impl Mults {
    pub(crate) fn of(&self, key: &Key) -> (f64, f64) {
        self.0.get(key).copied().unwrap_or((1.0, 1.0))
    }

    pub(crate) fn entries(&self) -> impl Iterator<Item = (&Key, (f64, f64))> {
        self.0.iter().map(|(k, m)| (k, *m))
    }

    /// What [`encode_mults`] wrote, each key as the number it was sent as; a number twice, or
    /// a factor that is not finite, is an error.
    pub(crate) fn decode(bytes: &[u8]) -> Result<Mults> {
        if bytes.len() % ENTRY != 0 {
            return Err(KvError::Protocol("malformed optimizer multipliers".into()));
        }
        let mut r = Reader(bytes);
        let mut m = FxHashMap::default();
        while let (Some(k), Some(l), Some(w)) = (r.u64(), r.f64(), r.f64()) {
            if !(l.is_finite() && w.is_finite()) {
                return Err(KvError::Protocol("a multiplier that is not finite".into()));
            }
            if m.insert(Key::Int(k as i64), (l, w)).is_some() {
                return Err(KvError::Protocol(format!("multipliers for key {k} twice")));
            }
        }
        Ok(Mults(m))
    }

    /// For a file of saved states: the count, then each key as the states write keys, and its
    /// factors, in key order.
    pub(super) fn save(&self, out: &mut Vec<u8>) {
        let mut keys: Vec<&Key> = self.0.keys().collect();
        keys.sort();
        out.extend_from_slice(&(keys.len() as u64).to_le_bytes());
        for k in keys {
            let (l, w) = self.0[k];
            write_key(out, k);
            out.extend_from_slice(&l.to_le_bytes());
            out.extend_from_slice(&w.to_le_bytes());
        }
    }

    /// What [`Mults::save`] wrote; `None` where it is cut short or malformed.
    pub(super) fn load(r: &mut Reader<'_>) -> Option<Mults> {
        let n = r.u64()?;
        let mut m = FxHashMap::default();
        for _ in 0..n {
            let k = read_key(r)?;
            let (l, w) = (r.f64()?, r.f64()?);
            if !(l.is_finite() && w.is_finite()) {
                return None;
            }
            m.insert(k, (l, w));
        }
        Some(Mults(m))
    }
}

/// Multipliers for the wire: each key by its number, then its factors, in number order.
pub(crate) fn encode_mults(mut entries: Vec<(u64, (f64, f64))>) -> Vec<u8> {
    entries.sort_by_key(|e| e.0);
    let mut out = Vec::with_capacity(entries.len() * ENTRY);
    for (k, (l, w)) in entries {
        out.extend_from_slice(&k.to_le_bytes());
        out.extend_from_slice(&l.to_le_bytes());
        out.extend_from_slice(&w.to_le_bytes());
    }
    out
}

/// A key in a file of saved states: a tag (0 int, 1 str), then the int or the str's length and
/// bytes.
pub(super) fn write_key(out: &mut Vec<u8>, k: &Key) {
    match k {
        Key::Int(i) => {
            out.push(0);
            out.extend_from_slice(&i.to_le_bytes());
        }
        Key::Str(s) => {
            out.push(1);
            out.extend_from_slice(&(s.len() as u64).to_le_bytes());
            out.extend_from_slice(s.as_bytes());
        }
    }
}

/// What [`write_key`] wrote; `None` where it is cut short or malformed.
pub(super) fn read_key(r: &mut Reader<'_>) -> Option<Key> {
    match r.take(1)?[0] {
        0 => Some(Key::Int(r.u64()? as i64)),
        1 => {
            let len = r.len()?;
            let s = r.take(len)?;
            String::from_utf8(s.to_vec()).ok().map(Key::Str)
        }
        _ => None,
    }
}
