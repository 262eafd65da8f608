"""Process-wide settings a script makes before its loop, which live in libraries, not in its variables.

``torch.set_default_dtype(torch.float64)`` or ``logging.basicConfig(filename="train.log")`` at the
top of ``main()`` runs once. A restore does not run it again (the statements before the safe
point are done), and the new process starts with the libraries' defaults: tensors made after the
restore would be float32, printed with another precision, and the log lines would go nowhere, a
silent difference. So each checkpoint records these settings and a restore puts them back before
the program continues:

* torch: default dtype and device, print options, float32 matmul precision, TF32 and reduced-
  precision flags, anomaly detection, flushing denormals (the deterministic settings are the
  fingerprint's; grad mode is scoped_modes.py's);
* numpy: print options and floating-point error handling, with the function ``np.seterrcall``
  gave it (``np.seterr(divide="call")`` without it raises);
* torch's global module hooks (``register_module_forward_hook``: torch_hooks.py);
* ``warnings`` filters, the recursion limit, the garbage collector's switch and thresholds, and
  ``sys.set_int_max_str_digits(0)`` (without it, ``str()`` of a big integer raises);
* ``logging.captureWarnings(True)``: warnings go to the ``py.warnings`` logger (and its log
  file), not to stderr;
* descriptors 1 and 2 pointed at a file by the job (``os.dup2(log.fileno(), 1)``): the file's
  bytes and place, pointed at again;
* the umask (``os.umask(0o077)`` to keep a run's outputs private): files made after the restore
  get the modes they would have had;
* the time zone the C library uses: ``os.environ["TZ"] = ...; time.tzset()`` changes it, and
  context.py puts back only the variable, so `apply` (which program.py runs after
  ``context.restore``) calls ``time.tzset()`` again;
* signal handlers the job installed (``signal.signal(signal.SIGUSR1, dump_stats)``): without
  them the signal's default action (ending the process) applies after the restore;
* ``sys.stdout`` / ``sys.stderr`` when the job replaced them (a "tee" object that prints to the
  terminal and a log file): the object is saved, and the streams it wraps, which were the
  process's own at the start, stand for the new process's own (`start_stream_name`);
* ``logging``: every configured logger's level, propagation, disabled flag, handlers (a
  ``FileHandler`` keeps its file's lines and place, open_files.py) and filters, the level names
  the job added, its record factory and logger class, and ``logging.disable``.

Only loggers the job configured are recorded: those whose level, handlers or flags differ from
when the program began (`begin`), so handlers the host process had already (a test runner's
capture, the service's own loggers ``backend.*`` and ``singularity_sdk.*``) are not. A handler
that cannot be saved (a socket handler, a queue to another process) is left out with a
``RuntimeWarning`` naming it, once; the new process's handlers for that logger stay as they are.
Signal handlers and the time zone likewise: only those the job changed since `begin` (the
worker's own SIGTERM handler, a preemption notice, is the host's; a job that installs its own
SIGTERM handler replaces it, after a restore too), and a handler that cannot be saved (a method
of an object holding a socket) is named in a ``RuntimeWarning`` and left out: that signal keeps
the new process's handler.
"""
from __future__ import annotations

import fcntl
import functools
import gc
import logging
import os
import signal
import _signal
import stat
import sys
import time
import warnings
from typing import Any, Callable, Optional

from . import torch_hooks

#: loggers of the service itself: configured by the worker, not the job
_OWN_LOGGERS = ("backend", "singularity_sdk")
#: each logger's configuration when the program began (or before a restore put the job's back)
_start: dict[str, Any] = {"pid": None, "loggers": {}, "streams": {}, "signals": {}, "zone": None, "logging": {}}
_warned: set[tuple[str, int]] = set()
#: in `_start`, a setting a restore put back: the job's, saved by every later checkpoint even
#: when it equals what the new process began with (the next one may begin with another)
_RESTORED = object()


_STREAMS = ("stdout", "stderr")


def begin() -> None:
    """Remember the loggers' configuration and the standard streams the program starts with:
    what the job changes is saved."""
    _start["pid"] = os.getpid()
    _start["loggers"] = {name: _signature(lg) for name, lg in _all_loggers().items()}
    _start["logging"] = _logging_globals()
    _start["streams"] = {name: getattr(sys, name) for name in _STREAMS}
    _start["signals"] = {sig: _handler(sig) for sig in _signals()}
    _start["zone"] = _zone()
    _start["descriptors"] = {fd: _identity(fd) for fd in _DESCRIPTORS}


