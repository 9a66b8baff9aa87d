//! Built-in optimizers that run where the updater runs (in the store, or on the servers).
//!
//! They follow MXNet 1.9's update rules (`sgd_update`, `sgd_mom_update`, `nag_mom_update`,
//! `adam_update` with the bias-corrected learning rate of its Python `Adam`, its Python
//! `AdaGrad`'s dense update, `rmsprop_update` and `rmspropalex_update`, its Python `AdaDelta`
//! and `Adamax`, `signum_update` and `signsgd_update`, `ftrl_update`, `ftml_update`, its
//! Python `Nadam`), element-wise, so they apply unchanged to the slice of a big tensor that
//! one server holds. Where the weight and the gradient are on a GPU (feature `cuda`), every
//! one of them runs there (`crate::gpu::optim`), with the state (and a `multi_precision`
//! master copy) in that GPU's memory, and gives the host's results bit for bit.

use rustc_hash::FxHashMap;

use crate::dtype::with_dtype;
use crate::{DType, Device, Key, KvError, NDArray, Result};
pub(crate) use rules::Step;
use rules::{adam_lr, adamax_lr, nadam_momentum, update_typed};

/// Per-key state of an optimizer: up to three arrays of moments (f64, where the weight is
/// updated: in host memory, or on the weight's GPU; empty where the optimizer keeps fewer), the
/// weight's float32 master copy where it has one (`multi_precision`; where the update runs, as
/// the moments), and the step count.
struct KeyState {
    m: NDArray,
    v: NDArray,
    d: NDArray,
    master: NDArray,
    t: u64,
}

impl Default for KeyState {
    fn default() -> Self {
        KeyState {
            m: NDArray::placeholder(DType::F64),
            v: NDArray::placeholder(DType::F64),
            d: NDArray::placeholder(DType::F64),
            master: NDArray::placeholder(DType::F32),
            t: 0,
        }
    }
}

/// An optimizer with the state it keeps per key.
pub struct OptimizerUpdater {
    opt: Optimizer,
    mults: Mults,
    schedule: Option<LrScheduler>,
    /// The scheduler as the caller last gave it (`new`, `retune`): given again, the running
    /// one goes on where it stands.
    given: Option<LrScheduler>,
    /// Where every key's update count starts (MXNet's `begin_num_update`).
    begin_num_update: u64,
    /// Whether a float16 or bfloat16 key first updated from now on keeps a float32 master copy
    /// (MXNet's `multi_precision`).
    multi_precision: bool,
    /// Nadam's momentum schedule, the product of every update's momentum (MXNet's
    /// `m_schedule`, on the optimizer); 1 before the first.
    m_schedule: f64,
    /// The most updates any key has had (MXNet's `num_update`): what the scheduler is given.
    num_update: u64,
    /// Whether MXNet's warning of float16 weights updated without `multi_precision` was given.
    warned_f16: bool,
    state: FxHashMap<Key, KeyState>,
    /// The update counts of keys whose state a load without the optimizer took away (the file
    /// had none for them): MXNet keeps every key's count on its optimizer, so the next update
    /// of such a key makes a fresh state and goes on counting from here.
    counts: FxHashMap<Key, u64>,
}

/// Makes `m` hold `n` moments on `device`: zeros where it has none of that size yet, and
/// moved there where it lives elsewhere (state loaded on the host and used on a GPU, say).
fn place(m: &mut NDArray, n: usize, device: Device) -> Result<()> {
    if m.size() != n {
        *m = NDArray::try_zeros_dtype(&[n], DType::F64)?.on(device)?;
    } else if m.device() != device {
        *m = m.copy_to(device)?;
    }
    Ok(())
}

