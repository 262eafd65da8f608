"""Checkpoints written before the proxy was split into layers name its modules by their old
paths (``backend.proxy.libraries``...): they still load, and only the proxy's names are redirected."""
from __future__ import annotations

import io

import pytest

from backend.proxy.checkpoint import dedup
from backend.proxy.engine import libraries, rng
from backend.proxy.engine.state import GraphUnpickler


def _global(module: str, name: str, stack: bool) -> bytes:
    """A pickle of one global: ``GLOBAL`` (protocols 0-3) or ``STACK_GLOBAL`` (4 and 5)."""
    if not stack:
        return b"\x80\x02c" + f"{module}\n{name}\n".encode() + b"."
    text = b"".join(bytes([0x8C, len(s)]) + s for s in (module.encode(), name.encode()))
    return b"\x80\x04" + text + b"\x93."


@pytest.mark.parametrize("stack", [False, True])
@pytest.mark.parametrize("obj", [rng.apply, libraries.ensure_process_group, dedup.load])
def test_old_module_paths_resolve_to_where_the_code_is_now(obj, stack):
    old = obj.__module__.replace(".engine.", ".").replace(".checkpoint.", ".")
    assert old != obj.__module__
    assert GraphUnpickler(io.BytesIO(_global(old, obj.__name__, stack))).load() is obj


def test_other_names_are_not_redirected():
    with pytest.raises(ModuleNotFoundError):
        GraphUnpickler(io.BytesIO(_global("backend.proxy.nowhere", "print", True))).load()
    assert GraphUnpickler(io.BytesIO(_global("builtins", "print", True))).load() is print
