"""What an exact resume depends on, recorded with each checkpoint and checked before a restore.

Bitwise-identical continuation holds only where the restoring process computes as the
checkpointing one did: the same Python, torch and numpy (kernels, RNG algorithms and pickles
change between versions), the same device model (kernels differ between GPU models), and the
same deterministic settings (``torch.backends.cudnn.benchmark``, deterministic algorithms, the
intra-op thread count), and the same versions of the libraries whose loops the engine rewrote
(a transformers ``Trainer`` loop: its position is recorded in that library's own statements). Versions and the device are *compared*: the scheduler places a job whose
checkpoint has a fingerprint only on nodes that match it, and a restore elsewhere is refused
naming the difference. Settings are *carried*: the statements that set them ran before the
checkpoint and are skipped on restore, so the restore sets them again.

``SINGULARITY_FINGERPRINT_OVERRIDE`` (a JSON object, e.g. ``{"torch": "2.0.0"}``) replaces
entries of what this process reports as its own fingerprint: a test and operations knob to
make one node look different (or to declare two builds equivalent); its ``"libraries"`` entry
(``{"transformers": "4.0.0"}``) does the same for rewritten libraries. It does not change what
actually runs.
"""
from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import sys
from typing import Any, Optional

OVERRIDE_ENV = "SINGULARITY_FINGERPRINT_OVERRIDE"
#: the entries a restoring process must match
COMPARED = ("python", "torch", "numpy", "device")
#: the distribution of this engine (named in a checkpoint, for a refusal's message)
ENGINE_DIST = "singularity-notebooks"


def _override(keys: tuple[str, ...] = COMPARED) -> dict[str, Any]:
    raw = os.environ.get(OVERRIDE_ENV)
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except ValueError:
        return {}
    return {k: v for k, v in value.items() if k in keys} if isinstance(value, dict) else {}


@functools.lru_cache(maxsize=None)
def _installed(dist: str) -> Optional[str]:
    """An installed distribution's version. Cached: a lookup scans every folder of sys.path
    (~40 ms for the engine's own name, which may be absent), and the warm spawner fills the cache
    once for all the workers it forks (`warm`)."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def warm() -> None:
    """Look up what every checkpoint records, once, before the warm spawner forks workers."""
    for module in ("torch", "numpy"):
        _unloaded_version(module)
    _installed(ENGINE_DIST)


def _loaded_version(module: str) -> Optional[str]:
    mod = sys.modules.get(module)
    return str(getattr(mod, "__version__", "")) or None if mod is not None else None


#: ``__version__ = '2.11.0+cu130'`` (torch) or ``version = "2.4.6"`` (numpy) in a package's version.py
_VERSION_LINES = (re.compile(r"^__version__\s*(?::\s*str\s*)?=\s*['\"]([^'\"]+)['\"]", re.M),
                  re.compile(r"^version\s*(?::\s*str\s*)?=\s*['\"]([^'\"]+)['\"]", re.M))


@functools.lru_cache(maxsize=None)
def _unloaded_version(module: str) -> Optional[str]:
    """What ``module.__version__`` will say, read from its ``version.py`` without importing it.

    The distribution's metadata is not that: PyPI's CUDA builds of torch are version 2.11.0 to
    pip and ``2.11.0+cu130`` to ``torch.__version__`` (what a checkpoint records), so comparing
    the two refused every restore on a GPU machine. The metadata is the last resort."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        try:
            with open(os.path.join(folder, "version.py"), encoding="utf-8") as f:
                text = f.read()
        except OSError:
            continue
        for line in _VERSION_LINES:
            found = line.search(text)
            if found:
                return found.group(1)
    return _installed(module)


def library_version(module: str) -> Optional[str]:
    """``module.__version__``, whether or not the module is imported yet (the same string both ways)."""
    return _loaded_version(module) or _unloaded_version(module)


def node(devices: list[Any]) -> dict[str, Any]:
    """This machine's fingerprint, as its agent reports it (installed versions; nothing imported).

    ``devices`` are the node's `DeviceInfo`; the device model is the first GPU's name, or "cpu"."""
    gpu = next((d for d in devices if getattr(d, "kind", "") == "cuda"), None)
    fp = {"python": platform.python_version(), "torch": library_version("torch"),
          "numpy": library_version("numpy"), "device": gpu.name if gpu is not None else "cpu"}
    return {**fp, **_override()}


