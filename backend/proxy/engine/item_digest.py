"""A digest of the items a replayed loop iterator yielded, so a restore can tell it replayed them.

A generator or iterable that cannot be pickled is resumed by creating it again and skipping the
items the loop had already taken (iterators.py).  That is exact only if the iterator yields the
same items again.  It does not when it reads state the loop body changes: hardest-example
mining from a ``losses`` list, a curriculum reading ``cfg.level``, a sampler re-weighted by the
body.  Its replay then runs against the checkpoint's values, not the ones each item first saw.
So each item such a loop takes is folded into a running digest, saved with the loop; the restore
folds the replayed items the same way and refuses to resume when the two differ.

What an item contributes is what decides which items the iterator chose, without reading what
the loop body is free to change afterwards:

- numbers, strings, bytes and containers of them: their values;
- a tensor or array made for the item (a batch, an index tensor): dtype, shape and up to 1,024
  evenly spaced values (all of a small one); a CUDA tensor only its dtype and shape (reading
  its values would wait for the device at every step);
- a view of a longer-lived tensor or array (``X[i:i + b]``): where it points (offset, shape,
  strides), not its values, which the body may update in place;
- a parameter (or a tensor that requires grad) and any other object: its type only.

The digest is a CRC-32 of the items' encodings, one after the other (``zlib.crc32(item, d)``): a
plain int, picklable, continued after a restore, ~0.5 µs for a short string or a number. It
guards against a replay that chose other items by accident, not against an adversary: two
different item sequences agree with probability 2^-32.
"""
from __future__ import annotations

import sys
import zlib
from typing import Any, Iterator

from . import lazy

#: values per tensor/array folded in; elements per container; objects per item
_SAMPLE = 1024
_BUDGET = 4096
_SCALARS = (int, float, complex, bool, type(None))
#: values whose repr is exact and the same in every process
_REPR_EXACT = frozenset({int, float, str, bool, type(None)})


class _Encoder:
    __slots__ = ("parts", "budget")

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.budget = _BUDGET

    def add(self, obj: Any) -> None:
        self.budget -= 1
        if self.budget < 0:
            return
        t = type(obj)
        if t in _SCALARS:
            self.parts.append(repr(obj).encode())
        elif t is str:
            self.parts.append(b"s%d:" % len(obj) + obj.encode("utf-8", "surrogatepass"))
        elif t is bytes or t is bytearray:
            self.parts.append(b"b%d:" % len(obj) + bytes(obj))
        elif t is list or t is tuple:
            self.parts.append(b"(%d" % len(obj))
            head = obj[:_SAMPLE]
            if all(type(x) in _REPR_EXACT for x in head):  # index lists: one repr, not one call each
                self.budget -= len(head)
                self.parts.append(repr(head).encode())
                return
            for x in head:
                self.add(x)
        elif t is dict:
            self.parts.append(b"{%d" % len(obj))
            for n, (k, v) in enumerate(obj.items()):
                if n >= _SAMPLE:
                    break
                self.add(k)
                self.add(v)
        else:
            self._other(obj)

    def _other(self, obj: Any) -> None:
        types_ = lazy.torch_types()
        if types_ is not None and isinstance(obj, types_.tensor):
            self._tensor(obj)
            return
        np = sys.modules.get("numpy")
        if np is not None and isinstance(obj, np.ndarray):
            self._array(obj, np)
            return
        if np is not None and isinstance(obj, np.generic):
            self.parts.append(b"g" + obj.dtype.str.encode() + obj.tobytes())
            return
        if isinstance(obj, (tuple, list)):  # a namedtuple or a list subclass
            self.parts.append(type(obj).__qualname__.encode())
            for x in obj[:_SAMPLE]:
                self.add(x)
            return
        self.parts.append(b"o" + type(obj).__qualname__.encode())

    def _tensor(self, t: Any) -> None:
        head = f"t{t.dtype}{tuple(t.shape)}{t.device.type}".encode()
        # a parameter by its head whatever its requires_grad now: a loop freezing them
        # (`p.requires_grad_(False)`) would make the replayed items look like other ones
        if t.requires_grad or isinstance(t, lazy.torch().nn.Parameter) or t.device.type != "cpu" \
                or t.is_sparse or t.is_quantized:
            self.parts.append(head)
        elif t._base is not None:  # a view: where it points into its base
            self.parts.append(head + f"@{t.storage_offset()}{t.stride()}".encode())
        else:
            from ..checkpoint.dedup import host_array

            # no copy (numpy's slicing is cheaper than torch's), and not through .numpy(), which
            # would leave the program's tensor unable to be resized
            self.parts.append(head + _sample(host_array(t)))

    def _array(self, a: Any, np: Any) -> None:
        head = f"a{a.dtype.str}{a.shape}".encode()
        base = a.base
        if isinstance(base, np.ndarray):  # a view: where it points into its base
            offset = a.__array_interface__["data"][0] - base.__array_interface__["data"][0]
            self.parts.append(head + f"@{offset}{a.strides}".encode())
        elif a.dtype.hasobject:
            self.parts.append(head)
            for x in a.reshape(-1)[:_SAMPLE].tolist():
                self.add(x)
        else:
            self.parts.append(head + _sample(a))


def _sample(a: Any) -> bytes:
    """Up to `_SAMPLE` evenly spaced values of a numpy array, as bytes."""
    flat = a.reshape(-1)
    if flat.size > _SAMPLE:
        flat = flat[:: flat.size // _SAMPLE][:_SAMPLE]
    return flat.tobytes()

def fold(digest: int, item: Any) -> int:
    """The digest after one more item."""
    t = type(item)
    if t is str:  # lines of a file, words: the common cheap items, without an encoder
        return zlib.crc32(b"s%d:" % len(item) + item.encode("utf-8", "surrogatepass") + b"\0", digest)
    if t is int:
        return zlib.crc32(b"%d\0" % item, digest)
    enc = _Encoder()
    enc.add(item)
    enc.parts.append(b"")
    return zlib.crc32(b"\0".join(enc.parts), digest)


class Digesting:
    """An iterator that passes its items through, folding each into `value`."""

    __slots__ = ("it", "value")

    def __init__(self, it: Iterator[Any], value: int = 0) -> None:
        self.it = it
        self.value = value

    def __iter__(self) -> "Digesting":
        return self

    def __next__(self) -> Any:
        item = next(self.it)
        self.value = fold(self.value, item)
        return item
