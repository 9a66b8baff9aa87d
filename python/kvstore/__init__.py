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
* ``row_sparse_pull`` and ``set_gradient_compression`` are absent (no sparse arrays, no
  gradient compression).
* ``save_optimizer_states`` of a distributed store saves the servers' state (MXNet refuses
  it); call it on one worker.
"""

from . import optimizer
from ._native import KVStore, KVStoreError, PeerLost, Timeout, create

__all__ = ["create", "KVStore", "KVStoreError", "PeerLost", "Timeout", "optimizer"]
