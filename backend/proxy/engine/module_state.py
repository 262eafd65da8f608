"""The state held in the job's own modules: ``config.lr = args.lr``, a counter in ``helpers.py``.

Scripts keep settings and counters in modules beside them: ``import config`` then
``config.batch_size = args.batch_size`` in ``main()``, or a ``helpers.py`` whose function bumps a
module-level ``calls``. A restore imports those modules afresh, so their globals would be back at
their import-time values: a silent difference. So a checkpoint records, for each module the program
imported from the job's folder (any depth, also through a ``sys.path`` entry such as ``src/``; not
``site-packages``, hidden folders or the service's own packages) or found by its name on
``sys.path`` outside every library folder (a shared utilities checkout, a source tree on
``PYTHONPATH``), its data globals, in the same pickle graph as the program's variables (objects
they share stay shared), and the restore sets them again after the load. The import itself
comes first in the load, with its output dropped (`Imports`).

Not recorded: names starting with ``__`` (but ``__warningregistry__``, where a module's
``warnings.warn`` calls remember what they have shown once: see `_current_warnings_version`), modules, and the functions and classes the module
defines (its import makes them again); but a class's data attributes are (``AverageMeter.instances``,
a registry dict, a counter: what ``cls.x = ...`` changed), under `CLASS_ATTRIBUTES`, and so is the
state a function carries (`FUNCTION_STATE`: a mutable default used as storage, ``def f(x,
_seen=[])``; an attribute used as a counter, ``tick.calls += 1``; a default that is one of the
module's objects, ``def report(quiet=_UNSET)``, which must stay the object the restored global
``_UNSET`` is). A function a call made (``next_id = make_counter()``: a closure, its counter in
its cells) is not the import's: it is saved as a data global. A global that does not pickle and holds no progress (a
lock, a logger, a thread pool: `handles.progress_free`) keeps what the import made; any other is
left out with a ``RuntimeWarning`` naming it, once.
"""
from __future__ import annotations

import enum
import importlib
import os
import sys
import types
import warnings
from typing import Any, Callable, Iterable, Optional

from . import handles, replay_effects
from .libraries import OWN_PACKAGES
from .ownership import in_job_folder
from ..checkpoint.errors import CheckpointError
from .rewrite import PREFIX

#: the key of a module's record under which its classes' data attributes are kept
#: where ``warnings`` keeps, per module, the warnings shown once from it (the "default" action)
WARNING_REGISTRY = "__warningregistry__"
CLASS_ATTRIBUTES = "__class_attributes__"
#: the key under which its functions' defaults and attributes are kept (``name`` or ``Class.name``)
FUNCTION_STATE = "__function_state__"
#: defaults of these types hold no state and are no object of the module's: not recorded
_PLAIN_DEFAULTS = (int, float, complex, str, bytes, bool, type(None))
_warned: set[tuple[str, str]] = set()
_decided: dict[tuple[str, int, tuple[str, ...]], bool] = {}
#: the last answer of `job_modules` (folders, the modules it was read from, the answer): a
#: checkpoint's scan of the ~1,000 modules torch brings costs ~1.3 ms, comparing the two dicts ~20 µs
_last_answer: list[Any] = [None, None, None]
#: the modules this process had before the program began (or its restore): not the job's
_start: dict[str, Any] = {"pid": None, "modules": frozenset()}


def begin() -> None:
    """Called as the program starts or its restore begins: modules imported before are the host's
    (the worker's, a test runner's), not the job's."""
    _start["pid"] = os.getpid()
    _start["modules"] = frozenset(sys.modules)
    _last_answer[:] = [None, None, None]


def end() -> None:
    """Called as the program ends: the remembered answer's copy of ``sys.modules`` holds the
    script's ``__main__``, which must be free to be collected at exit."""
    _last_answer[:] = [None, None, None]


def job_modules(folders: Iterable[str]) -> dict[str, types.ModuleType]:
    """The modules imported since the program began that are the job's own: their source file lies
    in one of ``folders``, or `_own_module_elsewhere` says so."""
    real = [os.path.realpath(f) for f in folders]
    if _start["pid"] != os.getpid():  # a forked child, or begin() was never called
        begin()
    if not real:
        return {}
    folders_then, modules_then, answer = _last_answer
    if folders_then == real and modules_then == sys.modules:  # nothing imported or replaced since
        return dict(answer)
    out = {}
    hosts = _start["modules"]
    main = sys.modules.get("__main__")
    for name, module in list(sys.modules.items()):
        if name in hosts:
            continue
        key = (name, id(module), tuple(real))
        mine = _decided.get(key)
        if mine is None:  # one realpath per module, not one per module per checkpoint
            path = getattr(module, "__file__", None)
            # not the program itself under another name (multiprocessing's __mp_main__), and not a
            # module whose __file__ is no path at all (torch.ops says "_ops.py": relative to nothing,
            # it would resolve into the job's folder)
            mine = _decided[key] = isinstance(path, str) and os.path.isabs(path) and name != "__main__" \
                and module is not main and name.partition(".")[0] not in OWN_PACKAGES \
                and not _installed(path, real) \
                and (in_job_folder(os.path.realpath(path), real) or _own_module_elsewhere(name, path))
        if mine:
            out[name] = module
    _last_answer[:] = [real, dict(sys.modules), out]
    return dict(out)


