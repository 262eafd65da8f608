"""A generator a restore replays must not be doing the program's work.

A loop over a generator (``for step in training_steps(n):``) resumes by creating the generator
again and skipping the items the loop had taken (iterators.py). When the generator itself does
the training step before each ``yield`` (updates a model, a dict of weights, a counter), the
replay applies the steps before the checkpoint a second time, on top of the restored state that
already holds them; its items (step numbers) are the same, so the items' digest cannot tell.

So before the replay the state the generator can reach is fingerprinted: its arguments, and the
module globals its code names (a model, an optimizer, a ``state`` dict), a bounded walk through
containers and attributes that samples tensors' and arrays' values. If the replay changed any of
it, the restore refuses, naming it, instead of resuming with the work done twice. Only the
program's own generators are watched (a library's, such as tqdm's ``__iter__`` advancing its
bar, does the library's work). Left out: random generators (their replay is handled by
iterators.py), the objects a replay puts back itself (a loop owner's attributes:
``iter_owners``), and the object the loop's expression made afresh (whose ``__iter__`` may
advance it).
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import os
import sys
import types
import zlib
from typing import Any, Iterable, Iterator, Optional

from . import lazy, ownership, rng

#: objects looked at per watched value; values sampled per tensor or array
_MAX_NODES = 2048
_SAMPLE = 256
_PLAIN = (int, float, complex, bool, type(None), str, bytes)
_SKIPPED = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
            types.CodeType, types.FrameType, types.GeneratorType)


def fingerprint(value: Any, skip: frozenset = frozenset()) -> int:
    """A CRC of ``value``'s contents (bounded; tensors and arrays by a sample of their values)."""
    crc = 0
    todo = [value]
    seen: set[int] = set()
    budget = _MAX_NODES
    tensor_type = lazy.torch_types().tensor if lazy.torch_types() is not None else None
    np = sys.modules.get("numpy")
    while todo and budget > 0:
        obj = todo.pop()
        if id(obj) in seen or id(obj) in skip:
            continue
        seen.add(id(obj))
        budget -= 1
        t = type(obj)
        if t in _PLAIN:
            crc = zlib.crc32(repr(obj).encode("utf-8", "surrogatepass"), crc)
        elif tensor_type is not None and isinstance(obj, tensor_type):
            crc = zlib.crc32(_tensor_sample(obj), crc)
        elif np is not None and isinstance(obj, np.ndarray):
            crc = zlib.crc32(_array_sample(obj), crc)
        elif isinstance(obj, _SKIPPED) or rng.is_generator_object(obj):
            continue
        elif isinstance(obj, dict):
            crc = zlib.crc32(b"{%d" % len(obj), crc)
            for n, (k, v) in enumerate(obj.items()):
                if n >= _SAMPLE:
                    break
                todo.append(v)
                todo.append(k)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            crc = zlib.crc32(b"(%d" % len(obj), crc)
            items = obj if isinstance(obj, (list, tuple)) else sorted(obj, key=repr)
            todo.extend(items[:_SAMPLE])
        else:
            attrs = getattr(obj, "__dict__", None)
            crc = zlib.crc32(t.__qualname__.encode(), crc)
            if isinstance(attrs, dict):
                todo.append(attrs)
    return crc


