"""Saving and loading a program's state: position, namespace, RNG, loop iterators.

Everything of one rank goes into a single ``torch.save(graph, f, pickle_module=<cloudpickle>)``
call, so objects shared between variables, loop iterators and the items a loop is working on stay
shared after a restore, and tensor storages are written once, device-independently.  When torch
has not been imported (so there can be no tensors) the same graph is written as one plain pickle
by the same pickler instead, sparing a torch-free job the torch import; `load_graph` tells the
two apart by torch's zip signature.

With several ranks (data-parallel replicas holding the same parameters and optimizer state) the
graph is pickled by `dedup.dump` instead: every tensor storage goes once into the checkpoint's
shared ``blobs/`` folder under its sha256, and the rank file is a plain pickle of the graph with
references to them, so a W-rank checkpoint is about the size of one rank's.  A pickle rank file
next to a ``blobs/`` folder is read back with `dedup.load`.

Our pickler extends cloudpickle in four ways:

* functions whose ``__globals__`` is the program's namespace are pickled by value but *without*
  a private copy of their globals: on load they get the restored namespace itself, so a later
  top-level rebinding (or a ``global`` statement) is seen by them exactly as before;
* classes defined in the program are always pickled by value (the namespace may be registered as
  a module, but it is empty when a restore starts);
* open regular files are saved with their place and written bytes and re-opened (open_files.py)
  instead of being silently turned into a StringIO (cloudpickle's default); other streams raise,
  and closed files (left behind by ``with open(...) as f``) come back as a `ClosedFile` placeholder;
* a DataLoader keeps the persistent-workers iterator it holds (training_state.py re-makes it,
  worker_rng.py puts its workers' generators back).

When the state cannot be pickled every variable is probed on its own (storages are not copied by
the probe); variables created by one already executed simple top-level statement are rebuilt on
restore by re-running that statement (ElasticNotebook-style), anything else fails the checkpoint
with the names and types of the culprits.
"""
from __future__ import annotations

import ast
import contextlib
import contextvars
import copyreg
import functools
import importlib.util
import io
import os
import pickle
import platform
import random
import sys
import tempfile
import time
import types
import warnings
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import cloudpickle

from . import (array_views, autograd_graphs, background, canonical_strings, container_subclasses, context,
               exit_handlers, finalizers, getattr_classes, handles, held_managers, hydra_state, imported_submodules,
               iterators, lazy, libraries, library_patches, mlflow_runs, module_state, open_files, ownership,
               process_settings, replay_effects, rng, resumable_generators, scoped_modes, sentinels, set_layouts,
               torch_hooks, training_state, type_memos, wandb_runs)
from ..checkpoint import digest, fingerprint, reading
from ..checkpoint.errors import CheckpointError, CheckpointFailure
from .loops import BlockFrame, ForFrame, IfFrame, WhileFrame
from .ports import RuntimeView
from .rewrite import PREFIX, RT
from ..checkpoint.store import CheckpointDamaged, CheckpointStore, DigestMismatch, RankFile, expected_digest

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from ..checkpoint.store import CheckpointRef

try:
    from cloudpickle import cloudpickle as _cp

    _make_function = _cp._make_function
    _function_getstate = _cp._function_getstate
    _function_setstate = _cp._function_setstate
    _make_empty_cell = _cp._make_empty_cell
    _dynamic_class_reduce = _cp._dynamic_class_reduce
    _class_reduce = _cp._class_reduce
    _make_skeleton_class = _cp._make_skeleton_class
    _code_reduce = _cp._code_reduce
    _should_pickle_by_reference = _cp._should_pickle_by_reference
    extract_code_globals = _cp._extract_code_globals
except AttributeError as _e:  # pragma: no cover
    raise ImportError(f"backend.proxy needs cloudpickle 3.x internals ({_e}); install cloudpickle>=3,<4") from _e

GRAPH_FORMAT = 1
#: the first bytes of every file torch.save writes (a zip archive); a plain pickle starts with 0x80
_ZIP_MAGIC = b"PK\x03\x04"
#: a pickle of protocol 5: what `dedup.dump` writes (a torch-free graph is protocol 4)
_DEDUP_MAGIC = b"\x80\x05"
#: not saved: the restoring process sets its own (``__file__``: the script where it runs now, see context.py)
_SKIP_NAMES = frozenset({"__builtins__", "__loader__", "__spec__", "__file__"})
#: (namespace, own): functions whose globals are ``namespace`` are saved bound to it; ``own`` says it is
#: the program's own namespace (restored from the checkpoint, so everything defined there goes by value)
_SAVE_NS: contextvars.ContextVar[Optional[tuple[dict, bool]]] = contextvars.ContextVar("sg_save_ns", default=None)
#: ids of the targets of the redirect_stdout/redirect_stderr statements a checkpoint is inside
_REDIRECT_TARGETS: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar("sg_redirects", default=frozenset())
_LOAD_NS: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar("sg_load_ns", default=None)
_PICKLE_ERRORS = (pickle.PickleError, TypeError, AttributeError, NotImplementedError, RuntimeError, ValueError)


def _current_namespace() -> dict:
    ns = _LOAD_NS.get()
    if ns is None:
        raise pickle.UnpicklingError("a checkpoint function needs its program namespace; load it with "
                                     "backend.proxy, not plain torch.load")
    return ns


class _NamespaceRef:
    """Stands for "the program's namespace" inside a pickle."""

    def __reduce__(self) -> tuple:
        return _current_namespace, ()