def _own_module_elsewhere(name: str, path: str) -> bool:
    """Whether a module outside the job's folders is still the user's: a ``.py`` file the import
    system finds by the module's name on ``sys.path`` (or its package's path), in no library
    folder and no hidden one (a shared utilities checkout put on ``sys.path``, a source tree on
    ``PYTHONPATH``). Not code a library wrote and loaded under a made-up name (torch.compile's
    generated modules), which no search of the path finds."""
    if not path.endswith(".py") or _installed(path, []) \
            or any(p.startswith(".") or p == "__pycache__" for p in path.split(os.sep)[:-1]):
        return False
    parent, _, leaf = name.rpartition(".")
    if parent:
        package = sys.modules.get(parent)
        entries = list(getattr(package, "__path__", None) or ())
    else:
        entries = [e or os.curdir for e in sys.path if isinstance(e, str)]
    real = os.path.realpath(path)
    return any(os.path.realpath(os.path.join(e, *candidate)) == real
               for e in entries for candidate in ((leaf + ".py",), (leaf, "__init__.py")))


def _installed(path: str, folders: list[str]) -> bool:
    """Whether ``path`` is plainly a library's: under the interpreter's prefixes or in a
    site-packages folder, and no job folder lies there. Decided without a realpath, which for the
    ~1,000 modules that ``import torch`` brings cost the first checkpoint ~40 ms."""
    roots = [r for r in {sys.prefix, sys.base_prefix, sys.exec_prefix} if r]
    if any(f.startswith(tuple(r + os.sep for r in roots)) or "site-packages" in f or "dist-packages" in f
           for f in folders):
        return False
    return path.startswith(tuple(r + os.sep for r in roots)) or f"{os.sep}site-packages{os.sep}" in path \
        or f"{os.sep}dist-packages{os.sep}" in path


def _made_by_import(module: types.ModuleType, value: Any) -> bool:
    """Whether the module's import makes ``value`` again: a module, or a class or function its
    body defines (not a closure a call made: ``<locals>`` in its name)."""
    if isinstance(value, types.ModuleType):
        return True
    return isinstance(value, (types.FunctionType, type)) and getattr(value, "__module__", None) == module.__name__ \
        and "<locals>" not in getattr(value, "__qualname__", "<locals>")


def _function_state(fn: types.FunctionType) -> Optional[tuple]:
    """(defaults, keyword defaults, attributes) of ``fn`` where any may hold state, else None."""
    defaults = fn.__defaults__ or ()
    kwdefaults = fn.__kwdefaults__ or {}
    attributes = {k: v for k, v in vars(fn).items() if not k.startswith("__")}
    if attributes or not all(isinstance(v, _PLAIN_DEFAULTS) for v in (*defaults, *kwdefaults.values())):
        return fn.__defaults__, fn.__kwdefaults__, attributes
    return None


class Imports:
    """The job's modules, imported again by the load as soon as it meets this (an early entry of
    the graph), with their output dropped. A restore imports them afresh, and their top-level code
    runs again: a ``print`` or ``logger.info`` there printed again at every restore, and a
    ``logging.FileHandler("train.log", mode="w")`` there truncated the log after the load had put
    its saved contents back (the restored handler then wrote at its offset into an empty file).
    Imported first, what they print is dropped (the run printed it before the checkpoint) and what
    the load puts back (open files and their contents, logging handlers, the module globals)
    comes after what their import did."""

    def __init__(self, modules: Iterable[str]) -> None:
        self.names = sorted(modules)

    def __reduce__(self) -> tuple:
        return _import_quietly, (self.names,)


def _import_quietly(names: list[str]) -> None:
    for name in names:
        if name in sys.modules:
            continue
        with replay_effects.quietly():
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - `apply` imports it again and says what failed
                pass


