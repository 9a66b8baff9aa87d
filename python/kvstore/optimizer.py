"""The optimizers a store runs as its updater (on the servers of a distributed store), with
MXNet's argument names: ``kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=0.1,
momentum=0.9, wd=1e-4))``. Their update rules are MXNet's ``sgd_update``,
``sgd_mom_update`` and ``adam_update``."""

from typing import Any, Dict, Optional, Tuple

__all__ = ["Optimizer", "SGD", "Adam", "create"]

# MXNet arguments that change nothing here: single-precision weights are updated in their own
# dtype, and updates are always element-wise and dense.
_IGNORED = ("multi_precision", "lazy_update", "use_fused_step", "aggregate_num", "param_idx2name",
            "param_dict", "sym", "begin_num_update")


class Optimizer:
    """The common parameters of MXNet's optimizers: ``learning_rate``, ``wd`` (weight decay),
    ``rescale_grad`` (a factor applied to gradients first) and ``clip_gradient``."""

    name = ""

    def __init__(self, learning_rate: Optional[float] = None, wd: float = 0.0,
                 rescale_grad: float = 1.0, clip_gradient: Optional[float] = None,
                 lr_scheduler: Any = None, **kwargs: Any) -> None:
        if lr_scheduler is not None:
            raise TypeError("lr_scheduler is not supported: set a new optimizer to change "
                            "the learning rate")
        unknown = [k for k in kwargs if k not in _IGNORED]
        if unknown:
            raise TypeError(f"{type(self).__name__} got unexpected arguments: {unknown}")
        self.learning_rate = float(self._default_lr if learning_rate is None else learning_rate)
        self.wd = float(wd)
        self.rescale_grad = float(rescale_grad)
        self.clip_gradient = None if clip_gradient is None else float(clip_gradient)

    _default_lr = 0.01

    @property
    def lr(self) -> float:
        return self.learning_rate

    def _params(self) -> Dict[str, Optional[float]]:
        return {"learning_rate": self.learning_rate, "wd": self.wd,
                "rescale_grad": self.rescale_grad, "clip_gradient": self.clip_gradient}

    def _kvstore_spec(self) -> Tuple[str, Dict[str, Optional[float]]]:
        return self.name, self._params()

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._params().items())
        return f"{type(self).__name__}({args})"


class SGD(Optimizer):
    """Stochastic gradient descent, with momentum when ``momentum`` > 0."""

    name = "sgd"

    def __init__(self, learning_rate: Optional[float] = None, momentum: float = 0.0,
                 **kwargs: Any) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.momentum = float(momentum)

    def _params(self) -> Dict[str, Optional[float]]:
        return {**super()._params(), "momentum": self.momentum}


class Adam(Optimizer):
    """Adam, with MXNet's bias-corrected learning rate."""

    name = "adam"
    _default_lr = 0.001

    def __init__(self, learning_rate: Optional[float] = None, beta1: float = 0.9,
                 beta2: float = 0.999, epsilon: float = 1e-8, **kwargs: Any) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.beta1 = float(beta1)
        self.beta2 = float(beta2)
        self.epsilon = float(epsilon)

    def _params(self) -> Dict[str, Optional[float]]:
        return {**super()._params(), "beta1": self.beta1, "beta2": self.beta2,
                "epsilon": self.epsilon}


def create(name: str, **kwargs: Any) -> Optimizer:
    """An optimizer by MXNet's name: ``create('sgd', learning_rate=0.1)``."""
    kinds = {"sgd": SGD, "adam": Adam}
    if name.lower() not in kinds:
        raise ValueError(f"unknown optimizer {name!r}; kvstore runs {sorted(kinds)}")
    return kinds[name.lower()](**kwargs)
