"""The optimizers a store runs as its updater (on the servers of a distributed store), with
MXNet 1.9's constructors: ``kv.set_optimizer(kvstore.optimizer.SGD(momentum=0.9,
learning_rate=0.1, wd=1e-4))``. Their update rules are MXNet's ``sgd_update``,
``sgd_mom_update``, ``nag_mom_update``, ``adam_update``, its ``AdaGrad``'s dense update,
``rmsprop_update`` and ``rmspropalex_update``, its ``AdaDelta``'s and ``Adamax``'s updates, ``signum_update`` and
``signsgd_update``, ``ftrl_update``, ``ftml_update`` and its ``Nadam``'s update.

As in MXNet, a local store runs the optimizer object it was given: a change to its parameters
afterwards (``set_learning_rate``, or ``opt.wd = ...``) applies from the next update on, and
the optimizer's state (momentum, moments) is kept. A distributed store's servers keep the
parameters ``set_optimizer`` sent them, as MXNet's do.

Per-parameter multipliers are MXNet's: ``set_lr_mult`` and ``set_wd_mult`` take a dict from
a key (an int, or a str, or a parameter's name that ``param_idx2name`` gives an int key) to a
factor of the learning rate or the weight decay, and with ``param_idx2name`` the parameters
whose names end in neither ``_weight`` nor ``_gamma`` get no weight decay (a ``wd_mult`` of 0),
as in MXNet. They travel to the servers with the optimizer.

A learning-rate scheduler (``lr_scheduler``, one of ``kvstore.lr_scheduler``'s, which are
MXNet's) runs where the optimizer runs, given ``num_update`` (the most updates any key has
had, counted from ``begin_num_update``) at every update, as in MXNet; so does Adam's bias
correction, from ``begin_num_update`` too.

``multi_precision=True`` is MXNet's: a float16 (here also bfloat16) key keeps a float32 master
copy of its weight, made at the key's first update; the update runs on the copy, and the
weight is the copy rounded (the copy is saved with the optimizer's states).

What MXNet's constructors take but kvstore cannot honour is refused with a ``ValueError``
rather than ignored: multipliers from a symbol or a parameter dict (``sym``, ``param_dict``);
a scheduler of your own (one that overrides ``__call__``) is a ``TypeError``.
"""

import math
import numbers
import os
import warnings
import weakref
from typing import Any, Dict, List, Optional, Tuple

from . import lr_scheduler as _schedulers

__all__ = ["Optimizer", "SGD", "NAG", "Adam", "AdaGrad", "RMSProp", "AdaDelta", "Adamax",
           "Signum", "Ftrl", "FTML", "Nadam", "create", "Updater", "get_updater"]

# The parameters a store's optimizer reads at each update: a change to one is sent to the
# local stores running this optimizer.
_TUNABLE = ("lr", "wd", "rescale_grad", "clip_gradient", "momentum", "beta1", "beta2",
            "epsilon", "float_stable_eps", "gamma1", "gamma2", "centered", "clip_weights", "rho",
            "wd_lh", "lamda1", "beta", "schedule_decay", "multi_precision", "begin_num_update",
            "lr_mult", "wd_mult", "idx2name", "lr_scheduler")
_UNSET = object()
# The dicts MXNet's optimizers read at each update: changed in place, they are sent too.
_WATCHED = ("lr_mult", "wd_mult", "idx2name")
# MXNet's hooks that a built-in optimizer's rule (run in Rust, from the parameters) never
# calls: a subclass that overrides one without a rule of its own (``update``) is refused,
# not run as if it had not.
_RULE_HOOKS = ("_get_lrs", "_get_lr", "_get_wds", "_get_wd", "_update_count", "_update_impl")
# Where a class of your own's rule may start besides update: MXNet's Updater calls these.
_OWN_RULE = ("update_multi_precision", "create_state_multi_precision")


_NO_PARAMS = ("multipliers read from a symbol or a parameter dict (sym, sym_info, param_dict) "
              "are not supported: use set_lr_mult and set_wd_mult")


