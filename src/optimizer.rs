//! Built-in optimizers that run where the updater runs (in the store, or on the servers).
//!
//! They follow MXNet's update rules (`sgd_update`, `sgd_mom_update`, `adam_update` with the
//! bias-corrected learning rate of its Python `Adam`), element-wise, so they apply unchanged to
//! the slice of a big tensor that one server holds.

use rustc_hash::FxHashMap;

use crate::dtype::with_dtype;
use crate::{Element, Key, KvError, NDArray, Result};

/// An optimizer and its hyper-parameters.
#[derive(Clone, Debug, PartialEq)]
pub enum Optimizer {
    /// Stochastic gradient descent, with optional momentum and weight decay.
    Sgd {
        /// Learning rate.
        lr: f64,
        /// Momentum (0 for plain SGD).
        momentum: f64,
        /// Weight decay.
        wd: f64,
        /// Factor applied to the gradient first (e.g. 1/batch size).
        rescale_grad: f64,
        /// Clip the rescaled gradient to `[-c, c]`; 0 or less for no clipping.
        clip_gradient: f64,
    },
    /// Adam.
    Adam {
        /// Learning rate.
        lr: f64,
        /// Decay of the first moment.
        beta1: f64,
        /// Decay of the second moment.
        beta2: f64,
        /// Added to the denominator.
        epsilon: f64,
        /// Weight decay.
        wd: f64,
        /// Factor applied to the gradient first.
        rescale_grad: f64,
        /// Clip the rescaled gradient to `[-c, c]`; 0 or less for no clipping.
        clip_gradient: f64,
    },
}

impl Optimizer {
    /// Plain SGD with learning rate `lr`.
    pub fn sgd(lr: f64) -> Optimizer {
        Optimizer::Sgd {
            lr,
            momentum: 0.0,
            wd: 0.0,
            rescale_grad: 1.0,
            clip_gradient: 0.0,
        }
    }

    /// Adam with MXNet's default betas and epsilon.
    pub fn adam(lr: f64) -> Optimizer {
        Optimizer::Adam {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            epsilon: 1e-8,
            wd: 0.0,
            rescale_grad: 1.0,
            clip_gradient: 0.0,
        }
    }

    /// Sets the learning rate.
    pub fn lr(mut self, value: f64) -> Optimizer {
        match &mut self {
            Optimizer::Sgd { lr, .. } | Optimizer::Adam { lr, .. } => *lr = value,
        }
        self
    }

    /// Sets SGD's momentum (no effect on Adam).
    pub fn momentum(mut self, value: f64) -> Optimizer {
        if let Optimizer::Sgd { momentum, .. } = &mut self {
            *momentum = value;
        }
        self
    }

    /// Sets the weight decay.
    pub fn wd(mut self, value: f64) -> Optimizer {
        match &mut self {
            Optimizer::Sgd { wd, .. } | Optimizer::Adam { wd, .. } => *wd = value,
        }
        self
    }

    /// Sets the factor applied to gradients first (e.g. 1/batch size).
    pub fn rescale_grad(mut self, value: f64) -> Optimizer {
        match &mut self {
            Optimizer::Sgd { rescale_grad, .. } | Optimizer::Adam { rescale_grad, .. } => {
                *rescale_grad = value
            }
        }
        self
    }

    /// Clips rescaled gradients to `[-value, value]` (0 or less: no clipping).
    pub fn clip_gradient(mut self, value: f64) -> Optimizer {
        match &mut self {
            Optimizer::Sgd { clip_gradient, .. } | Optimizer::Adam { clip_gradient, .. } => {
                *clip_gradient = value
            }
        }
        self
    }

    /// Sets Adam's first-moment decay (no effect on SGD).
    pub fn beta1(mut self, value: f64) -> Optimizer {
        if let Optimizer::Adam { beta1, .. } = &mut self {
            *beta1 = value;
        }
        self
    }

    /// Sets Adam's second-moment decay (no effect on SGD).
    pub fn beta2(mut self, value: f64) -> Optimizer {
        if let Optimizer::Adam { beta2, .. } = &mut self {
            *beta2 = value;
        }
        self
    }

    /// Sets Adam's epsilon (no effect on SGD).
    pub fn epsilon(mut self, value: f64) -> Optimizer {
        if let Optimizer::Adam { epsilon, .. } = &mut self {
            *epsilon = value;
        }
        self
    }

