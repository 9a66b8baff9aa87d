"""kvstore: MXNet's KVStore API on numpy arrays.

    import numpy as np
    import kvstore as kv

    store = kv.create('local')
    store.init(3, np.ones((2, 3)) * 2)
    a = np.zeros((2, 3))
    store.pull(3, out=a)

Code written against MXNet 1.9's ``mx.kv`` ports by changing the import and using numpy
arrays (device placement, ``ctx=``, is dropped: numpy arrays live on the CPU). Deliberate
differences from MXNet, each documented in README.md:

* In a distributed store an updater set with ``_set_updater`` runs on the servers (MXNet
  ignores it there); it is pickled by value with cloudpickle.
* ``row_sparse_pull`` takes dense numpy outputs of the value's shape: the rows asked for get
  the stored rows and the others zero (MXNet's row-sparse result, made dense); only those
  rows travel.
* ``set_gradient_compression`` ('2bit', MXNet 1.9's only type) refuses unknown parameters
  (MXNet ignores them); in a distributed store it must come before the first ``init``, and
  ``pushpull`` compresses its push too (MXNet's dist store refuses compressed pushpulls).
* ``save_optimizer_states`` of a distributed store saves the servers' state (MXNet refuses
  it); call it on one worker. The file is kvstore's own (MXNet's is a pickle).
* ``create`` refuses a name that contains none of 'dist', 'nccl', 'device' and 'local' (MXNet
  makes a local store of it).
* Errors are typed: ``pull`` without ``out`` is a ValueError (an AssertionError in MXNet), a
  bool key is a TypeError.
* An updater gets a str key as ``str`` (MXNet gives ``bytes``) and a read-only ``input``.
* The optimizers compute in float64 and round once into the weight's dtype, or into a
  ``multi_precision`` master copy and from it into the weight (MXNet computes in the weight's
  dtype, or the copy's); what they cannot honour (multipliers read from a ``sym`` or a
  ``param_dict``) is a ValueError; ``multi_precision`` keeps MXNet's float32 master copy of
  float16 weights (and of bfloat16 ones). Their per-parameter multipliers
  (``set_lr_mult``, ``set_wd_mult``, ``param_idx2name``'s defaults), ``begin_num_update`` and
  learning-rate schedulers (``kvstore.lr_scheduler``: MXNet's four, run by the store where
  the optimizer runs; a scheduler of your own is a TypeError) are MXNet's.
"""

import warnings
from typing import Any, Dict

from . import lr_scheduler, optimizer
from ._native import DTypeMismatch, KVStore, KVStoreError, PeerLost, Timeout, UnsupportedDType
from ._native import create as _create

__all__ = ["create", "DTypeMismatch", "KVStore", "KVStoreBase", "KVStoreError", "PeerLost", "TestStore",
           "Timeout", "UnsupportedDType", "lr_scheduler", "optimizer"]