class _ModuleGlobalsRef:
    """Stands for "the globals of module ``name``" inside a pickle: a function a rewritten module
    made (a closure its helper returned, DeiT's ``print`` that ``setup_for_distributed`` puts in
    ``builtins``) calls the runtime through its module's ``__sg_rt__``; a private copy of the
    globals would carry a copy of the runtime itself (with its threads: refused), and would not
    see the module's globals as the restore sets them."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __reduce__(self) -> tuple:
        return _module_globals, (self.name,)


def _module_globals(name: str) -> dict:
    return vars(importlib.import_module(name))


def _function_over(fn: types.FunctionType, globals_ref: Any) -> tuple:
    """``fn`` by value, its globals not copied but ``globals_ref`` (a reference resolved on load),
    its cells themselves (`CellType`), so closures of one factory still share theirs."""
    state, slotstate = _function_getstate(fn)
    slotstate["__globals__"] = {}
    slotstate["__closure__"] = None
    return (_make_function, (fn.__code__, globals_ref, None, None, fn.__closure__),
            (state, slotstate), None, None, _function_setstate)


def _rewritten_module_of(fn: types.FunctionType) -> Optional[str]:
    """The name of the module whose globals ``fn`` has, when it is a module the engine rewrote
    (its globals hold ``__sg_rt__``), else None (the program's namespace, a cell's globals)."""
    name = fn.__globals__.get("__name__")
    module = sys.modules.get(name) if isinstance(name, str) else None
    return name if module is not None and vars(module) is fn.__globals__ and name != "__main__" else None


def _std_stream_name(obj: Any) -> Optional[str]:
    for name in ("stdout", "stderr", "stdin"):
        if obj is getattr(sys, f"__{name}__", None):
            return name
    for name in ("stdout", "stderr", "stdin"):
        # a file the program opened is sys.stdout while a `redirect_stdout(f)` the safe point is
        # inside is active: it is saved as the file it is (the restore enters the redirect again)
        if obj is getattr(sys, name, None) and id(obj) not in _REDIRECT_TARGETS.get():
            return name
    return process_settings.start_stream_name(obj)  # what a job's tee object wraps


class ClosedFile:
    """What a closed file becomes after a restore: its name and mode; any I/O raises like a closed file."""

    closed = True

    def __init__(self, name: str, mode: str) -> None:
        self.name = name
        self.mode = mode

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise ValueError(f"I/O operation on closed file {self.name!r}")

    def __repr__(self) -> str:
        return f"<closed file {self.name!r} mode={self.mode!r}>"


#: types whose every instance the rules of `ProxyPickler.reducer_override` leave to plain pickling:
#: the rules ask a dozen questions of an object, and a checkpoint meets the same few types (loggers,
#: handlers, modules, their dicts) thousands of times, so each type is asked once a process
_PLAIN_TYPES: set[type] = type_memos.new_set()


def _decided_by_type(obj: Any, t: type) -> bool:
    """Whether the rules' answer for ``obj`` (plain pickling) holds for every instance of ``t``:
    all of them but these look at the type alone."""
    torch_types = lazy.torch_types()
    return not issubclass(t, type) and t not in (types.FunctionType, types.BuiltinFunctionType, types.GeneratorType,
                                                 weakref.finalize, memoryview) \
        and not isinstance(obj, (io.IOBase, types.ModuleType)) and t.__name__ not in ("memmap", "NpzFile") \
        and not (torch_types is not None and isinstance(obj, torch_types.tensor)) \
        and type(getattr(t, "_shared_state", None)) is not dict and not array_views.is_array(obj) \
        and not sentinels.named_instances(t) and not (isinstance(obj, random.Random) or t.__name__ in rng.GENERATOR_TYPE_NAMES)


def _fill_cell(cell: types.CellType, state: tuple) -> None:
    cell.cell_contents = state[0]


def _code_named(args: tuple, filename: str) -> types.CodeType:
    """A code object as cloudpickle rebuilds it, under its own file name again."""
    return types.CodeType(*args).replace(co_filename=filename)


#: classes `_make_class_answering_to` made: the program's own, whose hooks ran when it defined them
_MADE_BY_VALUE: "weakref.WeakSet[type]" = weakref.WeakSet()


def _own_bases(bases: tuple) -> list[type]:
    """The classes among ``bases`` and their ancestors that a restore made from the program's code."""
    return list({c: None for b in bases if isinstance(b, type) for c in b.__mro__ if c in _MADE_BY_VALUE})


def _make_class_answering_to(tracker_id: Optional[str], *args: Any) -> type:
    """A class the program's namespace defines, made anew, then registered under the
    cloudpickle tracker id it had.

    Made anew: an earlier copy in this process (a restore in the process that stopped) has
    methods that still see the old namespace. Registered: a class a notebook sent with the cell
    (by value, with the notebook's tracker id) must keep that id after a restore, or the cell's
    variables pulled back would hold instances of a new class: ``isinstance(model, Net)`` false
    in the notebook.

    The bases' ``__init_subclass__`` hooks do not run: the class was made, and its hooks ran,
    when the program defined it; their effects (a registry, a count) are in the checkpoint, and
    running them again while the namespace is still loading raised ``NameError`` on the base's
    own name, or counted the class twice."""
    hooks = [(base, base.__dict__["__init_subclass__"]) for base in _own_bases(args[2])
             if "__init_subclass__" in base.__dict__]
    for base, _hook in hooks:
        type.__delattr__(base, "__init_subclass__")
    try:
        cls = _make_skeleton_class(*args)
    finally:
        for base, hook in hooks:
            type.__setattr__(base, "__init_subclass__", hook)
    _MADE_BY_VALUE.add(cls)
    if tracker_id is not None:
        with _cp._DYNAMIC_CLASS_TRACKER_LOCK:
            _cp._DYNAMIC_CLASS_TRACKER_BY_ID[tracker_id] = cls
            _cp._DYNAMIC_CLASS_TRACKER_BY_CLASS[cls] = tracker_id
    return cls


