//! An optimizer's parameters on the wire and in saved states: 8 f64 words, its kind first.

use super::Optimizer;
use crate::{KvError, Result};

impl Optimizer {
    /// Encodes the optimizer as 8 f64 words (kind first), for the wire.
    pub(crate) fn encode(&self) -> [f64; 8] {
        match *self {
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
                let kind = if matches!(self, Optimizer::Nag { .. }) {
                    3.0
                } else {
                    1.0
                };
                [
                    kind,
                    lr,
                    momentum,
                    wd,
                    rescale_grad,
                    clip_gradient,
                    0.0,
                    0.0,
                ]
            }
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
            Optimizer::AdaGrad {
                lr,
                epsilon,
                wd,
                rescale_grad,
                clip_gradient,
            } => [4.0, lr, epsilon, wd, rescale_grad, clip_gradient, 0.0, 0.0],
            Optimizer::RmsProp {
                lr,
                gamma1,
                epsilon,
                wd,
                rescale_grad,
                clip_gradient,
                clip_weights,
            } => [
                5.0,
                lr,
                gamma1,
                epsilon,
                wd,
                rescale_grad,
                clip_gradient,
                clip_weights,
            ],
            Optimizer::AdaDelta {
                lr,
                rho,
                epsilon,
                wd,
                rescale_grad,
                clip_gradient,
            } => [6.0, lr, rho, epsilon, wd, rescale_grad, clip_gradient, 0.0],
            Optimizer::Adamax {
                lr,
                beta1,
                beta2,
                wd,
                rescale_grad,
                clip_gradient,
            } => [7.0, lr, beta1, beta2, wd, rescale_grad, clip_gradient, 0.0],
            Optimizer::Signum {
                lr,
                momentum,
                wd,
                rescale_grad,
                clip_gradient,
                wd_lh,
            } => [
                8.0,
                lr,
                momentum,
                wd,
                rescale_grad,
                clip_gradient,
                wd_lh,
                0.0,
            ],
            Optimizer::Ftrl {
                lr,
                lamda1,
                beta,
                wd,
                rescale_grad,
                clip_gradient,
            } => [9.0, lr, lamda1, beta, wd, rescale_grad, clip_gradient, 0.0],
        }
    }

    /// Decodes [`Optimizer::encode`]'s words.
    pub(crate) fn decode(w: &[f64]) -> Result<Optimizer> {
        if w.len() != 8 || w.iter().any(|v| !v.is_finite()) || w[0].fract() != 0.0 {
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
            3 => Ok(Optimizer::Nag {
                lr: w[1],
                momentum: w[2],
                wd: w[3],
                rescale_grad: w[4],
                clip_gradient: w[5],
            }),
            4 => Ok(Optimizer::AdaGrad {
                lr: w[1],
                epsilon: w[2],
                wd: w[3],
                rescale_grad: w[4],
                clip_gradient: w[5],
            }),
            5 => Ok(Optimizer::RmsProp {
                lr: w[1],
                gamma1: w[2],
                epsilon: w[3],
                wd: w[4],
                rescale_grad: w[5],
                clip_gradient: w[6],
                clip_weights: w[7],
            }),
            6 => Ok(Optimizer::AdaDelta {
                lr: w[1],
                rho: w[2],
                epsilon: w[3],
                wd: w[4],
                rescale_grad: w[5],
                clip_gradient: w[6],
            }),
            7 => Ok(Optimizer::Adamax {
                lr: w[1],
                beta1: w[2],
                beta2: w[3],
                wd: w[4],
                rescale_grad: w[5],
                clip_gradient: w[6],
            }),
            8 => Ok(Optimizer::Signum {
                lr: w[1],
                momentum: w[2],
                wd: w[3],
                rescale_grad: w[4],
                clip_gradient: w[5],
                wd_lh: w[6],
            }),
            9 => Ok(Optimizer::Ftrl {
                lr: w[1],
                lamda1: w[2],
                beta: w[3],
                wd: w[4],
                rescale_grad: w[5],
                clip_gradient: w[6],
            }),
            k => Err(KvError::Protocol(format!("unknown optimizer kind {k}"))),
        }
    }
}
