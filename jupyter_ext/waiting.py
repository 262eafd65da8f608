"""Let the job widget's buttons act while a ``%%singularity`` cell waits for its job.

A cell that waits keeps the kernel busy, and a kernel handles widget (comm) messages only
between cells, so Preempt / Resize / Cancel used to act only after the cell returned. Two ways
out were weighed:

- *the kernel handles comm messages while the magic waits.* ``jupyter-ui-poll`` does this by
  calling the kernel's ``do_one_iteration`` from the wait loop; ipykernel 7 no longer has that
  method (shell messages reach the main thread through a channel thread and an asyncio lock),
  so it silently processes nothing there. What ipykernel 7 does instead is dispatch comm
  messages *concurrently* while an async cell awaits. So a waiting ``%%singularity`` cell is run
  as a coroutine: this module's input transformer rewrites the cell into
  ``await <magics>.cell_async(line, cell)``, and the wait loop sleeps with ``asyncio.sleep``,
  during which the kernel runs the buttons' handlers. Ctrl-C reaches the coroutine as
  ``CancelledError`` (ipykernel's SIGINT handling for async cells) and does what
  ``--on-interrupt`` says. It is the same kernel protocol in every frontend: JupyterLab,
  Notebook 7, VS Code, nbclient.
- *the widget's JavaScript calls the server extension's* ``/singularity/`` *routes* (anywidget).
  That stays live when the kernel is gone, but only where the Jupyter server runs our extension
  (not in VS Code, which starts kernels itself, nor with a remote kernel), and it would be a
  second control path with its own auth beside the kernel's.

The first was chosen. Where the kernel cannot dispatch comms concurrently (ipykernel 6, or a
terminal IPython, which has no widgets), the transformer is not installed and the cell waits as
before: buttons act after it returns, Ctrl-C detaches.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

MAGIC = "%%singularity"


def concurrent_comms(shell: Any) -> bool:
    """Whether this shell's kernel dispatches comm messages while an async cell awaits."""
    kernel = getattr(shell, "kernel", None)
    dispatch = getattr(kernel, "dispatch_shell", None)
    if dispatch is None or not getattr(shell, "autoawait", False):
        return False
    try:
        from IPython.core.async_helpers import _asyncio_runner

        if getattr(shell, "loop_runner", None) is not _asyncio_runner:
            return False
        return "concurrent" in inspect.signature(dispatch).parameters
    except (ImportError, TypeError, ValueError):
        return False


def transformer(target: str) -> Callable[[list[str]], list[str]]:
    """An IPython cleanup transformer: a ``%%singularity`` cell becomes one awaited call of
    ``target.cell_async`` (``target`` is an expression that names the magics object)."""

    def rewrite(lines: list[str]) -> list[str]:
        if not lines or not lines[0].startswith(MAGIC):
            return lines
        first = lines[0].rstrip("\n")
        rest = first[len(MAGIC):]
        if (rest and not rest[0].isspace()) or first.rstrip().endswith("?"):
            return lines  # another magic's name, or %%singularity? (help)
        cell = "".join(lines[1:])
        return [f"await {target}.cell_async({rest.strip()!r}, {cell!r})\n"]

    rewrite.singularity_async = True  # type: ignore[attr-defined]
    return rewrite


def install(shell: Any, target: str) -> bool:
    """Add the transformer where it helps; returns whether it was added."""
    if not concurrent_comms(shell):
        return False
    uninstall(shell)
    shell.input_transformers_cleanup.append(transformer(target))
    return True


def uninstall(shell: Any) -> None:
    transforms = getattr(shell, "input_transformers_cleanup", None)
    if transforms is not None:
        transforms[:] = [t for t in transforms if not getattr(t, "singularity_async", False)]


__all__ = ["concurrent_comms", "install", "uninstall"]