class ProxyPickler(cloudpickle.Pickler):
    """cloudpickle, plus the namespace-aware rules described in the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._array_roots: set[int] = set()  # see array_views

    def reducer_override(self, obj: Any) -> Any:
        t = type(obj)
        if t is OrderedDict:  # torch's global hook dicts, by identity (OrderedDict is otherwise plain)
            reduced = torch_hooks.reduce_global_dict(obj)
            if reduced is not NotImplemented:
                return reduced
        if t in _PLAIN_TYPES:
            return NotImplemented
        reduced = self._reduce(obj, t)
        if reduced is NotImplemented and _decided_by_type(obj, t):
            _PLAIN_TYPES.add(t)
        return reduced

    def _reduce(self, obj: Any, t: type) -> Any:
        """The rules; a rule that looks at more than the type must be excepted in `_decided_by_type`."""
        if t is set_layouts.Pending:  # last in the graph: every set is in the memo by now
            return set_layouts.reduce_pending(self.memo)
        if t is finalizers.Pending:  # near the end: the objects the finalizers watch are in the memo
            return finalizers.reduce_pending(self.memo)
        if t is weakref.finalize:
            return finalizers.reduce_finalizer(obj)
        if torch_hooks.is_handle(obj):
            return torch_hooks.reduce_handle(obj)
        ns, own = _SAVE_NS.get() or (None, False)
        if t is types.GeneratorType:
            reduced = resumable_generators.reduce(obj)
            if reduced is not None:  # else plain pickling fails, naming it (handles.py)
                return reduced
        if t is types.CodeType:
            # cloudpickle names every code object "<dynamic-code>": a restored function's
            # tracebacks would lose their source lines, and ``__code__.co_filename`` its file
            return _code_named, (_code_reduce(obj)[1], obj.co_filename)
        if t is types.FunctionType and ns is not None and obj.__globals__ is ns \
                and (own or not _should_pickle_by_reference(obj)):
            # the cells themselves (`CellType` below), so two closures of one factory
            # (`update, get_best = make_tracker()`) still share theirs after a restore
            return _function_over(obj, _NamespaceRef())
        if t is types.FunctionType and RT in obj.__globals__ and not _should_pickle_by_reference(obj):
            module = _rewritten_module_of(obj)
            if module is not None:  # a closure or a replaced method of a rewritten module (a helper's)
                return _function_over(obj, _ModuleGlobalsRef(module))
        if own and isinstance(obj, type) and ns is not None \
                and getattr(obj, "__module__", None) == ns.get("__name__") and ns.get(obj.__name__) is obj:
            reduced = list(_dynamic_class_reduce(obj))
            if reduced[0] is _make_skeleton_class:
                args = list(reduced[1])
                tracker, args[4] = args[4], None
                reduced[0], reduced[1] = _make_class_answering_to, (tracker, *args)
            return tuple(reduced)
        if isinstance(obj, type):
            # any other class saved by value (defined in a function, a helper module saved by
            # value): made the same way, without running its bases' hooks again
            reduced = _class_reduce(obj)
            if reduced is NotImplemented or reduced[0] is not _make_skeleton_class:
                return reduced
            return (_make_class_answering_to, (None, *reduced[1]), *reduced[2:])
        if isinstance(obj, types.ModuleType) and t is not types.ModuleType \
                and sys.modules.get(obj.__name__) is obj:
            # a module that is an instance of a subclass (torch.backends.cudnn): by name, as
            # cloudpickle does plain modules (it fails on these, and on every function using one)
            return importlib.import_module, (obj.__name__,)
        if t is types.BuiltinFunctionType:  # print, when the program has replaced builtins.print
            reduced = library_patches.reduce_replaced_builtin(obj)
            if reduced is not NotImplemented:
                return reduced
        if t is types.CellType:  # made empty, then filled: a cell holding its own function is fine
            try:
                return _make_empty_cell, (), (obj.cell_contents,), None, None, _fill_cell
            except ValueError:
                return _make_empty_cell, ()
        sentinel = sentinels.reduce(obj, t) or rng.reduce_generator(obj, t)  # MISSING; random's own generator
        if sentinel is not None:
            return sentinel
        reduced = container_subclasses.reduce(obj, t)  # class LRU(OrderedDict) with __init__(self, cap)
        if reduced is not NotImplemented:
            return reduced
        if array_views.is_array(obj):
            return array_views.reduce(obj, self._array_roots)
        if t is memoryview:
            return array_views.reduce_memoryview(obj)
        if isinstance(obj, io.IOBase):
            stream = _std_stream_name(obj)
            if stream is not None:
                return getattr, (sys, stream)
            if obj.closed:  # e.g. left behind by `with open(...) as f:`; nothing to resume in it
                return ClosedFile, (str(getattr(obj, "name", "")), str(getattr(obj, "mode", "")))
            if open_files.is_open_file(obj):  # re-opened with its bytes and place
                return open_files.reduce(obj)
            if not isinstance(obj, (io.BytesIO, io.StringIO)):  # those two pickle as they are
                raise pickle.PicklingError(
                    f"cannot save an open stream ({obj!r}) that is not a plain file on disk (a compressed "
                    f"file's compressor, a pipe or a socket has state outside the process's reach): open "
                    f"and close it inside the loop body (append mode), or write a plain file")
        if t.__name__ == "memmap" and t.__module__ == "numpy":
            reduced = open_files.reduce_memmap(obj)
            if reduced is not NotImplemented:
                return reduced
        if t is tempfile.TemporaryDirectory:  # held by a with statement across stops
            return open_files.reduce_temporary_directory(obj)
        if t.__name__ == "NpzFile" and t.__module__.startswith("numpy."):
            reduced = open_files.reduce_npz(obj)
            if reduced is not NotImplemented:
                return reduced
        if lazy.is_dataloader(obj):
            state = dict(obj.__dict__)
            kept = state.pop("_iterator", None)
            state["_iterator"] = None  # one made before the engine started is recreated by iter()
            if kept is not None and iterators.LOADER_ORIGIN in kept.__dict__:
                training_state.note_kept_iterator(obj, kept)
            if obj.__class__ is not t:  # accelerate's DataLoaderShard says it is a DataLoader
                return libraries.new_instance, (t,), state
            return copyreg.__newobj__, (t,), state
        reduced = training_state.reduce(obj)  # grads, optimizers, schedulers, scalers, loader iterators
        if reduced is NotImplemented:
            reduced = handles.reduce(obj)  # a TensorBoard writer: re-opened on restore
        if reduced is NotImplemented:
            reduced = wandb_runs.reduce(obj)  # a W&B run: continued on restore
        if reduced is NotImplemented:
            reduced = libraries.reduce(obj)  # weak references, shared-state singletons (accelerate)
        if reduced is NotImplemented:
            reduced = getattr_classes.reduce(obj, t, self.proto)  # wrappers with a __getattr__
        if reduced is not NotImplemented:
            return reduced
        return super().reducer_override(obj)


class _ProbePickler(ProxyPickler):
    """Pickles to nowhere and skips tensor data: tells whether an object can be saved, cheaply."""

    def persistent_id(self, obj: Any) -> Optional[str]:
        return "storage" if lazy.is_storage(obj) else None


class _Sink:
    def write(self, data: Any) -> int:
        return len(memoryview(data))


def probe(obj: Any) -> Optional[str]:
    """None if ``obj`` pickles with our pickler, else the error text."""
    try:
        with autograd_graphs.watching(None):  # a graph in use stops the save, not a probe
            _ProbePickler(_Sink(), protocol=pickle.DEFAULT_PROTOCOL).dump(obj)
        return None
    except Exception as e:
        return f"{type(e).__name__}: {e}"


#: where the proxy's modules moved when it was split into layers (checkpoint, engine,
#: distributed): a checkpoint written before names e.g. ``backend.proxy.libraries``
_LAYERS = ("checkpoint", "engine", "distributed")


@functools.lru_cache(maxsize=None)
def _current_module(module: str) -> str:
    """``module``, or where it lives now if it is one of the proxy's modules that moved."""
    parent, _, name = module.rpartition(".")
    if parent != "backend.proxy" or importlib.util.find_spec(module) is not None:
        return module
    for layer in _LAYERS:
        if importlib.util.find_spec(f"{parent}.{layer}.{name}") is not None:
            return f"{parent}.{layer}.{name}"
    return module


class GraphUnpickler(pickle.Unpickler):
    """Reads checkpoint graphs, those written before the proxy's modules moved included."""

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("backend.proxy."):
            module = _current_module(module)
        return super().find_class(module, name)


class HeaderedGraphUnpickler(GraphUnpickler):
    """Reads a rank file `save_graph` wrote: the header of canonical strings (`canonical_strings`;
    older files have none), then the graph. Not for ``torch.load``, which sets its own
    ``persistent_load`` on the instance (a method of the class would take precedence)."""

    def persistent_load(self, pid: Any) -> Any:
        if type(pid) is not str:
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        return canonical_strings.resolve(pid)

    def load(self) -> Any:
        first = super().load()
        return super().load() if canonical_strings.is_header(first) else first


def _pickle_module() -> types.ModuleType:
    shim = types.ModuleType("singularity_proxy_pickle")
    shim.Pickler = ProxyPickler  # type: ignore[attr-defined]
    shim.Unpickler = GraphUnpickler  # type: ignore[attr-defined]
    shim.load = lambda f, **kw: GraphUnpickler(f, **kw).load()  # type: ignore[attr-defined]
    shim.loads = lambda data, **kw: GraphUnpickler(io.BytesIO(data), **kw).load()  # type: ignore[attr-defined]

    def dump(obj: Any, file: Any, protocol: Optional[int] = None) -> None:
        ProxyPickler(file, protocol=protocol).dump(obj)

    shim.dump = dump  # type: ignore[attr-defined]
    return shim