class _NoParams(dict):
    """An optimizer's ``param_dict``: empty, and refusing entries (changed in place as it is
    assigned), since a built-in rule would never read them."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise ValueError(_NO_PARAMS)

    __setitem__ = update = setdefault = __ior__ = _refuse  # type: ignore[assignment]


class _Watched(dict):
    """A dict of an optimizer's that tells the optimizer when it is changed in place (MXNet
    reads ``lr_mult``, ``wd_mult`` and ``idx2name`` at each update)."""

    def __init__(self, owner: "Optimizer", name: str, items: Dict[Any, Any]) -> None:
        super().__init__(items)
        self._owner = weakref.ref(owner)
        self._name = name

    def _changed(self, old: Dict[Any, Any]) -> None:
        owner = self._owner()
        if owner is not None:
            owner._dict_changed(self, old)


def _watching(method: str) -> Any:
    def changed(self: _Watched, *args: Any, **kwargs: Any) -> Any:
        old = dict(self)
        try:
            out = getattr(dict, method)(self, *args, **kwargs)
        except BaseException:
            # A change that failed part way is undone.
            dict.clear(self)
            dict.update(self, old)
            raise
        self._changed(old)
        return out
    changed.__name__ = method
    return changed


for _m in ("__setitem__", "__delitem__", "update", "pop", "popitem", "clear", "setdefault",
           "__ior__"):
    setattr(_Watched, _m, _watching(_m))


class Optimizer:
    """The common parameters of MXNet's optimizers, in MXNet's order: ``rescale_grad`` (a factor
    applied to gradients first), ``param_idx2name``, ``wd`` (weight decay), ``clip_gradient``,
    ``learning_rate``, ``lr_scheduler``, ``sym``, ``begin_num_update``, ``multi_precision``,
    ``param_dict``."""

    name = ""
    # The stores (and updaters) that run this object in this process (``_stores_pid``'s).
    _stores: "weakref.WeakSet[Any]"

    def __init__(self, rescale_grad: float = 1.0, param_idx2name: Optional[Dict[int, str]] = None,
                 wd: float = 0.0, clip_gradient: Optional[float] = None,
                 learning_rate: Optional[float] = None, lr_scheduler: Any = None,
                 sym: Any = None, begin_num_update: int = 0, multi_precision: bool = False,
                 param_dict: Any = None) -> None:
        object.__setattr__(self, "_stores", weakref.WeakSet())
        _check_scheduler(lr_scheduler)
        if sym is not None or param_dict:
            raise ValueError(_NO_PARAMS)
        # Any whole number (an int, a numpy integer, 3.0), as MXNet takes it.
        whole = isinstance(begin_num_update, numbers.Integral) or (
            isinstance(begin_num_update, numbers.Real)
            and float(begin_num_update).is_integer())
        if isinstance(begin_num_update, bool) or not whole:
            raise TypeError(f"begin_num_update is a whole number, not {begin_num_update!r}")
        begin_num_update = int(begin_num_update)
        if not 0 <= begin_num_update <= 2**53:
            raise ValueError("begin_num_update must be from 0 to 2**53")
        if param_idx2name is not None and not isinstance(param_idx2name, dict):
            raise TypeError("param_idx2name should be a dict of param indexes to names")
        self.idx2name = dict(param_idx2name or {})
        self.set_lr_mult({})
        self.set_wd_mult({})
        # As MXNet: with a scheduler and no learning_rate, the scheduler's base_lr is the rate
        # to start from; a learning_rate given replaces it.
        if lr_scheduler is None and learning_rate is None:
            # MXNet's base default, whatever the class's own: Adam(learning_rate=None) is
            # 0.01, as in MXNet, where Adam passes the None on.
            learning_rate = 0.01
        if lr_scheduler is not None and learning_rate is not None:
            if lr_scheduler.base_lr != learning_rate:
                warnings.warn("learning rate from ``lr_scheduler`` has been overwritten by "
                              "``learning_rate`` in optimizer.", UserWarning, stacklevel=2)
                lr_scheduler.base_lr = learning_rate
        self.lr = None if learning_rate is None else float(learning_rate)
        self.wd = float(wd)
        self.rescale_grad = float(rescale_grad)
        self.clip_gradient = None if clip_gradient is None else float(clip_gradient)
        self.lr_scheduler = lr_scheduler
        self.begin_num_update = begin_num_update
        self._num_update = begin_num_update
        self.multi_precision = bool(multi_precision)
        # MXNet's other attributes, as its constructor sets them. aggregate_num is 0: an
        # updater here calls an optimizer of your own key by key, never with lists. The counts
        # of an optimizer of your own are kept here; a built-in one's, where it runs.
        self.aggregate_num = 0
        self.sym_info = ()
        self.param_dict: Dict[Any, Any] = _NoParams()
        self.allow_np_array = False
        self._index_update_count: Dict[Any, int] = {}
        self._all_index_update_counts = {0: self._index_update_count}

    @property
    def num_update(self) -> int:
        """The most updates any key has had (MXNet's ``num_update``): from a local store that
        runs this optimizer, as it counts them; otherwise ``begin_num_update`` (a distributed
        store's servers count their own, as MXNet's do)."""
        counts = [store._optimizer_num_update(self) for store in self._live_stores()]
        return max([self._num_update, *counts])

    @num_update.setter
    def num_update(self, n: int) -> None:
        self._num_update = n

    @property
    def learning_rate(self) -> float:
        """The learning rate (as MXNet's property): the scheduler's at ``num_update``, if
        there is one (which advances it, as in MXNet), else the one ``set_learning_rate``
        set."""
        if self.lr_scheduler is not None:
            return self.lr_scheduler(self.num_update)
        assert self.lr is not None  # (None only where a scheduler gives the rate)
        return self.lr

    def set_learning_rate(self, lr: float) -> None:
        """Sets a new learning rate, used from the next update on by the local stores running
        this optimizer. With a scheduler it raises a UserWarning and changes nothing, as
        MXNet's does."""
        if self.lr_scheduler is not None:
            raise UserWarning("LRScheduler of the optimizer has already been defined. Note "
                              "that set_learning_rate can mutate the value of the learning "
                              "rate of the optimizer only when the LRScheduler of the "
                              "optimizer is undefined.")
        self.lr = float(lr)

    def set_lr_mult(self, args_lr_mult: Dict[Any, float]) -> None:
        """Sets the learning rate's factor per key or parameter name (MXNet's
        ``set_lr_mult``), replacing the earlier ones."""
        self.lr_mult = _mults(args_lr_mult)

    def set_lr_scale(self, args_lrscale: Any) -> None:
        """Deprecated in MXNet, which raises DeprecationWarning (use ``set_lr_mult``)."""
        raise DeprecationWarning

    def set_wd_mult(self, args_wd_mult: Dict[Any, float]) -> None:
        """Sets the weight decay's factor per key or parameter name (MXNet's ``set_wd_mult``),
        replacing the earlier ones: the parameters ``param_idx2name`` names that end in neither
        ``_weight`` nor ``_gamma`` get 0 unless ``args_wd_mult`` says otherwise."""
        wd = {n: 0.0 for n in self.idx2name.values()
              if not (n.endswith("_weight") or n.endswith("_gamma"))}
        wd.update(_mults(args_wd_mult))
        self.wd_mult = wd

    def _mult_of(self, mults: Dict[Any, float], key: Any) -> float:
        # MXNet's _get_lr and _get_wd: the key itself, else its parameter's name.
        if key in mults:
            return mults[key]
        if key in self.idx2name:
            return mults.get(self.idx2name[key], 1.0)
        return 1.0

    def _key_mults(self) -> Dict[Any, Tuple[float, float]]:
        """Each key some multiplier may apply to, with its factors (lr, wd)."""
        keys = set(self.lr_mult) | set(self.wd_mult) | set(self.idx2name)
        out = {}
        for k in keys:
            if isinstance(k, bool) or not isinstance(k, (numbers.Integral, str)):
                raise TypeError(f"a multiplier's key is an int or a str, not {k!r}")
            m = (float(self._mult_of(self.lr_mult, k)), float(self._mult_of(self.wd_mult, k)))
            if not all(math.isfinite(x) for x in m):
                raise ValueError(f"key {k!r}: multipliers must be finite, not {m}")
            if m != (1.0, 1.0):
                out[k if isinstance(k, str) else int(k)] = m
        return out

    def _dict_changed(self, d: _Watched, old: Dict[Any, Any]) -> None:
        """One of the watched dicts changed in place: the stores running this optimizer take
        it, or the change is undone and the error raised."""
        try:
            for store in self._live_stores():
                store._retune_optimizer(self)
        except BaseException:
            dict.clear(d)
            dict.update(d, old)
            for store in self._live_stores():
                store._retune_optimizer(self)
            raise

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "lr_scheduler":
            _check_scheduler(value)
        if name in ("param_dict", "sym_info") and value:
            # As the constructor refuses them: a built-in rule would never read them.
            raise ValueError(_NO_PARAMS)
        if name == "param_dict":
            value = _NoParams()
        if name in _WATCHED:
            if not isinstance(value, dict):
                raise TypeError(f"{name} is a dict")
            if value is self.__dict__.get(name):
                return  # `opt.lr_mult |= {...}` assigns the dict it changed in place
            value = _Watched(self, name, value)
        if name not in _TUNABLE:
            object.__setattr__(self, name, value)
            return
        old = self.__dict__.get(name, _UNSET)
        object.__setattr__(self, name, value)
        try:
            for store in self._live_stores():
                store._retune_optimizer(self)
        except BaseException:
            # A value the stores refuse is not kept: the object stays what they run.
            if old is _UNSET:
                object.__delattr__(self, name)
            else:
                object.__setattr__(self, name, old)
                for store in self._live_stores():
                    store._retune_optimizer(self)
            raise
        if name == "lr_scheduler":
            # The scheduler tells this optimizer's stores of its changes (as MXNet's optimizer
            # calls the object itself at every update).
            if old is not _UNSET and old is not None and old is not value:
                old._disowned_by(self)
            if value is not None:
                value._owned_by(self)

    def __getstate__(self) -> Dict[str, Any]:
        # A copy (copy, deepcopy, pickle) runs in no store, and its dicts are its own.
        return {k: (dict(v) if k in _WATCHED else v) for k, v in self.__dict__.items()
                if k not in ("_stores", "_stores_pid")}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        object.__setattr__(self, "_stores", weakref.WeakSet())
        for k, v in state.items():
            object.__setattr__(self, k, _Watched(self, k, v) if k in _WATCHED else v)
        if state.get("lr_scheduler") is not None:
            state["lr_scheduler"]._owned_by(self)

    # MXNet's extension point: an optimizer of your own subclasses Optimizer (or one of the
    # built-in ones), defines ``create_state`` and ``update`` on numpy arrays, and may be
    # registered by name. The store runs it in Python (as an updater); the built-in ones run
    # in Rust.
    opt_registry: Dict[str, Any] = {}

    @staticmethod
    def register(klass: Any) -> Any:
        """Registers an optimizer class under its lower-case name, for ``create_optimizer``
        (MXNet's ``Optimizer.register``, a decorator); one that replaces another is warned of."""
        if not isinstance(klass, type):
            raise TypeError("register takes an optimizer class")
        name = klass.__name__.lower()
        if name in Optimizer.opt_registry:
            warnings.warn(f"WARNING: New optimizer {klass.__module__}.{klass.__name__} is "
                          f"overriding existing optimizer "
                          f"{Optimizer.opt_registry[name].__module__}."
                          f"{Optimizer.opt_registry[name].__name__}", stacklevel=2)
        Optimizer.opt_registry[name] = klass
        return klass

    @staticmethod
    def create_optimizer(name: str, **kwargs: Any) -> "Optimizer":
        """An optimizer of a registered class by its name, in any case (MXNet's
        ``Optimizer.create_optimizer``)."""
        if name.lower() in Optimizer.opt_registry:
            return Optimizer.opt_registry[name.lower()](**kwargs)
        raise ValueError(f"Cannot find optimizer {name}")

    def create_state(self, index: Any, weight: Any) -> Any:
        """An optimizer of your own: the state of parameter ``index`` (MXNet's; none here)."""
        return None

    def update(self, index: Any, weight: Any, grad: Any, state: Any) -> None:
        """An optimizer of your own: updates ``weight`` (a numpy array) in place from
        ``grad``."""
        raise NotImplementedError()

    def create_state_multi_precision(self, index: Any, weight: Any) -> Any:
        """As MXNet's: with ``multi_precision``, a float16 weight's state is a float32 master
        copy and the state made for it."""
        import numpy as np
        if self.multi_precision and weight.dtype == np.float16:
            master = weight.astype(np.float32)
            return (master, self.create_state(index, master))
        if weight.dtype == np.float16:
            warnings.warn("Accumulating with float16 in optimizer can lead to poor accuracy or "
                          "slow convergence. Consider using multi_precision=True option of the "
                          "optimizer", stacklevel=2)
        return self.create_state(index, weight)

    def update_multi_precision(self, index: Any, weight: Any, grad: Any, state: Any) -> None:
        """As MXNet's: with ``multi_precision``, a float16 weight is updated through its
        float32 master copy."""
        import numpy as np
        if self.multi_precision and weight.dtype == np.float16:
            master, inner = state
            self.update(index, master, grad.astype(np.float32), inner)
            weight[...] = master.astype(np.float16)
        else:
            self.update(index, weight, grad, state)

    def _set_current_context(self, device_id: int) -> None:
        """Counts updates per device from now on (MXNet's, which its Updater calls for each
        array's device): ``device_id``'s counts are the ones ``_update_count`` moves."""
        counts = self.__dict__.setdefault("_all_index_update_counts", {})
        self._index_update_count = counts.setdefault(device_id, {})

    def _update_count(self, index: Any) -> None:
        """Counts an update of each index (MXNet's): ``num_update`` is the most any has had."""
        counts = self.__dict__.setdefault("_index_update_count", {})
        for i in index if isinstance(index, (list, tuple)) else [index]:
            counts[i] = counts.get(i, self.begin_num_update) + 1
            self._num_update = max(counts[i], self._num_update)

    def _get_lrs(self, indices: Any) -> Any:
        lr = self.learning_rate
        return [lr * self._mult_of(self.lr_mult, i) for i in indices]

    def _get_lr(self, index: Any) -> float:
        """The learning rate of ``index`` (MXNet's): the scheduler's at ``num_update`` or
        ``lr``, times its ``lr_mult``."""
        return self._get_lrs([index])[0]

    def _get_wds(self, indices: Any) -> Any:
        return [self.wd * self._mult_of(self.wd_mult, i) for i in indices]

    def _get_wd(self, index: Any) -> float:
        """The weight decay of ``index`` (MXNet's): ``wd`` times its ``wd_mult``."""
        return self._get_wds([index])[0]

    def _custom(self) -> bool:
        """Whether this optimizer's rule is its own (it defines ``update``, ``create_state``
        or their ``_multi_precision`` forms), which the store runs in Python, not a built-in
        one's. A TypeError where it overrides a hook the built-in rule would not call."""
        t = type(self)
        if t.update is not Optimizer.update or t.create_state is not Optimizer.create_state:
            return True
        if not any(c in _RUST_RULES for c in t.__mro__):
            # A class of your own on Optimizer: its rule may start at update_multi_precision,
            # which MXNet's Updater calls.
            return any(getattr(t, m) is not getattr(Optimizer, m) for m in _OWN_RULE)
        # A built-in's subclass: its super().update would be the Rust rule's, which is not in
        # Python, and the Rust rule calls none of MXNet's hooks.
        ignored = [m for m in _RULE_HOOKS + _OWN_RULE
                   if getattr(t, m, None) is not getattr(Optimizer, m, None)]
        if ignored:
            raise TypeError(
                f"{t.__name__} overrides {', '.join(ignored)}, which the built-in "
                f"{self.name!r} rule does not call (it runs in Rust, from the optimizer's "
                "parameters): set lr_mult, wd_mult or the parameters instead, or define "
                "update (and create_state) to run a rule of your own")
        return False

    def _attached_to(self, store: Any) -> None:
        """Called by a local store's ``set_optimizer``: the store runs this optimizer."""
        if self.__dict__.get("_stores_pid") != os.getpid():
            # The stores a parent attached are no child's (made by fork): forgotten here.
            object.__setattr__(self, "_stores", weakref.WeakSet())
            object.__setattr__(self, "_stores_pid", os.getpid())
        self._stores.add(store)

    def _live_stores(self) -> List[Any]:
        """The stores that run this optimizer in this process: none in a child made by fork,
        where its parent's refuse every call (the child reads and sets the object alone)."""
        if self.__dict__.get("_stores_pid") != os.getpid():
            return []
        return list(self._stores)

    def _params(self) -> Dict[str, Optional[float]]:
        return {"learning_rate": self.lr, "wd": self.wd,
                "rescale_grad": self.rescale_grad, "clip_gradient": self.clip_gradient}

    def _kvstore_spec(self) -> Tuple[str, Dict[str, Any], Dict[Any, Tuple[float, float]]]:
        params: Dict[str, Any] = dict(self._params())
        params["begin_num_update"] = self.begin_num_update
        params["multi_precision"] = bool(self.multi_precision)
        if self.lr_scheduler is not None:
            # The scheduler as far as the stores running it have taken it (a store given an
            # older state would step back to it).
            self.lr_scheduler._catch_up()
            # The rate to start from is the scheduler's (which a learning_rate given at
            # construction replaced).
            params["learning_rate"] = self.lr_scheduler.base_lr
            params["lr_scheduler"] = self.lr_scheduler._spec()
        return self.name, params, self._key_mults()

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._params().items())
        return f"{type(self).__name__}({args})"


def _check_scheduler(s: Any) -> None:
    if s is not None and not _schedulers._runnable(s):
        raise TypeError("lr_scheduler is one of kvstore.lr_scheduler's schedulers "
                        "(FactorScheduler, MultiFactorScheduler, PolyScheduler, "
                        "CosineScheduler), whose rule the store runs; not "
                        f"{type(s).__name__}")


def _mults(d: Any) -> Dict[Any, float]:
    # A dict, or what dict() takes (pairs), as MXNet's dict.update takes them.
    if not isinstance(d, dict):
        try:
            d = dict(d)
        except (TypeError, ValueError):
            raise TypeError("multipliers are a dict (or pairs) of keys or parameter names to "
                            "factors") from None
    return {k: float(v) for k, v in d.items()}


# MXNet's optimizers, whose rules kvstore runs (their constructors in _builtins.py).
from ._builtins import (SGD, NAG, Adam, AdaGrad, RMSProp, AdaDelta, Adamax,  # noqa: E402
                        Signum, Ftrl, FTML, Nadam, ccSGD, Test)

for _k in (SGD, NAG, Adam, AdaGrad, RMSProp, AdaDelta, Adamax, Signum, Ftrl, FTML, Nadam, ccSGD,
           Test):
    Optimizer.opt_registry[_k.__name__.lower()] = _k

register = Optimizer.register


def create(name: str, **kwargs: Any) -> Optimizer:
    """An optimizer by MXNet's name, or a class registered with ``register``:
    ``create('sgd', learning_rate=0.1)`` (MXNet's ``optimizer.create``)."""
    if name.lower() not in Optimizer.opt_registry:
        raise ValueError(f"unknown optimizer {name!r}; kvstore runs "
                         f"{sorted(Optimizer.opt_registry)}")
    return Optimizer.create_optimizer(name, **kwargs)


# MXNet's Updater and get_updater live in this module; their code, in _updater.py.
from ._updater import Updater, _updater_of_states, get_updater  # noqa: E402

# The built-ins whose rules run in Rust (Test's runs in Python).
_RUST_RULES = frozenset((SGD, NAG, Adam, AdaGrad, RMSProp, AdaDelta, Adamax, Signum, Ftrl, FTML,
                         Nadam, ccSGD))

# They read as this module's, where MXNet has them (and pickles name them by it).
for _named in (SGD, NAG, Adam, AdaGrad, RMSProp, AdaDelta, Adamax, Signum, Ftrl, FTML, Nadam,
               ccSGD, Test, Updater, _updater_of_states, get_updater):
    _named.__module__ = __name__
