"""numpy views saved as views: an array and a view of it stay one buffer after a restore.

numpy pickles every array with its own copy of the data, so a view (``col = storage[:, 0]``,
a replay buffer's ``self.obs = self.storage[:, :3]``) came back as an independent array: writes
through it no longer reached the base, silently. The pickler asks `reduce` about each array: a
view whose root (the array that owns the memory) this pickle has already written, or whose root
is small beside it, is saved as (root, offset, shape, strides) and made again over the restored
root. A small view of a large buffer that nothing but the view holds stays a copy (the buffer is
not worth saving for it, and nothing else can see the sharing); held by anything else (the
program's ``big`` that the pickle reaches later, another view), the buffer is saved with the first
view it meets, or the sharing would be lost (silently: writes to ``big`` no longer seen through
``head = big[:4]``).

An array over a ``bytearray`` or an ``array.array`` (``np.frombuffer(buf)``) is saved as a view of
that object, which pickles as itself: writes to ``buf`` are seen through the array after a restore;
so is an array over a CPU tensor's memory (``w.numpy()``), a view of the restored tensor's storage.
"""
from __future__ import annotations

import array
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
    if a.dtype.hasobject:
        return None
    owner = base.base.obj if isinstance(base.base, memoryview) else base.base  # np.frombuffer's
    if isinstance(owner, (bytearray, array.array)) and len(owner):
        return owner
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(owner, torch.Tensor) and owner.device.type == "cpu" \
            and owner.layout == torch.strided and owner.untyped_storage().nbytes():
        return owner  # `w.numpy()`: a view of the tensor's storage
    if base is a or not base.flags.c_contiguous or base.dtype.hasobject:
        return None
    return base


def _address(root: Any) -> int:
    np = sys.modules["numpy"]
    if isinstance(root, np.ndarray):
        return root.__array_interface__["data"][0]
    if _is_tensor(root):
        return root.untyped_storage().data_ptr()
    return np.frombuffer(root, np.uint8).__array_interface__["data"][0]


def reduce(a: Any, roots_seen: set[int]) -> Any:
    """How to pickle ndarray ``a``: NotImplemented (numpy's own way), or as a view of its root.
    ``roots_seen`` holds the ids of the arrays this pickle wrote whole (it records ``a``'s)."""
    root = _root(a)
    if root is None:
        roots_seen.add(id(a))
        return NotImplemented
    offset = a.__array_interface__["data"][0] - _address(root)
    if id(root) not in roots_seen and isinstance(root, sys.modules["numpy"].ndarray) \
            and root.nbytes > max(_ROOT_FACTOR * a.nbytes, _SMALL_ROOT) and a.base is root \
            and sys.getrefcount(root) <= _HELD_ONLY_BY_THE_VIEW:
        return NotImplemented
    roots_seen.add(id(root))
    if _is_tensor(root):
        return _view_of_tensor, (root, offset, a.shape, a.strides, a.dtype, a.flags.writeable)
    return view_of, (root, offset, a.shape, a.strides, a.dtype, a.flags.writeable)


def _is_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _view_of_tensor(tensor: Any, offset: int, shape: tuple, strides: tuple, dtype: Any, writeable: bool) -> Any:
    """`view_of` over a tensor's storage (``w.numpy()``: writes through either show in the other)."""
    from ..checkpoint.dedup import storage_memory

    storage = tensor.untyped_storage()
    return view_of(storage_memory(storage), offset, shape, strides, dtype, writeable)


#: ``sys.getrefcount(root)`` in `reduce` when only the view's ``.base`` holds it (and the local, and the call)
_HELD_ONLY_BY_THE_VIEW = 3


def view_of(root: Any, offset: int, shape: tuple, strides: tuple, dtype: Any, writeable: bool) -> Any:
    np = sys.modules.get("numpy") or __import__("numpy")
    view = np.ndarray(shape, dtype, buffer=root, offset=offset, strides=strides)
    if not writeable:
        view.flags.writeable = False
    return view


def reduce_memoryview(view: memoryview) -> Any:
    """A ``memoryview`` saved as a view of the object it shows (a ``bytearray``, an ``array``, a
    numpy array, ``bytes``), which pickles as itself. Pickled its default way it came back as a
    ``bytes`` copy: frozen at the checkpoint's contents (silently), and failing at a write through
    it or at ``.tolist()``. Views with gaps between elements are refused: made again contiguous,
    they would share nothing."""
    import pickle

    import numpy as np  # for the addresses; imported with torch anyway

    owner = view.obj
    if not isinstance(owner, (bytes, bytearray, array.array, np.ndarray)):
        return NotImplemented
    problem = "its elements are not contiguous" if not view.c_contiguous else None
    if problem is None:
        try:
            offset = np.frombuffer(view.cast("B") if view.ndim != 1 or view.format != "B" else view, np.uint8) \
                .__array_interface__["data"][0] - _address(owner)
            args = (owner, offset, view.nbytes, view.format, view.shape, view.readonly)
            _memoryview_over(*args)  # refused now, not at the restore, if it cannot be made again
            return _memoryview_over, args
        except (TypeError, ValueError) as e:
            problem = str(e)
    raise pickle.PicklingError(f"cannot save a memoryview of {type(owner).__name__} ({problem}); keep the object "
                               f"it shows and make the view again after the loop's safe points, or use a numpy array")


def _memoryview_over(owner: Any, offset: int, nbytes: int, format: str, shape: tuple, readonly: bool) -> memoryview:
    view = memoryview(owner).cast("B")[offset:offset + nbytes]
    view = view.cast(format, shape) if (format, shape) != ("B", (nbytes,)) else view
    return view.toreadonly() if readonly and not view.readonly else view
