"""Dicts and sets keyed by ``id(obj)``, re-keyed to the restored objects' ids.

``names = {id(p): n for n, p in model.named_parameters()}``, a momentum buffer per
``id(param)``, ``frozen = {id(model[0].bias)}``: the keys are addresses in the process that
made them. A restore makes every object again at another address, so lookups by ``id(p)``
afterwards raised ``KeyError`` or, through ``.get`` and ``in``, silently found nothing (a
frozen layer trained again). A checkpoint therefore looks for containers whose keys look like
addresses (ints of at least 2**32 and a multiple of 16, which CPython objects are), among the
objects its graph reaches within a bounded walk, and records, for each key that is the id of an
object the checkpoint saves, that object; the load puts the restored object's id in its place,
keeping the dict's order.

Only containers reachable within `LIMIT` objects of the program's variables are found (a list or
dict of more than 1,000 entries that starts with plain values is not walked into), and a key
whose object the checkpoint does not save (an object since freed) stays as it is: it would
match nothing in the uninterrupted run either. A frozenset of ids is not re-keyed.
"""
from __future__ import annotations

import itertools
import sys
import types
from typing import Any, Iterable

#: the walk stops after this many objects (a model's modules, attributes and containers)
LIMIT = 20_000
_ID_MIN = 1 << 32
_LONG = 1_000
#: values with nothing inside to walk
_ATOMS = frozenset({int, float, complex, bool, str, bytes, bytearray, type(None), range, slice,
                    types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.ModuleType, type})
_module_internals: frozenset = frozenset()


def _looks_like_id(key: Any) -> bool:
    return type(key) is int and key >= _ID_MIN and not key % 16


def _skipped_attributes(obj: Any) -> frozenset:
    """An nn.Module's own bookkeeping (parameters, buffers, hook dicts): nothing of the program's
    is in there, and a model has thousands of them; its submodules (``_modules``) are walked."""
    global _module_internals
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(obj, torch.nn.Module):
        return frozenset()
    if not _module_internals:
        _module_internals = frozenset(vars(torch.nn.Module())) - {"_modules"}
    return _module_internals


def _inside(values: Any, size: int) -> Iterable[Any]:
    """What to walk among a container's values: nothing in a long one that starts with plain
    values (a vocabulary, a list of token ids), where walking would cost more than pickling."""
    if size > _LONG and all(type(v) in _ATOMS for v in itertools.islice(values, 8)):
        return ()
    return (v for v in values if type(v) not in _ATOMS)


def find(roots: Iterable[Any], known: dict[int, Any]) -> list[tuple[Any, list[tuple[int, Any]]]]:
    """``[(container, [(old key, object), ...])]`` for the id-keyed dicts and sets reachable from
    ``roots``; ``known``: more objects the checkpoint saves, by id (its tensors)."""
    objects: dict[int, Any] = dict(known)
    candidates: list[Any] = []
    stack = [r for r in roots if type(r) not in _ATOMS]
    visited = 0
    while stack and visited < LIMIT:
        obj = stack.pop()
        if id(obj) in objects:  # seen, or a tensor the checkpoint saves (nothing to walk inside)
            continue
        objects[id(obj)] = obj
        visited += 1
        if isinstance(obj, dict):
            if obj and _looks_like_id(next(iter(obj))):
                candidates.append(obj)
            stack.extend(_inside(obj.values(), len(obj)))
        elif type(obj) in (list, tuple):
            stack.extend(_inside(obj, len(obj)))
        elif isinstance(obj, set):  # (a frozenset cannot be re-keyed in place)
            if any(_looks_like_id(k) for k in itertools.islice(obj, 8)):
                candidates.append(obj)
        else:
            try:
                attributes = object.__getattribute__(obj, "__dict__")
            except AttributeError:
                continue
            if isinstance(attributes, dict):
                skip = _skipped_attributes(obj)
                stack.extend(v for k, v in attributes.items() if type(v) not in _ATOMS and k not in skip)
    found = []
    for container in candidates:
        pairs = [(k, objects[k]) for k in container if type(k) is int and k in objects]
        if pairs:
            found.append((container, pairs))
    return found


def rekey(found: list[tuple[Any, list[tuple[int, Any]]]]) -> None:
    """After a load: each recorded key becomes its object's id in this process (dicts keep their order)."""
    for container, pairs in found:
        new = {old: id(obj) for old, obj in pairs}
        if isinstance(container, dict):
            items = list(container.items())
            container.clear()
            container.update((new.get(k, k), v) for k, v in items)
        else:
            container.difference_update(new)
            container.update(new.values())
