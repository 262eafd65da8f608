"""Objects that stand for something outside the process: re-opened, re-created, or refused.

A checkpoint cannot hold an open socket or a thread, but a few such objects carry no progress
of the job at all, so a restore may make them anew and stay exact:

* a TensorBoard ``SummaryWriter`` is flushed when checkpointed and re-opened on restore on the
  same log folder (a new event file beside the old ones: TensorBoard reads them as one log);
* a ``tqdm`` progress bar is drawn anew on restore with the same settings, its count and its
  postfix (it writes to a terminal stream, which a pickled copy cannot hold: its own pickling
  "succeeds" and then recurses forever on load);
* a ``csv.writer`` (and so a ``csv.DictWriter``) made while the program runs is one of ours
  (`install`), saved as its file and dialect and made again over the re-opened file; so is a
  ``csv.reader`` (and ``csv.DictReader``), which reads its file's lines with ``readline()`` so
  that the file keeps its ``tell()`` and is saved at its place;
* a ``multiprocessing`` pool or a ``concurrent.futures`` executor that has ended (``with Pool(4)
  as pool:`` before the loop leaves ``pool`` bound) is saved as an ended one without workers;
* a ``struct.Struct`` (a compiled format, nothing more) is made again from its format;
* a lock no thread holds is saved as a new lock, an ``Event`` as a new one in the same state,
  wherever they are (an attribute of a trainer, a local of ``main()``); a ``threading.local``
  with the attributes the job's thread gave it;
* locks, events, conditions, thread pools and loggers (modules in `PROGRESS_FREE_MODULES`) may
  be re-created by re-running the one statement that made them (state.py checks the statement).

Anything else that does not pickle is refused, with advice that names the attribute that fails
(`explain`): re-running ``bl = Infinite(ds)`` would silently restart whatever ``bl`` had done.
"""
from __future__ import annotations

import csv
import dis
import pickle
import queue
import struct
import sys
import threading
import types
from typing import Any, Callable, Optional

from . import generator_rewrite, manual_next, resumable_generators

#: an unpicklable value of a type from these modules holds no progress: its statement may be re-run
PROGRESS_FREE_MODULES = ("threading", "_thread", "concurrent.futures", "logging", "multiprocessing.synchronize",
                         "torch.utils.tensorboard")


_csv_writer = csv.writer  # the C functions `install` puts `CsvWriter` and `CsvReader` in front of
_csv_reader = csv.reader
_CSV_READER = type(_csv_reader([]))


class CsvWriter:
    """What ``csv.writer(f, dialect, **fmtparams)`` returns while a program runs: the C writer
    (whose rows go straight to its own methods), plus what makes it again on restore."""

    def __init__(self, f: Any, dialect: Any = "excel", **fmtparams: Any) -> None:
        self._made_from = (f, dialect, fmtparams)
        self._writer = _csv_writer(f, dialect, **fmtparams)
        self.writerow = self._writer.writerow
        self.writerows = self._writer.writerows

    @property
    def dialect(self) -> Any:
        return self._writer.dialect

    def __reduce__(self) -> tuple:
        return _new_csv_writer, self._made_from


def _new_csv_writer(f: Any, dialect: Any, fmtparams: dict) -> Any:
    if getattr(f, "closed", False):  # its file was closed before the checkpoint: writing raises, as then
        return ClosedCsvWriter(f)
    return CsvWriter(f, dialect, **fmtparams)


class ClosedCsvWriter:
    """A csv writer whose file was closed when the checkpoint was taken: writing raises as it would have."""

    def __init__(self, f: Any) -> None:
        self._made_from = f

    def writerow(self, row: Any) -> Any:
        raise ValueError("I/O operation on closed file.")

    def writerows(self, rows: Any) -> Any:
        raise ValueError("I/O operation on closed file.")


