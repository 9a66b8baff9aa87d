"""MXNet's optimizers, as ``kvstore.optimizer`` gives them: their constructors, with MXNet
1.9's arguments and defaults, and the parameters each sends to the store that runs its rule
(in Rust). ``ccSGD`` and ``Test`` as MXNet has them (``Test`` runs in Python)."""

from typing import Any, Dict, Optional

from .optimizer import Optimizer


class SGD(Optimizer):
    """Stochastic gradient descent, with momentum when ``momentum`` > 0 (MXNet's
    ``SGD(momentum=0.0, lazy_update=True, **kwargs)``; ``lazy_update`` concerns sparse
    gradients only, and changes nothing for dense ones)."""

    name = "sgd"

    def __init__(self, momentum: float = 0.0, lazy_update: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.momentum = float(momentum)
        self.lazy_update = lazy_update

    def _params(self) -> Dict[str, Optional[float]]:
        return {**super()._params(), "momentum": self.momentum}


class NAG(Optimizer):
    """Nesterov accelerated gradient (MXNet's ``NAG(momentum=0.0, **kwargs)``, its
    ``nag_mom_update``, a momentum that is not positive taken as 0). As MXNet's, a key whose
    momentum was 0 at its first update has no momentum state and takes plain SGD steps; a
    positive momentum set later fails its updates, as MXNet's ``sgd_update`` refuses it."""

    name = "nag"

    def __init__(self, momentum: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.momentum = float(momentum)

    def _params(self) -> Dict[str, Optional[float]]:
        return {**super()._params(), "momentum": self.momentum}


class Adam(Optimizer):
    """Adam, with MXNet's bias-corrected learning rate (MXNet's ``Adam(learning_rate=0.001,
    beta1=0.9, beta2=0.999, epsilon=1e-8, lazy_update=True, **kwargs)``)."""

    name = "adam"

    def __init__(self, learning_rate: float = 0.001, beta1: float = 0.9, beta2: float = 0.999,
                 epsilon: float = 1e-8, lazy_update: bool = True, **kwargs: Any) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.beta1 = float(beta1)
        self.beta2 = float(beta2)
        self.epsilon = float(epsilon)
        self.lazy_update = lazy_update

    def _params(self) -> Dict[str, Optional[float]]:
        return {**super()._params(), "beta1": self.beta1, "beta2": self.beta2,
                "epsilon": self.epsilon}


class AdaGrad(Optimizer):
    """AdaGrad (MXNet's ``AdaGrad(eps=1e-7, **kwargs)``, its dense update): the squared
    gradients summed into a history; ``weight += (grad / sqrt(history + eps) + wd * weight) *
    -lr``. Its update runs on the host. A ``clip_gradient`` of 0 or less clips nothing, as in
    MXNet's other optimizers (MXNet's AdaGrad would clip every gradient to 0)."""

    name = "adagrad"

    def __init__(self, eps: float = 1e-7, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.float_stable_eps = float(eps)

    def _params(self) -> Dict[str, Optional[float]]:
        return {**super()._params(), "eps": self.float_stable_eps}


class RMSProp(Optimizer):
    """RMSProp (MXNet's ``RMSProp(learning_rate=0.001, gamma1=0.9, gamma2=0.9, epsilon=1e-8,
    centered=False, clip_weights=None, **kwargs)``): Tieleman and Hinton's
    (``rmsprop_update``), or with ``centered=True`` Graves's (``rmspropalex_update``), which
    alone uses ``gamma2``. A store running one version cannot take on the other's state:
    ``centered`` changed on an optimizer a store runs is refused (``set_optimizer`` starts
    afresh). Its update runs on the host."""

    name = "rmsprop"

    def __init__(self, learning_rate: float = 0.001, gamma1: float = 0.9, gamma2: float = 0.9,
                 epsilon: float = 1e-8, centered: bool = False,
                 clip_weights: Optional[float] = None, **kwargs: Any) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.gamma1 = float(gamma1)
        self.gamma2 = float(gamma2)
        self.epsilon = float(epsilon)
        self.centered = centered
        self.clip_weights = None if clip_weights is None else float(clip_weights)

    def _params(self) -> Dict[str, Any]:
        return {**super()._params(), "gamma1": self.gamma1, "gamma2": self.gamma2,
                "epsilon": self.epsilon, "centered": bool(self.centered),
                "clip_weights": self.clip_weights}


class AdaDelta(Optimizer):
    """AdaDelta, Zeiler's (MXNet's ``AdaDelta(rho=0.90, epsilon=1e-5, **kwargs)``, its
    update): ``acc_g = rho * acc_g + (1 - rho) * g * g``; ``delta = sqrt(acc_delta + epsilon)
    / sqrt(acc_g + epsilon) * g``; ``acc_delta = rho * acc_delta + (1 - rho) * delta * delta``;
    ``weight -= delta + wd * weight``, ``g`` being the rescaled, clipped gradient. Its rule has
    no learning rate. A ``clip_gradient`` of 0 or less clips nothing, as in MXNet's other
    optimizers (MXNet's AdaDelta would clip every gradient to 0). Its update runs on the
    host."""

    name = "adadelta"

    def __init__(self, rho: float = 0.90, epsilon: float = 1e-5, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.rho = float(rho)
        self.epsilon = float(epsilon)

    def _params(self) -> Dict[str, Optional[float]]:
        return {**super()._params(), "rho": self.rho, "epsilon": self.epsilon}


class Adamax(Optimizer):
    """Adamax, Adam with the infinity norm (MXNet's ``Adamax(learning_rate=0.002, beta1=0.9,
    beta2=0.999, **kwargs)``, its update): ``u = max(beta2 * u, |g|)``, ``weight -= lr / (1 -
    beta1**t) * m / u`` (a weight whose every gradient so far was 0 becomes NaN, as in MXNet).
    A ``clip_gradient`` of 0 or less clips nothing (MXNet's Adamax would clip every gradient
    to 0). Its update runs on the host."""

    name = "adamax"

    def __init__(self, learning_rate: float = 0.002, beta1: float = 0.9, beta2: float = 0.999,
                 **kwargs: Any) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.beta1 = float(beta1)
        self.beta2 = float(beta2)

    def _params(self) -> Dict[str, Optional[float]]:
        return {**super()._params(), "beta1": self.beta1, "beta2": self.beta2}


class FTML(Optimizer):
    """FTML, Follow the Moving Leader (MXNet's ``FTML(beta1=0.6, beta2=0.999, epsilon=1e-8,
    **kwargs)``, its ``ftml_update``). Its update runs on the host."""

    name = "ftml"

    def __init__(self, beta1: float = 0.6, beta2: float = 0.999, epsilon: float = 1e-8,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.beta1 = float(beta1)
        self.beta2 = float(beta2)
        self.epsilon = float(epsilon)

    def _params(self) -> Dict[str, Optional[float]]:
        return {**super()._params(), "beta1": self.beta1, "beta2": self.beta2,
                "epsilon": self.epsilon}


class Nadam(Optimizer):
    """Nadam, Adam with Nesterov momentum (MXNet's ``Nadam(learning_rate=0.001, beta1=0.9,
    beta2=0.999, epsilon=1e-8, schedule_decay=0.004, **kwargs)``, its update). As in MXNet,
    its momentum schedule (``m_schedule``) is one product over every update the store's
    optimizer makes, whatever the key (a local store updates a call's keys in order of their
    numbers, as MXNet's); it lives where the optimizer runs (a distributed store's servers
    each keep their own, as MXNet's), not on this object. A ``clip_gradient`` of 0 or less
    clips nothing (MXNet's Nadam would clip every gradient to 0). Its update runs on the
    host."""

    name = "nadam"

    def __init__(self, learning_rate: float = 0.001, beta1: float = 0.9, beta2: float = 0.999,
                 epsilon: float = 1e-8, schedule_decay: float = 0.004, **kwargs: Any) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.beta1 = float(beta1)
        self.beta2 = float(beta2)
        self.epsilon = float(epsilon)
        self.schedule_decay = float(schedule_decay)

    def _params(self) -> Dict[str, Optional[float]]:
        return {**super()._params(), "beta1": self.beta1, "beta2": self.beta2,
                "epsilon": self.epsilon, "schedule_decay": self.schedule_decay}


class Signum(Optimizer):
    """Signum, the sign of a momentum (MXNet's ``Signum(learning_rate=0.01, momentum=0.9,
    wd_lh=0.0, **kwargs)``, its ``signum_update``; with ``momentum=0``, ``signsgd_update``,
    the sign of the gradient itself, without the rescale, the clip or ``wd_lh``). As in MXNet,
    a key keeps a momentum state where the momentum was not 0 at its first update, and runs
    ``signum_update`` from then on (a momentum of 0 or less is none in the kernel); a key
    without runs ``signsgd_update``, which refuses a momentum or ``wd_lh`` (an error at
    ``set_optimizer``, or at such a key's update after a change). Its update runs on the
    host."""

    name = "signum"

    def __init__(self, learning_rate: float = 0.01, momentum: float = 0.9, wd_lh: float = 0.0,
                 **kwargs: Any) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.momentum = float(momentum)
        self.wd_lh = float(wd_lh)

    def _params(self) -> Dict[str, Optional[float]]:
        return {**super()._params(), "momentum": self.momentum, "wd_lh": self.wd_lh}


class Ftrl(Optimizer):
    """FTRL-proximal (MXNet's ``Ftrl(lamda1=0.01, learning_rate=0.1, beta=1, **kwargs)``, its
    ``ftrl_update``). As in MXNet, ``learning_rate`` sets ``lr`` after the common parameters:
    a scheduler's ``base_lr`` is not replaced by it. Its update runs on the host."""

    name = "ftrl"

    def __init__(self, lamda1: float = 0.01, learning_rate: float = 0.1, beta: float = 1,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.lamda1 = float(lamda1)
        self.beta = float(beta)
        self.lr = float(learning_rate)

    def _params(self) -> Dict[str, Optional[float]]:
        return {**super()._params(), "lamda1": self.lamda1, "beta": self.beta}


class ccSGD(SGD):
    """[Deprecated in MXNet] Same as ``SGD``, kept for code that names it (MXNet's)."""


class Test(Optimizer):
    """MXNet's ``Test`` optimizer: ``weight += rescale_grad * grad``, its state a copy of the
    weight. An optimizer of MXNet's own written as yours would be, run in Python."""

    def create_state(self, index: Any, weight: Any) -> Any:
        import numpy as np
        return np.zeros(weight.shape, dtype=weight.dtype)

    def update(self, index: Any, weight: Any, grad: Any, state: Any) -> None:
        weight[:] += grad * self.rescale_grad
        state[:] = weight