def start_stream_name(obj: Any) -> Optional[str]:
    """"stdout" or "stderr" for the stream this process had there when the program began (a
    job's tee object wraps it), else None; a restore pickles it as the new process's stream."""
    for name, stream in (_start.get("streams") or {}).items():
        if obj is stream:
            return name
    return None


def capture(probe: Callable[[Any], Optional[str]], redirected: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The settings to put back; ``probe(obj)`` says why ``obj`` does not pickle (None if it does)."""
    if _start["pid"] != os.getpid():  # a forked child, or begin() was never called
        begin()
    return {"recursion_limit": sys.getrecursionlimit(), "logging": _logging(probe),
            "streams": _streams(redirected or {}), "umask": _umask(), "zone": _changed_zone(),
            "signals": _signal_handlers(probe), "gc": (gc.isenabled(), gc.get_threshold()),
            "int_max_str_digits": _int_max_str_digits(), "numpy_errcall": _numpy_errcall(probe),
            "torch_hooks": torch_hooks.capture(), "descriptors": _redirected_descriptors(), **snapshot()}


# --------------------------------------------------------------------------- os.dup2 of stdout / stderr
_DESCRIPTORS = (1, 2)


def _identity(fd: int) -> Optional[tuple[int, int]]:
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _redirected_descriptors() -> dict[int, dict[str, Any]]:
    """Descriptors 1 and 2 when the job pointed them at a file (``os.dup2(log.fileno(), 1)``, to
    catch what C code prints too): the file's path, bytes and place, and whether it appends.
    Without them a restored job printed to the process's own stdout, and the log missed the rest."""
    from . import context, open_files

    out: dict[int, dict[str, Any]] = {}
    for fd in _DESCRIPTORS:
        now = _identity(fd)
        if now is None or now == (_start.get("descriptors") or {}).get(fd):
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue  # a pipe or a terminal of the job's: nothing a restore could point it at again
            path = os.readlink(f"/proc/self/fd/{fd}")
            getattr(sys, "stdout" if fd == 1 else "stderr").flush()
            position = os.lseek(fd, 0, os.SEEK_CUR)
            append = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_APPEND)
            if os.path.getsize(path) > open_files.MAX_CONTENT_BYTES:
                continue
            with open(path, "rb") as f:
                content = f.read()
        except (OSError, ValueError):
            continue
        rel, relative = context.relative_path(path)
        out[fd] = {"path": rel, "relative": relative, "position": position, "append": append, "content": content}
    return out


def _apply_descriptors(saved: dict[int, dict[str, Any]]) -> None:
    from . import context

    for fd, d in saved.items():
        path = context.resolve_path(d["path"], d["relative"])
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "wb") as f:
            f.write(d["content"])
        new = os.open(path, os.O_WRONLY | (os.O_APPEND if d["append"] else 0))
        os.lseek(new, d["position"], os.SEEK_SET)
        getattr(sys, "stdout" if fd == 1 else "stderr").flush()
        os.dup2(new, fd)
        os.close(new)


def _int_max_str_digits() -> Optional[int]:
    get = getattr(sys, "get_int_max_str_digits", None)  # Python >= 3.11 (and patched 3.10s)
    return get() if get is not None else None


def _numpy_errcall(probe: Callable[[Any], Optional[str]]) -> Any:
    np = sys.modules.get("numpy")
    call = np.geterrcall() if np is not None and hasattr(np, "geterrcall") else None
    return None if call is None else _saveable("the function numpy.seterrcall was given", call, probe)


# --------------------------------------------------------------------------- switched by with statements
def switches_settings(manager: Any) -> bool:
    """Whether a with statement's context manager changes settings `snapshot` records, and puts
    back at its end what it found (``np.printoptions``, ``np.errstate``, ``warnings.catch_warnings``,
    ``torch.autograd.detect_anomaly``, ``with torch.device("meta")``, ``contextlib.chdir``, whose
    directory scoped_modes.py records beside them): a restore enters it again,
    so what it found then must be what it found the first time (scoped_modes.py)."""
    if isinstance(manager, warnings.catch_warnings) or type(manager).__name__ == "chdir" \
            and type(manager).__module__ == "contextlib":
        return True
    t = type(manager)
    module = t.__module__ or ""
    if module.startswith("numpy"):
        return t.__name__ == "errstate"
    if module.startswith("torch"):
        return t.__name__ in ("device", "detect_anomaly", "set_detect_anomaly")
    func = getattr(manager, "func", None)  # a @contextmanager's, until it is entered
    return t.__name__ == "_GeneratorContextManager" and func is not None \
        and (func.__module__ or "").startswith("numpy") and func.__name__ == "printoptions"