/// Refuses a step whose bias-corrected learning rate is not a number (Adam's or Adamax's
/// `1 - beta1^t` is 0 at `beta1 = 1`, a `beta2` above 1 takes the root of a negative): MXNet's
/// Python raises there (ZeroDivisionError, a math domain error); the weight would be NaN.
fn bias_corrected(key: &Key, step: Step) -> Result<()> {
    match step.lr_t.is_finite() {
        true => Ok(()),
        false => Err(KvError::Updater {
            key: key.clone(),
            reason: format!(
                "the bias-corrected learning rate at step {} is {} (is beta1 1, or beta2 \
                 above 1?): the weight is left as it was",
                step.t, step.lr_t
            ),
        }),
    }
}

/// What every built-in optimizer refuses: a key of a dtype that is not a float. The stores
/// check it before a call updates (or sends) any of its keys, and the optimizer at each update.
pub(crate) fn check_float(key: &Key, dtype: crate::DType) -> Result<()> {
    if dtype.is_float() {
        return Ok(());
    }
    Err(KvError::Updater {
        key: key.clone(),
        reason: format!("optimizers need a float dtype, not {dtype}"),
    })
}

impl OptimizerUpdater {
    /// An updater running `opt` (with its per-key multipliers, if any), with fresh state.
    pub fn new(opt: impl Into<Multiplied>) -> Self {
        let Multiplied {
            opt,
            mults,
            schedule,
            begin_num_update,
            multi_precision,
        } = opt.into();
        OptimizerUpdater {
            opt,
            mults,
            given: schedule.clone(),
            schedule,
            begin_num_update,
            multi_precision,
            m_schedule: 1.0,
            warned_f16: false,
            num_update: begin_num_update,
            state: FxHashMap::default(),
            counts: FxHashMap::default(),
        }
    }

    /// The most updates any key has had (MXNet's `num_update`), counted from
    /// `begin_num_update`.
    pub fn num_update(&self) -> u64 {
        self.num_update
    }

    /// The learning rate the next update would start from (MXNet's `learning_rate`: the
    /// scheduler's rate at [`OptimizerUpdater::num_update`], advancing it as MXNet's does, or
    /// the optimizer's), before a key's multiplier.
    pub fn learning_rate(&mut self) -> f64 {
        match &mut self.schedule {
            Some(s) => s.lr(self.num_update),
            None => self.opt.learning_rate(),
        }
    }

    /// The optimizer.
    pub fn optimizer(&self) -> &Optimizer {
        &self.opt
    }

    /// Runs `opt` from the next update on, with its multipliers in place of the earlier ones
    /// (an [`Optimizer`] has none) and the state kept (a new learning rate, say); an error,
    /// with nothing changed, where `opt` is another kind of optimizer.
    ///
    /// The scheduler it was last given, given again, goes on where it stands; another
    /// scheduler (or the same rule in another state) starts from its own state. The update
    /// counts are kept; a new `begin_num_update` is where the keys first updated after it
    /// start counting (as MXNet's `_update_count` reads it). A change of `multi_precision`
    /// applies to the keys first updated after it (a key's master copy is made at its first
    /// update, or not, as MXNet's state).
    pub fn retune(&mut self, opt: impl Into<Multiplied>) -> Result<()> {
        let Multiplied {
            opt,
            mults,
            schedule,
            begin_num_update,
            multi_precision,
        } = opt.into();
        if !opt.same_kind(&self.opt) {
            return Err(KvError::Incompatible(format!(
                "the store runs {}, whose state {} cannot take on: set_optimizer starts afresh",
                self.opt.label(),
                opt.label()
            )));
        }
        self.opt = opt;
        self.mults = mults;
        self.begin_num_update = begin_num_update;
        self.multi_precision = multi_precision;
        if schedule != self.given {
            self.schedule = schedule.clone();
            self.given = schedule;
        }
        Ok(())
    }

