//! Learning-rate schedulers: MXNet 1.9's `mx.lr_scheduler` (`FactorScheduler`,
//! `MultiFactorScheduler`, `PolyScheduler`, `CosineScheduler`, each with its warm-up), run
//! where the optimizer runs (in the store, or on each server) at every update.
//!
//! A scheduler is given `num_update`, the most updates any key has had from the optimizer that
//! runs it, and answers the learning rate, as MXNet's `LRScheduler.__call__` does, step by step
//! and with MXNet's own arithmetic (a factor scheduler multiplies its rate once per step it
//! passes, so that its rates are MXNet's bit for bit). Like MXNet's, the factor schedulers and
//! the decays past `max_update` keep state: the rate they reached.

use super::{Multiplied, Optimizer, Reader};
use crate::{KvError, Result};

/// A learning-rate scheduler (MXNet's `mx.lr_scheduler`), given to an optimizer with
/// [`crate::Optimizer::lr_scheduler`].
///
/// ```
/// use kvstore::{create, LrScheduler, NDArray, Optimizer};
/// let mut kv = create("local").unwrap();
/// kv.init(0, &NDArray::zeros(&[1])).unwrap();
/// // The rate halves after every 2 updates: 1, 1, 0.5, 0.5, 0.25.
/// kv.set_optimizer(Optimizer::sgd(1.0).lr_scheduler(LrScheduler::factor(2, 0.5))).unwrap();
/// for _ in 0..5 {
///     kv.push(0, &NDArray::from_vec(&[1], vec![-1.0f32]).unwrap()).unwrap();
/// }
/// let mut w = NDArray::zeros(&[1]);
/// kv.pull(0, &mut w).unwrap();
/// assert_eq!(w.to_vec::<f32>().unwrap(), [3.25]);
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct LrScheduler {
    rule: Rule,
    warmup: Warmup,
    /// The rate the scheduler holds now (MXNet's `base_lr`, which the factor rules lower and
    /// the decays recompute; an optimizer's learning rate replaces it when given one).
    base_lr: f64,
    /// The factor rules' progress: the update count of the last step passed, and (for
    /// `multi_factor`) how many steps were passed.
    count: u64,
    passed: u64,
}

#[derive(Clone, Debug, PartialEq)]
enum Rule {
    Factor {
        step: u64,
        factor: f64,
        stop_factor_lr: f64,
    },
    MultiFactor {
        steps: Vec<u64>,
        factor: f64,
    },
    /// From `base_lr_orig` to `final_lr` between the warm-up's end and `max_update`.
    Decay {
        max_update: u64,
        base_lr_orig: f64,
        final_lr: f64,
        curve: Curve,
    },
}

/// The shape of a decay: MXNet's `PolyScheduler` (its power) or `CosineScheduler`.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Curve {
    Poly(f64),
    Cosine,
}

impl Curve {
    /// The share of the decay's span still to go after `done` of its `span` updates, with
    /// MXNet's arithmetic (its cosine's `(b - f) * (1 + cos) / 2` halves exactly, so the
    /// half may come first).
    fn left(self, done: u64, span: u64) -> f64 {
        match self {
            Curve::Poly(pwr) => (1.0 - done as f64 / span as f64).powf(pwr),
            Curve::Cosine => {
                let turn = std::f64::consts::PI * done as f64 / span as f64;
                (1.0 + turn.cos()) / 2.0
            }
        }
    }
}

/// MXNet's warm-up: for the first `steps` updates the rate goes from `begin_lr` towards
/// `final_lr` (the scheduler's `base_lr` when it was made) in equal increments, or stays at
/// `begin_lr` (`constant`).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Warmup {
    steps: u64,
    begin_lr: f64,
    final_lr: f64,
    constant: bool,
}

/// MXNet's default `base_lr` of a scheduler.
const DEFAULT_BASE_LR: f64 = 0.01;

