//! The optimizers a store runs, each with its hyper-parameters.

/// An optimizer and its hyper-parameters. More may come: a `match` on it needs a `_` arm.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
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
    /// Nesterov accelerated gradient (MXNet's `NAG`): plain SGD without momentum.
    Nag {
        /// Learning rate.
        lr: f64,
        /// Momentum (0 for plain SGD).
        momentum: f64,
        /// Weight decay.
        wd: f64,
        /// Factor applied to the gradient first.
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
    /// AdaGrad (MXNet's `AdaGrad`, its dense update): the squared gradients summed into a
    /// history, each step divided by the root of it.
    AdaGrad {
        /// Learning rate.
        lr: f64,
        /// Added to the history under the root (MXNet's `eps`, its `float_stable_eps`).
        epsilon: f64,
        /// Weight decay (added to the divided step, as MXNet's AdaGrad does).
        wd: f64,
        /// Factor applied to the gradient first.
        rescale_grad: f64,
        /// Clip the rescaled gradient to `[-c, c]`; 0 or less for no clipping, as for the
        /// other optimizers (MXNet's AdaGrad clips at any value it is given, 0 included).
        clip_gradient: f64,
    },
    /// RMSProp, Tieleman and Hinton's (MXNet's `RMSProp` with `centered=False`, its
    /// `rmsprop_update`); Graves's centered version is [`Optimizer::RmsPropCentered`].
    RmsProp {
        /// Learning rate.
        lr: f64,
        /// Decay of the moving average of squared gradients.
        gamma1: f64,
        /// Added to the average under the root.
        epsilon: f64,
        /// Weight decay (joins the gradient before the clip).
        wd: f64,
        /// Factor applied to the gradient first.
        rescale_grad: f64,
        /// Clip the gradient (weight decay included) to `[-c, c]`; 0 or less for no clipping.
        clip_gradient: f64,
        /// Clip the updated weight to `[-c, c]`; 0 or less for no clipping.
        clip_weights: f64,
    },
    /// RMSProp, Graves's centered version (MXNet's `RMSProp` with `centered=True`, its
    /// `rmspropalex_update`): the squared gradients' average less the square of the
    /// gradients' average under the root, and a momentum of the steps.
    RmsPropCentered {
        /// Learning rate.
        lr: f64,
        /// Decay of the moving averages of gradients and of squared gradients.
        gamma1: f64,
        /// Momentum of the steps.
        gamma2: f64,
        /// Added under the root.
        epsilon: f64,
        /// Weight decay (joins the gradient before the clip).
        wd: f64,
        /// Factor applied to the gradient first.
        rescale_grad: f64,
        /// Clip the gradient (weight decay included) to `[-c, c]`; 0 or less for no clipping.
        clip_gradient: f64,
        /// Clip the updated weight to `[-c, c]`; 0 or less for no clipping.
        clip_weights: f64,
    },
    /// Nadam, Adam with Nesterov momentum (MXNet's `Nadam`): its momentum schedule is one
    /// product over every update the optimizer makes (each server's own, in a distributed
    /// store, as MXNet's).
    Nadam {
        /// Learning rate.
        lr: f64,
        /// Decay of the first moment.
        beta1: f64,
        /// Decay of the second moment.
        beta2: f64,
        /// Added to the denominator.
        epsilon: f64,
        /// Decay of the momentum schedule.
        schedule_decay: f64,
        /// Weight decay (joins the gradient before the clip).
        wd: f64,
        /// Factor applied to the gradient first.
        rescale_grad: f64,
        /// Clip the gradient (weight decay included) to `[-c, c]`; 0 or less for no clipping.
        clip_gradient: f64,
    },
    /// FTML, Zheng and Kwok's Follow the Moving Leader (MXNet's `FTML`, its `ftml_update`).
    Ftml {
        /// Learning rate.
        lr: f64,
        /// Decay of the moving leader (MXNet's default 0.6).
        beta1: f64,
        /// Decay of the average of squared gradients.
        beta2: f64,
        /// Added to the root.
        epsilon: f64,
        /// Weight decay (joins the gradient before the clip).
        wd: f64,
        /// Factor applied to the gradient first.
        rescale_grad: f64,
        /// Clip the gradient (weight decay included) to `[-c, c]`; 0 or less for no clipping.
        clip_gradient: f64,
    },
    /// AdaDelta, Zeiler's (MXNet's `AdaDelta`): each step scaled by the ratio of the roots
    /// of two moving averages, of squared steps and of squared gradients. Its rule has no
    /// learning rate.
    AdaDelta {
        /// Learning rate: kept, as MXNet's optimizer keeps it, but not used by the rule.
        lr: f64,
        /// Decay of both moving averages.
        rho: f64,
        /// Added to both averages under the roots.
        epsilon: f64,
        /// Weight decay (added to the step, as MXNet's AdaDelta does).
        wd: f64,
        /// Factor applied to the gradient first.
        rescale_grad: f64,
        /// Clip the rescaled gradient to `[-c, c]`; 0 or less for no clipping.
        clip_gradient: f64,
    },
    /// Adamax (MXNet's `Adamax`): Adam with the infinity norm in place of the second moment,
    /// and the first moment's bias correction.
    Adamax {
        /// Learning rate.
        lr: f64,
        /// Decay of the first moment.
        beta1: f64,
        /// Decay of the infinity norm.
        beta2: f64,
        /// Weight decay (joins the gradient before the clip).
        wd: f64,
        /// Factor applied to the gradient first.
        rescale_grad: f64,
        /// Clip the gradient (weight decay included) to `[-c, c]`; 0 or less for no clipping.
        clip_gradient: f64,
    },
    /// Signum, Bernstein et al.'s (MXNet's `Signum`, its `signum_update`): the weight moves by
    /// the learning rate against the sign of a momentum; without momentum, signSGD
    /// (`signsgd_update`: the sign of the gradient itself).
    Signum {
        /// Learning rate.
        lr: f64,
        /// Momentum (0 for signSGD: a key whose first update has momentum 0 keeps no momentum
        /// state, and runs signSGD from then on, as in MXNet).
        momentum: f64,
        /// Weight decay (in the momentum; in signSGD, the weight's decay).
        wd: f64,
        /// Factor applied to the gradient first (not in signSGD, whose kernel ignores it).
        rescale_grad: f64,
        /// Clip the rescaled gradient to `[-c, c]`; 0 or less for no clipping.
        clip_gradient: f64,
        /// Decoupled weight decay (Loshchilov and Hutter's), outside the momentum.
        wd_lh: f64,
    },
    /// FTRL-proximal, McMahan et al.'s (MXNet's `Ftrl`, its `ftrl_update`): L1 and L2
    /// regularised, with per-coordinate rates.
    Ftrl {
        /// Learning rate.
        lr: f64,
        /// L1 regularisation.
        lamda1: f64,
        /// Per-coordinate learning rate's offset.
        beta: f64,
        /// Weight decay (L2 regularisation).
        wd: f64,
        /// Factor applied to the gradient first.
        rescale_grad: f64,
        /// Clip the rescaled gradient to `[-c, c]`; 0 or less for no clipping.
        clip_gradient: f64,
    },
}