class CsvReader:
    """What ``csv.reader(source, dialect, **fmtparams)`` returns while a program runs: the C
    reader, which does not pickle, over the source's lines, plus what makes it again on restore.

    A text file is read through its ``readline()``: iterating the file itself, as the C reader
    does, disables its ``tell()``, so neither the reader nor the file
    could be saved, and ``reader = csv.reader(f); header = next(reader); for row in reader:``,
    the commonest way to read a CSV, made a job that could never be checkpointed. Between two
    rows the C reader holds nothing but its line count (a row is returned only once complete),
    so the source at its place, the dialect and that count are the whole state."""

    __slots__ = ("_made_from", "_source", "_reader", "_lines_before")

    def __init__(self, source: Any, dialect: Any = "excel", *args: Any, **fmtparams: Any) -> None:
        self._made_from = (source, dialect, args, fmtparams)
        # ``readline`` until "": a C iterator (the row costs this wrapper's __next__ more: bench/csv_reader.py)
        self._source = iter(source.readline, "") if manual_next.is_text_file(source) else iter(source)
        self._reader = _csv_reader(self._source, dialect, *args, **fmtparams)
        self._lines_before = 0  # lines read before a restore made this reader again

    def __iter__(self) -> "CsvReader":
        return self

    def __next__(self) -> list:
        return next(self._reader)

    @property
    def dialect(self) -> Any:
        return self._reader.dialect

    @property
    def line_num(self) -> int:
        return self._lines_before + self._reader.line_num

    def __reduce__(self) -> tuple:
        source, dialect, args, fmtparams = self._made_from
        if not manual_next.is_text_file(source):
            source = self._source  # an iterator over strings: saved with its place, or refused naming it
        return _new_csv_reader, (source, dialect, args, fmtparams, self.line_num)


def _new_csv_reader(source: Any, dialect: Any, args: tuple, fmtparams: dict, line_num: int) -> CsvReader:
    reader = CsvReader(source, dialect, *args, **fmtparams)
    reader._lines_before = line_num
    return reader


def install() -> None:
    """Make ``csv.writer`` return a `CsvWriter` and ``csv.reader`` a `CsvReader`
    (``csv.DictWriter`` and ``csv.DictReader`` call them too): the C objects do not pickle, so a
    job writing a CSV log or looping over a CSV reader could not be checkpointed at all."""
    csv.writer = CsvWriter  # type: ignore[assignment,misc]
    csv.reader = CsvReader  # type: ignore[assignment,misc]


def progress_free(value: Any) -> bool:
    """True for a value that re-running its creating statement re-creates exactly (not a running
    thread: the statement would make it again unstarted, and what it was doing would stop)."""
    if isinstance(value, threading.Thread) and value.is_alive():
        return False
    module = getattr(type(value), "__module__", "") or ""
    return any(module == m or module.startswith(m + ".") for m in PROGRESS_FREE_MODULES) or _script_function(value)


def _script_function(value: Any) -> bool:
    """A TorchScript function (``@torch.jit.script`` on a ``def``): compiled code without state,
    which does not pickle. (A scripted module holds parameters: not this.)"""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch._C.ScriptFunction)


def reduce(obj: Any) -> Any:
    """A reduction that re-opens ``obj`` on restore, or NotImplemented."""
    cls = type(obj)
    if cls is _LOCK or cls is _RLOCK:
        if not _free(obj):
            raise pickle.PicklingError(f"a {cls.__name__} held at the safe point cannot be saved")
        return (_new_lock if cls is _LOCK else _new_rlock), ()  # a free lock has no other state
    if cls is threading.Event:
        return _event, (obj.is_set(),)
    if cls is struct.Struct:
        return struct.Struct, (obj.format,)
    if isinstance(obj, threading.local):
        return _new_local, (cls,), dict(obj.__dict__)
    if cls.__name__ == "SummaryWriter" and cls.__module__.startswith("torch.utils.tensorboard"):
        obj.flush()  # what was logged up to the checkpoint is on disk before it counts
        return _reopen_summary_writer, (cls, obj.log_dir, obj.max_queue, obj.flush_secs, obj.filename_suffix)
    if _is_tqdm(cls):
        return _new_tqdm, (cls, _tqdm_arguments(obj))
    if _is_ended_pool(obj):
        return _ended_pool, (cls, obj._state, len(obj._pool))
    if _is_ended_executor(obj):
        return _ended_executor, (cls, obj._max_workers)
    return NotImplemented