impl LrScheduler {
    fn with(rule: Rule, base_lr: f64) -> LrScheduler {
        LrScheduler {
            rule,
            warmup: Warmup {
                steps: 0,
                begin_lr: 0.0,
                final_lr: base_lr,
                constant: false,
            },
            base_lr,
            count: 0,
            passed: 0,
        }
    }

    /// MXNet's `FactorScheduler(step, factor)`: the rate is multiplied by `factor` (at most 1)
    /// after every `step` updates, down to `stop_factor_lr` (1e-8 unless set).
    pub fn factor(step: u64, factor: f64) -> LrScheduler {
        let rule = Rule::Factor {
            step,
            factor,
            stop_factor_lr: 1e-8,
        };
        LrScheduler::with(rule, DEFAULT_BASE_LR)
    }

    /// MXNet's `MultiFactorScheduler(step, factor)`: the rate is multiplied by `factor` once
    /// the update count passes each of `steps` (increasing).
    pub fn multi_factor(steps: impl Into<Vec<u64>>, factor: f64) -> LrScheduler {
        let rule = Rule::MultiFactor {
            steps: steps.into(),
            factor,
        };
        LrScheduler::with(rule, DEFAULT_BASE_LR)
    }

    /// MXNet's `PolyScheduler(max_update, base_lr, pwr)`: after the warm-up, the rate falls
    /// from `base_lr` to the final rate (0 unless set) as `(1 - n / max)^pwr` over the
    /// updates up to `max_update`, then stays.
    pub fn poly(max_update: u64, base_lr: f64, pwr: f64) -> LrScheduler {
        LrScheduler::decay(max_update, base_lr, Curve::Poly(pwr))
    }

    /// MXNet's `CosineScheduler(max_update, base_lr)`: after the warm-up, the rate falls from
    /// `base_lr` to the final rate (0 unless set) along half a cosine up to `max_update`,
    /// then stays.
    pub fn cosine(max_update: u64, base_lr: f64) -> LrScheduler {
        LrScheduler::decay(max_update, base_lr, Curve::Cosine)
    }

    fn decay(max_update: u64, base_lr: f64, curve: Curve) -> LrScheduler {
        let rule = Rule::Decay {
            max_update,
            base_lr_orig: base_lr,
            final_lr: 0.0,
            curve,
        };
        LrScheduler::with(rule, base_lr)
    }

    /// The constructor's `base_lr` (MXNet's argument): the rate to start from and the one a
    /// warm-up ends at. An optimizer given this scheduler replaces the rate to start from
    /// with its own learning rate, as MXNet's does; the warm-up's end (and a decay's start)
    /// stay this one.
    pub fn base_lr(mut self, lr: f64) -> LrScheduler {
        self.base_lr = lr;
        self.warmup.final_lr = lr;
        if let Rule::Decay { base_lr_orig, .. } = &mut self.rule {
            *base_lr_orig = lr;
        }
        self
    }

    /// The lowest rate a `factor` scheduler goes to (MXNet's `stop_factor_lr`); no effect on
    /// the others.
    pub fn stop_factor_lr(mut self, lr: f64) -> LrScheduler {
        if let Rule::Factor { stop_factor_lr, .. } = &mut self.rule {
            *stop_factor_lr = lr;
        }
        self
    }

    /// The rate a `poly` or `cosine` scheduler ends at (MXNet's `final_lr`); no effect on the
    /// others.
    pub fn final_lr(mut self, lr: f64) -> LrScheduler {
        if let Rule::Decay { final_lr, .. } = &mut self.rule {
            *final_lr = lr;
        }
        self
    }

    /// A linear warm-up over the first `steps` updates, from `begin_lr` (MXNet's
    /// `warmup_steps`, `warmup_begin_lr`).
    pub fn warmup(mut self, steps: u64, begin_lr: f64) -> LrScheduler {
        self.warmup.steps = steps;
        self.warmup.begin_lr = begin_lr;
        self
    }

