//! The update rules on the host, element by element in f64 and rounded once into the
//! weight's dtype: MXNet's `sgd_update`, `sgd_mom_update`, `nag_mom_update`, `adam_update`,
//! its Python `AdaGrad`'s dense update, `rmsprop_update`, `rmspropalex_update`, its Python
//! `AdaDelta`, `Adamax` and `Nadam`, `signum_update`, `signsgd_update`, `ftrl_update` and
//! `ftml_update` (MXNet 1.9).

use super::Optimizer;
use crate::Element;

fn prep(g: f64, rescale: f64, clip: f64) -> f64 {
    let g = g * rescale;
    if clip > 0.0 {
        g.clamp(-clip, clip)
    } else {
        g
    }
}

/// Adam's bias-corrected learning rate at step `t` (from 1), with MXNet's arithmetic:
/// `lr * (sqrt(1 - beta2^t) / (1 - beta1^t))`, the powers by `pow` as Python's `**`.
pub(super) fn adam_lr(lr: f64, beta1: f64, beta2: f64, t: u64) -> f64 {
    let t = t as f64;
    lr * ((1.0 - beta2.powf(t)).sqrt() / (1.0 - beta1.powf(t)))
}

/// Adamax's bias-corrected learning rate at step `t` (from 1), as MXNet's Python `Adamax`:
/// `lr / (1 - beta1^t)`.
pub(super) fn adamax_lr(lr: f64, beta1: f64, t: u64) -> f64 {
    lr / (1.0 - beta1.powf(t as f64))
}

/// The sign, as MXNet's kernels take it: 1, -1, or 0 (for 0 and NaN).
fn sign(x: f64) -> f64 {
    f64::from(u8::from(x > 0.0)) - f64::from(u8::from(x < 0.0))
}

/// What one step of a key takes beyond the optimizer's parameters, from its count.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Step {
    /// The key's update count (its `t`-th step, counted from `begin_num_update`).
    pub(crate) t: u64,
    /// Adam's or Adamax's bias-corrected learning rate.
    pub(crate) lr_t: f64,
    /// Nadam's momentum schedule: `momentum_t`, `momentum_t_1`, `m_schedule` and
    /// `m_schedule_next`, as its `update` computes them.
    pub(crate) nadam: [f64; 4],
}

/// Nadam's momentum at step `t` (MXNet's `beta1 * (1 - 0.5 * 0.96 ** (t * schedule_decay))`).
pub(super) fn nadam_momentum(beta1: f64, schedule_decay: f64, t: u64) -> f64 {
    beta1 * (1.0 - 0.5 * 0.96f64.powf(t as f64 * schedule_decay))
}

