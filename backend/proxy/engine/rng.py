"""Capture and restore the global random number generators.

Exact resume needs every generator the program draws from: python ``random``, the numpy global
RandomState, torch's CPU generator and every initialised CUDA device.  A snapshot holds only the
generators the program can have drawn from: torch's once torch is imported, numpy's once
``numpy.random`` is (see lazy.py), so a program that never imports them never loads them here.
Restoring a snapshot that holds one imports its library (the program had imported it anyway).
Capturing numpy is the slow part (~25 us), so callers that only need torch (a DataLoader's
``iter()``) ask for less.
"""
from __future__ import annotations

import random
from typing import Any, Optional

from . import lazy

RngState = dict[str, Any]


def capture(full: bool = True) -> RngState:
    """Snapshot the global generators; ``full=False`` takes torch (CPU and CUDA) only."""
    state: RngState = {}
    torch = lazy.torch()
    if torch is not None:
        state["torch"] = torch.get_rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
    if full:
        state["python"] = random.getstate()
        np_random = lazy.numpy_random()
        if np_random is not None:
            state["numpy"] = np_random.get_state()
    return state


def apply(state: Optional[RngState]) -> None:
    """Set the generators captured in ``state``; parts it lacks are left alone."""
    if not state:
        return
    if "torch" in state:
        import torch

        torch.set_rng_state(state["torch"])
        cuda = state.get("cuda")
        if cuda is not None and torch.cuda.is_available():
            n = min(len(cuda), torch.cuda.device_count())
            for index in range(n):
                torch.cuda.set_rng_state(cuda[index], index)
    if "python" in state:
        random.setstate(state["python"])
    if "numpy" in state:
        import numpy.random

        numpy.random.set_state(state["numpy"])


def reduce_generator(obj: Any, t: type) -> Optional[tuple]:
    """How a Python or numpy generator is saved where pickling's own way goes wrong, else None.

    The generator behind ``random.shuffle`` or ``numpy.random.rand`` is saved as a reference to
    the restoring process's: ``from random import shuffle`` binds a method of it, and pickled by
    value that method came back drawing from a copy the restore never set, while the module's
    functions drew from the global one (silently other numbers after a restore). Its state is
    `capture`'s. A subclass of ``random.Random`` is made without calling its ``__init__``
    (``Random.__reduce__`` calls the class with no arguments: the restore of a checkpoint of
    ``class R(random.Random): def __init__(self, seed)`` failed)."""
    if t is random.Random or t is random.SystemRandom:
        return (_global_generator, ("random",)) if obj is random._inst else None  # type: ignore[attr-defined]
    if isinstance(obj, random.Random):
        if isinstance(obj, random.SystemRandom):
            return None  # refused by its own getstate, with the reason
        return _random_of_class, (t, obj.getstate(), dict(vars(obj)))
    np_random = lazy.numpy_random()
    if np_random is not None and obj is getattr(getattr(np_random, "mtrand", None), "_rand", None):
        return _global_generator, ("numpy",)
    return None


#: the types `reduce_generator` looks at instances of (not decided by the type alone)
GENERATOR_TYPE_NAMES = ("Random", "RandomState")


def _global_generator(library: str) -> Any:
    if library == "random":
        return random._inst  # type: ignore[attr-defined]
    import numpy.random

    return numpy.random.mtrand._rand


def _random_of_class(cls: type, state: tuple, attributes: dict) -> random.Random:
    generator = cls.__new__(cls)
    random.Random.setstate(generator, state)
    vars(generator).update(attributes)
    return generator


#: ``@contextmanager`` functions that save the global generators when entered and set them back at
#: their end: (module, name); Lightning's ``isolate_rng`` wraps its sanity check and learning-rate finder
_FORKING = frozenset({("torch.random", "fork_rng"), ("lightning.pytorch.utilities.seed", "isolate_rng"),
                      ("pytorch_lightning.utilities.seed", "isolate_rng")})


def forks(manager: Any) -> bool:
    """Whether a with statement's context manager puts back, at its end, the generators it found
    when entered (``with torch.random.fork_rng():``). A restore enters it again, when the
    generators are not yet the checkpoint's: it must find what it found the first time, which
    the checkpoint records (runtime.py's `with_ctx`), or the run after the block draws from a
    fresh process's generators."""
    func = getattr(manager, "func", None)  # a @contextmanager's function (contextlib keeps it)
    return func is not None and (getattr(func, "__module__", None), getattr(func, "__name__", None)) in _FORKING


def equal(a: RngState, b: RngState) -> bool:
    """True when two snapshots describe the same generator positions (common parts only)."""
    if "torch" in a and "torch" in b:
        import torch

        if not torch.equal(a["torch"], b["torch"]):
            return False
        if "cuda" in a and "cuda" in b:
            if len(a["cuda"]) != len(b["cuda"]):
                return False
            if not all(torch.equal(x, y) for x, y in zip(a["cuda"], b["cuda"])):
                return False
    if "python" in a and "python" in b and a["python"] != b["python"]:
        return False
    if "numpy" in a and "numpy" in b:
        import numpy

        na, nb = a["numpy"], b["numpy"]
        if na[0] != nb[0] or na[2:] != nb[2:] or not numpy.array_equal(na[1], nb[1]):
            return False
    return True


# --------------------------------------------------------------------------- generators a program owns
def is_generator_object(obj: Any) -> bool:
    """A random number generator object of the program's own: ``random.Random``, numpy's
    ``Generator`` or ``RandomState``, a ``torch.Generator`` (not the global ones above)."""
    if isinstance(obj, random.Random) or lazy.is_torch_generator(obj):
        return True
    np_random = lazy.numpy_random()
    return np_random is not None and isinstance(obj, (np_random.Generator, np_random.RandomState))


def object_state(obj: Any) -> Any:
    """The position of a generator object (see `is_generator_object`), to set back with `set_object_state`."""
    if isinstance(obj, random.Random):
        return obj.getstate()
    if lazy.is_torch_generator(obj):
        return obj.get_state()
    if hasattr(obj, "bit_generator"):
        return obj.bit_generator.state
    return obj.get_state(legacy=False)


def set_object_state(obj: Any, state: Any) -> None:
    if isinstance(obj, random.Random):
        obj.setstate(state)
    elif lazy.is_torch_generator(obj):
        obj.set_state(state)
    elif hasattr(obj, "bit_generator"):
        obj.bit_generator.state = state
    else:
        obj.set_state(state)


def same_state(a: Any, b: Any) -> bool:
    """Two positions of one generator object are the same (tensors and arrays compared by value)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    if hasattr(a, "shape") and hasattr(b, "shape"):  # a tensor or an array
        return tuple(a.shape) == tuple(b.shape) and bool((a == b).all())
    return a == b