def capture(folders: Iterable[str], probe: Callable[[Any], Optional[str]],
            modules: Optional[dict[str, types.ModuleType]] = None) -> dict[str, dict[str, Any]]:
    """module name -> {global name: value} for the job's modules (``modules``, when the caller
    has asked `job_modules` already); ``probe(v)`` says why ``v`` does not pickle (None when it does)."""
    out: dict[str, dict[str, Any]] = {}
    for name, module in (job_modules(folders) if modules is None else modules).items():
        saved: dict[str, Any] = {}
        classes: dict[str, dict[str, Any]] = {}
        functions: dict[str, tuple] = {}
        for key, value in list(vars(module).items()):
            if (key.startswith("__") and key != WARNING_REGISTRY) or key.startswith(PREFIX):
                continue
            if not _made_by_import(module, value):
                _keep(saved, name, key, value, probe)
            elif isinstance(value, types.FunctionType) and value.__qualname__ == key:
                state = _function_state(value)
                if state is not None:
                    _keep(functions, name, key, state, probe)
            elif isinstance(value, type) and not isinstance(value, enum.EnumMeta) and value.__qualname__ == key:
                attributes: dict[str, Any] = {}
                for attr, v in list(vars(value).items()):
                    if isinstance(v, types.FunctionType) and v.__qualname__ == f"{key}.{attr}":
                        state = _function_state(v)
                        if state is not None:
                            _keep(functions, name, f"{key}.{attr}", state, probe)
                    elif not attr.startswith("_abc_") and not (attr.startswith("__") and attr.endswith("__")) \
                            and not hasattr(type(v), "__get__") and not isinstance(v, type):
                        _keep(attributes, name, f"{key}.{attr}", v, probe, attr)
                if attributes:
                    classes[key] = attributes
        if classes:
            saved[CLASS_ATTRIBUTES] = classes
        if functions:
            saved[FUNCTION_STATE] = functions
        if saved:
            out[name] = saved
    return out


def kept_names(captured: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    """What a `capture` kept, by name (``Meter.count`` for a class attribute): two captures that
    probed differently left out the same things when these agree."""
    return {module: sorted(k for k in values if k not in (CLASS_ATTRIBUTES, FUNCTION_STATE)) + sorted(
        f"{cls}.{attr}" for cls, attrs in values.get(CLASS_ATTRIBUTES, {}).items() for attr in attrs) + sorted(
        f"{fn}()" for fn in values.get(FUNCTION_STATE, {}))
        for module, values in captured.items()}


def _keep(into: dict[str, Any], module: str, name: str, value: Any, probe: Callable[[Any], Optional[str]],
          key: Optional[str] = None) -> None:
    """``into[key or name] = value`` if it pickles; else a warning naming it (once), unless it
    holds no progress (a lock, a logger: what the import makes will do)."""
    why = probe(value)
    if why is None:
        into[key or name] = value
    elif not handles.progress_free(value) and (module, name) not in _warned:
        _warned.add((module, name))
        warnings.warn(f"{module}.{name} ({type(value).__name__}) cannot be saved ({why}); after a restore it "
                      f"holds what importing {module} makes", RuntimeWarning, stacklevel=4)


def apply(saved: Optional[dict[str, dict[str, Any]]]) -> None:
    """Set the recorded globals again, importing a module the load did not need."""
    for name, values in (saved or {}).items():
        module = sys.modules.get(name)
        if module is None:
            try:
                module = importlib.import_module(name)
            except ImportError as exc:
                raise CheckpointError(f"the job's module {name!r}, whose state the checkpoint holds, cannot be "
                                      f"imported here ({exc}); restore it beside the script (or on sys.path) as it "
                                      f"was, or start the job over") from exc
        for key, value in values.items():
            if key == CLASS_ATTRIBUTES:
                for cls_name, attributes in value.items():
                    cls = getattr(module, cls_name, None)
                    for attr, v in attributes.items() if isinstance(cls, type) else ():
                        setattr(cls, attr, v)
            elif key == FUNCTION_STATE:
                for path, (defaults, kwdefaults, attributes) in value.items():
                    owner, _, fn_name = path.rpartition(".")
                    fn = getattr(getattr(module, owner, None) if owner else module, fn_name, None)
                    if isinstance(fn, types.FunctionType):
                        fn.__defaults__, fn.__kwdefaults__ = defaults, kwdefaults
                        fn.__dict__.update(attributes)
            elif key == WARNING_REGISTRY and isinstance(value, dict):
                value["version"] = _current_warnings_version()
                setattr(module, key, value)
            else:
                setattr(module, key, value)


def _current_warnings_version() -> int:
    """The version ``warnings`` stamps on registries in this process.

    A registry whose ``version`` is not the process's current one (which counts how often the
    filters changed, so a restoring process has its own) is emptied at the next warning: the
    restored one would show every warning again. ``warn_explicit`` stamps a fresh registry before
    it consults the filters; the filters are replaced in place (no version bump) by one that
    ignores everything for that call, so nothing is shown.
    """
    probe: dict[Any, Any] = {}
    filters = warnings.filters
    saved = filters[:]
    filters[:] = [("ignore", None, Warning, None, 0)]
    try:
        warnings.warn_explicit("version probe", UserWarning, "<singularity>", 0, registry=probe)
    finally:
        filters[:] = saved
    return int(probe.get("version", 0))
