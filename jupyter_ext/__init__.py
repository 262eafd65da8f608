"""Singularity in Jupyter: the ``%%singularity`` magic, live widgets, and a server extension.

In a notebook::

    %load_ext jupyter_ext

    %%singularity --gpus 1 --sla basic
    ...cell code, run on the cluster...

Started with JupyterLab (or ``jupyter server``), the server extension runs a backend beside it
and tells the kernels where it is, so nothing needs configuring (see docs/jupyter.md).
"""
from __future__ import annotations

from typing import Any

__all__ = ["load_ipython_extension", "unload_ipython_extension", "_jupyter_server_extension_points"]

_MAGICS_KEY = "_singularity_magics"


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext jupyter_ext``: register the magics (imports stay light until then)."""
    from .magic import SingularityMagics
    from .waiting import install

    magics = SingularityMagics(ipython)
    ipython.register_magics(magics)
    setattr(ipython, _MAGICS_KEY, magics)
    install(ipython, f"get_ipython().{_MAGICS_KEY}")  # buttons act while a cell waits


def unload_ipython_extension(ipython: Any) -> None:
    """Stop the background threads the magics started."""
    from .waiting import uninstall

    uninstall(ipython)
    magics = getattr(ipython, _MAGICS_KEY, None)
    if magics is not None:
        magics.close()
        delattr(ipython, _MAGICS_KEY)


def _jupyter_server_extension_points() -> list[dict[str, Any]]:
    from .serverext import SingularityApp

    return [{"module": "jupyter_ext", "app": SingularityApp}]
