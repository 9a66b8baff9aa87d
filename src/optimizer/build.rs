//! The optimizers' constructors, with MXNet's defaults, the builders that set their
//! parameters, and the parameters every optimizer has.

use super::Optimizer;

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

    /// Nesterov accelerated gradient with learning rate `lr` (momentum 0 until set: plain
    /// SGD, as MXNet's `NAG`).
    pub fn nag(lr: f64) -> Optimizer {
        Optimizer::Nag {
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

    /// AdaGrad with MXNet's default epsilon (1e-7).
    pub fn adagrad(lr: f64) -> Optimizer {
        Optimizer::AdaGrad {
            lr,
            epsilon: 1e-7,
            wd: 0.0,
            rescale_grad: 1.0,
            clip_gradient: 0.0,
        }
    }

    /// RMSProp (not centered) with MXNet's defaults: `gamma1` 0.9, epsilon 1e-8, no weight
    /// clipping.
    pub fn rmsprop(lr: f64) -> Optimizer {
        Optimizer::RmsProp {
            lr,
            gamma1: 0.9,
            epsilon: 1e-8,
            wd: 0.0,
            rescale_grad: 1.0,
            clip_gradient: 0.0,
            clip_weights: 0.0,
        }
    }

    /// AdaDelta with MXNet's defaults: `rho` 0.9, epsilon 1e-5 (its rule has no learning rate;
    /// MXNet's default, 0.01, is kept).
    pub fn adadelta() -> Optimizer {
        Optimizer::AdaDelta {
            lr: 0.01,
            rho: 0.9,
            epsilon: 1e-5,
            wd: 0.0,
            rescale_grad: 1.0,
            clip_gradient: 0.0,
        }
    }

    /// Adamax with MXNet's default betas (0.9, 0.999).
    pub fn adamax(lr: f64) -> Optimizer {
        Optimizer::Adamax {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            wd: 0.0,
            rescale_grad: 1.0,
            clip_gradient: 0.0,
        }
    }

    /// Signum with MXNet's default momentum (0.9) and no decoupled weight decay; momentum 0
    /// makes it signSGD.
    pub fn signum(lr: f64) -> Optimizer {
        Optimizer::Signum {
            lr,
            momentum: 0.9,
            wd: 0.0,
            rescale_grad: 1.0,
            clip_gradient: 0.0,
            wd_lh: 0.0,
        }
    }

    /// FTRL-proximal with MXNet's defaults: `lamda1` 0.01, `beta` 1.
    pub fn ftrl(lr: f64) -> Optimizer {
        Optimizer::Ftrl {
            lr,
            lamda1: 0.01,
            beta: 1.0,
            wd: 0.0,
            rescale_grad: 1.0,
            clip_gradient: 0.0,
        }
    }

    /// FTML with MXNet's defaults: `beta1` 0.6, `beta2` 0.999, epsilon 1e-8.
    pub fn ftml(lr: f64) -> Optimizer {
        Optimizer::Ftml {
            lr,
            beta1: 0.6,
            beta2: 0.999,
            epsilon: 1e-8,
            wd: 0.0,
            rescale_grad: 1.0,
            clip_gradient: 0.0,
        }
    }

    /// Nadam with MXNet's defaults: betas 0.9 and 0.999, epsilon 1e-8, `schedule_decay` 0.004.
    pub fn nadam(lr: f64) -> Optimizer {
        Optimizer::Nadam {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            epsilon: 1e-8,
            schedule_decay: 0.004,
            wd: 0.0,
            rescale_grad: 1.0,
            clip_gradient: 0.0,
        }
    }

    /// Sets Nadam's decay of its momentum schedule (no effect on the others).
    pub fn schedule_decay(mut self, value: f64) -> Optimizer {
        if let Optimizer::Nadam { schedule_decay, .. } = &mut self {
            *schedule_decay = value;
        }
        self
    }

    /// Sets the learning rate.
    pub fn lr(mut self, value: f64) -> Optimizer {
        *self.common().lr = value;
        self
    }

    /// Sets SGD's, NAG's or Signum's momentum (no effect on the others).
    pub fn momentum(mut self, value: f64) -> Optimizer {
        if let Optimizer::Sgd { momentum, .. }
        | Optimizer::Nag { momentum, .. }
        | Optimizer::Signum { momentum, .. } = &mut self
        {
            *momentum = value;
        }
        self
    }

    /// Sets the weight decay.
    pub fn wd(mut self, value: f64) -> Optimizer {
        *self.common().wd = value;
        self
    }

    /// Sets the factor applied to gradients first (e.g. 1/batch size).
    pub fn rescale_grad(mut self, value: f64) -> Optimizer {
        *self.common().rescale_grad = value;
        self
    }

    /// Clips rescaled gradients to `[-value, value]` (0 or less: no clipping).
    pub fn clip_gradient(mut self, value: f64) -> Optimizer {
        *self.common().clip_gradient = value;
        self
    }

    /// Sets Adam's or Adamax's first-moment decay, or FTML's `beta1` (no effect on the others).
    pub fn beta1(mut self, value: f64) -> Optimizer {
        if let Optimizer::Adam { beta1, .. }
        | Optimizer::Adamax { beta1, .. }
        | Optimizer::Ftml { beta1, .. }
        | Optimizer::Nadam { beta1, .. } = &mut self
        {
            *beta1 = value;
        }
        self
    }

    /// Sets Adam's or FTML's second-moment decay, or Adamax's infinity norm's (no effect on
    /// the others).
    pub fn beta2(mut self, value: f64) -> Optimizer {
        if let Optimizer::Adam { beta2, .. }
        | Optimizer::Adamax { beta2, .. }
        | Optimizer::Ftml { beta2, .. }
        | Optimizer::Nadam { beta2, .. } = &mut self
        {
            *beta2 = value;
        }
        self
    }

    /// Sets Adam's, AdaGrad's, RMSProp's, AdaDelta's or FTML's epsilon (no effect on the
    /// others).
    pub fn epsilon(mut self, value: f64) -> Optimizer {
        if let Optimizer::Adam { epsilon, .. }
        | Optimizer::AdaGrad { epsilon, .. }
        | Optimizer::RmsProp { epsilon, .. }
        | Optimizer::RmsPropCentered { epsilon, .. }
        | Optimizer::AdaDelta { epsilon, .. }
        | Optimizer::Ftml { epsilon, .. }
        | Optimizer::Nadam { epsilon, .. } = &mut self
        {
            *epsilon = value;
        }
        self
    }

    /// Sets RMSProp's decay of its averages (no effect on the others).
    pub fn gamma1(mut self, value: f64) -> Optimizer {
        if let Optimizer::RmsProp { gamma1, .. } | Optimizer::RmsPropCentered { gamma1, .. } =
            &mut self
        {
            *gamma1 = value;
        }
        self
    }

    /// Clips RMSProp's updated weights to `[-value, value]` (0 or less: no clipping; no
    /// effect on the others).
    pub fn clip_weights(mut self, value: f64) -> Optimizer {
        if let Optimizer::RmsProp { clip_weights, .. }
        | Optimizer::RmsPropCentered { clip_weights, .. } = &mut self
        {
            *clip_weights = value;
        }
        self
    }

    /// Sets AdaDelta's decay of its averages (no effect on the others).
    pub fn rho(mut self, value: f64) -> Optimizer {
        if let Optimizer::AdaDelta { rho, .. } = &mut self {
            *rho = value;
        }
        self
    }

    /// Sets Signum's decoupled weight decay (no effect on the others).
    pub fn wd_lh(mut self, value: f64) -> Optimizer {
        if let Optimizer::Signum { wd_lh, .. } = &mut self {
            *wd_lh = value;
        }
        self
    }

    /// Sets FTRL's L1 regularisation (no effect on the others).
    pub fn lamda1(mut self, value: f64) -> Optimizer {
        if let Optimizer::Ftrl { lamda1, .. } = &mut self {
            *lamda1 = value;
        }
        self
    }

    /// Sets FTRL's `beta` (no effect on the others).
    pub fn beta(mut self, value: f64) -> Optimizer {
        if let Optimizer::Ftrl { beta, .. } = &mut self {
            *beta = value;
        }
        self
    }

    /// Makes RMSProp Graves's centered version ([`Optimizer::RmsPropCentered`], its momentum
    /// `gamma2` 0.9, MXNet's default, until set) or, with `false`, Tieleman and Hinton's; its
    /// other parameters kept (no effect on the others).
    pub fn centered(self, value: bool) -> Optimizer {
        match self {
            Optimizer::RmsProp {
                lr,
                gamma1,
                epsilon,
                wd,
                rescale_grad,
                clip_gradient,
                clip_weights,
            } if value => Optimizer::RmsPropCentered {
                lr,
                gamma1,
                gamma2: 0.9,
                epsilon,
                wd,
                rescale_grad,
                clip_gradient,
                clip_weights,
            },
            Optimizer::RmsPropCentered {
                lr,
                gamma1,
                epsilon,
                wd,
                rescale_grad,
                clip_gradient,
                clip_weights,
                ..
            } if !value => Optimizer::RmsProp {
                lr,
                gamma1,
                epsilon,
                wd,
                rescale_grad,
                clip_gradient,
                clip_weights,
            },
            other => other,
        }
    }

    /// Sets centered RMSProp's momentum of the steps (no effect on the others, RMSProp not
    /// centered included).
    pub fn gamma2(mut self, value: f64) -> Optimizer {
        if let Optimizer::RmsPropCentered { gamma2, .. } = &mut self {
            *gamma2 = value;
        }
        self
    }

    /// The parameters every optimizer has, whatever its kind.
    pub(crate) fn common(&mut self) -> Common<'_> {
        match self {
            Optimizer::Sgd {
                lr,
                wd,
                rescale_grad,
                clip_gradient,
                ..
            }
            | Optimizer::Nag {
                lr,
                wd,
                rescale_grad,
                clip_gradient,
                ..
            }
            | Optimizer::Adam {
                lr,
                wd,
                rescale_grad,
                clip_gradient,
                ..
            }
            | Optimizer::AdaGrad {
                lr,
                wd,
                rescale_grad,
                clip_gradient,
                ..
            }
            | Optimizer::RmsProp {
                lr,
                wd,
                rescale_grad,
                clip_gradient,
                ..
            }
            | Optimizer::RmsPropCentered {
                lr,
                wd,
                rescale_grad,
                clip_gradient,
                ..
            }
            | Optimizer::AdaDelta {
                lr,
                wd,
                rescale_grad,
                clip_gradient,
                ..
            }
            | Optimizer::Ftml {
                lr,
                wd,
                rescale_grad,
                clip_gradient,
                ..
            }
            | Optimizer::Nadam {
                lr,
                wd,
                rescale_grad,
                clip_gradient,
                ..
            }
            | Optimizer::Adamax {
                lr,
                wd,
                rescale_grad,
                clip_gradient,
                ..
            }
            | Optimizer::Signum {
                lr,
                wd,
                rescale_grad,
                clip_gradient,
                ..
            }
            | Optimizer::Ftrl {
                lr,
                wd,
                rescale_grad,
                clip_gradient,
                ..
            } => Common {
                lr,
                wd,
                rescale_grad,
                clip_gradient,
            },
        }
    }
}

/// The parameters every optimizer has ([`Optimizer::common`]).
pub(crate) struct Common<'a> {
    pub(crate) lr: &'a mut f64,
    pub(crate) wd: &'a mut f64,
    pub(crate) rescale_grad: &'a mut f64,
    pub(crate) clip_gradient: &'a mut f64,
}