def snapshot() -> dict[str, Any]:
    """The settings with statements switch: warnings filters and where warnings are shown (a
    ``catch_warnings`` puts back ``warnings.showwarning``, which ``logging.captureWarnings``
    replaces), torch's and numpy's (~30 us)."""
    out: dict[str, Any] = {"warnings": list(warnings.filters), "capture_warnings": _warnings_captured()}
    torch = sys.modules.get("torch")
    if torch is not None:
        out["torch"] = _torch(torch)
    np = sys.modules.get("numpy")
    if np is not None and hasattr(np, "get_printoptions"):
        out["numpy"] = {"print": dict(np.get_printoptions()), "err": dict(np.geterr())}
    return out


def apply_switchable(saved: dict[str, Any]) -> None:
    """Set the parts of `snapshot` (or of a `capture`) that differ from this process's."""
    if warnings.filters != saved["warnings"]:
        warnings.filters[:] = saved["warnings"]  # in place: a catch_warnings puts its own list back
        # the cache the filters are read through (renamed in newer Pythons)
        mutated = getattr(warnings, "_filters_mutated", None) or getattr(warnings, "_filters_mutated_lock_held", None)
        if mutated is not None:
            mutated()
    if "capture_warnings" in saved and saved["capture_warnings"] != _warnings_captured():
        _capture_warnings(saved["capture_warnings"])
    if "torch" in saved:
        import torch

        _apply_torch(torch, saved["torch"])
    if "numpy" in saved:
        import numpy as np

        if dict(np.get_printoptions()) != saved["numpy"]["print"]:
            np.set_printoptions(**saved["numpy"]["print"])
        if dict(np.geterr()) != saved["numpy"]["err"]:
            np.seterr(**saved["numpy"]["err"])


def _streams(redirected: dict[str, Any]) -> dict[str, Any]:
    """The standard streams the job replaced; for one a ``redirect_stdout`` the restore enters
    again has replaced (``redirected``), the stream it replaced."""
    now = {name: redirected.get(name, getattr(sys, name)) for name in _STREAMS}
    return {name: stream for name, stream in now.items() if stream is not _start["streams"][name]}


def apply(saved: Optional[dict[str, Any]]) -> None:
    """Put the settings of a checkpoint back in this process (None: a checkpoint without them)."""
    if not saved:
        return
    begin()  # what this process had before: the job's loggers put back below differ from it
    sys.setrecursionlimit(max(saved["recursion_limit"], 100))
    if saved.get("gc") is not None:  # gc.disable() for speed, gc.set_threshold(...): the job's own
        enabled, threshold = saved["gc"]
        gc.set_threshold(*threshold)
        (gc.enable if enabled else gc.disable)()
    apply_switchable(saved)
    _apply_logging(saved["logging"])
    for name, stream in saved.get("streams", {}).items():
        setattr(sys, name, stream)
    if saved.get("umask") is not None:
        os.umask(saved["umask"])
    if saved.get("int_max_str_digits") is not None and hasattr(sys, "set_int_max_str_digits"):
        sys.set_int_max_str_digits(saved["int_max_str_digits"])
    torch_hooks.apply(saved.get("torch_hooks"))
    _apply_descriptors(saved.get("descriptors") or {})
    if saved.get("numpy_errcall") is not None:
        import numpy as np

        np.seterrcall(saved["numpy_errcall"])
    if saved.get("zone") is not None:
        _apply_zone(saved["zone"])
    _apply_signals(saved.get("signals") or {})


# --------------------------------------------------------------------------- torch
#: torch.backends attributes: the legacy flags, then newer torch's precision API. Reading a legacy
#: flag after the new API was used raises (so it is not saved), and putting the legacy ones back
#: first makes the new API's values, derived from them, equal (so they are not set: mixing the
#: two APIs makes torch raise on the next read)
_LEGACY_FLAGS = ("cuda.matmul.allow_tf32", "cudnn.allow_tf32", "cuda.matmul.allow_fp16_reduced_precision_reduction",
                 "cuda.matmul.allow_bf16_reduced_precision_reduction")
