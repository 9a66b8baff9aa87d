"""Learning-rate schedulers with MXNet 1.9's ``mx.lr_scheduler`` constructors and rates:
``FactorScheduler``, ``MultiFactorScheduler``, ``PolyScheduler`` and ``CosineScheduler``, each
with a warm-up (``warmup_steps``, ``warmup_begin_lr``, ``warmup_mode``).

Give one to an optimizer (``kvstore.optimizer.SGD(learning_rate=0.1,
lr_scheduler=FactorScheduler(step=100, factor=0.9))``) and the store runs it at every update,
where the optimizer runs: in a local store, or on every server of a distributed one, as MXNet's
servers run the optimizer they were sent. The store runs the scheduler's rule in Rust, from
the state the object had when ``set_optimizer`` took it; calling the object yourself gives
MXNet's rates too (``scheduler(num_update)``), as the optimizer's ``learning_rate`` does.

As in MXNet, whose optimizer calls the object itself at every update, a change to the object
(``scheduler.base_lr = 0.5``, say) applies from the next update on: the object first takes
the state a local store running its optimizer has reached, then the change, and those stores
take the result. (A distributed store's servers run the copy they were sent, as MXNet's.)

A scheduler of your own (a subclass that overrides ``__call__``) cannot run in the store and
is refused by the optimizer with a TypeError.
"""

import contextlib
import math
import numbers
import operator
import threading
import weakref
from typing import Any, Dict, Iterator, List

__all__ = ["LRScheduler", "FactorScheduler", "MultiFactorScheduler", "PolyScheduler",
           "CosineScheduler"]

# One lock for every scheduler's state: a change, a rate and a catch-up each see and leave a
# whole state, whichever thread makes them. It is never held while a store is called.
_LOCK = threading.RLock()


