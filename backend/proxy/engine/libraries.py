"""Safe points inside library trainers: named library modules rewritten as they are imported.

Many training loops are not the user's: ``Trainer.train()`` of Hugging Face transformers runs
its loop in ``transformers/trainer.py``.  The functions of the modules named here are rewritten
like the functions of the program (`rewrite.rewrite_library`: the module body itself runs as it
is), so the library's loops are safe points, and a checkpoint taken there records the library
frames on its stack like the program's own (`frames.user_chain`): a restore re-enters
``trainer.train()`` and, through it, the library's inner loop, with each frame's locals back.

The modules of the job's own folder (the script's, or the working directory of a cell), helper
modules the program imports from there, are rewritten the same way, unless
``SINGULARITY_REWRITE_FOLDER=0``: loops in their functions are the user's loops. Left out: the
service's own packages, anything under ``site-packages`` or ``dist-packages`` (a virtualenv
inside the folder) or a hidden folder, and packages' ``__init__``.

On by default for `DEFAULT_MODULES` (a short, tested list); a job may name more modules
(``submit(..., rewrite_modules=[...])``, ``--rewrite-module NAME``), which reach the process
that runs it as `ENV` (comma-separated). A named module that is already imported when the
program starts, is not Python source, or is a package's ``__init__`` is left as it is; its loops
are then no safe points, and a preempt that finds the program inside one is answered with
``checkpoint_failed`` naming the library function (`where.locate`).

Node and function ids of a library module lie in a range of their own, derived from its name
(`base_of`), so they are the same in every process that imports it.
"""
from __future__ import annotations

import copyreg
import functools
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys
import types
import weakref
import zlib
from typing import Any, Iterable, Optional, Sequence

from singularity_sdk.config import REWRITE_MODULES_ENV

from . import training_state
from .ownership import in_job_folder
from .rewrite import RT, rewrite_library

#: library modules rewritten unless the job says otherwise: transformers' `Trainer` loop.
#: ``transformers.trainer`` holds ``Trainer.train`` -> ``_inner_training_loop`` ->
#: ``_run_epoch`` -> ``get_batch_samples``; its DataLoader (accelerate's ``DataLoaderShard``)
#: iterates through a generator, made resumable by `shard_iterators`.
DEFAULT_MODULES: tuple[str, ...] = (
    "transformers.trainer",
    # Lightning's Trainer.fit down to its epoch loop and its validation loop, which runs through the
    # no-grad decorator of loops.utilities (``lightning`` and the older ``pytorch_lightning``)
    *(f"{package}.{module}" for package in ("lightning.pytorch", "pytorch_lightning")
      for module in ("trainer.trainer", "trainer.call", "loops.fit_loop", "loops.training_epoch_loop",
                     "loops.evaluation_loop", "loops.utilities")),
)
#: the environment variable naming extra modules (comma-separated); ``-`` first turns the defaults off
ENV = REWRITE_MODULES_ENV
#: "0" leaves the modules of the job's own folder as they are
FOLDER_ENV = "SINGULARITY_REWRITE_FOLDER"
#: never rewritten from a job's folder: the service's own code (a job run from its checkout)
OWN_PACKAGES = frozenset({"backend", "singularity_sdk", "jupyter_ext"})
#: a library module's ids are ``base + 1 ...``; ranges are this wide
SPAN = 1_000_000


def base_of(name: str) -> int:
    """The id range of module ``name``: far above any submitted program's ids, stable across processes."""
    return (zlib.crc32(name.encode()) % 2000 + 1) * SPAN


def modules_from_env(value: Optional[str] = None) -> list[str]:
    """The modules to rewrite: `DEFAULT_MODULES` plus those of `ENV` (``-`` alone drops the defaults)."""
    value = os.environ.get(ENV, "") if value is None else value
    names = [n.strip() for n in value.split(",") if n.strip()]
    defaults = [] if "-" in names else list(DEFAULT_MODULES)
    return list(dict.fromkeys(defaults + [n for n in names if n != "-"]))


class Registry:
    """What the rewritten library modules add to the program: nodes, functions, call spans."""

    def __init__(self) -> None:
        self.nodes: dict[int, Any] = {}
        self.defs: dict[int, Any] = {}
        self.call_spans: dict[int, dict] = {}
        self.modules: dict[str, types.ModuleType] = {}
        self.bases: dict[int, str] = {}
        #: changes whenever a module is added (the program re-merges its tables)
        self.version = 0
        self.runtime: Any = None
        #: named modules that could not be rewritten, and why
        self.skipped: dict[str, str] = {}

    def add(self, name: str, rewritten: Any, module: types.ModuleType) -> None:
        self.nodes.update(rewritten.nodes)
        self.defs.update(rewritten.defs)
        self.call_spans.update(rewritten.call_spans)
        self.modules[name] = module
        self.version += 1