_PRECISION_FLAGS = ("fp32_precision", "cuda.matmul.fp32_precision", "cudnn.fp32_precision",
                    "cudnn.conv.fp32_precision", "cudnn.rnn.fp32_precision", "mkldnn.fp32_precision",
                    "mkldnn.matmul.fp32_precision", "mkldnn.conv.fp32_precision", "mkldnn.rnn.fp32_precision")


def _backend_flag(torch: Any, path: str) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    *owner_path, attr = path.split(".")

    def owner() -> Any:
        o = torch.backends
        for part in owner_path:
            o = getattr(o, part)
        return o

    return (lambda: getattr(owner(), attr)), (lambda v: setattr(owner(), attr, v))


def _torch_settings(torch: Any) -> dict[str, tuple[Callable[[], Any], Callable[[Any], None]]]:
    """name -> (read, write) of each setting, in the order they are put back."""
    opts = torch._tensor_str.PRINT_OPTS
    out: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {
        "dtype": (torch.get_default_dtype, torch.set_default_dtype),
        "print": (lambda: {k: getattr(opts, k) for k in ("precision", "threshold", "edgeitems", "linewidth", "sci_mode")},
                  lambda v: torch.set_printoptions(**v)),
        "anomaly": (lambda: (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
                    lambda v: torch.autograd.set_detect_anomaly(*v)),
    }
    if hasattr(torch, "get_default_device"):
        out["device"] = (lambda: str(torch.get_default_device()),
                         lambda v: torch.set_default_device(None if v == "cpu" else v))
    out["matmul_precision"] = (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision)
    # no getter: whether a denormal float32 comes out of a CPU multiplication as zero
    out["flush_denormal"] = (lambda: torch.tensor([1e-40], dtype=torch.float32, device="cpu").mul_(1.0).item() == 0.0,
                             torch.set_flush_denormal)
    for path in _LEGACY_FLAGS + _PRECISION_FLAGS:
        out[f"backends.{path}"] = _backend_flag(torch, path)
    return out


def _torch(torch: Any) -> dict[str, Any]:
    out = {}
    for name, (read, _write) in _torch_settings(torch).items():
        try:
            out[name] = read()
        except (AttributeError, RuntimeError):  # not in this torch, or unreadable after the new API
            pass
    return out


def _apply_torch(torch: Any, saved: dict[str, Any]) -> None:
    for name, (read, write) in _torch_settings(torch).items():
        if name not in saved:
            continue
        try:
            if read() == saved[name]:
                continue
        except (AttributeError, RuntimeError):
            continue
        try:
            write(saved[name])
        except (AttributeError, RuntimeError, ValueError) as exc:
            warnings.warn(f"the job's torch setting {name}={saved[name]!r} could not be put back ({exc}); "
                          f"results after the restore may differ", RuntimeWarning, stacklevel=3)


# --------------------------------------------------------------------------- logging
def _signature(logger: logging.Logger) -> tuple:
    return logger.level, logger.propagate, logger.disabled, tuple(map(id, logger.handlers)), \
        tuple(map(id, logger.filters))


def _logging_globals() -> dict[str, Any]:
    """What ``logging.addLevelName``, ``setLogRecordFactory`` and ``setLoggerClass`` set."""
    return {"levels": dict(logging._levelToName),  # type: ignore[attr-defined]
            "record_factory": logging.getLogRecordFactory(), "logger_class": logging.getLoggerClass()}


def _all_loggers() -> dict[str, logging.Logger]:
    loggers: dict[str, logging.Logger] = {"": logging.getLogger()}
    loggers.update((name, lg) for name, lg in list(logging.Logger.manager.loggerDict.items())
                   if isinstance(lg, logging.Logger))
    return loggers


def _changed_by_job(name: str, logger: logging.Logger) -> bool:
    if name.split(".")[0] in _OWN_LOGGERS:
        return False
    started = _start["loggers"].get(name)
    if started is None:  # made since the program began: by the job, or a library it imported
        return bool(logger.handlers) or bool(logger.filters) or logger.level != logging.NOTSET \
            or not logger.propagate or logger.disabled
    return started != _signature(logger)


def _logging(probe: Callable[[Any], Optional[str]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    changed = {name: logger for name, logger in _all_loggers().items() if _changed_by_job(name, logger)}
    # One probe for all the handlers (torch alone gives ~40 loggers a stderr handler): they share
    # their streams and formatters, so together they cost what one does; one at a time only if not.
    every_one_saves = probe([h for logger in changed.values() for h in logger.handlers]) is None
    for name, logger in changed.items():
        handlers: Optional[list] = []
        for handler in logger.handlers:
            why = None if every_one_saves else probe(handler)
            if why is not None:
                if (name, id(handler)) not in _warned:
                    _warned.add((name, id(handler)))
                    warnings.warn(f"the logging handler {handler!r} of logger {name or 'root'!r} cannot be saved "
                                  f"({why}); after a restore that logger keeps the handlers the new process gives "
                                  f"it", RuntimeWarning, stacklevel=3)
                handlers = None
                break
            handlers.append(handler)
        out[name] = {"level": logger.level, "propagate": logger.propagate, "disabled": logger.disabled,
                     "handlers": handlers, "filters": _saveable(f"the filters of logger {name or 'root'!r}",
                                                                list(logger.filters), probe)}
    return {"disable": logging.Logger.manager.disable, "loggers": out, **_changed_logging_globals(probe)}


def _saveable(what: str, value: Any, probe: Callable[[Any], Optional[str]]) -> Any:
    """``value``, or None with a warning (once) when it does not pickle."""
    why = probe(value)
    if why is None:
        return value
    if (what, 0) not in _warned:
        _warned.add((what, 0))
        warnings.warn(f"{what} cannot be saved ({why}); after a restore the new process's are used",
                      RuntimeWarning, stacklevel=4)
    return None


def _changed_logging_globals(probe: Callable[[Any], Optional[str]]) -> dict[str, Any]:
    """Level names the job added (``logging.addLevelName(25, "NOTICE")``), and its record factory
    and logger class where it set them: a restore does not run those statements again, so records
    said "Level 25" and lost the fields the factory added."""
    start, now = _start.get("logging") or _logging_globals(), _logging_globals()
    out: dict[str, Any] = {}
    levels = {level: name for level, name in now["levels"].items() if start["levels"].get(level) != name}
    if levels:
        out["levels"] = levels
    for key in ("record_factory", "logger_class"):
        if now[key] is not start[key]:
            value = _saveable(f"logging's {key.replace('_', ' ')}", now[key], probe)
            if value is not None:
                out[key] = value
    return out


def _apply_logging(saved: dict[str, Any]) -> None:
    logging.disable(saved["disable"])
    for level, name in (saved.get("levels") or {}).items():
        logging.addLevelName(level, name)
    if saved.get("record_factory") is not None:
        logging.setLogRecordFactory(saved["record_factory"])
    if saved.get("logger_class") is not None:
        logging.setLoggerClass(saved["logger_class"])
    for name, conf in saved["loggers"].items():
        logger = logging.getLogger(name or None)
        logger.setLevel(conf["level"])
        logger.propagate = conf["propagate"]
        logger.disabled = conf["disabled"]
        if conf.get("filters") is not None:
            logger.filters[:] = conf["filters"]
        if conf["handlers"] is None:
            continue
        for handler in conf["handlers"]:
            _adopt(handler)
        logger.handlers[:] = conf["handlers"]


def _adopt(handler: logging.Handler) -> None:
    """Register an unpickled handler as `logging.Handler.__init__` would, so that
    ``logging.shutdown`` flushes and closes it at exit; a file handler's path follows its file."""
    add = getattr(logging, "_addHandlerRef", None)
    if add is not None:
        add(handler)
    stream = getattr(handler, "stream", None)
    if isinstance(handler, logging.FileHandler) and stream is not None and isinstance(getattr(stream, "name", None), str):
        handler.baseFilename = os.path.abspath(stream.name)


# --------------------------------------------------------------------------- warnings to logging
def _warnings_captured() -> bool:
    """Whether ``logging.captureWarnings(True)`` is in effect: warnings go to ``py.warnings``."""
    return warnings.showwarning is getattr(logging, "_showwarning", None)


def _capture_warnings(on: bool) -> None:
    """``logging.captureWarnings(on)``, also when a ``catch_warnings`` that ended put the old
    ``showwarning`` back while logging still holds it (then ``captureWarnings(True)`` does nothing)."""
    if on and getattr(logging, "_warnings_showwarning", None) is not None:
        warnings.showwarning = logging._showwarning  # type: ignore[attr-defined]
    else:
        logging.captureWarnings(on)


# --------------------------------------------------------------------------- umask, time zone
def _umask() -> int:
    """The process's umask. Read from /proc where it can be: setting it to read it, even for an
    instant, would give a file another thread creates meanwhile other permissions."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def _zone() -> tuple:
    """The time zone ``time.localtime`` and ``time.strftime`` use: read from ``TZ`` by the last
    ``time.tzset()`` (or at startup), not by setting ``TZ`` alone."""
    return time.tzname, time.timezone, time.altzone, time.daylight


def _changed_zone() -> Optional[tuple]:
    """The time zone when the job changed it (``time.tzset()`` after setting ``TZ``), else None:
    a job that only set the variable keeps the zone the process began with, as it did here."""
    zone = _zone()
    return zone if _start["zone"] is _RESTORED or zone != _start["zone"] else None


def _apply_zone(zone: tuple) -> None:
    """``time.tzset()`` with the job's ``TZ``, which ``context.restore`` has put back by now."""
    _start["zone"] = _RESTORED
    if _zone() == zone:
        return
    time.tzset()
    if _zone() != zone:
        warnings.warn(f"the job's time zone {zone[0]!r} could not be put back (TZ={os.environ.get('TZ')!r} gives "
                      f"{time.tzname!r} on this node); local times after the restore may differ",
                      RuntimeWarning, stacklevel=3)


# --------------------------------------------------------------------------- signal handlers
def _handler(sig: int) -> Any:
    """The signal's handler as the C module keeps it (``signal.getsignal`` turns SIG_DFL and
    SIG_IGN into enum members: ~4 µs a signal, 0.25 ms a checkpoint over all of them)."""
    return _signal.getsignal(sig)


@functools.lru_cache(maxsize=None)
def _signals() -> tuple[int, ...]:
    """The signals a handler can be installed for (not SIGKILL or SIGSTOP); asked once (~60 µs)."""
    cannot = {getattr(signal, name) for name in ("SIGKILL", "SIGSTOP") if hasattr(signal, name)}
    return tuple(sorted(int(sig) for sig in signal.valid_signals() if sig not in cannot))


def _signal_handlers(probe: Callable[[Any], Optional[str]]) -> dict[int, Any]:
    """signal number -> handler, for the signals whose handler the job changed since `begin`
    (a function of the job, ``SIG_IGN``, ``SIG_DFL``); one that cannot be saved is named once."""
    out: dict[int, Any] = {}
    started = _start["signals"]
    for sig in _signals():
        handler = _handler(sig)
        if handler is None or sig in started and started[sig] is handler:
            continue  # a handler installed outside Python, or the one the process began with
        why = probe(handler)
        if why is None:
            out[sig] = handler
        elif (f"signal {sig}", id(handler)) not in _warned:
            _warned.add((f"signal {sig}", id(handler)))
            warnings.warn(f"the handler {handler!r} of signal {signal.Signals(sig).name} cannot be saved ({why}); "
                          f"after a restore that signal has the new process's handler", RuntimeWarning, stacklevel=3)
    return out


def host_sets_signal(sig: int, handler: Any) -> None:
    """``signal.signal(sig, handler)`` by the host while the program runs (the worker's SIGTERM
    handler putting back the default action, so that a second notice ends the process): the
    host's handler, like one it set before `begin`, so no checkpoint saves it as the job's (a
    restored job would then be ended by its next preemption notice instead of stopping)."""
    signal.signal(sig, handler)
    _start["signals"][int(sig)] = _handler(sig)


def _apply_signals(saved: dict[int, Any]) -> None:
    for sig, handler in saved.items():
        _start["signals"][sig] = _RESTORED
        try:
            signal.signal(sig, handler)
        except (ValueError, OSError) as exc:  # not the main thread, or a signal this system lacks
            warnings.warn(f"the job's handler {handler!r} of signal {sig} could not be put back ({exc}); "
                          f"that signal has the new process's handler", RuntimeWarning, stacklevel=3)