class LRScheduler:
    """The common part of MXNet's schedulers: ``base_lr`` (the rate to start from; an
    optimizer given ``learning_rate`` replaces it) and the warm-up, which goes from
    ``warmup_begin_lr`` to the ``base_lr`` given here over ``warmup_steps`` updates
    ('linear') or stays at ``warmup_begin_lr`` ('constant')."""

    def __init__(self, base_lr: float = 0.01, warmup_steps: int = 0,
                 warmup_begin_lr: float = 0, warmup_mode: str = "linear") -> None:
        warmup_steps = _count("warmup_steps", warmup_steps)
        if warmup_steps < 0:
            raise ValueError("warmup_steps must be 0 or more")
        if warmup_begin_lr > base_lr:
            raise ValueError("base_lr must be at least warmup_begin_lr")
        if warmup_mode not in ("linear", "constant"):
            raise ValueError("warmup_mode is 'linear' or 'constant'")
        self.base_lr = base_lr
        self.warmup_steps = warmup_steps
        self.warmup_begin_lr = warmup_begin_lr
        self.warmup_final_lr = base_lr
        self.warmup_mode = warmup_mode

    def get_warmup_lr(self, num_update: int) -> float:
        """The warm-up's rate after ``num_update`` updates (fewer than ``warmup_steps``)."""
        if self.warmup_mode == "constant":
            return self.warmup_begin_lr
        span = self.warmup_final_lr - self.warmup_begin_lr
        return self.warmup_begin_lr + span * float(num_update) / float(self.warmup_steps)

    def __call__(self, num_update: int) -> float:
        """The rate after ``num_update`` updates; the rule's progress (a factor passed, say) is
        kept, as MXNet's. The object first takes the state that the stores running its
        optimizer have reached, and they take what this call changes."""
        counts = self._store_counts()
        with _LOCK:
            self._reach(counts)
            before = self._state()
            with self._stepping():
                rate = self._rate(num_update)
            changed = self._state() != before
        if changed:
            self._tell_owners()
        return rate

    def _rate(self, num_update: int) -> float:
        raise NotImplementedError("a scheduler's rule gives its rate")

    def _reached_at(self, n: int) -> None:
        """Takes the state the rule reaches after ``n`` updates, one at a time."""
        self._rate(n)

    # The optimizers that hold this scheduler (weakly), whose stores run a copy of its state,
    # are told of each change made from outside the rule.
    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            object.__setattr__(self, name, value)
            return
        with _LOCK:
            if self.__dict__.get("_in_step") or not self._owners_now():
                object.__setattr__(self, name, value)
                return
        counts = self._store_counts()
        with _LOCK:
            self._reach(counts)
            before = self._state()
            object.__setattr__(self, name, value)
        try:
            self._tell_owners()
        except BaseException:
            # A value the stores refuse is not kept, nor what it changed on the way (a
            # catch-up run with it): the object stays what they run.
            with _LOCK:
                for k in [k for k in self.__dict__ if not k.startswith("_")]:
                    object.__delattr__(self, k)
                for k, v in before.items():
                    object.__setattr__(self, k, v)
            self._tell_owners()
            raise

    def __getstate__(self) -> Dict[str, Any]:
        # A copy (copy, deepcopy, pickle) is held by no optimizer until one takes it.
        return {k: v for k, v in self.__dict__.items() if k not in ("_owners", "_in_step")}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        for k, v in state.items():
            object.__setattr__(self, k, v)

    def _owned_by(self, optimizer: Any) -> None:
        with _LOCK:
            if "_owners" not in self.__dict__:
                object.__setattr__(self, "_owners", weakref.WeakSet())
            self.__dict__["_owners"].add(optimizer)

    def _disowned_by(self, optimizer: Any) -> None:
        with _LOCK:
            if "_owners" in self.__dict__:
                self.__dict__["_owners"].discard(optimizer)

    def _owners_now(self) -> List[Any]:
        with _LOCK:
            return list(self.__dict__.get("_owners", ()))

    @contextlib.contextmanager
    def _stepping(self) -> Iterator[None]:
        """The rule's own progress (under the lock): not a change the stores are told of."""
        was = self.__dict__.get("_in_step", False)
        object.__setattr__(self, "_in_step", True)
        try:
            yield
        finally:
            object.__setattr__(self, "_in_step", was)

    def _store_counts(self) -> List[int]:
        """The update counts of the local stores running its optimizers (asked without the
        lock: a store may be busy); a store that refuses calls (fenced after an interrupt or
        a panic) runs nothing more and is not counted."""
        counts = []
        for opt in self._owners_now():
            for store in opt._live_stores():
                try:
                    counts.append(store._optimizer_num_update(opt))
                except RuntimeError:
                    pass
        return counts

    def _reach(self, counts: List[int]) -> None:
        """Takes the state those stores reached (under the lock), as MXNet's optimizer ran the
        object at every update: once per count reached (run again at the same count, a decay
        would recompute its rate with what was changed since, which MXNet's object, past
        that update, never does)."""
        n = max(counts, default=0)
        with _LOCK:
            if n > self.__dict__.get("_at", 0):
                with self._stepping():
                    self._reached_at(n)
                object.__setattr__(self, "_at", n)

    def _catch_up(self) -> None:
        self._reach(self._store_counts())

    def _state(self) -> Dict[str, Any]:
        return {k: (list(v) if isinstance(v, list) else v) for k, v in self.__dict__.items()
                if not k.startswith("_")}

    def _tell_owners(self) -> None:
        for opt in self._owners_now():
            for store in opt._live_stores():
                store._retune_optimizer(opt)

    def _spec(self) -> Dict[str, Any]:
        """What the store runs: the rule, the warm-up and the state reached."""
        return {"warmup_steps": self.warmup_steps, "warmup_begin_lr": self.warmup_begin_lr,
                "warmup_final_lr": self.warmup_final_lr,
                "warmup_constant": self.warmup_mode == "constant", "base_lr": self.base_lr}