    /// Applies one step to `weight` with gradient `grad`, in place.
    pub fn update(&mut self, key: &Key, grad: &NDArray, weight: &mut NDArray) -> Result<()> {
        weight.check_in_place()?;
        if grad.shape() != weight.shape() || grad.dtype() != weight.dtype() {
            return Err(KvError::ShapeMismatch {
                key: key.clone(),
                expected: weight.shape().to_vec(),
                got: grad.shape().to_vec(),
            });
        }
        check_float(key, weight.dtype())?;
        // Signum's momentum state, as MXNet's: made at a key's first update where the momentum
        // is not 0; a key without it runs signsgd_update, which takes neither a momentum nor
        // wd_lh (MXNet's refuses them).
        let mut signum_state = false;
        if let Optimizer::Signum {
            momentum, wd_lh, ..
        } = self.opt
        {
            // (A state of another size than the weight, loaded from elsewhere, is one: it
            // starts afresh, as every optimizer's does.)
            signum_state = match self.state.get(key) {
                Some(st) => st.m.size() != 0 || weight.size() == 0,
                None => momentum != 0.0,
            };
            if !signum_state && (momentum > 0.0 || wd_lh != 0.0) {
                return Err(KvError::Updater {
                    key: key.clone(),
                    reason: format!(
                        "this key's Signum has no momentum state (its momentum was 0 at its \
                         first update): it runs signSGD, which takes no momentum ({momentum}) \
                         or wd_lh ({wd_lh}), as MXNet's signsgd_update"
                    ),
                });
            }
        }
        // SGD's and NAG's momentum state, as MXNet's: made at a key's first update where the
        // momentum is not 0 (a negative one too). A key with it runs sgd_mom_update or
        // nag_mom_update from then on, whatever the momentum becomes (SGD a plain step while
        // it is not positive, as MXNet's aggregated update); one without runs sgd_update,
        // which takes no momentum: a positive one is refused, as MXNet's kernel refuses it.
        let mom_state = match (&self.opt, self.state.get(key)) {
            (Optimizer::Sgd { .. } | Optimizer::Nag { .. }, Some(st)) => {
                st.m.size() != 0 || weight.size() == 0
            }
            (Optimizer::Sgd { momentum, .. } | Optimizer::Nag { momentum, .. }, None) => {
                *momentum != 0.0
            }
            _ => false,
        };
        if let Optimizer::Sgd { momentum, .. } | Optimizer::Nag { momentum, .. } = self.opt {
            if !mom_state && momentum > 0.0 {
                return Err(KvError::Updater {
                    key: key.clone(),
                    reason: format!(
                        "this key's {} has no momentum state (its momentum was 0 at its first \
                         update): it runs sgd_update, which takes no momentum ({momentum}), as \
                         MXNet's; set_optimizer with the momentum starts afresh",
                        self.opt.label().to_uppercase()
                    ),
                });
            }
        }
        // A master copy, as MXNet's create_state_multi_precision makes one: at the key's first
        // update, where the optimizer has multi_precision and the weight is a half type. One
        // of another size than the weight (loaded from elsewhere) is made afresh, as moments
        // are. Made before the count moves: a failure to make it changes nothing.
        let n = weight.size();
        let half = master::applies(weight.dtype());
        let copy = match self.state.get(key) {
            None if half && self.multi_precision => Some(master::copy_of(weight)?),
            Some(st) if half && st.master.size() != 0 && st.master.size() != n => {
                Some(master::copy_of(weight)?)
            }
            _ => None,
        };
        // The update, all or nothing: where it fails (a GPU out of memory for the state, say),
        // the key's count, the optimizer's and Nadam's schedule are as they were, and a key
        // updated for the first time keeps no state.
        let before = (
            self.state.get(key).map(|st| st.t),
            self.num_update,
            self.m_schedule,
        );
        // (A count kept for a key without state, which a first update takes.)
        let kept = self.counts.get(key).copied();
        let done = self.apply(key, grad, weight, copy, signum_state || mom_state);
        if done.is_err() {
            let (t, num_update, m_schedule) = before;
            (self.num_update, self.m_schedule) = (num_update, m_schedule);
            match t {
                Some(t) => {
                    if let Some(st) = self.state.get_mut(key) {
                        st.t = t;
                    }
                }
                None => {
                    self.state.remove(key);
                    if let Some(c) = kept {
                        self.counts.insert(key.clone(), c);
                    }
                }
            }
        }
        done
    }

