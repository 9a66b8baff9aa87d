"""MXNet's ``Updater`` and ``get_updater``, which ``kvstore.optimizer`` gives: an optimizer run
in this process on numpy arrays, by the same Rust code as a store's (``OptimizerRunner``), or
in Python for an optimizer of your own."""

from typing import Any, Dict, Optional

from .optimizer import Optimizer

__all__ = ["Updater", "get_updater"]


class Updater:
    """MXNet's ``Updater`` (``get_updater(optimizer)``): the optimizer run in this process on
    numpy arrays, ``updater(index, grad, weight)`` updating ``weight`` in place (or lists of
    them, as MXNet's), with a state per index. It is the engine of ``set_optimizer``, by the
    same Rust code. As a store, it runs the optimizer object it was given: a change to its
    parameters applies from the next update on.

    ``kv._set_updater(get_updater(opt))`` runs it as the store's updater; in a distributed
    store, on the servers (where MXNet ignores a worker's updater): it travels there by value,
    its state fresh (the state of an updater that loaded states with their optimizer travels
    with it). A pickled or copied updater is such a value.

    ``get_states(dump_optimizer=False)`` and ``set_states(states)`` take kvstore's
    saved-states format (MXNet's is a pickle); states that carry the optimizer replace this
    updater's, and it no longer runs the object it was given: ``optimizer`` is then None."""

    def __init__(self, optimizer: Optimizer) -> None:
        if not isinstance(optimizer, Optimizer):
            raise TypeError("get_updater takes a kvstore.optimizer object, not "
                            f"{type(optimizer).__name__}")
        self.optimizer: Optional[Optimizer] = optimizer
        if optimizer._custom():
            # An optimizer of your own: its rule runs here, its state per index in
            # ``states`` (MXNet's Updater), saved as MXNet saves it (a pickle).
            self._runner = None
            self.states: Dict[Any, Any] = {}
            self.states_synced: Dict[Any, bool] = {}
            return
        from ._native import OptimizerRunner
        self._runner = OptimizerRunner(optimizer)
        optimizer._attached_to(self)

    def __call__(self, index: Any, grad: Any, weight: Any) -> None:
        if not isinstance(index, (list, tuple)):
            index, grad, weight = [index], [grad], [weight]
        for i, g, w in zip(index, grad, weight):
            # MXNet's updaters may be given a str key as bytes.
            i = i.decode() if isinstance(i, bytes) else i
            if self._runner is not None:
                self._runner.update(i, g, w)
                continue
            opt = self.optimizer
            assert opt is not None  # (an optimizer of one's own is never let go of)
            if i not in self.states:
                self.states[i] = opt.create_state_multi_precision(i, w)
                self.states_synced[i] = True
            opt.update_multi_precision(i, w, g, self.states[i])

    def get_states(self, dump_optimizer: bool = False) -> bytes:
        """The state of every index (and the optimizer, with ``dump_optimizer``), as bytes."""
        if self._runner is None:
            import pickle
            return pickle.dumps((self.states, self.optimizer) if dump_optimizer
                                else self.states)
        return self._runner.save_states(bool(dump_optimizer))

    def set_states(self, states: bytes) -> None:
        """Replaces the state with what ``get_states`` gave."""
        if self._runner is None:
            import pickle
            got = pickle.loads(bytes(states))
            if isinstance(got, tuple) and len(got) == 2:
                self.states, self.optimizer = got
            else:
                self.states = got
            self.states_synced = dict.fromkeys(self.states, False)
            return
        if self._runner.load_states(bytes(states)) and self.optimizer is not None:
            self.optimizer._stores.discard(self)
            self.optimizer = None

    def _retune_optimizer(self, optimizer: Optimizer) -> None:
        if self._runner is not None:
            self._runner.retune(optimizer)

    def _optimizer_num_update(self, optimizer: Optimizer) -> int:
        return optimizer._num_update if self._runner is None else self._runner.num_update()

    def __reduce__(self) -> Any:
        # By value: the optimizer object, the state fresh (a distributed store's servers start
        # their own); or, once it runs loaded states with their optimizer, those.
        if self._runner is None:
            return (Updater, (self.optimizer,))
        if self.optimizer is None:
            return (_updater_of_states, (self.get_states(dump_optimizer=True),))
        return (Updater, (self.optimizer,))


def _updater_of_states(states: bytes) -> Updater:
    from ._native import OptimizerRunner
    u = Updater.__new__(Updater)
    u.optimizer = None
    u._runner = OptimizerRunner.from_states(states)
    return u


def get_updater(optimizer: Optimizer) -> Updater:
    """MXNet's ``get_updater``: an ``Updater`` running ``optimizer``."""
    return Updater(optimizer)
