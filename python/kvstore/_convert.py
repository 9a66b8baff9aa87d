"""Values and outputs of another dtype than their key's, converted as MXNet converts them.

MXNet copies a pushed value into its key's dtype, and a pulled value into the output's
(``CopyFromTo`` casts). kvstore lends numpy arrays to the store without a copy, so the store
refuses an array of another dtype; the binding then calls these and makes the call again
with copies in the key's dtype, and copies the results into the outputs (numpy's unsafe
casting, as MXNet's cast). The common call, whose dtypes agree, never comes here.

``dtypes`` holds each key's dtype name, in the order of the keys.
"""

from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np


def _is_list(obj: Any) -> bool:
    return isinstance(obj, (list, tuple))


def _readable(a: Any) -> bool:
    """Whether numpy reads ``a`` as an array (not a 0-d object array): an ndarray, an object
    with numpy's interfaces, or one with the buffer protocol (``array.array``,
    ``memoryview``, ``bytearray``)."""
    if isinstance(a, np.ndarray) or hasattr(a, "__array_interface__") or hasattr(
            a, "__array__"):
        return True
    try:
        memoryview(a).release()
    except TypeError:
        return False
    return True


def _real(arr: np.ndarray) -> bool:
    """Whether ``arr`` holds bools or real numbers, which convert as MXNet's cast does (a
    complex value would lose its imaginary part silently: never converted)."""
    return arr.dtype.kind in "biuf"


def _dtype(name: str) -> Optional[np.dtype]:
    """numpy's dtype of that name; None for one numpy lacks (bfloat16)."""
    try:
        return np.dtype(name)
    except TypeError:
        return None


def _map(key: Any, obj: Any, f: Callable[[int, Any], Any]) -> Any:
    """``obj`` with ``f(i, array)`` in place of each array of the i-th key, paired as MXNet
    pairs them (a key takes an array or a list of arrays; a list of keys, a list with one
    entry per key). A shape that does not pair is left for the call to refuse."""
    def one(i: int, o: Any) -> Any:
        return [f(i, a) for a in o] if _is_list(o) else f(i, o)

    if _is_list(key):
        if _is_list(obj) and len(obj) == len(key):
            return [one(i, o) for i, o in enumerate(obj)]
        if len(key) == 1:
            return one(0, obj)
        return obj
    return one(0, obj)


def values(key: Any, obj: Any, dtypes: Sequence[str]) -> Optional[List[Any]]:
    """``obj`` with each array of another dtype than its key's replaced by a copy in the
    key's dtype; None if none is."""
    changed = False

    def f(i: int, a: Any) -> Any:
        nonlocal changed
        if i >= len(dtypes) or not _readable(a):
            return a
        arr, want = np.asarray(a), _dtype(dtypes[i])
        if want is None or arr.dtype == want or not _real(arr):
            return a
        changed = True
        return arr.astype(want)

    out = _map(key, obj, f)
    return out if changed else None


def outputs(key: Any, obj: Any,
            dtypes: Sequence[str]) -> Optional[Tuple[Any, List[Tuple[np.ndarray, np.ndarray]]]]:
    """``obj`` with each output of another dtype than its key's replaced by an array of the
    key's dtype, and the pairs (output, stand-in) to copy back after the call; None if no
    output needs one."""
    backs: List[Tuple[np.ndarray, np.ndarray]] = []

    def f(i: int, o: Any) -> Any:
        if i >= len(dtypes) or not _readable(o):
            return o
        arr, want = np.asarray(o), _dtype(dtypes[i])
        if want is None or arr.dtype == want or not _real(arr):
            return o
        # The output must take the values in place, as one of the key's dtype must: refused
        # now, before the call changes anything (a stand-in would let the call through).
        # (In a pushpull without out, the output is the value itself.)
        if not arr.flags.writeable:
            raise ValueError("an output is read-only: the store writes it in place")
        if not (arr.flags.c_contiguous and arr.flags.aligned):
            raise ValueError(
                "an output is not C-contiguous and aligned: the store writes it in place "
                "(np.ascontiguousarray makes a contiguous copy)")
        stand_in = np.empty(arr.shape, dtype=want)
        backs.append((arr, stand_in))
        return stand_in

    outs = _map(key, obj, f)
    return (outs, backs) if backs else None


def copy_back(backs: List[Tuple[np.ndarray, np.ndarray]]) -> None:
    """Casts each stand-in's values into its output."""
    for out, stand_in in backs:
        np.copyto(out, stand_in, casting="unsafe")