def _check_factor(factor: float) -> None:
    if not factor <= 1.0:
        raise ValueError("factor must be at most 1 (the rate only goes down)")


def _count(name: str, n: Any) -> int:
    """``n`` as an int (an int or a numpy integer: update counts are whole)."""
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise TypeError(f"{name} is an int, not {n!r}")
    return operator.index(n)


def _check_count(name: str, n: Any) -> int:
    n = _count(name, n)
    if n < 1:
        raise ValueError(f"{name} must be at least 1")
    return n


class FactorScheduler(LRScheduler):
    """MXNet's ``FactorScheduler``: the rate is multiplied by ``factor`` each time the update
    count passes another ``step`` updates, and never goes below ``stop_factor_lr``."""

    def __init__(self, step: int, factor: float = 1, stop_factor_lr: float = 1e-8,
                 base_lr: float = 0.01, warmup_steps: int = 0, warmup_begin_lr: float = 0,
                 warmup_mode: str = "linear") -> None:
        super().__init__(base_lr, warmup_steps, warmup_begin_lr, warmup_mode)
        step = _check_count("step", step)
        _check_factor(factor)
        self.step = step
        self.factor = factor
        self.stop_factor_lr = stop_factor_lr
        self.count = 0

    def _rate(self, num_update: int) -> float:
        if num_update < self.warmup_steps:
            return self.get_warmup_lr(num_update)
        while num_update > self.count + self.step:
            self.count += self.step
            before = self.base_lr
            self.base_lr = max(self.base_lr * self.factor, self.stop_factor_lr)
            if self.base_lr == before:
                # At its floor the rate stays: the steps left are counted at once.
                self.count += (num_update - self.count - 1) // self.step * self.step
                break
        return self.base_lr

    def _spec(self) -> Dict[str, Any]:
        return {**super()._spec(), "kind": "factor", "step": self.step, "factor": self.factor,
                "stop_factor_lr": self.stop_factor_lr, "count": self.count}


class MultiFactorScheduler(LRScheduler):
    """MXNet's ``MultiFactorScheduler``: the rate is multiplied by ``factor`` once the update
    count passes each of the increasing counts in ``step``."""

    def __init__(self, step: List[int], factor: float = 1, base_lr: float = 0.01,
                 warmup_steps: int = 0, warmup_begin_lr: float = 0,
                 warmup_mode: str = "linear") -> None:
        super().__init__(base_lr, warmup_steps, warmup_begin_lr, warmup_mode)
        if not isinstance(step, list) or not step:
            raise TypeError("step is a list of at least one update count")
        step = [_check_count("each step", s) for s in step]
        for i, s in enumerate(step):
            if i and s <= step[i - 1]:
                raise ValueError("step must be an increasing list")
        _check_factor(factor)
        self.step = step
        self.factor = factor
        self.cur_step_ind = 0
        self.count = 0

    def _rate(self, num_update: int) -> float:
        if num_update < self.warmup_steps:
            return self.get_warmup_lr(num_update)
        while self.cur_step_ind < len(self.step) and num_update > self.step[self.cur_step_ind]:
            self.count = self.step[self.cur_step_ind]
            self.cur_step_ind += 1
            self.base_lr *= self.factor
        return self.base_lr

    def _spec(self) -> Dict[str, Any]:
        return {**super()._spec(), "kind": "multi_factor", "steps": list(self.step),
                "factor": self.factor, "count": self.count, "passed": self.cur_step_ind}


