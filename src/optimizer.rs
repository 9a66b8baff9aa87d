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

    /// Encodes the optimizer as 8 f64 words (kind first), for the wire.
    pub fn encode(&self) -> [f64; 8] {
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
    pub fn decode(w: &[f64]) -> Result<Optimizer> {
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
            if momentum == 0.0 {
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
                let g = prep(g.to_f64(), rescale_grad, clip_gradient) + wd * wf;
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
    fn integer_weights_are_refused() {
        let mut u = OptimizerUpdater::new(Optimizer::sgd(0.1));
        let mut w = NDArray::zeros_dtype(&[2], crate::DType::I32);
        let g = NDArray::zeros_dtype(&[2], crate::DType::I32);
        assert!(u.update(&Key::Int(0), &g, &mut w).is_err());
    }
}