def _visible_gpu_name() -> Optional[str]:
    """The model of this process's first visible GPU without creating a CUDA context."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return str(torch.cuda.get_device_name(torch.cuda.current_device()))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and not visible.strip():
        return None
    return _nvml_gpu_name(visible)


#: visible devices -> their first one's model, or None where this machine has no NVML at all
_nvml_names: dict[Optional[str], Optional[str]] = {}


def _nvml_gpu_name(visible: Optional[str]) -> Optional[str]:
    """The model of the first of ``visible`` through NVML. Remembered: every checkpoint asks,
    twice (its event and its graph), and an NVML init and shutdown (or, without a GPU, a failed
    search for the library) each time cost the safe point up to milliseconds for an answer that
    does not change while the process lives. A failure that may pass is not remembered: a
    checkpoint must never be recorded as a CPU one because NVML hiccuped once."""
    if visible in _nvml_names:
        return _nvml_names[visible]
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        _nvml_names[visible] = None
        return None
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        missing = getattr(pynvml, "NVMLError_LibraryNotFound", None)
        if missing is not None and isinstance(exc, missing):  # no GPU driver on this machine
            _nvml_names[visible] = None
        return None
    try:
        first = (visible or "0").split(",")[0].strip()
        handle = (pynvml.nvmlDeviceGetHandleByUUID(first) if not first.isdigit()
                  else pynvml.nvmlDeviceGetHandleByIndex(int(first)))
        name = pynvml.nvmlDeviceGetName(handle)
        _nvml_names[visible] = name.decode() if isinstance(name, bytes) else str(name)
        return _nvml_names[visible]
    except Exception:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def settings() -> dict[str, Any]:
    """The process's deterministic settings (empty when torch was never imported)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return {}
    return {"cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
            "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
            "deterministic_algorithms": bool(torch.are_deterministic_algorithms_enabled()),
            "threads": int(torch.get_num_threads())}


def str_hash() -> int:
    """A string's hash: it tells whether two processes salt string hashes alike (PYTHONHASHSEED),
    i.e. whether a set of strings iterates in the same order in both."""
    return hash("singularity: the order of a set of strings")