PICKLE_MODULE = _pickle_module()


def _map_location(storage: Any, location: str) -> Any:
    """CUDA tensors land on this rank's current device, or on the CPU where there is none."""
    import torch  # only torch.load calls this

    if location.startswith("cuda"):
        if torch.cuda.is_available():
            return storage.cuda(torch.cuda.current_device())
        return storage.cpu()
    return storage


def _map_device(saved: "torch.device") -> "torch.device":
    """`_map_location` for `dedup.load`, which asks per device instead of per storage."""
    import torch  # only dedup.load calls this

    if saved.type == "cuda":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    return saved


# --------------------------------------------------------------------------- what to save
def _keep(name: str) -> bool:
    return name not in _SKIP_NAMES and not name.startswith(PREFIX) \
        and not (name.startswith(_DYNAMO_GLOBALS) and "torch._dynamo" in sys.modules)


#: what ``torch.compile`` puts in the globals of the code it compiles (its graphs, whose tensors
#: are fake and cannot be saved, and names its compiled code reads); compiled again after a restore
_DYNAMO_GLOBALS = ("__compiled_fn", "__resume_at_", "__builtins_dict__", "__import_", "___", "__dtensor_spec_",
                   "__comprehension_", "__warnings_warn_wrapper", "__gen_rand_values")


def _with_targets(rt: RuntimeView, entries: Optional[list] = None) -> set[str]:
    """``as`` targets of active with statements: the restore re-enters their headers anyway."""
    names: set[str] = set()
    for frame in rt.stack if entries is None else entries:
        if getattr(frame, "kind", "") == "with":
            names.update(rt.program.nodes[frame.node].with_targets)
    return names


def _frame_locals(rt: RuntimeView, fid: int, frame: Any, entries: list) -> dict:
    """The variables of a user function's frame that a restore puts back (not its ``with`` targets)."""
    wanted = set(rt.program.defs[fid].local_names) - _with_targets(rt, entries)
    return {k: v for k, v in frame.f_locals.items() if k in wanted}


def _position(rt: RuntimeView, boundary: Optional[int]) -> tuple[list[dict], list[CheckpointFailure]]:
    """The frame stack as records, outermost first; loops whose iterator cannot be saved are
    returned as failures.  Between the records of two user frames stands a ``call`` record with
    the callee's id and locals (all frames' locals are pickled in the one graph, so objects they
    share stay shared)."""
    nodes = rt.program.nodes
    records: list[dict] = []
    failures: list[CheckpointFailure] = []
    chain = rt.chain
    if chain is None:  # a checkpoint outside a safe point's slow path: the top-level frame only
        entries = list(rt.stack)
        records.extend(_records(rt, entries, boundary, len(entries) - 1, failures))
    else:
        last = sum(len(u.entries) for u in chain) - 1
        first = 0
        for i, user in enumerate(chain):
            records.extend(_records(rt, user.entries, boundary, last - first, failures))
            first += len(user.entries)
            if i + 1 < len(chain):
                callee = chain[i + 1]
                assert user.call is not None
                records.append({"node": user.call, "kind": "call", "line": nodes[user.call].line,
                                "function": callee.fid,
                                "locals": _frame_locals(rt, callee.fid, callee.frame, callee.entries)})
    if boundary is not None:
        records.append({"node": boundary, "kind": "boundary", "line": nodes[boundary].line})
    return records, failures


def _records(rt: RuntimeView, entries: list, boundary: Optional[int], last: int,
             failures: list[CheckpointFailure]) -> list[dict]:
    """Records of one frame's loops, branches and blocks; ``last`` is the index of the safe point's
    own loop among them (entries before it are loops the restore resumes inside)."""
    nodes = rt.program.nodes
    records: list[dict] = []
    for depth, frame in enumerate(entries):
        inside = boundary is not None or depth < last
        if isinstance(frame, ForFrame):
            info = nodes[frame.node]
            desc = frame.desc
            if desc is None:
                assert frame.source is not None
                try:
                    desc = iterators.describe(frame.source, [x.text for x in info.leaves],
                                              [x.reevaluable for x in info.leaves],
                                              [x.why_not for x in info.leaves], info.line, probe)
                except CheckpointFailure as e:
                    failures.append(e)
                    desc = {}
            else:
                try:
                    iterators.refuse_drawn_after_restore(desc, frame.digests, [x.text for x in info.leaves], info.line)
                except CheckpointFailure as e:
                    failures.append(e)
            desc = iterators.with_item_digests(desc, frame.digests, frame.extra)
            rec = {"node": frame.node, "kind": "for", "line": info.line, "fetched": frame.fetched, "source": desc}
            if inside:
                rec["current"] = frame.current
            records.append(rec)
        elif isinstance(frame, WhileFrame):
            records.append({"node": frame.node, "kind": "while", "line": nodes[frame.node].line,
                            "ticks": frame.ticks})
        elif isinstance(frame, IfFrame):
            records.append({"node": frame.node, "kind": "if", "line": nodes[frame.node].line,
                            "branch": frame.branch})
        else:
            assert isinstance(frame, BlockFrame)
            rec = {"node": frame.node, "kind": frame.kind, "line": nodes[frame.node].line}
            if frame.kind == "with":
                rec["files"] = _with_files(frame, rec["line"], failures)
                rec["held"] = _held_managers(frame, rec["line"], failures)
                if frame.rng_before:
                    rec["rng"] = frame.rng_before
                failures.extend(CheckpointFailure(f"the with statement at line {rec['line']} holds {why}")
                                for why in map(_not_reenterable, frame.managers) if why)
            records.append(rec)
    return records


def _with_files(frame: BlockFrame, line: int, failures: list[CheckpointFailure]) -> list:
    """The files a ``with`` header opened for writing, in item order (None for other managers),
    saved as themselves (with their bytes, open_files.py): the restore runs the header again,
    which truncates such a file, and then goes on with the saved handle, which is the one a
    ``csv.writer`` made inside the block refers to. A file opened for reading: ``("read",
    position)``, where the restore seeks the one the header opens again."""
    out: list = []
    for manager in frame.managers:
        saved = None
        if open_files.is_open_file(manager) and manager.writable():
            try:
                open_files.capture(manager, content=False)  # the checks only: the pickle reads the bytes
                saved = manager
            except open_files.FileNotCarried as e:
                failures.append(CheckpointFailure(f"the with statement at line {line} holds a file that "
                                                  f"cannot be saved: {e}"))
        elif open_files.is_open_file(manager) and not manager.closed:
            try:  # read from with readline()/read(): the restore seeks the re-opened file there
                saved = ("read", manager.tell())
            except OSError:  # a loop is iterating it: the loop puts it back in place (manual_next.py)
                pass
        out.append(saved)
    return out