    /// Encodes the optimizer as 8 f64 words (kind first), for the wire.
    pub(crate) fn encode(&self) -> [f64; 8] {
        match *self {
            Optimizer::Sgd {
                lr,
                momentum,
                wd,
                rescale_grad,
                clip_gradient,
            } => [1.0, lr, momentum, wd, rescale_grad, clip_gradient, 0.0, 0.0],
            Optimizer::Adam {
                lr,
                beta1,
                beta2,
                epsilon,
                wd,
                rescale_grad,
                clip_gradient,
            } => [
                2.0,
                lr,
                beta1,
                beta2,
                epsilon,
                wd,
                rescale_grad,
                clip_gradient,
            ],
        }
    }

    /// Decodes [`Optimizer::encode`]'s words.
    pub(crate) fn decode(w: &[f64]) -> Result<Optimizer> {
        if w.len() != 8 || w.iter().any(|v| !v.is_finite()) {
            return Err(KvError::Protocol("malformed optimizer parameters".into()));
        }
        match w[0] as i64 {
            1 => Ok(Optimizer::Sgd {
                lr: w[1],
                momentum: w[2],
                wd: w[3],
                rescale_grad: w[4],
                clip_gradient: w[5],
            }),
            2 => Ok(Optimizer::Adam {
                lr: w[1],
                beta1: w[2],
                beta2: w[3],
                epsilon: w[4],
                wd: w[5],
                rescale_grad: w[6],
                clip_gradient: w[7],
            }),
            k => Err(KvError::Protocol(format!("unknown optimizer kind {k}"))),
        }
    }
}

/// Per-key state of an optimizer (momentum, moments, step count).
#[derive(Default)]
struct KeyState {
    m: Vec<f64>,
    v: Vec<f64>,
    t: u64,
}

/// An optimizer with the state it keeps per key.
pub struct OptimizerUpdater {
    opt: Optimizer,
    state: FxHashMap<Key, KeyState>,
}

fn prep(g: f64, rescale: f64, clip: f64) -> f64 {
    let g = g * rescale;
    if clip > 0.0 {
        g.clamp(-clip, clip)
    } else {
        g
    }
}

fn update_typed<T: Element>(opt: &Optimizer, st: &mut KeyState, grad: &[T], weight: &mut [T]) {
    match *opt {
        Optimizer::Sgd {
            lr,
            momentum,
            wd,
            rescale_grad,
            clip_gradient,
        } => {
            // As MXNet's `SGD.update`: momentum is used only when it is positive.
            if momentum <= 0.0 {
                for (w, g) in weight.iter_mut().zip(grad) {
                    let wf = w.to_f64();
                    let g = prep(g.to_f64(), rescale_grad, clip_gradient);
                    *w = T::from_f64(wf - lr * (g + wd * wf));
                }
            } else {
                st.m.resize(weight.len(), 0.0);
                for ((w, g), m) in weight.iter_mut().zip(grad).zip(st.m.iter_mut()) {
                    let wf = w.to_f64();
                    let g = prep(g.to_f64(), rescale_grad, clip_gradient);
                    *m = momentum * *m - lr * (g + wd * wf);
                    *w = T::from_f64(wf + *m);
                }
            }
        }
        Optimizer::Adam {
            lr,
            beta1,
            beta2,
            epsilon,
            wd,
            rescale_grad,
            clip_gradient,
        } => {
            st.t += 1;
            st.m.resize(weight.len(), 0.0);
            st.v.resize(weight.len(), 0.0);
            let t = st.t as i32;
            let lr_t = lr * (1.0 - beta2.powi(t)).sqrt() / (1.0 - beta1.powi(t));
            for (((w, g), m), v) in weight
                .iter_mut()
                .zip(grad)
                .zip(st.m.iter_mut())
                .zip(st.v.iter_mut())
            {
                let wf = w.to_f64();
                // MXNet's adam_update: weight decay joins the gradient before the clip.
                let g = prep(g.to_f64() * rescale_grad + wd * wf, 1.0, clip_gradient);
                *m = beta1 * *m + (1.0 - beta1) * g;
                *v = beta2 * *v + (1.0 - beta2) * g * g;
                *w = T::from_f64(wf - lr_t * *m / (v.sqrt() + epsilon));
            }
        }
    }
}

impl OptimizerUpdater {
    /// An updater running `opt`, with fresh state.
    pub fn new(opt: Optimizer) -> Self {
        OptimizerUpdater {
            opt,
            state: FxHashMap::default(),
        }
    }

    /// The optimizer.
    pub fn optimizer(&self) -> &Optimizer {
        &self.opt
    }