    /// The warm-up keeps `begin_lr` throughout (MXNet's `warmup_mode='constant'`).
    pub fn constant_warmup(mut self) -> LrScheduler {
        self.warmup.constant = true;
        self
    }

    /// This scheduler resumed where one stood: its rate, the update count of the last step
    /// it passed, and how many of its steps it passed (a `multi_factor` scheduler's). What an
    /// MXNet scheduler object holds as `base_lr`, `count` and `cur_step_ind`.
    pub fn resumed(mut self, base_lr: f64, count: u64, steps_passed: u64) -> LrScheduler {
        self.base_lr = base_lr;
        self.count = count;
        self.passed = steps_passed;
        self
    }

    /// The rate after `num_update` updates (MXNet's `__call__`), advancing the scheduler's
    /// state as MXNet's does.
    pub fn lr(&mut self, num_update: u64) -> f64 {
        let w = self.warmup;
        if num_update < w.steps {
            return match w.constant {
                true => w.begin_lr,
                false => {
                    w.begin_lr + (w.final_lr - w.begin_lr) * num_update as f64 / w.steps as f64
                }
            };
        }
        match &self.rule {
            Rule::Factor {
                step,
                factor,
                stop_factor_lr,
            } => {
                // (A step of 0, which `check` refuses, would never end: taken as 1.)
                let step = (*step).max(1);
                while num_update > self.count.saturating_add(step) {
                    self.count += step;
                    let before = self.base_lr;
                    self.base_lr *= factor;
                    if self.base_lr < *stop_factor_lr {
                        self.base_lr = *stop_factor_lr;
                    }
                    if self.base_lr == before {
                        // At its floor (or a factor of 1) the rate stays: the steps left are
                        // counted at once, not one by one (a count from a large
                        // begin_num_update).
                        self.count += (num_update - self.count - 1) / step * step;
                        break;
                    }
                }
            }
            Rule::MultiFactor { steps, factor } => {
                while let Some(&s) = steps.get(self.passed as usize) {
                    if num_update <= s {
                        break;
                    }
                    self.count = s;
                    self.passed += 1;
                    self.base_lr *= factor;
                }
            }
            Rule::Decay {
                max_update,
                base_lr_orig,
                final_lr,
                curve,
            } => {
                // (Past the warm-up, `num_update` is at least its steps; a span of 0, which
                // `check` refuses, would divide by zero.)
                let span = max_update.saturating_sub(w.steps);
                if num_update <= *max_update && span > 0 {
                    let left = curve.left(num_update - w.steps, span);
                    self.base_lr = final_lr + (base_lr_orig - final_lr) * left;
                }
            }
        }
        self.base_lr
    }

    /// Starts from the optimizer's learning rate (MXNet's optimizer, given `learning_rate`,
    /// sets its scheduler's `base_lr`).
    pub(crate) fn starting_at(mut self, lr: f64) -> LrScheduler {
        self.base_lr = lr;
        self
    }

