"""torch and numpy, touched only once the program itself has imported them.

Every job's worker imports `backend.proxy`, and importing torch costs about a second of start-up.
The engine needs torch and numpy only for things the program made with them: an object cannot be a
tensor or a DataLoader, and torch's generators cannot have been drawn from, unless torch is in
``sys.modules``; numpy's global RandomState exists only once ``numpy.random`` is.  So the engine
asks the helpers here instead of importing either library, and a job that never imports them
never pays for them.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any, Callable, NamedTuple, Optional, Sequence

Callback = Callable[[types.ModuleType], None]


def torch() -> Optional[types.ModuleType]:
    """The torch module if the program (or anything it ran) imported it; never imports it."""
    return sys.modules.get("torch")


def numpy_random() -> Optional[types.ModuleType]:
    """``numpy.random`` if imported: the global RandomState is created by that import."""
    return sys.modules.get("numpy.random")


class _TorchTypes(NamedTuple):
    dataloader: type
    iterable_dataset: type
    samplers: tuple[type, ...]
    tensor: type
    generator: type
    typed_storage: type
    rng_free_codes: frozenset


_torch_types: Optional[_TorchTypes] = None


def _load_torch_types() -> _TorchTypes:
    import torch
    from torch.utils.data import DataLoader, IterableDataset
    from torch.utils.data import sampler as s

    samplers: tuple[type, ...] = (s.SequentialSampler, s.RandomSampler, s.SubsetRandomSampler,
                                  s.WeightedRandomSampler, s.BatchSampler)
    try:  # DistributedSampler draws from its own seed, not from the global generators
        from torch.utils.data.distributed import DistributedSampler
        samplers += (DistributedSampler,)
    except ImportError:  # pragma: no cover
        pass
    # nn.Module's member generators (parameters() etc.) draw no random numbers
    codes = set()
    for name in ("parameters", "named_parameters", "buffers", "named_buffers", "children",
                 "named_children", "modules", "named_modules", "_named_members"):
        fn = getattr(torch.nn.Module, name, None)
        if fn is not None and hasattr(fn, "__code__"):
            codes.add(fn.__code__)
    return _TorchTypes(DataLoader, IterableDataset, samplers, torch.Tensor, torch.Generator,
                       torch.storage.TypedStorage, frozenset(codes))


def torch_types() -> Optional[_TorchTypes]:
    """torch's classes the engine tests against, or None while torch is not imported (cheap)."""
    global _torch_types
    if _torch_types is None and "torch" in sys.modules:
        _torch_types = _load_torch_types()
    return _torch_types


def is_dataloader(obj: Any) -> bool:
    t = torch_types()
    return t is not None and isinstance(obj, t.dataloader)


def is_iterable_dataset(obj: Any) -> bool:
    t = torch_types()
    return t is not None and isinstance(obj, t.iterable_dataset)


def is_builtin_sampler(obj: Any) -> bool:
    """A torch sampler whose randomness comes from the torch generators (or its own seed) only."""
    t = torch_types()
    return t is not None and isinstance(obj, t.samplers)


def is_torch_generator(obj: Any) -> bool:
    t = torch_types()
    return t is not None and isinstance(obj, t.generator)


def is_storage(obj: Any) -> bool:
    """A torch storage (typed or untyped): what torch.save writes out of line."""
    t = torch_types()
    if t is None:
        return False
    return isinstance(obj, t.typed_storage) or sys.modules["torch"].is_storage(obj)


def is_array(obj: Any) -> bool:
    """A numpy array or a torch tensor (a sequence: iter() again and skip to resume)."""
    np = sys.modules.get("numpy")
    if np is not None and isinstance(obj, np.ndarray):
        return True
    t = torch_types()
    return t is not None and isinstance(obj, t.tensor)


def is_rng_free_generator(obj: Any) -> bool:
    """A generator of nn.Module's members (``model.parameters()``): it draws no random numbers."""
    t = torch_types()
    return t is not None and getattr(obj, "gi_code", None) in t.rng_free_codes


# --------------------------------------------------------------------------- import hook
class _WrappedLoader(importlib.abc.Loader):
    """Runs the real loader, then the callbacks; hands the module its real loader before it runs."""

    def __init__(self, loader: importlib.abc.Loader, callbacks: list[Callback]) -> None:
        self._loader = loader
        self._callbacks = callbacks

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[types.ModuleType]:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        for callback in self._callbacks:
            callback(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds a watched module with the other finders and wraps its loader (see `when_imported`)."""

    def __init__(self) -> None:
        self.pending: dict[str, list[Callback]] = {}

    def find_spec(self, fullname: str, path: Optional[Sequence[str]],
                  target: Optional[types.ModuleType] = None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname not in self.pending:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _WrappedLoader(spec.loader, self.pending.pop(fullname))
        if not self.pending:
            sys.meta_path.remove(self)
        return spec


_after_import = _AfterImport()


def when_imported(name: str, callback: Callback) -> None:
    """Call ``callback(module)`` as soon as ``name`` is imported: now, if it already is.

    The CLI configures torch's thread pools this way, without importing torch for a program
    that never does; the callback runs before the importing statement continues.
    """
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    _after_import.pending.setdefault(name, []).append(callback)
    if _after_import not in sys.meta_path:
        sys.meta_path.insert(0, _after_import)
