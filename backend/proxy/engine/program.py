"""`ResumableProgram`: submitted code compiled for resumable execution, and its `run`."""
from __future__ import annotations

import ast
import hashlib
import inspect
import linecache
import os
import sys
import textwrap
import time
import types
import warnings
from typing import TYPE_CHECKING, Any, Optional

from . import (caches, closure_cells, context, exit_handlers, grad_decorators, handles, hydra_state,
               imported_submodules, libraries, library_patches, mlflow_runs, module_state, ownership,
               process_settings, replay_effects, scoped_modes, training_state, type_memos, wandb_runs)
from ..checkpoint.errors import CheckpointError, Preempted
from .rewrite import MARKER, PREFIX, REWRITE_VERSION, RT, Rewritten, rewrite_function, rewrite_module
from .runtime import Runtime, install_dormant
from .state import extract_code_globals, load_graph, rebuild_variables

if TYPE_CHECKING:  # pragma: no cover
    from .controller import Controller
    from ..checkpoint.store import CheckpointRef


def _register_source(filename: str, source: str) -> None:
    """Let tracebacks and inspect show the submitted source for ``filename``."""
    lines = source.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    linecache.cache[filename] = (len(source), None, lines, filename)


def _digest(*parts: str) -> str:
    h = hashlib.sha256(f"proxy-rewrite-{REWRITE_VERSION}".encode())
    for p in parts:
        h.update(b"\0" + p.encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def _uses_mangled_names(node: ast.AST) -> bool:
    def private(name: str) -> bool:
        return name.startswith("__") and not name.endswith("__")

    for n in ast.walk(node):
        if isinstance(n, ast.Name) and private(n.id):
            return True
        if isinstance(n, ast.Attribute) and private(n.attr):
            return True
    return False


#: A function attribute holding its own source; the SDK sets it before cloudpickling a callable,
#: because cloudpickle (>= 3.1) replaces ``co_filename`` and the worker could not find the file.
SOURCE_ATTR = "__singularity_source__"


class ResumableProgram:
    """Code (a cell, a script, or a function with its arguments) that can stop and resume exactly."""

    def __init__(self, kind: str, filename: str, identity: str, rewritten: Optional[Rewritten],
                 code: Optional[types.CodeType], fn: Any = None, args: tuple = (),
                 kwargs: Optional[dict] = None, fallback_reason: str = "") -> None:
        self.kind = kind
        self.filename = filename
        self.identity = identity
        self._rewritten = rewritten
        #: `a.b.attr = ...` statements: monkeypatches of libraries, set again on restore
        self.patched_attributes = library_patches.candidates(rewritten.tree) if rewritten else ()
        self.patch_imports = library_patches.imported_names(rewritten.tree) if rewritten else {}
        #: `import a.b` statements: submodules imported again on restore (the top package alone is saved)
        self.submodule_imports = imported_submodules.candidates(rewritten.tree) if rewritten else ()
        self._code = code
        self.fn = fn
        self.args = tuple(args)
        self.kwargs = dict(kwargs or {})
        #: why a callable runs without safe points ("" when it has them)
        self.fallback_reason = fallback_reason
        #: the code of the top-level frame (function id 0): the module, or the callable's function
        self._root_code = code if kind == "source" else next(
            (c for c in (code.co_consts if code is not None else ()) if isinstance(c, types.CodeType)), None)
        self._fids: dict[types.CodeType, Optional[int]] = {}
        self._merged: tuple = (-1, {}, {}, {})  # registry version, nodes, defs, call spans

    @property
    def code(self) -> Optional[types.CodeType]:
        """What runs: the rewritten module, or the factory of the rewritten callable."""
        return self._code

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_source(cls, source: str, filename: str = "<cell>") -> "ResumableProgram":
        """Compile a cell or script; syntax errors surface here, pointing into ``source``."""
        _register_source(filename, source)
        rewritten = rewrite_module(source, filename)
        code = compile(rewritten.tree, filename, "exec", dont_inherit=True)
        # the file name is not part of the identity: a migrated job may see another path
        return cls("source", filename, _digest("source", source), rewritten, code)

    @classmethod
    def from_callable(cls, fn: Any, args: tuple = (), kwargs: Optional[dict] = None, *,
                      source: Optional[str] = None) -> "ResumableProgram":
        """Rewrite the loops of ``fn``'s own body.

        The source comes from ``source``, else ``fn.__singularity_source__``, else `inspect.getsource`.

        Without usable source (a builtin, a lambda, a generator function, a wrapper, source not
        on disk) the callable runs unchanged and without safe points; `fallback_reason` says why.
        """
        args = tuple(args)
        if inspect.ismethod(fn):
            args = (fn.__self__,) + args
            fn = fn.__func__
        reason = ""
        fdef: Optional[ast.FunctionDef] = None
        filename = getattr(getattr(fn, "__code__", None), "co_filename", "<callable>")
        if not isinstance(fn, types.FunctionType):
            reason = f"{type(fn).__name__} objects are not Python functions"
        elif fn.__code__.co_flags & (inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR):
            reason = "generator and coroutine functions are run unchanged"
        elif hasattr(fn, "__wrapped__"):
            reason = "the function is a decorator's wrapper"
        elif any(_empty_cell(c) for c in fn.__closure__ or ()):
            reason = "a variable it closes over is unbound"
        else:
            offset = fn.__code__.co_firstlineno - 1
            attached = source if source is not None else fn.__dict__.get(SOURCE_ATTR)
            try:
                text = attached if attached is not None else inspect.getsource(fn)
            except (OSError, TypeError) as e:
                text, reason = "", (f"its source is unavailable ({e}); cloudpickle drops source file names, "
                                    f"so set fn.{SOURCE_ATTR} = inspect.getsource(fn) before pickling")
            if text:
                if attached is not None:
                    filename = f"<callable {fn.__qualname__}>"
                    _register_source(filename, "\n" * offset + textwrap.dedent(attached))
                fdef, reason = cls._find_def(fn, text, offset)
        boxed: set[str] = set()
        if fdef is not None:  # its closures' shared variables go into one object, or it runs unchanged
            blocked, boxed = closure_cells.box_shared(fdef)
            if blocked:
                fdef, reason = None, blocked
        if fdef is None:
            digest = _digest("callable-plain", fn.__qualname__ if hasattr(fn, "__qualname__") else repr(fn),
                             getattr(getattr(fn, "__code__", None), "co_code", b"").hex())
            return cls("callable", filename, digest, None, None, fn, args, kwargs, reason)
        code_obj = fn.__code__
        nparams = code_obj.co_argcount + code_obj.co_kwonlyargcount + \
            bool(code_obj.co_flags & inspect.CO_VARARGS) + bool(code_obj.co_flags & inspect.CO_VARKEYWORDS)
        local_names = [n for n in dict.fromkeys(code_obj.co_varnames + code_obj.co_cellvars)
                       if n not in boxed or n in code_obj.co_varnames[:nparams]]
        local_names += [closure_cells.BOX] if boxed else []  # the boxed variables live in it
        rewritten = rewrite_function(fdef, local_names, list(code_obj.co_varnames[:nparams]),
                                     list(code_obj.co_freevars))
        module_code = compile(rewritten.tree, filename, "exec", dont_inherit=True)
        factory = next(c for c in module_code.co_consts
                       if isinstance(c, types.CodeType) and c.co_name == f"{PREFIX}factory")
        return cls("callable", filename, _digest("callable", fn.__qualname__, ast.dump(fdef)),
                   rewritten, factory, fn, args, kwargs)

    @staticmethod
    def _find_def(fn: types.FunctionType, text: str, offset: int) -> tuple[Optional[ast.FunctionDef], str]:
        try:
            tree = ast.parse(textwrap.dedent(text))
        except SyntaxError as e:
            return None, f"its source does not parse on its own ({e.msg})"
        fdef = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == fn.__name__), None)
        if fdef is None:
            return None, "its source is not a plain `def` (a lambda or an async def)"
        if "." in fn.__qualname__ and _uses_mangled_names(fdef):
            return None, "it is a method that uses name-mangled __private names"
        ast.increment_lineno(tree, offset)
        return fdef, ""

    # ------------------------------------------------------------------ facts used by the runtime
    def _tables(self) -> tuple:
        """The program's nodes, functions and call spans, plus those of rewritten library modules."""
        version = libraries.REGISTRY.version
        if self._merged[0] != version:
            own = self._rewritten
            reg = libraries.REGISTRY
            self._merged = (version, {**(own.nodes if own else {}), **reg.nodes},
                            {**(own.defs if own else {}), **reg.defs},
                            {**(own.call_spans if own else {}), **reg.call_spans})
            self._fids.clear()
        return self._merged

    @property
    def unchanged_defs(self) -> dict[int, str]:
        """Why each function of the program that runs unchanged does (its line -> the reason)."""
        return self._rewritten.unchanged_defs if self._rewritten else {}

    @property
    def nodes(self) -> dict:
        if not libraries.REGISTRY.version:
            return self._rewritten.nodes if self._rewritten else {}
        return self._tables()[1]

    @property
    def statements(self) -> list:
        return self._rewritten.statements if self._rewritten else []

    @property
    def unstable(self) -> frozenset:
        return self._rewritten.unstable if self._rewritten else frozenset()

    @property
    def local_names(self) -> tuple:
        return self._rewritten.local_names if self._rewritten else ()

    @property
    def defs(self) -> dict:
        if not libraries.REGISTRY.version:
            return self._rewritten.defs if self._rewritten else {}
        return self._tables()[2]

    @property
    def call_spans(self) -> dict:
        if not libraries.REGISTRY.version:
            return self._rewritten.call_spans if self._rewritten else {}
        return self._tables()[3]

    def fid_of(self, code: types.CodeType) -> Optional[int]:
        """The function id of a frame's code: 0 for the top level, that of a rewritten function of
        this program (a code object unpickled from a checkpoint included), else None."""
        if code is self._root_code:
            return 0
        try:
            return self._fids[code]
        except KeyError:
            pass
        fid = None
        for c in code.co_consts:
            if type(c) is str and c.startswith(MARKER):
                fid = int(c[len(MARKER):])
                break
        if fid is not None and fid not in self.defs:
            fid = None
        self._fids[code] = fid
        return fid

    @property
    def has_safe_points(self) -> bool:
        return bool(self._rewritten and self._rewritten.has_safe_points)

    # ------------------------------------------------------------------ running
    def run(self, namespace: dict, controller: "Controller", restore: "Optional[CheckpointRef]" = None) -> Any:
        """Run in ``namespace`` (the ``__main__`` globals) under ``controller``, from ``restore`` if given.

        Returns the last top-level expression's value (or the callable's return value); raises
        `Preempted` after a ``then='stop'`` checkpoint; user exceptions propagate unchanged.
        """
        namespace.setdefault("__name__", "__main__")
        install_dormant()
        libraries.install(folder=self._folder())  # before the checkpoint loads: it may import a library trainer
        training_state.install()  # DataLoader iterators made from now on can be checkpointed
        grad_decorators.install()  # @torch.no_grad() on the program's functions records the caller's mode
        handles.install()  # and csv writers
        wandb_runs.install()  # a W&B run's open row and folder are kept for its checkpoints
        mlflow_runs.install()  # a restore's `with mlflow.start_run():` starts no second run
        rt = Runtime(self, namespace, controller)
        if self.kind == "callable":
            globals_ = self._callable_globals(namespace)
            rt.fn_globals = globals_
        else:
            globals_ = namespace
        graph = None
        module_state.begin()  # modules imported from here on may be the job's
        if restore is not None:
            if not self.has_safe_points:
                raise CheckpointError(f"this program has no safe points, so it has no checkpoint to resume "
                                      f"({self.fallback_reason or 'nothing to resume'})")
            rt.restore_started = time.monotonic()
            # what the imports the load makes print, the run printed before (transformers' at import)
            with replay_effects.quietly(stderr=False):
                graph = load_graph(restore, controller.rank, globals_, self.identity, self._code)
            context.restore(graph.get("context"))  # before rebuilds: they may read relative paths
            process_settings.apply(graph.get("process"))  # the settings the skipped statements made
            hydra_state.apply(graph.get("hydra"))  # what @hydra.main set up before main(cfg)
            mlflow_runs.apply(graph.get("mlflow"))  # mlflow.log_metric logs to the same run again
            scoped_modes.apply_outer(graph.get("modes"))  # grad mode, decimal context outside the with statements
            with replay_effects.quietly(stderr=False):
                module_state.apply(graph.get("modules"))  # config.lr = args.lr, counters in helper modules
                imported_submodules.apply(graph.get("submodules"))  # import xml.sax.saxutils: xml.sax is set
            library_patches.apply(graph.get("patches"))  # F.gelu = my_gelu
        else:
            context.begin()
            process_settings.begin()
        if self.fallback_reason and self.kind == "callable":
            warnings.warn(f"{self.fn!r} runs without safe points: {self.fallback_reason}", RuntimeWarning,
                          stacklevel=2)
        controller.attach(rt)
        libraries.bind(rt)
        ownership.PROGRAM.set(globals_, self._folder())
        caches.install()  # lru_cache on the program's functions saves its entries
        exit_handlers.install(graph.get("exit_handlers") if graph else None)  # and so do atexit handlers
        stopped = False
        try:
            if self.kind == "source":
                return self._run_source(rt, namespace, graph)
            return self._run_callable(rt, namespace, globals_, graph)
        except Preempted:
            stopped = True
            wandb_runs.stopped()  # what the job logged reaches its tracker before the process ends
            mlflow_runs.stopped()
            raise
        finally:
            exit_handlers.uninstall(ended=not stopped, main_globals=self._main_globals(namespace))
            caches.uninstall()
            module_state.end()
            type_memos.forget()
            ownership.PROGRAM.set(None, None)
            libraries.bind(None)
            controller.detach()

    def _main_globals(self, namespace: dict) -> Optional[dict]:
        """``namespace`` when it is a script's ``__main__`` module (not a notebook cell's, whose
        kernel goes on), which the interpreter would clear at exit."""
        main = sys.modules.get("__main__")
        if self.kind != "source" or self.filename.startswith("<") or main is None or vars(main) is not namespace:
            return None
        return namespace

    def _folder(self) -> Optional[str]:
        """The job's own folder, whose modules are the user's: the script's, or a cell's working
        directory (a callable's code may come from anywhere: none)."""
        if self.kind != "source":
            return None
        if self.filename.startswith("<"):
            return os.getcwd()
        return os.path.dirname(os.path.abspath(self.filename))

    def _run_source(self, rt: Runtime, namespace: dict, graph: Optional[dict]) -> Any:
        namespace[RT] = rt
        try:
            if graph is not None:
                namespace.update(graph["namespace"])
                rt.rebuilt = rebuild_variables(rt, graph, namespace, None)
                rt.begin_restore(graph["position"], graph["step"], graph["rng"], None, dict(namespace))
            assert self._code is not None
            exec(self._code, namespace)
            return rt.result
        finally:
            for name in [k for k in namespace if k.startswith(PREFIX)]:
                del namespace[name]

    def _callable_globals(self, namespace: dict) -> dict:
        """The callable's own module dict if importable, else the run's namespace.

        In the second case the namespace receives the globals the function's code refers to
        (what cloudpickle would ship), not a whole ``__main__`` that may hold anything.
        """
        fn = self.fn
        module = inspect.getmodule(fn) if isinstance(fn, types.FunctionType) else None
        if module is not None and module.__dict__ is getattr(fn, "__globals__", None) \
                and module.__name__ != "__main__":
            return fn.__globals__
        if isinstance(fn, types.FunctionType):
            for name in extract_code_globals(fn.__code__):
                if name in fn.__globals__:
                    namespace.setdefault(name, fn.__globals__[name])
        return namespace

    def _run_callable(self, rt: Runtime, namespace: dict, globals_: dict, graph: Optional[dict]) -> Any:
        if self._code is None:
            return self.fn(*self.args, **self.kwargs)
        if graph is not None:
            if globals_ is namespace:
                namespace.update(graph["namespace"])
            saved_locals = dict(graph["locals"] or {})
            rt.rebuilt = rebuild_variables(rt, graph, globals_, saved_locals)
            rt.begin_restore(graph["position"], graph["step"], graph["rng"], saved_locals, dict(saved_locals))
        factory = types.FunctionType(self._code, globals_, f"{PREFIX}factory")
        saved_cells = (graph or {}).get("closure") or {}  # a closure's state at the checkpoint
        cells = [saved_cells.get(name, c.cell_contents)
                 for name, c in zip(self.fn.__code__.co_freevars, self.fn.__closure__ or ())]
        fn = factory(rt, *cells)
        src = self.fn
        fn.__defaults__ = src.__defaults__
        fn.__kwdefaults__ = src.__kwdefaults__
        fn.__dict__.update(src.__dict__)
        fn.__doc__, fn.__qualname__, fn.__module__ = src.__doc__, src.__qualname__, src.__module__
        fn.__annotations__ = dict(src.__annotations__)
        try:
            return fn(*self.args, **self.kwargs)
        finally:
            rt.fn_frame = None


def _empty_cell(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return True
    return False