def _is_ended_pool(obj: Any) -> bool:
    """A ``multiprocessing`` pool closed or terminated, whose workers have all exited: what
    ``pool`` still names after ``with Pool(4) as pool: ...`` (preprocessing before the loop)."""
    pool_module = sys.modules.get("multiprocessing.pool")
    if pool_module is None or not isinstance(obj, pool_module.Pool):
        return False
    workers = getattr(obj, "_pool", None)
    return obj._state != pool_module.RUN and workers is not None and not any(w.is_alive() for w in workers)


class _Ended:
    """An ended pool's worker or handler thread: ``pool.join()`` returns at once."""

    def join(self, timeout: Optional[float] = None) -> None:
        return None

    def is_alive(self) -> bool:
        return False


def _ended_pool(cls: type, state: str, workers: int) -> Any:
    """The ended pool made again with ended workers: using it raises "Pool not running", as the
    ended one did; ``close()``, ``terminate()`` and ``join()`` do nothing, as for the ended one."""
    pool = cls.__new__(cls)
    pool._state = state
    pool._pool = [_Ended() for _ in range(workers)]
    pool._terminate = lambda: None
    pool._worker_handler = pool._task_handler = pool._result_handler = _Ended()
    return pool


def _is_ended_executor(obj: Any) -> bool:
    """A ``concurrent.futures`` thread or process pool (not a subclass) after ``shutdown()``, with
    no worker left: what ``ex`` still names after ``with ThreadPoolExecutor() as ex: ...``."""
    cls = type(obj)
    if (cls.__module__, cls.__name__) == ("concurrent.futures.thread", "ThreadPoolExecutor"):
        return obj._shutdown and not any(t.is_alive() for t in obj._threads)
    if (cls.__module__, cls.__name__) == ("concurrent.futures.process", "ProcessPoolExecutor"):
        return obj._shutdown_thread and obj._processes is None
    return False


def _ended_executor(cls: type, max_workers: int) -> Any:
    """A new executor of the same size, shut down before it started a worker: ``submit`` raises
    "cannot schedule new futures after shutdown", as it did on the one saved."""
    executor = cls(max_workers=max_workers)
    executor.shutdown()
    return executor


def _is_tqdm(cls: type) -> bool:
    return any(c.__name__ == "tqdm" and c.__module__.startswith("tqdm") for c in cls.__mro__)


#: tqdm's constructor arguments that it keeps as attributes of the same name
_TQDM_SETTINGS = ("desc", "total", "leave", "ncols", "nrows", "mininterval", "maxinterval", "ascii", "unit",
                  "unit_scale", "dynamic_ncols", "smoothing", "bar_format", "unit_divisor", "colour", "delay")


def _tqdm_arguments(bar: Any) -> dict[str, Any]:
    """What re-makes ``bar``: its settings (a disabled bar keeps only a few), count and output."""
    kwargs = {k: getattr(bar, k) for k in _TQDM_SETTINGS if hasattr(bar, k)}
    if not getattr(bar, "dynamic_miniters", True):
        kwargs["miniters"] = bar.miniters
    kwargs.update(iterable=bar.iterable, disable=bar.disable, initial=bar.n, postfix=getattr(bar, "postfix", None))
    stream = getattr(getattr(bar, "fp", None), "_wrapped", None)
    if stream is not None:
        kwargs["file"] = stream  # sys.stdout / sys.stderr pickle as the new process's streams
    return kwargs


def _new_tqdm(cls: type, kwargs: dict[str, Any]) -> Any:
    return cls(**kwargs)


_LOCK = type(threading.Lock())
_RLOCK = type(threading.RLock())


def _free(lock: Any) -> bool:
    """Whether no thread holds ``lock`` (an RLock this thread holds counts as held)."""
    if getattr(lock, "_is_owned", lambda: False)():
        return False
    if not lock.acquire(blocking=False):
        return False
    lock.release()
    return True


def _new_lock() -> Any:
    return threading.Lock()


def _new_rlock() -> Any:
    return threading.RLock()


def _event(is_set: bool) -> threading.Event:
    event = threading.Event()
    if is_set:
        event.set()
    return event


