"""numpy views saved as views: an array and a view of it stay one buffer after a restore.

numpy pickles every array with its own copy of the data, so a view (``col = storage[:, 0]``,
a replay buffer's ``self.obs = self.storage[:, :3]``) came back as an independent array: writes
through it no longer reached the base, silently. The pickler asks `reduce` about each array: a
view whose root (the array that owns the memory) this pickle has already written, or whose root
is small beside it, is saved as (root, offset, shape, strides) and made again over the restored
root. A small view of a large buffer the pickle never writes stays a copy (the buffer is not
worth saving for it, and nothing else can see the sharing).
"""
from __future__ import annotations

import sys
from typing import Any, Optional

#: a view's root is saved with it when no bigger than this many times the view (or 1 MB)
_ROOT_FACTOR = 4
_SMALL_ROOT = 1 << 20


def is_array(obj: Any) -> bool:
    np = sys.modules.get("numpy")
    return np is not None and type(obj) is np.ndarray


def _root(a: Any) -> Optional[Any]:
    np = sys.modules["numpy"]
    base = a
    while isinstance(base.base, np.ndarray):
        base = base.base
    if base is a or not base.flags.c_contiguous or base.dtype.hasobject or a.dtype.hasobject:
        return None
    return base


def reduce(a: Any, roots_seen: set[int]) -> Any:
    """How to pickle ndarray ``a``: NotImplemented (numpy's own way), or as a view of its root.
    ``roots_seen`` holds the ids of the arrays this pickle wrote whole (it records ``a``'s)."""
    root = _root(a)
    if root is None:
        roots_seen.add(id(a))
        return NotImplemented
    offset = a.__array_interface__["data"][0] - root.__array_interface__["data"][0]
    if id(root) not in roots_seen and root.nbytes > max(_ROOT_FACTOR * a.nbytes, _SMALL_ROOT):
        return NotImplemented
    roots_seen.add(id(root))
    return view_of, (root, offset, a.shape, a.strides, a.dtype, a.flags.writeable)


def view_of(root: Any, offset: int, shape: tuple, strides: tuple, dtype: Any, writeable: bool) -> Any:
    np = sys.modules.get("numpy") or __import__("numpy")
    view = np.ndarray(shape, dtype, buffer=root, offset=offset, strides=strides)
    if not writeable:
        view.flags.writeable = False
    return view