class _Decay(LRScheduler):
    """A rate that falls from ``base_lr`` to ``final_lr`` between the warm-up's end and
    ``max_update``, then stays."""

    def __init__(self, max_update: int, base_lr: float, final_lr: float, warmup_steps: int,
                 warmup_begin_lr: float, warmup_mode: str) -> None:
        super().__init__(base_lr, warmup_steps, warmup_begin_lr, warmup_mode)
        max_update = _check_count("max_update", max_update)
        if max_update == warmup_steps:
            # MXNet divides by their difference at that update (a ZeroDivisionError).
            raise ValueError("max_update must not be warmup_steps")
        self.base_lr_orig = base_lr
        self.max_update = max_update
        self.final_lr = final_lr
        self.max_steps = max_update - warmup_steps

    def _decayed(self, after_warmup: int) -> float:
        raise NotImplementedError

    def _reached_at(self, n: int) -> None:
        # Past max_update each update keeps the rate computed at max_update.
        self._rate(min(n, self.max_update))

    def _rate(self, num_update: int) -> float:
        if num_update < self.warmup_steps:
            return self.get_warmup_lr(num_update)
        if num_update <= self.max_update:
            self.base_lr = self._decayed(num_update - self.warmup_steps)
        return self.base_lr

    def _spec(self) -> Dict[str, Any]:
        # The store derives the decay's span and the warm-up's end from max_update,
        # warmup_steps and base_lr_orig, as the constructor set them.
        if (self.max_steps != self.max_update - self.warmup_steps
                or self.warmup_final_lr != self.base_lr_orig):
            raise ValueError("this scheduler's max_steps or warmup_final_lr no longer follow "
                             "from its max_update, warmup_steps and base_lr_orig (changed "
                             "after it was made): the store cannot run it; make a new one")
        return {**super()._spec(), "max_update": self.max_update,
                "base_lr_orig": self.base_lr_orig, "final_lr": self.final_lr}


class PolyScheduler(_Decay):
    """MXNet's ``PolyScheduler``: after the warm-up the rate falls as ``(1 - done)**pwr``."""

    def __init__(self, max_update: int, base_lr: float = 0.01, pwr: float = 2,
                 final_lr: float = 0, warmup_steps: int = 0, warmup_begin_lr: float = 0,
                 warmup_mode: str = "linear") -> None:
        super().__init__(max_update, base_lr, final_lr, warmup_steps, warmup_begin_lr,
                         warmup_mode)
        if not pwr >= 0:
            # MXNet's rate would be infinite at max_update (a ZeroDivisionError).
            raise ValueError("pwr must be 0 or more")
        self.power = pwr

    def _decayed(self, after_warmup: int) -> float:
        left = 1 - float(after_warmup) / float(self.max_steps)
        return self.final_lr + (self.base_lr_orig - self.final_lr) * pow(left, self.power)

    def _spec(self) -> Dict[str, Any]:
        return {**super()._spec(), "kind": "poly", "pwr": float(self.power)}


class CosineScheduler(_Decay):
    """MXNet's ``CosineScheduler``: after the warm-up the rate falls along half a cosine."""

    def __init__(self, max_update: int, base_lr: float = 0.01, final_lr: float = 0,
                 warmup_steps: int = 0, warmup_begin_lr: float = 0,
                 warmup_mode: str = "linear") -> None:
        super().__init__(max_update, base_lr, final_lr, warmup_steps, warmup_begin_lr,
                         warmup_mode)

    def _decayed(self, after_warmup: int) -> float:
        turn = math.pi * after_warmup / self.max_steps
        return self.final_lr + (self.base_lr_orig - self.final_lr) * (1 + math.cos(turn)) / 2

    def _spec(self) -> Dict[str, Any]:
        return {**super()._spec(), "kind": "cosine"}


_RULES = (FactorScheduler, MultiFactorScheduler, PolyScheduler, CosineScheduler)


def _runnable(s: Any) -> bool:
    """Whether the store can run ``s``: one of these schedulers, its rule not overridden."""
    kinds = [k for k in _RULES if isinstance(s, k)]
    return bool(kinds) and all(
        getattr(type(s), m) is getattr(kinds[0], m)
        for m in ("__call__", "_rate", "get_warmup_lr", "_decayed") if hasattr(kinds[0], m))