def _tensor_sample(t: Any) -> bytes:
    flat = t.detach().reshape(-1)
    if flat.numel() > _SAMPLE:
        flat = flat[:: flat.numel() // _SAMPLE][:_SAMPLE]
    torch = lazy.torch()
    # a copy: .numpy() of the program's own memory would leave its tensor unable to be resized
    return f"t{t.dtype}{tuple(t.shape)}".encode() + flat.cpu().clone().view(torch.uint8).numpy().tobytes()


def _array_sample(a: Any) -> bytes:
    if a.dtype.hasobject:
        return f"a{a.dtype.str}{a.shape}".encode()
    flat = a.reshape(-1)
    if flat.size > _SAMPLE:
        flat = flat[:: flat.size // _SAMPLE][:_SAMPLE]
    return f"a{a.dtype.str}{a.shape}".encode() + flat.tobytes()


class Watch:
    """The state a generator can reach, fingerprinted before its replay (`watch`)."""

    def __init__(self, gen: types.GeneratorType, skip: frozenset) -> None:
        self.skip = skip
        frame = gen.gi_frame
        self.arguments = [(name, value) for name, value in (frame.f_locals.items() if frame is not None else ())
                          if id(value) not in skip]
        self.globals = frame.f_globals if frame is not None else {}
        self.names = [name for name in dict.fromkeys(_names(gen.gi_code)) if name in self.globals
                      and not isinstance(self.globals[name], _SKIPPED) and id(self.globals[name]) not in skip]
        self.before = self._fingerprints()

    def _fingerprints(self) -> dict[str, int]:
        out = {f"`{name}` (an argument)": fingerprint(value, self.skip) for name, value in self.arguments}
        out.update({f"`{name}`": fingerprint(self.globals.get(name), self.skip) for name in self.names})
        return out

    def changed(self) -> list[str]:
        """What the replay changed, by name."""
        after = self._fingerprints()
        return [name for name, crc in self.before.items() if after.get(name) != crc]


def _names(code: types.CodeType) -> Iterable[str]:
    """The global names ``code`` and the code nested in it (generator expressions, lambdas) use."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names(const)


def _programs(gen: types.GeneratorType) -> bool:
    """Whether ``gen`` runs the program's own code (the script's, a cell's, its folder's modules):
    a library's generator (tqdm's ``__iter__`` advancing its bar) does the library's work."""
    owner = ownership.PROGRAM
    if owner.globals is None or gen.gi_frame is None:
        return False
    if gen.gi_frame.f_globals is owner.globals:
        return True
    return owner.folder is not None and ownership.in_job_folder(os.path.realpath(gen.gi_code.co_filename),
                                                                [owner.folder])


def watch(it: Any, skip: Iterable[Any] = ()) -> Optional[Watch]:
    """A `Watch` of ``it`` if it is a generator of the program's not yet started, else None.
    ``skip``: objects whose changes do not matter (made afresh by the replay, or put back after it)."""
    if not isinstance(it, types.GeneratorType) or inspect.getgeneratorstate(it) != inspect.GEN_CREATED \
            or not _programs(it):
        return None
    return Watch(it, frozenset(id(o) for o in skip))


#: how many `quietly` windows are open: while any is, a `_Muted` stream drops what it is given
_muted = 0


class _Muted:
    """Stands for a standard stream inside `quietly`: drops what is written while the window is
    open and passes on what is written after it. Something made meanwhile may keep it (a logging
    handler, a default argument ``file=sys.stdout`` of a module imported then): it writes to the
    real stream afterwards, as it would have without the window."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        return len(text) if _muted else self._stream.write(text)

    def flush(self) -> None:
        if not _muted:
            self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def __reduce__(self) -> tuple:
        return _unmuted, (self._stream,)


def _unmuted(stream: Any) -> Any:
    return stream


@contextlib.contextmanager
def quietly(stderr: bool = True) -> Iterator[None]:
    """What a restore runs again of what the run did before its checkpoint (a replay's items, a
    rebuilt statement, the imports of the job's modules and of the libraries the load needs)
    prints nothing: the run printed it then. Output to ``sys.stdout`` (and ``sys.stderr``, unless
    ``stderr`` is False: the load's own warnings go there) is dropped and logging is off meanwhile
    (a generator's ``print("load", shard)``, an IterableDataset's ``logger.info("opening
    shards")``, transformers' ``print`` at import printed again at every restore). Output a worker
    process writes to the file descriptors is not."""
    global _muted
    disabled = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    _muted += 1
    try:
        with contextlib.redirect_stdout(_Muted(sys.stdout)), \
                contextlib.redirect_stderr(_Muted(sys.stderr)) if stderr else contextlib.nullcontext():
            yield
    finally:
        _muted -= 1
        logging.disable(disabled)