def _held_managers(frame: BlockFrame, line: int, failures: list[CheckpointFailure]) -> list:
    """The job's own managers of a with statement (`held_managers`), in item order (None for
    others): saved, so a restore goes on inside the statement without entering them again."""
    out: list = []
    for manager in frame.managers:
        held = manager if isinstance(manager, held_managers.HeldManager) else None
        why = probe(held) if held is not None else None
        if why is not None:
            failures.append(CheckpointFailure(
                f"the with statement at line {line} holds a {type(held.manager).__qualname__}, a context manager "
                f"held across stops that cannot be saved ({why}); a restore would have to enter it again. Take "
                f"the checkpoint outside it (put the with statement inside the loop body), or make it picklable"))
        out.append(held)
    return out


def _not_reenterable(manager: Any) -> Optional[str]:
    """Why entering this ``with`` manager again at restore would not continue the run (None: it
    would). The restore runs the header again, so a manager whose ``__enter__`` records the
    moment it ran, or whose exit at the stop undid the block's work, cannot be carried."""
    if isinstance(manager, contextlib.AsyncExitStack) and manager._exit_callbacks:  # an ExitStack is held
        # stack.callback(fn) wraps fn (``__wrapped__``); enter_context(cm) pushes cm's bound __exit__
        plain = [cb for _, cb in manager._exit_callbacks if hasattr(cb, "__wrapped__")]
        advice = []
        if plain:
            names = ", ".join(sorted({getattr(cb.__wrapped__, "__qualname__", "?") for cb in plain}))
            advice.append(f"Call what `stack.callback(...)` registered ({names}) in a `try: ... finally:` "
                          f"around the loop instead")
        if len(plain) < len(manager._exit_callbacks):
            advice.append("Open each resource in the with statement itself instead (`with open(a) as f, "
                          "open(b) as g:`), which a restore enters again")
        return (f"a contextlib.{type(manager).__name__} with {len(manager._exit_callbacks)} callback(s) "
                f"registered: a restore enters the statement again with an empty stack, so they would "
                f"never run. {'. '.join(advice)}")
    if isinstance(manager, io.IOBase) and not isinstance(manager, (io.BytesIO, io.StringIO)) \
            and not open_files.is_open_file(manager) and not manager.closed and open_files.writable(manager):
        return (f"{manager!r}, a stream written through something other than a plain file (a gzip, bz2 or "
                f"lzma compressor): its state cannot be saved and a restore would open it again, "
                f"truncating what the loop wrote. Open it in append mode inside the loop body, or write a "
                f"plain file")
    gen = getattr(manager, "gen", None)  # a @contextmanager's generator (its func is dropped on enter)
    frame = getattr(gen, "gi_frame", None)
    own = _own_manager(manager, gen, frame)
    if own:
        return (f"{own}, a context manager of the job's own: stopping the job runs its exit, and a restore "
                f"would run its enter again (what they print or count would happen twice; an uninterrupted "
                f"run does each once). Take the checkpoint outside it: put the with statement inside the "
                f"loop body, or around the code after the loop")
    if isinstance(manager, warnings.catch_warnings) and getattr(manager, "_record", False):
        return ("warnings.catch_warnings(record=True): a restore would enter it again with a new, empty "
                "list, and the warnings caught before the stop would be lost. Record them in a list of "
                "your own (`warnings.showwarning = lambda *a, **k: caught.append(a[0])`), or take the "
                "checkpoint outside it")
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(manager, torch.autocast) and getattr(manager, "_cache_enabled", False):
        return ("torch.autocast around the loop: it keeps low-precision copies of the weights for the "
                "whole block (not updated by the optimizer's steps), and a restore would start with none, "
                "so the steps after it would compute with other values. Put the with statement around the "
                "forward pass and the loss inside the loop, as PyTorch recommends, or pass cache_enabled=False")
    return None


def _own_manager(manager: Any, gen: Any, frame: Any) -> str:
    """How to name ``manager`` if it is a ``@contextmanager`` function of the job's own, else ''
    (the job's own classes are held across the stop instead: held_managers.py)."""
    if isinstance(manager, contextlib._GeneratorContextManager) and frame is not None \
            and ownership.PROGRAM.owns(gen.gi_code, frame.f_globals):
        return f"{gen.gi_code.co_name}(), a @contextmanager"
    return ""


def _redirected_streams(rt: RuntimeView) -> dict[str, Any]:
    """What ``sys.stdout``/``sys.stderr`` were before the active ``redirect_stdout``/``redirect_stderr``
    of the with statements the safe point is inside: the restore enters those again, so the
    streams to put back are the ones they replaced, not their targets."""
    out: dict[str, Any] = {}
    for manager in _redirects(rt):
        out.setdefault(manager._stream, manager._old_targets[0])
    return out


def _redirects(rt: RuntimeView) -> list[Any]:
    """The active redirect_stdout/redirect_stderr managers of the with statements around the safe point."""
    return [m for frame in rt.stack for m in getattr(frame, "managers", ())
            if isinstance(m, contextlib._RedirectStream) and m._old_targets]


def _current_statement(rt: RuntimeView, position: list[dict]) -> int:
    return rt.program.nodes[position[0]["node"]].top_index if position else len(rt.program.statements)


def _rebuild_statement(rt: RuntimeView, name: str, current: int) -> Optional[int]:
    """Index of the one executed simple statement that can recreate ``name``, if that is sound."""
    program = rt.program
    stmts = program.statements
    upto = min(current, len(stmts) - 1)
    binders = [i for i in range(upto + 1) if name in stmts[i].bound]
    if not binders or name in program.unstable:
        return None
    i = binders[-1]
    if i >= current or not stmts[i].simple:
        return None
    later = set().union(*(stmts[j].bound for j in range(i + 1, upto + 1))) if upto > i else set()
    if stmts[i].reads & (later | program.unstable):
        return None
    return i


# --------------------------------------------------------------------------- writing
def _variables(rt: RuntimeView) -> tuple[dict, Optional[dict]]:
    """The top-level frame's variables: the namespace, and a submitted callable's locals."""
    skip = _with_targets(rt, rt.chain[0].entries if rt.chain else None)
    namespace = {k: v for k, v in rt.ns.items() if _keep(k) and k not in skip}
    saved_locals = None
    if rt.fn_frame is not None:
        wanted = set(rt.program.local_names)
        saved_locals = {k: v for k, v in rt.fn_frame.f_locals.items() if k in wanted and k not in skip}
    return namespace, saved_locals


def _closure_values(rt: RuntimeView) -> Optional[dict]:
    """The values of a submitted callable's free variables (the model and optimizer a factory
    made for the closure it returned), which are its state as much as its locals are: a restore
    hands them to the rewritten function instead of those of the submitted closure."""
    frame = rt.fn_frame
    if frame is None:
        return None
    mine = {name for name in frame.f_code.co_freevars if name != RT and not name.startswith("__")}
    return {name: value for name, value in frame.f_locals.items() if name in mine}