    /// Runs `opt` from the next update on, with the state kept (a new learning rate, say);
    /// an error, with nothing changed, where `opt` is another kind of optimizer.
    pub fn retune(&mut self, opt: Optimizer) -> Result<()> {
        if opt.name() != self.opt.name() {
            return Err(KvError::Incompatible(format!(
                "the store runs {}, whose state {} cannot take on: set_optimizer starts afresh",
                self.opt.name(),
                opt.name()
            )));
        }
        self.opt = opt;
        Ok(())
    }

    /// Applies one step to `weight` with gradient `grad`, in place.
    pub fn update(&mut self, key: &Key, grad: &NDArray, weight: &mut NDArray) -> Result<()> {
        if grad.shape() != weight.shape() || grad.dtype() != weight.dtype() {
            return Err(KvError::ShapeMismatch {
                key: key.clone(),
                expected: weight.shape().to_vec(),
                got: grad.shape().to_vec(),
            });
        }
        if !weight.dtype().is_float() {
            return Err(KvError::Updater {
                key: key.clone(),
                reason: format!("optimizers need a float dtype, not {}", weight.dtype()),
            });
        }
        let st = self.state.entry(key.clone()).or_default();
        let dtype = weight.dtype();
        with_dtype!(dtype, T => update_typed::<T>(
            &self.opt,
            st,
            grad.as_slice::<T>()?,
            weight.as_mut_slice::<T>()?,
        ));
        Ok(())
    }
}

/// The first bytes of saved optimizer states.
const STATES_MAGIC: &[u8; 8] = b"KVOPTST1";
/// The first bytes of saved states that carry the optimizer too (MXNet's `dump_optimizer`):
/// loading them replaces the optimizer with the saved one.
const DUMPED_MAGIC: &[u8; 8] = b"KVOPTSD1";

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
    bytes.starts_with(DUMPED_MAGIC)
}

impl OptimizerUpdater {
    /// The per-key state (momentum, moments, step counts) as bytes, for
    /// [`OptimizerUpdater::load_states`]: MXNet's `save_optimizer_states`.
    pub fn save_states(&self) -> Vec<u8> {
        let mut out = STATES_MAGIC.to_vec();
        for w in self.opt.encode() {
            out.extend_from_slice(&w.to_le_bytes());
        }
        let mut keys: Vec<&Key> = self.state.keys().collect();
        keys.sort();
        out.extend_from_slice(&(keys.len() as u64).to_le_bytes());
        for k in keys {
            let st = &self.state[k];
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
            out.extend_from_slice(&st.t.to_le_bytes());
            for v in [&st.m, &st.v] {
                out.extend_from_slice(&(v.len() as u64).to_le_bytes());
                for x in v.iter() {
                    out.extend_from_slice(&x.to_le_bytes());
                }
            }
        }
        out
    }

    /// [`OptimizerUpdater::save_states`] with the optimizer itself (MXNet's
    /// `dump_optimizer=True`): loading them replaces the optimizer with the saved one.
    pub fn save_states_and_optimizer(&self) -> Vec<u8> {
        let mut out = self.save_states();
        mark_dumped(&mut out);
        out
    }

    /// Replaces the per-key state with what [`OptimizerUpdater::save_states`] saved, which
    /// must come from an optimizer of the same kind; and with what
    /// [`OptimizerUpdater::save_states_and_optimizer`] saved, the optimizer too (its kind
    /// and parameters): then `true`. A malformed or truncated input is an error and changes
    /// nothing.
    pub fn load_states(&mut self, bytes: &[u8]) -> Result<bool> {
        let bad = |why: &str| KvError::Config(format!("optimizer states: {why}"));
        let mut r = Reader(bytes);
        let dumped = match r.take(8).ok_or_else(|| bad("empty"))? {
            m if m == STATES_MAGIC => false,
            m if m == DUMPED_MAGIC => true,
            _ => return Err(bad("not a file of saved optimizer states")),
        };
        let mut words = [0.0; 8];
        for w in &mut words {
            *w = r.f64().ok_or_else(|| bad("truncated"))?;
        }
        let saved = Optimizer::decode(&words).map_err(|_| bad("unknown optimizer"))?;
        if !dumped && std::mem::discriminant(&saved) != std::mem::discriminant(&self.opt) {
            return Err(bad(&format!(
                "saved by {}, loaded into {}",
                saved.name(),
                self.opt.name()
            )));
        }
        let n = r.u64().ok_or_else(|| bad("truncated"))?;
        let mut state = FxHashMap::default();
        for _ in 0..n {
            let key = match r.take(1).ok_or_else(|| bad("truncated"))?[0] {
                0 => Key::Int(r.u64().ok_or_else(|| bad("truncated"))? as i64),
                1 => {
                    let len = r.len().ok_or_else(|| bad("truncated"))?;
                    let s = r.take(len).ok_or_else(|| bad("truncated"))?;
                    Key::Str(String::from_utf8(s.to_vec()).map_err(|_| bad("a key is not UTF-8"))?)
                }
                _ => return Err(bad("a malformed key")),
            };
            let t = r.u64().ok_or_else(|| bad("truncated"))?;
            let mut vecs = [Vec::new(), Vec::new()];
            for v in &mut vecs {
                let len = r.len().ok_or_else(|| bad("truncated"))?;
                if len.checked_mul(8).is_none_or(|b| b > r.0.len()) {
                    return Err(bad("truncated"));
                }
                *v = (0..len).filter_map(|_| r.f64()).collect();
            }
            let [m, v] = vecs;
            state.insert(key, KeyState { m, v, t });
        }
        if !r.0.is_empty() {
            return Err(bad("bytes after the last key"));
        }
        self.state = state;
        if dumped {
            self.opt = saved;
        }
        Ok(dumped)
    }
}