/// One step on the host: each of `moments` (`m`, `v`, `d`) holds the weight's size of moments
/// where `opt` uses it.
pub(super) fn update_typed<T: Element>(
    opt: &Optimizer,
    step: Step,
    grad: &[T],
    weight: &mut [T],
    moments: [&mut [f64]; 3],
) {
    let [m, v, d] = moments;
    let Step { t, lr_t, nadam } = step;
    match *opt {
        Optimizer::Sgd {
            lr,
            momentum,
            wd,
            rescale_grad,
            clip_gradient,
        }
        | Optimizer::Nag {
            lr,
            momentum,
            wd,
            rescale_grad,
            clip_gradient,
        } => {
            // As MXNet's `SGD.update`: momentum is used only when it is positive. As its
            // `NAG.update`: a key with a momentum state (made at its first update where the
            // momentum was not 0) runs nag_mom_update, with the momentum where it is positive
            // and 0 where not (MXNet passes it only then); one without runs sgd_update (whose
            // kernel orders the step `(1 - lr * wd) * w - lr * g`, so the last bit may
            // differ).
            let nesterov = matches!(opt, Optimizer::Nag { .. }) && m.len() == weight.len();
            let plain = match opt {
                Optimizer::Nag { .. } => !nesterov,
                _ => momentum <= 0.0,
            };
            if plain {
                for (w, g) in weight.iter_mut().zip(grad) {
                    let wf = w.to_f64();
                    let g = prep(g.to_f64(), rescale_grad, clip_gradient);
                    *w = T::from_f64(wf - lr * (g + wd * wf));
                }
            } else if nesterov {
                // MXNet's `nag_mom_update`, in its order: the momentum decays, the weight
                // moves by it and by (1 + momentum) times the step, then the step joins the
                // momentum with the weight decay of the weight just written (MXNet's NAG runs
                // the kernel in place, `out=weight`, and it reads the weight back after
                // writing it; so does its `mp_nag_mom_update`, on the master copy).
                let momentum = if momentum > 0.0 { momentum } else { 0.0 };
                for ((w, g), m) in weight.iter_mut().zip(grad).zip(m.iter_mut()) {
                    let wf = w.to_f64();
                    let g = prep(g.to_f64(), rescale_grad, clip_gradient);
                    *m *= momentum;
                    let nw = T::from_f64(wf - *m + (momentum + 1.0) * (*m - lr * (g + wd * wf)));
                    *w = nw;
                    *m -= lr * (g + wd * nw.to_f64());
                }
            } else {
                for ((w, g), m) in weight.iter_mut().zip(grad).zip(m.iter_mut()) {
                    let wf = w.to_f64();
                    let g = prep(g.to_f64(), rescale_grad, clip_gradient);
                    *m = momentum * *m - lr * (g + wd * wf);
                    *w = T::from_f64(wf + *m);
                }
            }
        }
        Optimizer::Adam {
            beta1,
            beta2,
            epsilon,
            wd,
            rescale_grad,
            clip_gradient,
            ..
        } => {
            for (((w, g), m), v) in weight
                .iter_mut()
                .zip(grad)
                .zip(m.iter_mut())
                .zip(v.iter_mut())
            {
                let wf = w.to_f64();
                // MXNet's adam_update: weight decay joins the gradient before the clip.
                let g = prep(g.to_f64() * rescale_grad + wd * wf, 1.0, clip_gradient);
                *m = beta1 * *m + (1.0 - beta1) * g;
                *v = beta2 * *v + (1.0 - beta2) * g * g;
                *w = T::from_f64(wf - lr_t * *m / (v.sqrt() + epsilon));
            }
        }
        Optimizer::AdaGrad {
            lr,
            epsilon,
            wd,
            rescale_grad,
            clip_gradient,
        } => {
            // MXNet's AdaGrad.update (dense): the history grows by the square of the
            // rescaled, clipped gradient; weight decay joins the divided step.
            for ((w, g), h) in weight.iter_mut().zip(grad).zip(m.iter_mut()) {
                let wf = w.to_f64();
                let g = prep(g.to_f64(), rescale_grad, clip_gradient);
                *h += g * g;
                let div = g / (*h + epsilon).sqrt();
                *w = T::from_f64(wf + (div + wf * wd) * -lr);
            }
        }
        Optimizer::RmsProp {
            lr,
            gamma1,
            epsilon,
            wd,
            rescale_grad,
            clip_gradient,
            clip_weights,
        } => {
            // MXNet's rmsprop_update: weight decay joins the gradient before the clip.
            for ((w, g), n) in weight.iter_mut().zip(grad).zip(m.iter_mut()) {
                let wf = w.to_f64();
                let g = prep(g.to_f64() * rescale_grad + wd * wf, 1.0, clip_gradient);
                *n = (1.0 - gamma1) * (g * g) + gamma1 * *n;
                let nw = wf - lr * (g / (*n + epsilon).sqrt());
                *w = T::from_f64(if clip_weights > 0.0 {
                    nw.clamp(-clip_weights, clip_weights)
                } else {
                    nw
                });
            }
        }
        Optimizer::RmsPropCentered {
            lr,
            gamma1,
            gamma2,
            epsilon,
            wd,
            rescale_grad,
            clip_gradient,
            clip_weights,
        } => {
            // RMSPropAlexUpdateKernel, in its order: `n` is `m`, the gradients' average `v`,
            // the steps' momentum `d`.
            for ((w, g), (n, (ga, delta))) in weight
                .iter_mut()
                .zip(grad)
                .zip(m.iter_mut().zip(v.iter_mut().zip(d.iter_mut())))
            {
                let wf = w.to_f64();
                let g = prep(g.to_f64() * rescale_grad + wd * wf, 1.0, clip_gradient);
                *n = (1.0 - gamma1) * g * g + gamma1 * *n;
                *ga = (1.0 - gamma1) * g + gamma1 * *ga;
                *delta = gamma2 * *delta - lr * g / (*n - *ga * *ga + epsilon).sqrt();
                let nw = wf + *delta;
                *w = T::from_f64(if clip_weights > 0.0 {
                    nw.clamp(-clip_weights, clip_weights)
                } else {
                    nw
                });
            }
        }
        Optimizer::Nadam {
            lr,
            beta1,
            beta2,
            epsilon,
            wd,
            rescale_grad,
            clip_gradient,
            ..
        } => {
            // MXNet's Nadam.update, in its order.
            let [mom_t, mom_t_1, m_schedule, m_schedule_next] = nadam;
            let c2 = 1.0 - beta2.powf(t as f64);
            for ((w, g), (m, v)) in weight
                .iter_mut()
                .zip(grad)
                .zip(m.iter_mut().zip(v.iter_mut()))
            {
                let wf = w.to_f64();
                let g = prep(g.to_f64() * rescale_grad + wd * wf, 1.0, clip_gradient);
                *m = *m * beta1 + (1.0 - beta1) * g;
                *v = *v * beta2 + (1.0 - beta2) * g * g;
                let g_prime = g / (1.0 - m_schedule);
                let m_prime = *m / (1.0 - m_schedule_next);
                let v_prime = *v / c2;
                let m_bar = (1.0 - mom_t) * g_prime + mom_t_1 * m_prime;
                *w = T::from_f64(wf - lr * m_bar / (v_prime.sqrt() + epsilon));
            }
        }
        Optimizer::Ftml {
            lr,
            beta1,
            beta2,
            epsilon,
            wd,
            rescale_grad,
            clip_gradient,
        } => {
            // FTMLKernel, in its order: the last step's `d` is `m`, `v` is `v`, `z` is `d`.
            let t = t as f64;
            let (c1, c2) = (1.0 - beta1.powf(t), 1.0 - beta2.powf(t));
            for ((w, g), (d_prev, (v, z))) in weight
                .iter_mut()
                .zip(grad)
                .zip(m.iter_mut().zip(v.iter_mut().zip(d.iter_mut())))
            {
                let wf = w.to_f64();
                let g = prep(g.to_f64() * rescale_grad + wd * wf, 1.0, clip_gradient);
                *v = beta2 * *v + (1.0 - beta2) * (g * g);
                let d_t = c1 / lr * ((*v / c2).sqrt() + epsilon);
                *z = beta1 * *z + (1.0 - beta1) * g - (d_t - beta1 * *d_prev) * wf;
                *d_prev = d_t;
                *w = T::from_f64(-*z / d_t);
            }
        }
        Optimizer::AdaDelta {
            rho,
            epsilon,
            wd,
            rescale_grad,
            clip_gradient,
            ..
        } => {
            // MXNet's AdaDelta.update, in its order (its code, not its docstring: weight decay
            // is added to the step, not to the gradient).
            for ((w, g), (acc_g, acc_d)) in weight
                .iter_mut()
                .zip(grad)
                .zip(m.iter_mut().zip(v.iter_mut()))
            {
                let wf = w.to_f64();
                let g = prep(g.to_f64(), rescale_grad, clip_gradient);
                *acc_g = *acc_g * rho + (1.0 - rho) * g * g;
                let delta = (*acc_d + epsilon).sqrt() / (*acc_g + epsilon).sqrt() * g;
                *acc_d = *acc_d * rho + (1.0 - rho) * delta * delta;
                *w = T::from_f64(wf - (delta + wd * wf));
            }
        }
        Optimizer::Adamax {
            beta1,
            beta2,
            wd,
            rescale_grad,
            clip_gradient,
            ..
        } => {
            // MXNet's Adamax.update: weight decay joins the gradient before the clip.
            for ((w, g), (m, u)) in weight
                .iter_mut()
                .zip(grad)
                .zip(m.iter_mut().zip(v.iter_mut()))
            {
                let wf = w.to_f64();
                let g = prep(g.to_f64() * rescale_grad + wd * wf, 1.0, clip_gradient);
                *m = *m * beta1 + (1.0 - beta1) * g;
                *u = (beta2 * *u).max(g.abs());
                *w = T::from_f64(wf - lr_t * *m / *u);
            }
        }
        Optimizer::Signum {
            lr,
            momentum,
            wd,
            rescale_grad,
            clip_gradient,
            wd_lh,
        } => {
            // As MXNet's Signum: a key with a momentum state (made at its first update where
            // the momentum was not 0) runs signum_update, one without runs signsgd_update
            // (`OptimizerUpdater::update` refused a momentum or wd_lh that it cannot take).
            if m.len() != weight.len() {
                // signsgd_update: neither the rescale nor the clip applies.
                for (w, g) in weight.iter_mut().zip(grad) {
                    let wf = w.to_f64();
                    *w = T::from_f64((1.0 - lr * wd) * wf - lr * sign(g.to_f64()));
                }
            } else {
                // signum_update; MXNet's Signum passes a momentum of 0 or less on as none
                // (the kernel's default, 0).
                let mom = momentum.max(0.0);
                for ((w, g), s) in weight.iter_mut().zip(grad).zip(m.iter_mut()) {
                    let wf = w.to_f64();
                    let g = g.to_f64();
                    // The kernel's two orders, with the clip and without.
                    let step = if clip_gradient > 0.0 {
                        (1.0 - mom) * (rescale_grad * g).clamp(-clip_gradient, clip_gradient)
                    } else {
                        (1.0 - mom) * rescale_grad * g
                    };
                    *s = mom * *s - (1.0 - mom) * wd * wf - step;
                    *w = T::from_f64((1.0 - lr * wd_lh) * wf + lr * sign(*s));
                }
            }
        }
        Optimizer::Ftrl {
            lr,
            lamda1,
            beta,
            wd,
            rescale_grad,
            clip_gradient,
        } => {
            // FtrlUpdateKernel, in its order: `z` is `m`, `n` is `v`.
            for ((w, g), (z, n)) in weight
                .iter_mut()
                .zip(grad)
                .zip(m.iter_mut().zip(v.iter_mut()))
            {
                let wf = w.to_f64();
                let g = prep(g.to_f64(), rescale_grad, clip_gradient);
                *z += g - ((*n + g * g).sqrt() - n.sqrt()) * wf / lr;
                *n += g * g;
                let kept = if z.abs() > lamda1 { 1.0 } else { 0.0 };
                *w = T::from_f64((sign(*z) * lamda1 - *z) / ((beta + n.sqrt()) / lr + wd) * kept);
            }
        }
    }
}

#[cfg(test)]
#[path = "rules_tests.rs"]
mod tests;