def graphs_in_use(rt: RuntimeView) -> Optional[autograd_graphs.GraphsHeld]:
    """Why this safe point is no place for a checkpoint (`autograd_graphs`), or None."""
    namespace, saved_locals = _variables(rt)
    scopes = [("", namespace), ("", saved_locals or {})]
    for user in (rt.chain or [])[1:]:
        scopes.append((f"in {rt.program.defs[user.fid].name}()", user.frame.f_locals))
    return autograd_graphs.in_use(scopes)


def _diagnose(namespace: dict, saved_locals: Optional[dict],
              position: list[dict]) -> list[tuple[str, str, Any, str]]:
    """(where, name, value, error) of everything that does not pickle on its own."""
    bad: list[tuple[str, str, Any, str]] = []
    for where, scope in (("namespace", namespace), ("locals", saved_locals or {})):
        for name, value in scope.items():
            err = probe(value)
            if err is not None:
                bad.append((where, name, value, err))
    for rec in position:
        for name, value in rec.get("locals", {}).items():  # a call record: the callee's frame
            err = probe(value)
            if err is not None:  # never rebuilt: only top-level statements are re-run
                bad.append((f"frame of the call at line {rec['line']}", name, value, err))
        for key, label in (("current", "item"), ("source", "iterable")):
            if key in rec:
                err = probe(rec[key])
                if err is not None:
                    value = _failing_part(rec[key]) if key == "source" else rec[key]
                    bad.append(("loop", f"<{label} of the loop at line {rec['line']}>", value, err))
    return bad


def _failing_part(desc: Any) -> Any:
    """The iterable or iterator of a loop's description that does not pickle (named in the
    message, rather than the description's dict), else the description."""
    states = [desc.get("tree", {})] if isinstance(desc, dict) else []
    while states:
        state = states.pop()
        states.extend(state.get("children", ()))
        for key in ("iterable", "iterator", "loader"):
            if key in state and probe(state[key]) is not None:
                return state[key]
    return desc


def write_checkpoint(rt: RuntimeView, boundary: Optional[int], label: Optional[int] = None,
                     snapshot: bool = False) -> tuple[Any, int, list[str]]:
    """Write this rank's part of a checkpoint at the current safe point, as checkpoint number
    ``label`` (default: this rank's step; the ranks of a job pass the number they agreed on).

    Returns (reference, bytes written, names that the restore will rebuild); with ``snapshot``
    the bytes are only pickled into memory and a `background.Snapshot` stands for the reference
    (background.py writes it).  Raises `CheckpointFailure` (program state untouched) when
    something cannot be saved.  A write still in flight behind the loop is waited for first.
    """
    rt.ctl.writer.wait()
    globals_ = rt.fn_globals if rt.fn_globals is not None else rt.ns
    token = _SAVE_NS.set((globals_, globals_ is rt.ns))  # probes and the save pickle alike
    redirects = _REDIRECT_TARGETS.set(frozenset(id(m._new_target) for m in _redirects(rt)))
    try:
        return _write_checkpoint(rt, boundary, rt.step if label is None else label, snapshot)
    finally:
        _REDIRECT_TARGETS.reset(redirects)
        _SAVE_NS.reset(token)


def _write_checkpoint(rt: RuntimeView, boundary: Optional[int], label: int,
                      snapshot: bool) -> tuple[Any, int, list[str]]:
    ctl = rt.ctl
    position, loop_failures = _position(rt, boundary)
    namespace, saved_locals = _variables(rt)
    current = _current_statement(rt, position)
    scope = saved_locals if saved_locals is not None else namespace

    # variables found unpicklable by an earlier checkpoint and still bound to the same object
    rebuild: dict[str, int] = {}
    for name, obj_id in rt.unpicklable_cache.items():
        if name in scope and id(scope[name]) == obj_id:
            index = _rebuild_statement(rt, name, current)
            if index is not None:
                rebuild[name] = index

    def plan() -> list[tuple[str, str, str, str]]:
        """Probe everything; schedule rebuilds where sound; return what stays unsaveable."""
        rest_ns = namespace if saved_locals is not None else _without(namespace, rebuild)
        rest_locals = _without(saved_locals, rebuild) if saved_locals is not None else None
        stuck = []
        rebuild_scope = "locals" if saved_locals is not None else "namespace"
        for where, name, value, err in _diagnose(rest_ns, rest_locals, position):
            mine = where == rebuild_scope
            # re-running the statement is exact only for values that hold no progress of the job
            index = _rebuild_statement(rt, name, current) if mine and handles.progress_free(value) else None
            if index is None:
                advice = handles.explain_known(name, value, probe) \
                    if where == "loop" and not resumable_generators.is_resumable(value) else \
                    handles.explain(name, value, probe, top_level=mine)
                stuck.append((name, type(value).__name__, err, advice))
            else:
                rebuild[name] = index
                rt.unpicklable_cache[name] = id(scope[name])
        return stuck

    if loop_failures:
        raise _failure(loop_failures, plan())
    probing = not _SETTINGS_SAVED["so_far"]
    assumed: Optional[dict] = None  # the graph built without probes, when its save failed
    folders = _job_folders(rt)
    modules = module_state.job_modules(folders)
    header = canonical_strings.header_for(rt.program.code, modules.values())
    for _attempt in range(3):
        graph = _graph(rt, position, namespace, saved_locals, rebuild, probe if probing else _assume_saves,
                       (folders, modules))
        written: dict[str, Any] = {}

        one_rank = ctl.world_size == 1

        def writer(f: RankFile) -> None:
            blob_bytes = save_graph(graph, f, blobs=f.blobs, header=header, one_rank=one_rank)
            written["bytes"] = f.bytes + blob_bytes

        try:
            if snapshot:
                snap = background.Snapshot(ctl.store.reusable_blob_dirs())
                save_graph(graph, snap, header=header, one_rank=one_rank)
                copied = snap.bytes + snap.blobs.copied_bytes
                result: tuple[Any, int, list[str]] = (snap, copied, sorted(rebuild))
            else:
                ref = ctl.store.write(label, ctl.rank, ctl.world_size, writer)
                result = (ref, int(written["bytes"]), sorted(rebuild))
        except CheckpointFailure:
            raise  # refused by a part of the state that knows why (worker_rng): probing would not help
        except Exception as e:
            if not probing:  # perhaps a setting or a module global that does not save: probe them
                probing, assumed = True, graph
                continue
            if not isinstance(e, _PICKLE_ERRORS):
                raise
            before = dict(rebuild)
            stuck = plan()
            if stuck:
                raise _failure([], stuck) from e
            if rebuild == before:
                raise CheckpointFailure(f"cannot save the program state: {type(e).__name__}: {e}") from e
            continue
        if assumed is not None:  # probe the settings from now on only if the probes left something out
            _SETTINGS_SAVED["so_far"] = _settings_kept(assumed) == _settings_kept(graph)
        return result
    raise CheckpointFailure("cannot save the program state even after excluding the rebuildable variables")