    /// An error naming what MXNet's constructor refuses (and what would divide by zero).
    pub(crate) fn check(&self) -> Result<()> {
        let bad = |why: String| Err(KvError::Unsupported(format!("lr_scheduler: {why}")));
        let w = self.warmup;
        let finite = [self.base_lr, w.begin_lr, w.final_lr];
        if finite.iter().any(|x| !x.is_finite()) {
            return bad("learning rates must be finite".into());
        }
        if w.begin_lr > w.final_lr {
            return bad(format!(
                "the warm-up's begin_lr {} is above base_lr {}",
                w.begin_lr, w.final_lr
            ));
        }
        match &self.rule {
            Rule::Factor {
                step,
                factor,
                stop_factor_lr,
            } => {
                if *step < 1 {
                    return bad("step must be at least 1".into());
                }
                if !(factor.is_finite() && *factor <= 1.0 && stop_factor_lr.is_finite()) {
                    return bad(format!("factor {factor} must be at most 1"));
                }
            }
            Rule::MultiFactor { steps, factor } => {
                if steps.is_empty() || steps[0] < 1 || steps.windows(2).any(|p| p[1] <= p[0]) {
                    return bad("steps must be an increasing list of counts from 1".into());
                }
                if steps.len() as u64 > MAX_STEPS {
                    return bad(format!("{} steps: at most {MAX_STEPS}", steps.len()));
                }
                if !(factor.is_finite() && *factor <= 1.0) {
                    return bad(format!("factor {factor} must be at most 1"));
                }
                if self.passed > steps.len() as u64 {
                    return bad(format!("{} steps passed of {}", self.passed, steps.len()));
                }
            }
            Rule::Decay {
                max_update,
                base_lr_orig,
                final_lr,
                curve,
            } => {
                if !(base_lr_orig.is_finite() && final_lr.is_finite()) {
                    return bad("base_lr and final_lr must be finite".into());
                }
                if let Curve::Poly(pwr) = curve {
                    // MXNet's rate would be infinite at max_update (a ZeroDivisionError).
                    if !(pwr.is_finite() && *pwr >= 0.0) {
                        return bad(format!("pwr {pwr} must be finite and 0 or more"));
                    }
                }
                return decay_span(*max_update, w.steps).or_else(bad);
            }
        }
        Ok(())
    }
}

/// A decay's `max_update`: at least 1, and not the warm-up's end (MXNet would divide by zero
/// there; one before it is never reached, and the rate stays where the warm-up left it).
fn decay_span(max_update: u64, warmup: u64) -> std::result::Result<(), String> {
    match max_update {
        0 => Err("max_update must be at least 1".into()),
        m if m == warmup => Err(format!(
            "max_update {m} must not be warmup_steps (MXNet divides by their difference)"
        )),
        _ => Ok(()),
    }
}

impl Optimizer {
    /// This optimizer with its learning rate set by `schedule` at every update (MXNet's
    /// `lr_scheduler`), starting from this optimizer's learning rate.
    pub fn lr_scheduler(self, schedule: LrScheduler) -> Multiplied {
        Multiplied::from(self).lr_scheduler(schedule)
    }

    /// This optimizer with every key's update count starting at `n` instead of 0 (MXNet's
    /// `begin_num_update`): schedulers and Adam's bias correction count from there.
    pub fn begin_num_update(self, n: u64) -> Multiplied {
        Multiplied::from(self).begin_num_update(n)
    }
}

impl Multiplied {
    /// Sets the learning rate by `schedule` at every update (MXNet's `lr_scheduler`),
    /// starting from the optimizer's learning rate.
    pub fn lr_scheduler(mut self, schedule: LrScheduler) -> Multiplied {
        self.schedule = Some(schedule.starting_at(self.opt.learning_rate()));
        self
    }

    /// Starts every key's update count at `n` (MXNet's `begin_num_update`).
    pub fn begin_num_update(mut self, n: u64) -> Multiplied {
        self.begin_num_update = n;
        self
    }

    /// The learning-rate scheduler, if any.
    pub fn schedule(&self) -> Option<&LrScheduler> {
        self.schedule.as_ref()
    }
}

/// Appends the scheduler (if any) and the count to begin from: a flag, the scheduler, then
/// the count.
pub(crate) fn write_extras(out: &mut Vec<u8>, schedule: Option<&LrScheduler>, begin: u64) {
    match schedule {
        Some(s) => {
            out.push(1);
            s.write(out);
        }
        None => out.push(0),
    }
    out.extend_from_slice(&begin.to_le_bytes());
}

/// What [`write_extras`] wrote; `None` where it is cut short or malformed.
pub(super) fn read_extras(r: &mut Reader<'_>) -> Option<(Option<LrScheduler>, u64)> {
    let schedule = match r.take(1)?[0] {
        0 => None,
        1 => Some(LrScheduler::read(r)?),
        _ => return None,
    };
    Some((schedule, r.u64().filter(|&n| n <= MAX_BEGIN)?))
}