def capture(libraries: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """The running job's fingerprint, for its checkpoint. A library the job never imported is
    recorded as None: its version cannot matter to the result. ``libraries``: the distributions
    (name -> version) whose modules the engine rewrote, which a restore must match too."""
    fp: dict[str, Any] = {"python": platform.python_version(), "torch": _loaded_version("torch"),
                          "numpy": _loaded_version("numpy"), "device": _visible_gpu_name() or "cpu"}
    fp.update(_override())
    for lib in ("torch", "numpy"):  # an override names a version only for a library in use
        if sys.modules.get(lib) is None:
            fp[lib] = None
    fp["settings"] = settings()
    fp["libraries"] = dict(libraries or {})
    fp["str_hash"] = str_hash()
    fp["engine"] = _installed(ENGINE_DIST)  # who wrote it, for a refusal's message
    return fp


def for_event() -> dict[str, Any]:
    """What a ``checkpointed`` event says the checkpoint depends on (the scheduler resumes it only
    on a node that matches). Taken at the safe point, on the program's thread: a write behind the
    loop reports from another thread, by when the program may be half-way through importing torch."""
    fp = capture()
    return {k: fp.get(k) for k in (*COMPARED, "engine")}


def here() -> dict[str, Any]:
    """What a restoring process compares a checkpoint with (before importing anything)."""
    fp = {"python": platform.python_version(), "torch": library_version("torch"),
          "numpy": library_version("numpy"), "device": _visible_gpu_name() or "cpu"}
    return {**fp, **_override()}


def differences(recorded: Optional[dict[str, Any]], current: dict[str, Any]) -> list[str]:
    """What differs, one phrase each (``torch 2.4.0 (checkpoint) vs 2.5.1 (here)``); entries the
    checkpoint does not depend on (None) are not compared."""
    out = []
    for key in COMPARED:
        want = (recorded or {}).get(key)
        if want is not None and current.get(key) != want:
            out.append(f"{key} {want} (checkpoint) vs {current.get(key)} (here)")
    want_hash, have_hash = (recorded or {}).get("str_hash"), current.get("str_hash")
    if want_hash is not None and have_hash is not None and want_hash != have_hash:  # a restore's check only
        out.append(f"string hashing (PYTHONHASHSEED {os.environ.get('PYTHONHASHSEED', 'unset: random')} here): "
                   f"a set of strings would iterate in another order; run with the PYTHONHASHSEED the "
                   f"checkpointed process had (the engine's own processes use 0)")
    if "libraries" in current:  # a node's fingerprint does not list them: only a restore compares
        for dist, want in ((recorded or {}).get("libraries") or {}).items():
            have = current["libraries"].get(dist)
            if have != want:
                out.append(f"{dist} {want} (checkpoint) vs {have or 'not installed'} (here)")
    return out


def matches(recorded: Optional[dict[str, Any]], node_fp: Optional[dict[str, Any]]) -> bool:
    """Whether a node with fingerprint ``node_fp`` can resume a checkpoint recorded as ``recorded``."""
    return not recorded or (node_fp is not None and not differences(recorded, node_fp))


def check_restore(recorded: Optional[dict[str, Any]], where: str) -> None:
    """Refuse a restore whose result could differ, naming the difference; then put the
    checkpoint's deterministic settings back (their statements are skipped on restore)."""
    from .errors import CheckpointError

    current = here()
    wanted = (recorded or {}).get("libraries") or {}
    current["str_hash"] = str_hash()
    current["libraries"] = {**{dist: _installed(dist) for dist in wanted}, **_override(("libraries",)).get("libraries", {})}
    diff = differences(recorded, current)
    if diff:
        raise CheckpointError(
            f"{where} cannot resume exactly here: {'; '.join(diff)}. Resume it on a node that matches "
            f"(the scheduler picks one when it can), install the same versions, or start over")
    apply_settings((recorded or {}).get("settings") or {})


def apply_settings(saved: dict[str, Any]) -> None:
    """Restore torch's deterministic settings as they were when the checkpoint was taken."""
    torch = sys.modules.get("torch")
    if torch is None or not saved:
        return
    torch.backends.cudnn.benchmark = bool(saved.get("cudnn_benchmark", torch.backends.cudnn.benchmark))
    torch.backends.cudnn.deterministic = bool(saved.get("cudnn_deterministic", torch.backends.cudnn.deterministic))
    wanted = saved.get("deterministic_algorithms")
    if wanted is not None and bool(wanted) != torch.are_deterministic_algorithms_enabled():
        # only on a change: the call imports torch._inductor (1.5-1.8 s in a process that has
        # not), which every restore paid even when the setting was already the saved one
        torch.use_deterministic_algorithms(bool(wanted))
    if saved.get("threads"):
        torch.set_num_threads(int(saved["threads"]))


def warnings_for(settings_: dict[str, Any]) -> list[str]:
    """Settings under which a resume on a GPU may not continue bit for bit."""
    out = []
    if settings_.get("cudnn_benchmark"):
        out.append("torch.backends.cudnn.benchmark is on: cuDNN times candidate kernels and may pick "
                   "others after a resume, so results can differ on a GPU; set it False for an exact resume")
    if settings_ and not settings_.get("deterministic_algorithms") and not settings_.get("cudnn_deterministic"):
        out.append("deterministic algorithms are off: some CUDA kernels (atomic adds) are not bitwise "
                   "reproducible on a GPU; torch.use_deterministic_algorithms(True) makes them so")
    return out


def report() -> dict[str, Any]:
    """The ``exactness`` event: the fingerprint, and warnings about settings (on a GPU only the
    nondeterministic-kernel warning applies; cudnn benchmark mode is reported wherever it is set)."""
    fp = capture()
    warnings = warnings_for(fp["settings"])
    if fp["device"] == "cpu":
        warnings = [w for w in warnings if "benchmark" in w]
    return {"fingerprint": fp, "warnings": warnings, "gpu_exact": not warnings_for(fp["settings"])}


def format_refusal(found: Any, expected: int, engine: Optional[str], path: Any) -> str:
    """The message for a checkpoint of another graph format: who wrote it and what to do."""
    by = f" by engine {engine}" if engine else ""
    return (f"{path} was written{by} in checkpoint format {found!r}; this engine reads format {expected}. "
            f"Resume it with the engine version that wrote it (then checkpoints it writes stay readable by "
            f"that version), or start the job over without restoring")