def _new_local(cls: type) -> threading.local:
    """A ``threading.local`` (or subclass) made anew; the pickle then sets the attributes the
    checkpointing thread (the job's) saw. Re-running ``tls = threading.local()`` made it empty, so
    a cache or counter kept in it silently started over. Threads do not survive a restore, so
    what other threads kept in it is not saved. A subclass's ``__init__`` arguments are not
    kept (Python does not show them): another thread touching it first calls ``__init__()``."""
    return cls.__new__(cls)


def _reopen_summary_writer(cls: type, log_dir: str, max_queue: int, flush_secs: int, suffix: str) -> Any:
    return cls(log_dir=log_dir, max_queue=max_queue, flush_secs=flush_secs, filename_suffix=suffix)


def explain(name: str, value: Any, probe: Callable[[Any], Optional[str]], top_level: bool = True) -> str:
    """Advice for one variable that cannot be saved, naming the attribute that fails if there is
    one; ``top_level``: the variable is the program's own (its statement could be re-run), not a
    function's local."""
    path, culprit = _culprit(name, value, probe)
    known = _known(name, value, path, culprit)
    if known:
        return known
    kind = type(culprit).__name__
    if isinstance(culprit, types.GeneratorType) and _receives_values(culprit.gi_code):
        code = culprit.gi_code
        return (f"`{path}` is a coroutine from {code.co_name}() (line {code.co_firstlineno}): it receives values "
                f"through `send()`, and where it stopped cannot be saved; keep its state in an object "
                f"instead, a class whose method does with each value what the body does after `yield` "
                f"(e.g. `def send(self, value): self.total += value; self.count += 1; return self.total / "
                f"self.count`), so the checkpoint saves its attributes")
    if resumable_generators.is_resumable(culprit):
        code = culprit.gi_code
        for local, inner in culprit.gi_frame.f_locals.items():
            error = probe(inner)
            if error is not None and local != generator_rewrite.STATE:
                what = "the iterator of one of its `for` loops" if local.startswith(generator_rewrite.LOOP_PREFIX) \
                    else f"its local `{local}`"
                inner_advice = explain(local, inner, probe, top_level=False)
                return (f"`{path}` is a generator from {code.co_name}() (line {code.co_firstlineno}), saved where "
                        f"it stopped with its locals, but {what} ({type(inner).__name__}) cannot be saved "
                        f"({error}): {inner_advice}")
    if isinstance(culprit, types.GeneratorType):
        code = culprit.gi_code
        return (f"`{path}` is a generator from {code.co_name}() (line {code.co_firstlineno}), of a shape whose "
                f"stopping point cannot be saved: only generator functions defined at module level (or as "
                f"methods of its classes), undecorated (but for `@contextmanager`), whose yields are "
                f"statements inside nothing but `for`, `while`, `if`, `with open(...)` and the body of a "
                f"`try` (no yield in its `except` or `finally`, no other `with`, no `x = yield`). Give "
                f"{code.co_name}() that shape, loop over the data with `for` instead (e.g. "
                f"`for batch in loader:` inside `while True:`), or keep the position in an object: a class "
                f"whose `__next__` calls `next(self.it)` on `self.it = iter(loader)` and makes a new "
                f"`iter(loader)` on StopIteration (a live DataLoader iterator in an attribute is saved exactly)")
    if path != name:
        owner = type(value).__name__
        attr = path.rsplit(".", 1)[-1]
        return (f"`{path}` is a {kind}, which cannot be saved and holds state a re-created `{name}` would "
                f"lose; give {owner} `__getstate__`/`__setstate__` methods that leave out `{attr}` and "
                f"re-open it, or create `{attr}` inside the loop body and close it there")
    if progress_free(value) and top_level:
        return (f"`{name}` ({kind}) is re-created on restore only when one top-level statement that nothing "
                f"reassigns creates it; create it that way, or `del {name}` before the loop")
    if progress_free(value):
        return (f"`{name}` ({kind}) holds no progress but, as a function's local, cannot be re-created on "
                f"restore; create it at the top level of the script, or `del {name}` before the loop")
    return (f"`{name}` ({kind}) cannot be saved and re-creating it could resume differently; close it or "
            f"`del {name}` before the loop, or create and close it inside the loop body")