def _failure(loops: list[CheckpointFailure], stuck: list[tuple[str, str, str, str]]) -> CheckpointFailure:
    parts = [str(f) for f in loops]
    variables = [v for f in loops for v in f.variables]
    named = {v[0] for v in variables}
    stuck = [s for s in stuck if s[0] not in named]
    if stuck:
        listing = "; ".join(f"`{n}` ({t}: {err})" for n, t, err, _ in stuck)
        advice = "; ".join(a for *_, a in stuck if a) or (
            "close or delete them before the loop (`del name`), or keep them out of the job's state")
        parts.append(f"these variables cannot be saved: {listing}. To fix: {advice}")
        variables += [[n, t] for n, t, _, _ in stuck]
    return CheckpointFailure("cannot checkpoint: " + " Also, ".join(parts), variables)


def _without(d: Optional[dict], names: dict) -> dict:
    return {k: v for k, v in (d or {}).items() if k not in names}


#: whether every logging handler and job-module global has pickled at each checkpoint of this
#: process so far: while so, they are saved without a probe each (the probes cost ~4 ms a safe
#: point with torch's ~40 handlers, as much as the save itself); the save pickle checks them anyway
_SETTINGS_SAVED = {"so_far": True}


def _assume_saves(obj: Any) -> Optional[str]:
    """The probe while `_SETTINGS_SAVED`: everything saves (a failing save retries with `probe`)."""
    return None


def _settings_kept(graph: dict) -> tuple:
    """What the probes of `_graph`'s settings decide: the module globals, the loggers whose
    handlers are saved and the signals whose handlers are."""
    return (module_state.kept_names(graph["modules"]),
            sorted(name for name, conf in graph["process"]["logging"]["loggers"].items()
                   if conf["handlers"] is not None),
            sorted(graph["process"]["signals"]))


def _graph(rt: RuntimeView, position: list[dict], namespace: dict, saved_locals: Optional[dict],
           rebuild: dict[str, int], probe_setting: Callable[[Any], Optional[str]],
           job: tuple[list[str], dict[str, types.ModuleType]]) -> dict:
    """The checkpoint's graph; ``job`` is the job's folders and the modules imported from them."""
    by_statement: dict[int, list[str]] = {}
    for name, index in rebuild.items():
        by_statement.setdefault(index, []).append(name)
    in_locals = saved_locals is not None
    tail = training_state.Tail()
    graph = {
        "format": GRAPH_FORMAT,
        "program": rt.program.identity,
        "step": rt.step,
        # before anything that may hold a DDP module: a group the program (or a library such as
        # accelerate, in a one-rank job) created is created again first, as the load meets this
        "process_group": libraries.ProcessGroupMarker.now(),
        "folder": context.carried_folder(),  # before any open file: the load rolls the folder back first
        "import_path": context.import_path(),  # before anything pickled by reference: its module may need it
        # the job's modules, imported quietly before any file or logging handler is put back
        "imports": module_state.Imports(job[1]),
        # default dtype, print options, logging...: put back on restore
        "process": process_settings.capture(probe_setting, _redirected_streams(rt)),
        "hydra": hydra_state.capture(),  # HydraConfig.get(): @hydra.main's setup is not run again
        "mlflow": mlflow_runs.capture(),  # the active runs mlflow.log_metric logs to
        # grad mode, decimal context: outside the with statements a restore enters again, and inside
        "modes": scoped_modes.capture([f for f in rt.stack if getattr(f, "kind", None) == "with"],
                                      rt.chain or ()),
        "position": position,
        "namespace": namespace if in_locals else _without(namespace, rebuild),
        "locals": _without(saved_locals, rebuild) if in_locals else None,
        "closure": _closure_values(rt),  # a submitted closure's cells: `run` of make_trainer(lr)
        "modules": module_state.capture(job[0], probe_setting, job[1]),  # config.lr = args.lr: set again on restore
        "submodules": imported_submodules.capture(rt.program.submodule_imports),  # import logging.config
        # F.gelu = my_gelu; builtins.print replaced by a helper module's setup_for_distributed
        "patches": library_patches.capture(rt.fn_globals or rt.ns, rt.program.patched_attributes, probe_setting,
                                           rt.program.patch_imports, job[1]),
        "exit_handlers": exit_handlers.capture(probe_setting),  # atexit.register(write_summary): run at the real end
        "rng": rng.capture(full=True),
        "context": context.capture(),  # argv, cwd, env changes: redone by program.run on restore
        "rebuild": [{"index": i, "names": sorted(n)} for i, n in sorted(by_statement.items())],
        "meta": {"created": time.time(), "rank": rt.ctl.rank, "world_size": rt.ctl.world_size,
                 "python": platform.python_version(),
                 "torch": getattr(lazy.torch(), "__version__", None),  # None: torch not loaded
                 "filename": rt.program.filename},
        "fingerprint": fingerprint.capture(libraries.rewritten_distributions()),  # what an exact resume depends on: checked on restore
        # last: refers back to the tensors and optimizers above (grads, a GradScaler's pending state)
        "tail": tail,
        # weakref.finalize callbacks of the program, over objects saved above
        "finalizers": finalizers.Pending(),
        # after everything: the tables of the sets above, so they iterate as they did
        "set_layouts": set_layouts.Pending(),
    }
    tail.roots = [graph["namespace"], graph["locals"], graph["modules"], position]
    tail.reiterated = iterators.reiterated_loaders(position)
    return graph


def _job_folders(rt: RuntimeView) -> list[str]:
    """Where the job's own modules live: the folder it started in and its script's."""
    folders = [context.job_folder()]
    if not rt.program.filename.startswith("<"):
        folders.append(os.path.dirname(os.path.abspath(rt.program.filename)))
    return folders


def save_graph(graph: dict, f: Any, blob_dir: Optional[Path] = None,
               blobs: Optional[dict[str, int]] = None,
               header: canonical_strings.Header = canonical_strings.EMPTY, one_rank: bool = False) -> int:
    """Write ``graph`` to ``f``; returns the blob bytes this call wrote.

    When torch is loaded, `dedup.dump` (pickle protocol 5): each tensor storage once, inline in
    the file, or in a blob folder unless it is small — ``blob_dir``, or the one ``f`` names
    (a `RankFile`'s, linking from its ``reuse_from``; a `background.Snapshot`'s) — recording the blobs the file
    references in ``blobs``.  With ``one_rank`` only frozen parameters go to blobs
    (`dedup.frozen_parameter`: the next checkpoint links them if unchanged).  Without torch a plain pickle
    (protocol 4: nothing in the graph can be a tensor, and importing torch costs ~1 s).
    Before the graph, the ``header`` pickle of the program's strings (`canonical_strings`), which
    the graph refers to rather than writing them again.
    """
    torch = lazy.torch()
    protocol = 4 if torch is None else 5
    f.write(header.pickle(protocol))
    tail = graph.get("tail")
    notes = tail if isinstance(tail, training_state.Tail) else contextlib.nullcontext()
    if torch is None:
        with notes:
            pickler = ProxyPickler(f, protocol=protocol)
            header.preload(pickler)
            pickler.dump(graph)
        return 0
    from ..checkpoint import dedup

    if blob_dir is not None:
        store: Any = dedup.BlobStore(blob_dir)
    elif isinstance(f, RankFile):
        store = dedup.BlobStore(f.blob_dir, f.reuse_from, writers=dedup.BLOB_WRITERS)
    elif isinstance(f, background.Snapshot):
        store = f.blobs
    else:
        store = None
    with notes:
        stats = dedup.dump(graph, f, store, pickler=PICKLE_MODULE.Pickler, protocol=protocol,
                           on_tensor=training_state.note_tensor, prepare=header.preload,
                           to_blob=dedup.frozen_parameter if one_rank else None)
    if blobs is not None:
        blobs.update(stats.storages)
    return stats.blob_bytes_written


