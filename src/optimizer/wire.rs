//! An optimizer's parameters on the wire and in saved states: f64 words, its kind first, 8 of
//! them for every kind but centered RMSProp's and Nadam's, which take 9.

use super::{Optimizer, Reader};
use crate::{KvError, Result};

/// How many words an optimizer of kind `kind` (its first word) takes; `None` for a kind that
/// is not one.
fn words_of(kind: f64) -> Option<usize> {
    match kind {
        1.0 | 2.0 | 3.0 | 4.0 | 5.0 | 6.0 | 7.0 | 8.0 | 9.0 | 11.0 => Some(8),
        10.0 | 12.0 => Some(9),
        _ => None,
    }
}

/// Reads an optimizer's words off the front of `r`: an error where the kind is unknown or the
/// words are cut short.
pub(super) fn read_words(r: &mut Reader<'_>) -> Result<Vec<f64>> {
    let truncated = || KvError::Protocol("truncated optimizer parameters".into());
    let kind = r.f64().ok_or_else(truncated)?;
    let n = words_of(kind)
        .ok_or_else(|| KvError::Protocol(format!("unknown optimizer kind {kind}")))?;
    let mut words = vec![kind];
    for _ in 1..n {
        words.push(r.f64().ok_or_else(truncated)?);
    }
    Ok(words)
}

impl Optimizer {
    /// Encodes the optimizer as f64 words (kind first), for the wire.
    pub(crate) fn encode(&self) -> Vec<f64> {
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
                vec![
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
            } => vec![
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
            } => vec![4.0, lr, epsilon, wd, rescale_grad, clip_gradient, 0.0, 0.0],
            Optimizer::RmsProp {
                lr,
                gamma1,
                epsilon,
                wd,
                rescale_grad,
                clip_gradient,
                clip_weights,
            } => vec![
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
            } => vec![6.0, lr, rho, epsilon, wd, rescale_grad, clip_gradient, 0.0],
            Optimizer::Adamax {
                lr,
                beta1,
                beta2,
                wd,
                rescale_grad,
                clip_gradient,
            } => vec![7.0, lr, beta1, beta2, wd, rescale_grad, clip_gradient, 0.0],
            Optimizer::Signum {
                lr,
                momentum,
                wd,
                rescale_grad,
                clip_gradient,
                wd_lh,
            } => vec![
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
            } => vec![9.0, lr, lamda1, beta, wd, rescale_grad, clip_gradient, 0.0],
            Optimizer::Ftml {
                lr,
                beta1,
                beta2,
                epsilon,
                wd,
                rescale_grad,
                clip_gradient,
            } => vec![
                11.0,
                lr,
                beta1,
                beta2,
                epsilon,
                wd,
                rescale_grad,
                clip_gradient,
            ],
            Optimizer::Nadam {
                lr,
                beta1,
                beta2,
                epsilon,
                schedule_decay,
                wd,
                rescale_grad,
                clip_gradient,
            } => {
                vec![
                    12.0,
                    lr,
                    beta1,
                    beta2,
                    epsilon,
                    schedule_decay,
                    wd,
                    rescale_grad,
                    clip_gradient,
                ]
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
                vec![
                    10.0,
                    lr,
                    gamma1,
                    gamma2,
                    epsilon,
                    wd,
                    rescale_grad,
                    clip_gradient,
                    clip_weights,
                ]
            }
        }
    }

    /// Decodes [`Optimizer::encode`]'s words.
    pub(crate) fn decode(w: &[f64]) -> Result<Optimizer> {
        if w.first().and_then(|k| words_of(*k)) != Some(w.len()) || w.iter().any(|v| !v.is_finite())
        {
            return Err(KvError::Protocol(match w.first() {
                Some(k) if k.is_finite() && words_of(*k).is_none() => {
                    format!("unknown optimizer kind {k}")
                }
                _ => "malformed optimizer parameters".into(),
            }));
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
            10 => Ok(Optimizer::RmsPropCentered {
                lr: w[1],
                gamma1: w[2],
                gamma2: w[3],
                epsilon: w[4],
                wd: w[5],
                rescale_grad: w[6],
                clip_gradient: w[7],
                clip_weights: w[8],
            }),
            11 => Ok(Optimizer::Ftml {
                lr: w[1],
                beta1: w[2],
                beta2: w[3],
                epsilon: w[4],
                wd: w[5],
                rescale_grad: w[6],
                clip_gradient: w[7],
            }),
            12 => Ok(Optimizer::Nadam {
                lr: w[1],
                beta1: w[2],
                beta2: w[3],
                epsilon: w[4],
                schedule_decay: w[5],
                wd: w[6],
                rescale_grad: w[7],
                clip_gradient: w[8],
            }),
            k => Err(KvError::Protocol(format!("unknown optimizer kind {k}"))),
        }
    }
}
