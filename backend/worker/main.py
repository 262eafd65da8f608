"""One rank of a job: run the submitted code as ``__main__`` and leave its outcome in files.

The agent reads what this process leaves behind (``result.pkl``/``result.repr`` or
``error.txt``) after it exits, so the result survives even if the agent's connection to the
server does not. User output goes to stdout/stderr untouched; structured messages for the
agent go to the control pipe.
"""
from __future__ import annotations

import ast
import builtins
import ctypes
import json
import linecache
import os
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

RESULT_REPR_LIMIT = 20_000


class ControlChannel:
    """Worker -> agent messages on the pipe the agent passed in ``SINGULARITY_CONTROL_FD``."""

    def __init__(self) -> None:
        fd = os.environ.get("SINGULARITY_CONTROL_FD")
        self._out = os.fdopen(int(fd), "w", buffering=1) if fd else None
        self._lock = threading.Lock()

    def send(self, type: str, data: dict[str, Any]) -> None:
        if self._out is None:
            return
        line = json.dumps({"type": type, "data": data}, default=str)
        with self._lock:
            try:
                self._out.write(line + "\n")
            except (BrokenPipeError, OSError):
                pass


def die_with_parent() -> None:
    """If the agent dies, its workers must not run on unsupervised (Linux only)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() == 1:
        os._exit(1)


def compile_cell(source: str, filename: str) -> tuple[Any, Optional[Any]]:
    """Compile ``source`` like a notebook cell: the body, and its last expression separately."""
    tree = ast.parse(source, filename=filename)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        expr = tree.body.pop()
        last = compile(ast.Expression(expr.value), filename, "eval")
    return compile(tree, filename, "exec"), last


def register_source(source: str, filename: str) -> None:
    """Make tracebacks show the submitted lines (there is no file on disk to read them from)."""
    lines = source.splitlines(keepends=True)
    linecache.cache[filename] = (len(source), None, lines, filename)


def format_user_traceback(exc: BaseException, filename: str) -> str:
    """The traceback from the first frame of the user's code on: the worker's frames are noise."""
    tbe = traceback.TracebackException.from_exception(exc)
    frames = tbe.stack
    start = next((i for i, f in enumerate(frames) if f.filename == filename), None)
    if start is None:
        start = next((i for i, f in enumerate(frames) if not _is_ours(f.filename)), 0)
    tbe.stack = traceback.StackSummary.from_list(frames[start:])
    return "".join(tbe.format())


def _is_ours(path: str) -> bool:
    here = str(Path(__file__).resolve().parent.parent)
    return path.startswith(here)


def fresh_namespace(filename: str) -> dict[str, Any]:
    return {"__name__": "__main__", "__builtins__": builtins, "__file__": filename, "__doc__": None}


def run_source(source: str, filename: str, namespace: dict[str, Any]) -> Any:
    register_source(source, filename)
    body, last = compile_cell(source, filename)
    exec(body, namespace)
    return eval(last, namespace) if last is not None else None


def run_callable(callable_b64: str) -> Any:
    import base64

    import cloudpickle

    fn, args, kwargs = cloudpickle.loads(base64.b64decode(callable_b64))
    return fn(*args, **kwargs)


def load_inputs(inputs_b64: Optional[str], namespace: dict[str, Any]) -> None:
    """Variables sent with the job (a notebook's names the cell reads) start in its namespace."""
    if inputs_b64:
        import base64

        import cloudpickle

        namespace.update(cloudpickle.loads(base64.b64decode(inputs_b64)))


def save_outputs(names: list[str], namespace: dict[str, Any], out_dir: Path) -> None:
    """Pickle the requested names that exist and can be pickled; say why for the others."""
    import cloudpickle

    values, skipped = {}, {}
    for name in names:
        if name not in namespace:
            continue  # not assigned on this run (e.g. a branch not taken)
        try:
            cloudpickle.dumps(namespace[name])
        except Exception as exc:
            skipped[name] = f"{type(namespace[name]).__name__} cannot be pickled: {exc}"
            continue
        values[name] = namespace[name]
    (out_dir / "outputs.pkl").write_bytes(cloudpickle.dumps(values))
    (out_dir / "outputs.skipped").write_text(json.dumps(skipped))


def save_result(value: Any, out_dir: Path) -> None:
    try:
        text = repr(value)
    except Exception as exc:
        text = f"<unrepresentable {type(value).__name__}: {exc}>"
    (out_dir / "result.repr").write_text(text[:RESULT_REPR_LIMIT])
    try:
        import cloudpickle

        blob = cloudpickle.dumps(value)
    except Exception as exc:
        (out_dir / "result.error").write_text(
            f"the result ({type(value).__name__}) cannot be pickled: {exc}; return plain data instead")
        return
    tmp = out_dir / "result.pkl.tmp"
    tmp.write_bytes(blob)
    os.replace(tmp, out_dir / "result.pkl")


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Plain JSON, not the pydantic model: importing the SDK would add ~100 ms to every start.
    spec = json.loads(Path(argv[0]).read_text())
    out_dir = Path(argv[1])
    die_with_parent()
    rank = int(os.environ.get("RANK", "0"))
    filename = spec["filename"]
    sys.argv = [filename]
    namespace = fresh_namespace(filename)
    try:
        load_inputs(spec.get("inputs_b64"), namespace)
        if spec.get("source") is not None:
            value = run_source(spec["source"], filename, namespace)
        else:
            value = run_callable(spec["callable_b64"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if code:
            (out_dir / "error.txt").write_text(f"the job called sys.exit({exc.code!r})")
        return code
    except BaseException as exc:
        text = format_user_traceback(exc, filename)
        sys.stderr.write(text)
        (out_dir / "error.txt").write_text(text)
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    if rank == 0:
        save_result(value, out_dir)
        if spec.get("outputs"):
            save_outputs(spec["outputs"], namespace, out_dir)
    return 0


def entry() -> None:
    sys.exit(main())