# --------------------------------------------------------------------------- reading
def _read_graph(path: Path, blob_dir: Path, expected: Optional[tuple[str, Optional[str]]] = None) -> Any:
    """Read a file `save_graph` wrote; torch is imported only when the file holds tensors.

    Told apart by the first bytes: protocol 5 is `dedup.dump` (tensors inline or in blobs);
    protocol 4 is a torch-free pickle, or from an earlier engine a multi-rank file beside
    ``blobs/``; a zip archive is an earlier engine's torch.save.  With ``expected`` (algorithm,
    digest) the bytes are hashed as they are read, and `DigestMismatch` is raised after. Large
    storages are read by several threads (`reading.ParallelReads`).
    """
    with open(path, "rb") as raw, reading.ParallelReads(raw) as parallel:
        head = raw.peek(len(_ZIP_MAGIC))[:len(_ZIP_MAGIC)]
        if head != _ZIP_MAGIC:
            f = digest.HashingReader(parallel, expected[0]) if expected and expected[1] else parallel
            try:
                if head[:2] != _DEDUP_MAGIC and not blob_dir.is_dir():  # a torch-free pickle
                    graph = HeaderedGraphUnpickler(f).load()
                else:
                    from ..checkpoint import dedup

                    # a one-rank checkpoint's blobs (hashed as read, like its file: `verify` did not)
                    blobs = dedup.BlobStore(blob_dir, verify_reads=isinstance(f, digest.HashingReader)) \
                        if blob_dir.is_dir() else None
                    graph = dedup.load(f, blobs, unpickler=HeaderedGraphUnpickler, map_location=_map_device)
                failed: Optional[BaseException] = None
            except Exception as e:  # damaged bytes may fail the unpickler before the digest is known
                failed = e
            if isinstance(f, digest.HashingReader) and not f.finish(expected[1]):  # type: ignore[index]
                raise DigestMismatch(f"{path} does not match its {expected[0]} digest "  # type: ignore[index]
                                     f"(the file is corrupted)") from failed
            if failed is not None:
                raise failed
            return graph
    if expected and expected[1] and digest.of_file(path, expected[0]) != expected[1]:
        raise DigestMismatch(f"{path} does not match its {expected[0]} digest (the file is corrupted)")
    import torch

    return torch.load(path, map_location=_map_location, pickle_module=PICKLE_MODULE, weights_only=False)


def load_graph(ref: "CheckpointRef", rank: int, target_namespace: dict, identity: str,
               code: Optional[types.CodeType] = None) -> dict:
    """Load one rank's file; functions of the program get ``target_namespace`` as globals, and
    strings its header lists become the objects of ``code`` (the program's, compiled again).

    Rank 0 also drops staging folders of later steps: a crashed attempt's leftovers there would
    otherwise be mixed into the checkpoints this run writes when it reaches those steps again.
    No rank of this run can be writing one yet (that needs a cut rank 0 takes part in).
    """
    path = ref.rank_file(rank)
    if not path.exists():
        raise CheckpointError(f"{ref.path} has no file for rank {rank} (it was written by "
                              f"{ref.world_size} ranks)")
    if rank == 0:
        CheckpointStore(ref.path.parent).discard_staging(after=ref.step)
    token = _LOAD_NS.set(target_namespace)
    try:
        # one rank: its file is hashed as it is read (CheckpointStore.verify did not)
        with training_state.deferring() as iterators_to_make, canonical_strings.restoring(code):
            graph = _read_graph(path, ref.blob_dir, expected_digest(ref, path.name) if ref.world_size == 1 else None)
    except DigestMismatch as e:
        older = CheckpointStore(ref.path.parent).latest(before=ref.step)
        warnings.warn(f"checkpoint {ref.path} is damaged and was skipped: {e}", CheckpointDamaged, stacklevel=2)
        if older is None:
            raise CheckpointError(f"{e}; no older checkpoint is intact: start the job over without restoring") from e
        _LOAD_NS.reset(token)
        token = None
        return load_graph(older, rank, target_namespace, identity, code)
    except Exception as e:
        raise CheckpointError(f"cannot load {path}: {type(e).__name__}: {e}. If the code or its imports "
                              f"changed since the checkpoint, restore with the original code or start over.") from e
    finally:
        if token is not None:
            _LOAD_NS.reset(token)
    if isinstance(graph, dict):
        graph["deferred_iterators"] = iterators_to_make  # made by rebuild_variables, globals in place
    if not isinstance(graph, dict) or graph.get("format") != GRAPH_FORMAT:
        written = graph if isinstance(graph, dict) else {}
        raise CheckpointError(fingerprint.format_refusal(written.get("format"), GRAPH_FORMAT,
                                                         (written.get("fingerprint") or {}).get("engine"), path))
    if graph["program"] != identity:
        raise CheckpointError(f"{ref.path} was written by a different program (the submitted code changed); "
                              f"resume with the code that wrote it, or start over without restoring")
    fingerprint.check_restore(graph.get("fingerprint"), str(ref.path))
    return graph


def rebuild_variables(rt: RuntimeView, graph: dict, globals_: dict, locals_: Optional[dict]) -> list[str]:
    """Re-run the statements recorded in ``graph['rebuild']``; their output is suppressed.

    First the DataLoader iterators the load left as shells are made (the namespace is in place now).
    """
    training_state.finish_loading(graph.get("deferred_iterators") or [])
    rebuilt: list[str] = []
    saved = locals_ if locals_ is not None else globals_
    for entry in graph["rebuild"]:
        stmt = rt.program.statements[entry["index"]]
        code = compile(_module_of(stmt.node), rt.program.filename, "exec")
        keep = {k: saved[k] for k in stmt.bound if k in saved and k not in entry["names"]}
        try:
            with replay_effects.quietly():
                if locals_ is not None:
                    exec(code, globals_, locals_)
                else:
                    exec(code, globals_)
        except Exception as e:
            raise CheckpointError(
                f"restore could not rebuild {', '.join(entry['names'])} by re-running line "
                f"{stmt.node.lineno}: {type(e).__name__}: {e}") from e
        saved.update(keep)
        rebuilt.extend(entry["names"])
    return rebuilt


def _module_of(stmt: ast.stmt) -> ast.Module:
    return ast.Module(body=[stmt], type_ignores=[])