    /// [`OptimizerUpdater::update`]'s step, once its arguments are checked and the master copy
    /// made where one is due (`copy`).
    fn apply(
        &mut self,
        key: &Key,
        grad: &NDArray,
        weight: &mut NDArray,
        copy: Option<NDArray>,
        // Whether the key has (or now gets) Signum's or NAG's momentum state.
        mom_state: bool,
    ) -> Result<()> {
        let n = weight.size();
        let half = master::applies(weight.dtype());
        if weight.dtype() == DType::F16
            && !self.multi_precision
            && !self.warned_f16
            && !self.state.contains_key(key)
        {
            // MXNet's, where it makes a float16 key's state without a master copy (its Python
            // warns once; so does this updater).
            self.warned_f16 = true;
            tracing::warn!(
                "Accumulating with float16 in optimizer can lead to poor accuracy or slow \
                 convergence. Consider using multi_precision=True option of the optimizer \
                 (key {key})"
            );
        }
        let begin = self.begin_num_update;
        let counts = &mut self.counts;
        let st = self.state.entry(key.clone()).or_insert_with(|| KeyState {
            t: counts.remove(key).unwrap_or(begin),
            ..KeyState::default()
        });
        // Every key's count, and the most of them, as MXNet's `_update_count`; then the rate,
        // as its `_get_lr`.
        st.t = st.t.checked_add(1).ok_or_else(|| KvError::Updater {
            key: key.clone(),
            reason: "the update count overflows".into(),
        })?;
        self.num_update = self.num_update.max(st.t);
        let lr = match &mut self.schedule {
            Some(s) => Some(s.lr(self.num_update)),
            None => None,
        };
        if let Some(c) = copy {
            st.master = c;
        }
        let mp = half && st.master.size() == n && n > 0;
        #[cfg(feature = "cuda")]
        let on_gpu = crate::gpu::optim::applies(grad, weight);
        #[cfg(not(feature = "cuda"))]
        let on_gpu = false;
        // The state lives where the update runs.
        let device = if on_gpu {
            weight.device()
        } else {
            Device::default()
        };
        let mut step = Step {
            t: st.t,
            ..Step::default()
        };
        // The key's multipliers scale its learning rate and weight decay (MXNet's lr_mult,
        // wd_mult).
        let (lr_m, wd_m) = self.mults.of(key);
        let scaled;
        let opt = if lr.is_none() && (lr_m, wd_m) == (1.0, 1.0) {
            &self.opt
        } else {
            let lr = lr.unwrap_or_else(|| self.opt.learning_rate());
            scaled = self.opt.tuned(lr * lr_m, wd_m);
            &scaled
        };
        match *opt {
            Optimizer::Sgd { .. } | Optimizer::Nag { .. } if !mom_state => {}
            Optimizer::Sgd { .. } | Optimizer::Nag { .. } => place(&mut st.m, n, device)?,
            Optimizer::Adam {
                lr, beta1, beta2, ..
            } => {
                step.lr_t = adam_lr(lr, beta1, beta2, st.t);
                bias_corrected(key, step)?;
                place(&mut st.m, n, device)?;
                place(&mut st.v, n, device)?;
            }
            Optimizer::Adamax { lr, beta1, .. } => {
                step.lr_t = adamax_lr(lr, beta1, st.t);
                bias_corrected(key, step)?;
                place(&mut st.m, n, device)?;
                place(&mut st.v, n, device)?;
            }
            Optimizer::Signum { .. } if !mom_state => {}
            Optimizer::AdaGrad { .. } | Optimizer::RmsProp { .. } | Optimizer::Signum { .. } => {
                place(&mut st.m, n, device)?
            }
            Optimizer::AdaDelta { .. } | Optimizer::Ftrl { .. } => {
                place(&mut st.m, n, device)?;
                place(&mut st.v, n, device)?;
            }
            Optimizer::Nadam {
                beta1,
                schedule_decay,
                ..
            } => {
                place(&mut st.m, n, device)?;
                place(&mut st.v, n, device)?;
                // As MXNet's: the optimizer's schedule moves at every update, whatever the key.
                let mom_t = nadam_momentum(beta1, schedule_decay, st.t);
                let mom_t_1 = nadam_momentum(beta1, schedule_decay, st.t.saturating_add(1));
                self.m_schedule *= mom_t;
                step.nadam = [mom_t, mom_t_1, self.m_schedule, self.m_schedule * mom_t_1];
            }
            Optimizer::RmsPropCentered { .. } | Optimizer::Ftml { .. } => {
                place(&mut st.m, n, device)?;
                place(&mut st.v, n, device)?;
                place(&mut st.d, n, device)?;
            }
        }
        if mp && st.master.device() != device {
            st.master = st.master.copy_to(device)?;
        }
        #[cfg(feature = "cuda")]
        if on_gpu {
            let master = if mp { Some(&mut st.master) } else { None };
            let moments = [&mut st.m, &mut st.v, &mut st.d];
            return crate::gpu::optim::step(opt, step, grad, weight, moments, master);
        }
        let moments = [
            st.m.as_mut_slice::<f64>()?,
            st.v.as_mut_slice::<f64>()?,
            st.d.as_mut_slice::<f64>()?,
        ];
        if mp {
            return master::step(opt, step, grad, weight, &mut st.master, moments);
        }
        let dtype = weight.dtype();
        with_dtype!(dtype, T => update_typed::<T>(
            opt,
            step,
            grad.as_slice::<T>()?,
            weight.as_mut_slice::<T>()?,
            moments,
        ));
        Ok(())
    }
}