REGISTRY = Registry()


def rewritten_distributions() -> dict[str, str]:
    """The installed distributions (name -> version) whose modules were rewritten in this
    process: a checkpoint's position inside them is valid only for the same version. Modules of
    the job's own folder belong to no distribution and are not listed."""
    if not REGISTRY.modules:
        return {}
    owners = _distributions_by_package()
    out: dict[str, str] = {}
    for name in REGISTRY.modules:
        if _finder.in_folder(name):
            continue
        for dist in owners.get(name.partition(".")[0], ()):
            try:
                out[dist] = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                pass
    return out


@functools.lru_cache(maxsize=1)
def _distributions_by_package() -> dict[str, list[str]]:
    return dict(importlib.metadata.packages_distributions())


class _RewritingLoader(importlib.machinery.SourceFileLoader):
    """Compiles the module's source through `rewrite_library` (never from or into a ``.pyc``).
    ``own``: a module of the job's folder (its ``next()`` calls are counted too), not a named library."""

    def __init__(self, fullname: str, path: str, own: bool = False) -> None:
        super().__init__(fullname, path)
        self.own = own

    def get_code(self, fullname: str) -> types.CodeType:  # type: ignore[override]
        path = self.get_filename(fullname)
        source = importlib.util.decode_source(self.get_data(path))
        base = base_of(fullname)
        owner = REGISTRY.bases.get(base)
        if owner is not None and owner != fullname:
            REGISTRY.skipped[fullname] = f"its id range is taken by {owner}"
            return compile(source, path, "exec", dont_inherit=True)
        rewritten = rewrite_library(source, path, base, count_next=self.own, module=fullname,
                                    rewritten=frozenset(_finder.names))
        self._rewritten = rewritten
        REGISTRY.bases[base] = fullname
        return compile(rewritten.tree, path, "exec", dont_inherit=True)

    def exec_module(self, module: types.ModuleType) -> None:
        if REGISTRY.runtime is not None:  # else the name resolves through builtins to the dormant runtime
            module.__dict__[RT] = REGISTRY.runtime
        code = self.get_code(module.__name__)
        rewritten = getattr(self, "_rewritten", None)
        if rewritten is not None:
            REGISTRY.add(module.__name__, rewritten, module)
        exec(code, module.__dict__)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.names: set[str] = set()
        #: the job's own folders, whose modules are the user's (`in_folder`)
        self.folders: list[str] = []
        self._tops: dict[str, bool] = {}

    def in_folder(self, fullname: str) -> bool:
        """Whether ``fullname``'s top-level name is a module or package of one of `folders`
        (cheap: the import system is asked only for those)."""
        top = fullname.partition(".")[0]
        if not self.folders or top in OWN_PACKAGES:
            return False
        found = self._tops.get(top)
        if found is None:
            found = any(os.path.isfile(os.path.join(f, top + ".py")) or os.path.isdir(os.path.join(f, top))
                        for f in self.folders)
            self._tops[top] = found
        return found

    def _user_source(self, origin: str) -> bool:
        return in_job_folder(os.path.realpath(origin), self.folders)

    def find_spec(self, fullname: str, path: Optional[Sequence[str]],
                  target: Optional[types.ModuleType] = None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname in REGISTRY.modules:
            return None
        named = fullname in self.names
        if not named and not self.in_folder(fullname):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        plain = spec is not None and spec.origin is not None and spec.origin.endswith(".py") \
            and spec.submodule_search_locations is None
        if not named:  # the job's own module, or nothing of ours to do
            return self._rewriting(fullname, spec, own=True) if plain and self._user_source(spec.origin) else None
        if not plain:
            REGISTRY.skipped.setdefault(fullname, "not a plain Python source module")
            return None
        return self._rewriting(fullname, spec)

    @staticmethod
    def _rewriting(fullname: str, spec: Any, own: bool = False) -> Any:
        spec.loader = _RewritingLoader(fullname, spec.origin, own)
        spec.cached = None
        return spec


_finder = _Finder()


def install(names: Optional[Iterable[str]] = None, folder: Optional[str] = None) -> None:
    """Rewrite ``names`` (default: `modules_from_env`) when they are imported from now on, and
    the modules of ``folder`` (the job's own) unless `FOLDER_ENV` is "0".

    The caller has made the dormant runtime resolvable (`runtime.install_dormant`): functions of
    these modules find it through builtins while no program runs."""
    if folder and os.environ.get(FOLDER_ENV, "1") != "0":
        real = os.path.realpath(folder)
        if real not in _finder.folders:
            _finder.folders.append(real)
            _finder._tops.clear()
    wanted = list(modules_from_env() if names is None else names)
    for name in wanted:
        if name in sys.modules and name not in REGISTRY.modules:
            REGISTRY.skipped.setdefault(name, "it was imported before the job's engine started")
    _finder.names.update(wanted)
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
    shard_iterators()


def bind(runtime: Any) -> None:
    """Point the rewritten modules at ``runtime`` (the program's, while it runs), or (None) at the
    dormant one, which their functions then find through builtins."""
    REGISTRY.runtime = runtime
    for module in REGISTRY.modules.values():
        if runtime is not None:
            module.__dict__[RT] = runtime
        else:
            module.__dict__.pop(RT, None)


# --------------------------------------------------------------------------- accelerate's DataLoaderShard
def shard_iterators() -> None:
    """Make the iterators of accelerate's ``DataLoaderShard`` checkpointable.

    ``DataLoaderShard.__iter__`` is a generator (it iterates one batch ahead), and a live
    generator cannot be saved.  Wrapped, it returns a `ShardIterator`, which pickles as the
    loader, the RNG at its first batch (when the generator's body starts: it creates the
    underlying DataLoader iterator then) and the number of batches it yielded.  A restored one,
    at its first ``next``, runs the generator again from the start under that RNG, skips as
    many batches, and puts back the loader's attributes (and its gradient state's), the RNG
    and the loader's generators as they were: it then yields what the original would have.
    """
    from . import lazy

    lazy.when_imported("accelerate.data_loader", _patch_shard)


def _patch_shard(module: Any) -> None:
    cls = getattr(module, "DataLoaderShard", None)
    if cls is None or getattr(cls.__iter__, "_sg_patched", False):
        return
    original = cls.__iter__

    def __iter__(self: Any) -> "ShardIterator":
        return ShardIterator(self, original)

    __iter__._sg_patched = True  # type: ignore[attr-defined]
    __iter__.__wrapped_iter__ = original  # type: ignore[attr-defined]
    __iter__.__doc__ = original.__doc__
    cls.__iter__ = __iter__


class ShardIterator:
    """An iterator over a ``DataLoaderShard`` that a checkpoint can hold (see `shard_iterators`)."""

    def __init__(self, loader: Any, original: Any, first: Optional[tuple] = None, yielded: int = 0) -> None:
        self.loader = loader
        self._original = original
        self._gen: Any = None
        self.first = first
        self.yielded = yielded
        self._replay = yielded if first is not None else 0

    def __iter__(self) -> "ShardIterator":
        return self

    def __next__(self) -> Any:
        if self._gen is None:
            if self._replay:
                self._catch_up()
            else:
                self.first = training_state.loader_snapshot(self.loader, True)
                self._gen = self._original(self.loader)
        item = next(self._gen)
        self.yielded += 1
        return item

    def _catch_up(self) -> None:
        from . import rng
        from ..checkpoint.errors import CheckpointError

        loader = self.loader
        gs = getattr(loader, "gradient_state", None)
        saved = dict(loader.__dict__), (dict(gs.__dict__) if gs is not None else None)
        now = training_state.loader_snapshot(loader, True)
        try:
            assert self.first is not None
            training_state.apply_loader_snapshot(self.first)
            gen = self._original(loader)
            after_first = None
            for i in range(self._replay):
                next(gen)
                if i == 0:
                    after_first = rng.capture(full=True)
            if self._replay > 1 and after_first is not None and not rng.equal(after_first, rng.capture(full=True)):
                raise CheckpointError(
                    "the DataLoader of the library trainer drew random numbers while loading its batches; "
                    "they were interleaved with training steps and cannot be replayed exactly")
        finally:
            loader.__dict__.clear()
            loader.__dict__.update(saved[0])
            if gs is not None and saved[1] is not None:
                gs.__dict__.clear()
                gs.__dict__.update(saved[1])
            training_state.apply_loader_snapshot(now)
        self._gen = gen
        self._replay = 0

    def __reduce__(self) -> tuple:
        return _restore_shard_iterator, (self.loader, self.first, self.yielded)

    def __repr__(self) -> str:
        return f"<ShardIterator over {type(self.loader).__name__}, {self.yielded} batches>"


def _restore_shard_iterator(loader: Any, first: Optional[tuple], yielded: int) -> ShardIterator:
    original = getattr(type(loader).__iter__, "__wrapped_iter__", None)
    if original is None:  # pragma: no cover - the class is patched when its module is imported
        raise RuntimeError("accelerate's DataLoaderShard was imported before the job's engine started")
    return ShardIterator(loader, original, first, yielded)


# --------------------------------------------------------------------------- pickling library objects
def new_instance(cls: type) -> Any:
    """An empty instance (for a class whose ``__class__`` lies, which ``copyreg.__newobj__`` refuses)."""
    return cls.__new__(cls)


def _weakref_to(obj: Any) -> Any:
    return weakref.ref(obj)


class _Gone:
    pass


def _dead_weakref() -> Any:
    return weakref.ref(_Gone())  # the temporary dies at once


def _shared_state_instance(cls: type) -> Any:
    obj = cls.__new__(cls)
    obj.__dict__ = cls._shared_state  # type: ignore[attr-defined]
    return obj


def reduce(obj: Any) -> Any:
    """How the checkpoint saves what trainer libraries hold and plain pickling refuses or breaks.

    * a plain weak reference (accelerate's ``GradientState`` keeps its DataLoaders so): saved as a
      reference to its object, which the checkpoint then holds too (a dead one stays dead); a
      ``WeakValueDictionary`` likewise, with its live entries (an entry whose value nothing else
      the checkpoint saves is gone once the load ends, as it would be in the stopping process);
    * an instance of a shared-state ("Borg") class, whose ``__dict__`` is its class's
      ``_shared_state`` (accelerate's ``PartialState``, ``AcceleratorState``, ``GradientState``):
      restored into the class's shared state, so instances made after the restore see it too;
    * Lightning objects whose ``__getstate__`` leaves out what a process handing them to another
      could not send (`_LIGHTNING_WHOLE`): a ``LightningModule`` its trainer, the combined loader's
      iterator its DataLoader iterators, the tqdm progress bar its bars, the TensorBoard logger its
      writer (unflushed: the last values logged were lost at a stop), the W&B logger its run (a
      restore started a second one). A checkpoint saves all of these, so they are saved whole.
    """
    t = type(obj)
    if _lightning_whole(t):
        return copyreg.__newobj__, (t,), dict(obj.__dict__)
    if t is weakref.ReferenceType:
        target = obj()
        return (_dead_weakref, ()) if target is None else (_weakref_to, (target,))
    if t is weakref.WeakValueDictionary:  # its entries hold `KeyedRef`s, which do not pickle
        return weakref.WeakValueDictionary, (), None, None, iter(list(obj.items()))
    shared = getattr(t, "_shared_state", None)
    if type(shared) is dict and getattr(obj, "__dict__", None) is shared:
        return _shared_state_instance, (t,), dict(shared)
    return NotImplemented


#: Lightning classes saved whole: (module under ``lightning.``, class); ``pytorch_lightning`` and
#: ``lightning_fabric`` are the same modules under their older names
_LIGHTNING_WHOLE = frozenset({
    ("pytorch.core.module", "LightningModule"),  # its trainer
    ("pytorch.utilities.combined_loader", "_ModeIterator"),  # its DataLoader iterators
    ("pytorch.callbacks.progress.tqdm_progress", "TQDMProgressBar"),  # its bars
    ("fabric.loggers.tensorboard", "TensorBoardLogger"),  # its SummaryWriter, flushed by the checkpoint
    ("pytorch.loggers.wandb", "WandbLogger"),  # its W&B run, continued (wandb_runs.py), not a second one
})
_LIGHTNING_PACKAGES = (("lightning.", ""), ("pytorch_lightning.", "pytorch."), ("lightning_fabric.", "fabric."))


def _lightning_whole(t: type) -> bool:
    for c in t.__mro__:
        module = c.__module__
        for package, short in _LIGHTNING_PACKAGES:
            if module.startswith(package) and (short + module[len(package):], c.__name__) in _LIGHTNING_WHOLE:
                return True
    return False


# --------------------------------------------------------------------------- a one-rank job's process group
class ProcessGroupMarker:
    """Stands, in a checkpoint, for "a default process group existed": loading it creates one.

    accelerate, in a job's process (``LOCAL_RANK`` is set), initialises a one-process gloo group
    and wraps the model in ``DistributedDataParallel``, whose unpickling needs the group. A
    data-parallel job's worker creates the group before the load; a one-rank job's would not.
    """

    def __init__(self, backend: str) -> None:
        self.backend = backend

    @classmethod
    def now(cls) -> Optional["ProcessGroupMarker"]:
        dist = sys.modules.get("torch.distributed")
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return None
        return cls(str(dist.get_backend()))

    def __reduce__(self) -> tuple:
        return ensure_process_group, (self.backend,)


def ensure_process_group(backend: str) -> None:
    """Create the default process group (env:// rendezvous) unless one exists (see `ProcessGroupMarker`)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend=backend if backend in ("gloo", "nccl", "mpi") else None)