impl Optimizer {
    /// MXNet's name of the optimizer.
    pub fn name(&self) -> &'static str {
        match self {
            Optimizer::Sgd { .. } => "sgd",
            Optimizer::Adam { .. } => "adam",
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sgd_step() {
        let mut u = OptimizerUpdater::new(Optimizer::sgd(0.1));
        let mut w = NDArray::zeros(&[3]);
        u.update(&Key::Int(0), &NDArray::ones(&[3]), &mut w)
            .unwrap();
        assert_eq!(w.to_vec::<f32>().unwrap(), vec![-0.1; 3]);
    }

    #[test]
    fn sgd_momentum_and_weight_decay() {
        let opt = Optimizer::Sgd {
            lr: 0.5,
            momentum: 0.9,
            wd: 0.1,
            rescale_grad: 0.5,
            clip_gradient: 0.0,
        };
        let mut u = OptimizerUpdater::new(opt);
        let mut w = NDArray::from_vec(&[1], vec![1.0f64]).unwrap();
        let g = NDArray::from_vec(&[1], vec![2.0f64]).unwrap();
        u.update(&Key::Int(0), &g, &mut w).unwrap();
        // m = -0.5 * (1 + 0.1) = -0.55; w = 0.45
        let w1 = w.to_vec::<f64>().unwrap()[0];
        assert!((w1 - 0.45).abs() < 1e-12);
        u.update(&Key::Int(0), &g, &mut w).unwrap();
        // m = 0.9 * -0.55 - 0.5 * (1 + 0.045) = -1.0175; w = 0.45 - 1.0175
        let w2 = w.to_vec::<f64>().unwrap()[0];
        assert!((w2 - (0.45 - 1.0175)).abs() < 1e-12);
    }

    #[test]
    fn a_retune_keeps_the_state_and_negative_momentum_is_plain_sgd() {
        let g = NDArray::ones(&[1]);
        let k = Key::Int(0);
        let mut u = OptimizerUpdater::new(Optimizer::sgd(1.0).momentum(0.5));
        let mut w = NDArray::zeros(&[1]);
        u.update(&k, &g, &mut w).unwrap(); // m = -1, w = -1
        u.retune(Optimizer::sgd(0.5).momentum(0.5)).unwrap();
        u.update(&k, &g, &mut w).unwrap(); // m = 0.5 * -1 - 0.5 = -1, w = -2
        assert_eq!(w.to_vec::<f32>().unwrap(), [-2.0]);
        assert!(matches!(
            u.retune(Optimizer::adam(0.1)),
            Err(KvError::Incompatible(_))
        ));
        assert_eq!(u.optimizer().name(), "sgd");
        // As MXNet: momentum is used only when positive.
        let mut u = OptimizerUpdater::new(Optimizer::sgd(1.0).momentum(-0.5));
        let mut w = NDArray::zeros(&[1]);
        u.update(&k, &g, &mut w).unwrap();
        u.update(&k, &g, &mut w).unwrap();
        assert_eq!(w.to_vec::<f32>().unwrap(), [-2.0]);
    }

    #[test]
    fn states_saved_with_the_optimizer_bring_it_back() {
        let g = NDArray::ones(&[1]);
        let k = Key::Int(0);
        let mut a = OptimizerUpdater::new(Optimizer::sgd(0.1).momentum(0.9));
        let mut w = NDArray::zeros(&[1]);
        a.update(&k, &g, &mut w).unwrap(); // m = -0.1
                                           // Without the optimizer: the state only, into the same kind.
        let mut b = OptimizerUpdater::new(Optimizer::sgd(1.0).momentum(0.9));
        assert!(!b.load_states(&a.save_states()).unwrap());
        assert_eq!(b.optimizer(), &Optimizer::sgd(1.0).momentum(0.9));
        let mut c = OptimizerUpdater::new(Optimizer::adam(1.0));
        assert!(c.load_states(&a.save_states()).is_err());
        // With it: the state and the optimizer, whatever ran before.
        assert!(c.load_states(&a.save_states_and_optimizer()).unwrap());
        assert_eq!(c.optimizer(), &Optimizer::sgd(0.1).momentum(0.9));
        let mut w = NDArray::zeros(&[1]);
        c.update(&k, &g, &mut w).unwrap(); // m = 0.9 * -0.1 - 0.1 = -0.19
        let got = w.to_vec::<f32>().unwrap()[0];
        assert!((got + 0.19).abs() < 1e-6, "{got}");
    }

    #[test]
    fn adam_first_step_moves_by_lr() {
        let mut u = OptimizerUpdater::new(Optimizer::adam(0.01));
        let mut w = NDArray::from_vec(&[2], vec![1.0f64, 1.0]).unwrap();
        let g = NDArray::from_vec(&[2], vec![3.0f64, -0.5]).unwrap();
        u.update(&Key::Int(1), &g, &mut w).unwrap();
        let w = w.to_vec::<f64>().unwrap();
        assert!((w[0] - 0.99).abs() < 1e-6, "{w:?}");
        assert!((w[1] - 1.01).abs() < 1e-6, "{w:?}");
    }

    #[test]
    fn encoding_round_trips_and_rejects_garbage() {
        for o in [Optimizer::sgd(0.3), Optimizer::adam(0.001)] {
            assert_eq!(Optimizer::decode(&o.encode()).unwrap(), o);
        }
        assert!(Optimizer::decode(&[9.0; 8]).is_err());
        assert!(Optimizer::decode(&[1.0; 3]).is_err());
        assert!(Optimizer::decode(&[1.0, f64::NAN, 0., 0., 0., 0., 0., 0.]).is_err());
    }

    #[test]
    fn builders_set_fields() {
        let o = Optimizer::sgd(0.1).momentum(0.9).wd(1e-4).rescale_grad(0.5);
        assert_eq!(
            o,
            Optimizer::Sgd {
                lr: 0.1,
                momentum: 0.9,
                wd: 1e-4,
                rescale_grad: 0.5,
                clip_gradient: 0.0
            }
        );
        let a = Optimizer::adam(0.01)
            .beta1(0.8)
            .beta2(0.99)
            .epsilon(1e-6)
            .clip_gradient(1.0);
        assert_eq!(a.encode()[1..5], [0.01, 0.8, 0.99, 1e-6]);
        assert_eq!(a.encode()[7], 1.0);
    }

    #[test]
    fn states_round_trip_and_continue_exactly() {
        let g = NDArray::from_vec(&[2], vec![3.0f64, -0.5]).unwrap();
        let mut a = OptimizerUpdater::new(Optimizer::adam(0.01));
        let mut wa = NDArray::from_vec(&[2], vec![1.0f64, 1.0]).unwrap();
        a.update(&Key::Int(1), &g, &mut wa).unwrap();
        a.update(&Key::Str("w".into()), &g, &mut wa.clone())
            .unwrap();
        let saved = a.save_states();
        let mut b = OptimizerUpdater::new(Optimizer::adam(0.01));
        b.load_states(&saved).unwrap();
        let mut wb = wa.clone();
        a.update(&Key::Int(1), &g, &mut wa).unwrap();
        b.update(&Key::Int(1), &g, &mut wb).unwrap();
        assert_eq!(wa.to_vec::<f64>().unwrap(), wb.to_vec::<f64>().unwrap());
        assert_eq!(b.save_states(), a.save_states());
        // Every truncation is an error, and leaves the state alone.
        for n in 0..saved.len() {
            assert!(b.load_states(&saved[..n]).is_err(), "{n} bytes");
        }
        let mut sgd = OptimizerUpdater::new(Optimizer::sgd(0.1).momentum(0.9));
        assert!(sgd.load_states(&saved).is_err());
        assert_eq!(b.save_states(), a.save_states());
    }

    #[test]
    fn integer_weights_are_refused() {
        let mut u = OptimizerUpdater::new(Optimizer::sgd(0.1));
        let mut w = NDArray::zeros_dtype(&[2], crate::DType::I32);
        let g = NDArray::zeros_dtype(&[2], crate::DType::I32);
        assert!(u.update(&Key::Int(0), &g, &mut w).is_err());
    }
}