/// The most a `begin_num_update` may be (2^53: every count up to it is exact as a float, and
/// none overflows).
pub(crate) const MAX_BEGIN: u64 = 1 << 53;

/// Kinds of rule on the wire and in saved states.
const FACTOR: u8 = 1;
const MULTI_FACTOR: u8 = 2;
const POLY: u8 = 3;
const COSINE: u8 = 4;

/// The most steps a `multi_factor` scheduler may list (they travel in a control message).
const MAX_STEPS: u64 = 1024;

impl LrScheduler {
    /// Appends the scheduler, its state included, for the wire and for saved states.
    pub(super) fn write(&self, out: &mut Vec<u8>) {
        let w = self.warmup;
        let u = |out: &mut Vec<u8>, x: u64| out.extend_from_slice(&x.to_le_bytes());
        let f = |out: &mut Vec<u8>, x: f64| out.extend_from_slice(&x.to_le_bytes());
        let kind = match &self.rule {
            Rule::Factor { .. } => FACTOR,
            Rule::MultiFactor { .. } => MULTI_FACTOR,
            Rule::Decay {
                curve: Curve::Poly(_),
                ..
            } => POLY,
            Rule::Decay {
                curve: Curve::Cosine,
                ..
            } => COSINE,
        };
        out.push(kind);
        out.push(u8::from(w.constant));
        u(out, w.steps);
        f(out, w.begin_lr);
        f(out, w.final_lr);
        f(out, self.base_lr);
        u(out, self.count);
        u(out, self.passed);
        match &self.rule {
            Rule::Factor {
                step,
                factor,
                stop_factor_lr,
            } => {
                u(out, *step);
                f(out, *factor);
                f(out, *stop_factor_lr);
            }
            Rule::MultiFactor { steps, factor } => {
                f(out, *factor);
                u(out, steps.len() as u64);
                for s in steps {
                    u(out, *s);
                }
            }
            Rule::Decay {
                max_update,
                base_lr_orig,
                final_lr,
                curve,
            } => {
                // A poly's power between its start and end rates.
                u(out, *max_update);
                f(out, *base_lr_orig);
                if let Curve::Poly(pwr) = curve {
                    f(out, *pwr);
                }
                f(out, *final_lr);
            }
        }
    }

    /// What [`LrScheduler::write`] wrote; `None` where it is cut short, malformed, or a
    /// scheduler [`LrScheduler::check`] refuses.
    pub(super) fn read(r: &mut Reader<'_>) -> Option<LrScheduler> {
        let head = r.take(2)?;
        let (kind, constant) = (head[0], head[1]);
        let warmup = Warmup {
            steps: r.u64()?,
            begin_lr: r.f64()?,
            final_lr: r.f64()?,
            constant: match constant {
                0 => false,
                1 => true,
                _ => return None,
            },
        };
        let (base_lr, count, passed) = (r.f64()?, r.u64()?, r.u64()?);
        let rule = match kind {
            FACTOR => Rule::Factor {
                step: r.u64()?,
                factor: r.f64()?,
                stop_factor_lr: r.f64()?,
            },
            MULTI_FACTOR => {
                let factor = r.f64()?;
                let n = r.u64()?;
                if n > MAX_STEPS {
                    return None;
                }
                let steps = (0..n).map(|_| r.u64()).collect::<Option<Vec<u64>>>()?;
                Rule::MultiFactor { steps, factor }
            }
            POLY | COSINE => {
                let (max_update, base_lr_orig) = (r.u64()?, r.f64()?);
                let curve = match kind {
                    POLY => Curve::Poly(r.f64()?),
                    _ => Curve::Cosine,
                };
                Rule::Decay {
                    max_update,
                    base_lr_orig,
                    final_lr: r.f64()?,
                    curve,
                }
            }
            _ => return None,
        };
        let s = LrScheduler {
            rule,
            warmup,
            base_lr,
            count,
            passed,
        };
        s.check().ok().map(|()| s)
    }
}

#[cfg(test)]
#[path = "schedule_tests.rs"]
mod tests;