def _receives_values(code: types.CodeType) -> bool:
    """Whether a generator's code uses what a ``yield`` expression gives back (``value = yield avg``):
    a coroutine driven with ``send()``, not an iterator (whose ``yield x`` result is dropped)."""
    after_yield = False
    for ins in dis.get_instructions(code):
        if ins.opname == "YIELD_VALUE":
            after_yield = True
        elif after_yield and ins.opname not in ("RESUME", "CACHE", "NOP"):
            if ins.opname != "POP_TOP" and not ins.opname.startswith("JUMP_BACKWARD"):  # (a `yield from` loop)
                return True
            after_yield = False
    return False


def explain_known(name: str, value: Any, probe: Callable[[Any], Optional[str]]) -> str:
    """Advice for what a variable or a loop's iterable holds that is known to hold progress a
    checkpoint cannot save (a running thread, a csv reader), else ''."""
    return _known(name, value, *_culprit(name, value, probe))


def _known(name: str, value: Any, path: str, culprit: Any) -> str:
    """`explain_known`, given the attribute of ``value`` that does not pickle (`_culprit`)."""
    thread = _live_thread(name, value)
    if thread is not None:
        path, target = thread
        return (f"`{path}` is a running thread{target}: what a background thread has done and holds (a "
                f"queue it fills, where it is in its loop) cannot be saved. Let a DataLoader prefetch "
                f"instead (`num_workers=2`: its workers are replayed exactly), or stop and join the thread "
                f"before the loop")
    if isinstance(value, queue.Queue):
        return (f"`{name}` is a {type(value).__module__}.{type(value).__qualname__} between threads: what it "
                f"holds was made by a thread that fills it, whose place cannot be saved. Let a DataLoader "
                f"prefetch instead (`num_workers=2, prefetch_factor=2`: its workers are replayed exactly), or "
                f"stop and join the thread and empty the queue before the loop")
    if type(culprit) is _CSV_READER:
        return (f"`{path}` is a csv reader made by the C function itself (`_csv.reader`, or a library that "
                f"took `csv.reader` before the job ran), whose place in its file cannot be saved; make it "
                f"with `csv.reader(f)` in the job's code (saved with its file), read the rows where it is "
                f"made (`rows = list(csv.reader(f))`), or `del {path}` once it is read")
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.jit.ScriptModule):
        return (f"`{name}` is a TorchScript module (`torch.jit.trace`/`torch.jit.script`): its JIT optimizes "
                f"the graph after the first calls, and a module loaded again at a restore would optimize it "
                f"at another call, so the steps after a restore could differ in the last bits (measured). "
                f"Train and evaluate the eager module in the loop and trace or script it after the loop "
                f"(`torch.compile` is saved exactly), or `del {name}` before the loop")
    return ""


def _live_thread(name: str, value: Any, depth: int = 3) -> Optional[tuple[str, str]]:
    """The path of a running `threading.Thread` in ``value`` (through plain instance dicts), and
    what it runs (`` (Prefetcher._work)``)."""
    if isinstance(value, threading.Thread):
        if not value.is_alive():
            return None
        target = getattr(value, "_target", None)
        return name, f" ({target.__qualname__})" if hasattr(target, "__qualname__") else ""
    attrs = getattr(value, "__dict__", None)
    if depth and isinstance(attrs, dict) and not isinstance(value, type):
        for attr, inner in attrs.items():
            found = _live_thread(f"{name}.{attr}", inner, depth - 1)
            if found is not None:
                return found
    return None


def _culprit(name: str, value: Any, probe: Callable[[Any], Optional[str]], depth: int = 3) -> tuple[str, Any]:
    """The deepest attribute of ``value`` (through plain instance dicts) that does not pickle."""
    attrs = getattr(value, "__dict__", None)
    if depth and isinstance(attrs, dict) and not isinstance(value, type):
        for attr, inner in attrs.items():
            if probe(inner) is not None:
                return _culprit(f"{name}.{attr}", inner, probe, depth - 1)
    return name, value