class _StoreKind(type):
    """Makes kvstore's own stores instances of ``KVStoreBase`` too, as MXNet's ``KVStore`` is
    a subclass of it (code that checks ``isinstance(kv, KVStoreBase)`` takes them)."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, KVStore) or super().__instancecheck__(obj)


class KVStoreBase(metaclass=_StoreKind):
    """MXNet's ``KVStoreBase``: the interface a store class of your own implements (each
    method raises NotImplementedError until it does), the ``OPTIMIZER`` capability's name, and
    the registry of store classes that ``create`` looks in first (``@KVStoreBase.register``);
    kvstore's own stores are instances of it."""

    OPTIMIZER = "optimizer"
    kv_registry: Dict[str, Any] = {}

    def broadcast(self, key: Any, value: Any, out: Any, priority: int = 0) -> None:
        """Stores rank 0's ``value`` under ``key`` and writes it into ``out`` on every rank."""
        raise NotImplementedError()

    def pushpull(self, key: Any, value: Any, out: Any = None, priority: int = 0) -> None:
        """Sums ``value`` into the store and writes the result into ``out`` (or ``value``)."""
        raise NotImplementedError()

    def set_optimizer(self, optimizer: Any) -> None:
        """Runs ``optimizer`` where the store keeps its values."""
        raise NotImplementedError()

    def is_capable(self, capability: str) -> bool:
        """Whether the store can do ``capability`` (``KVStoreBase.OPTIMIZER``)."""
        raise NotImplementedError()

    def save_optimizer_states(self, fname: Any, dump_optimizer: bool = False) -> None:
        """Saves the optimizer's state (and the optimizer, with ``dump_optimizer``)."""
        raise NotImplementedError()

    def load_optimizer_states(self, fname: Any) -> None:
        """Loads what ``save_optimizer_states`` saved."""
        raise NotImplementedError()

    @property
    def type(self) -> str:
        """The store's type name."""
        raise NotImplementedError()

    @property
    def rank(self) -> int:
        """This worker's rank, from 0 to ``num_workers - 1``."""
        raise NotImplementedError()

    @property
    def num_workers(self) -> int:
        """The number of workers."""
        raise NotImplementedError()

    @staticmethod
    def register(klass: Any) -> Any:
        """Registers a store class under its lower-case name, for ``create``; one that takes
        the name of a class registered before replaces it, with a warning (as MXNet's)."""
        assert isinstance(klass, type)
        name = klass.__name__.lower()
        if name in KVStoreBase.kv_registry:
            old = KVStoreBase.kv_registry[name]
            warnings.warn(f"WARNING: New kvstore {klass.__module__}.{klass.__name__} is "
                          f"overriding existing kvstore {old.__module__}.{old.__name__}",
                          stacklevel=2)
        KVStoreBase.kv_registry[name] = klass
        return klass


@KVStoreBase.register
class TestStore(KVStoreBase):
    """MXNet's ``TestStore`` (``create('teststore')``): one process, no stored values and no
    optimizer; ``broadcast`` copies the value into the outputs, ``pushpull`` writes the sum of
    the values into the outputs (or back into the values)."""

    def broadcast(self, key: Any, value: Any, out: Any, priority: int = 0) -> None:
        for o in out if isinstance(out, list) else [out]:
            o[...] = value

    def pushpull(self, key: Any, value: Any, out: Any = None, priority: int = 0) -> None:
        values = value if isinstance(value, list) else [value]
        total = values[0].copy()
        for v in values[1:]:
            total += v
        targets = values if out is None else (out if isinstance(out, list) else [out])
        for t in targets:
            t[...] = total

    @staticmethod
    def is_capable(capability: str) -> bool:
        if capability.lower() == KVStoreBase.OPTIMIZER:
            return False
        raise ValueError(f"Unknown capability: {capability}")

    @property
    def type(self) -> str:
        return "teststore"

    @property
    def rank(self) -> int:
        return 0

    @property
    def num_workers(self) -> int:
        return 1


def create(name: str = "local") -> Any:
    """Creates a KVStore, as MXNet's ``mx.kv.create``: a class registered with
    ``KVStoreBase.register`` under that name, or one of kvstore's types (the name in any case):
    'local' and 'device' (one process, with MXNet's aliases 'local_allreduce_cpu',
    'local_allreduce_device', 'local_update_cpu' and 'nccl'), or 'dist_sync' and 'dist_async'
    (aliases 'dist_device_sync', 'dist_sync_device') in a job started by kvrun. In a job's
    server and scheduler processes, create runs that role until the job ends and then raises
    SystemExit with the role's exit code, as MXNet's server role runs inside the user's
    script. Other names are read as MXNet reads them, by what they contain: 'dist' (sync
    unless '_async'), 'nccl' or 'device', 'local'. A name with none of them is a ValueError
    (MXNet makes a local store of it)."""
    if not isinstance(name, str):
        raise TypeError("name must be a string")
    name = name.lower()
    if name in KVStoreBase.kv_registry:
        return KVStoreBase.kv_registry[name]()
    return _create(name)