impl Optimizer {
    /// Whether `other` is the same optimizer, whatever its parameters (its state fits).
    fn same_kind(&self, other: &Optimizer) -> bool {
        std::mem::discriminant(self) == std::mem::discriminant(other)
    }

    /// The learning rate.
    pub fn learning_rate(&self) -> f64 {
        *self.clone().common().lr
    }

    /// The optimizer's name, and whether it is centered where it is RMSProp (saved states
    /// of one do not load into the other).
    pub(crate) fn label(&self) -> &'static str {
        match self {
            Optimizer::RmsPropCentered { .. } => "centered rmsprop",
            _ => self.name(),
        }
    }

    /// MXNet's name of the optimizer (`rmsprop` for both of RMSProp's versions).
    pub fn name(&self) -> &'static str {
        match self {
            Optimizer::Sgd { .. } => "sgd",
            Optimizer::Nag { .. } => "nag",
            Optimizer::Adam { .. } => "adam",
            Optimizer::AdaGrad { .. } => "adagrad",
            Optimizer::RmsProp { .. } | Optimizer::RmsPropCentered { .. } => "rmsprop",
            Optimizer::AdaDelta { .. } => "adadelta",
            Optimizer::Adamax { .. } => "adamax",
            Optimizer::Signum { .. } => "signum",
            Optimizer::Ftrl { .. } => "ftrl",
            Optimizer::Ftml { .. } => "ftml",
            Optimizer::Nadam { .. } => "nadam",
        }
    }
}

/// Reads little-endian fields off the front of a byte slice.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if n > self.0.len() {
            return None;
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Some(a)
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
    fn f64(&mut self) -> Option<f64> {
        Some(f64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
    fn len(&mut self) -> Option<usize> {
        usize::try_from(self.u64()?).ok()
    }
}

mod build;
mod kinds;
mod master;
mod mults;
mod rules;
mod schedule;
mod states;
mod wire;
pub use kinds::Optimizer;
pub(crate) use mults::encode_mults;
pub use mults::Multiplied;
use mults::Mults;
pub(crate) use schedule::write_extras;
pub use schedule::LrScheduler;
pub(crate) use states::{is_dumped, mark_dumped};

#[cfg(test)]
#[path = "optimizer_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "optimizer/steps_tests.rs"]
mod steps_tests;

#[cfg(all(test, feature = "cuda"))]
#[path = "optimizer/gpu_tests.rs"]
mod gpu_tests;
