"""torch's global module hooks and the handles of hooks, across a restore.

``torch.nn.modules.module.register_module_forward_hook(fn)`` (a profiler counting every layer's
calls, an activation logger) puts ``fn`` in a dict of torch's own module, which no variable of the
program holds: a restore started without it, silently (the counts stopped), and a handle to it
had been saved with a copy of the dict, which only weak references held after the load, so the
next checkpoint wrote a handle that could not be loaded. So the global hook dicts are saved as
references to the restoring process's, filled with what they held (`capture` puts them in every
checkpoint where they hold anything), and a `RemovableHandle` whose module is gone (its dicts
freed) is saved as the dead handle it is: torch's own pickling wrote ``None`` for the dict, which
its loading could not take.
"""
from __future__ import annotations

import sys
import weakref
from collections import OrderedDict
from typing import Any, Optional

_MODULE = "torch.nn.modules.module"
#: torch's global hook dicts (Module hooks that apply to every module)
GLOBAL_DICTS = ("_global_buffer_registration_hooks", "_global_module_registration_hooks",
                "_global_parameter_registration_hooks", "_global_backward_pre_hooks", "_global_backward_hooks",
                "_global_forward_pre_hooks", "_global_forward_hooks", "_global_forward_hooks_always_called",
                "_global_forward_hooks_with_kwargs")


def _global_name(obj: Any) -> Optional[str]:
    module = sys.modules.get(_MODULE)
    if module is None:
        return None
    return next((name for name in GLOBAL_DICTS if getattr(module, name, None) is obj), None)


def reduce_global_dict(obj: OrderedDict) -> Any:
    """One of torch's global hook dicts, as a reference filled on load; else NotImplemented."""
    name = _global_name(obj)
    return NotImplemented if name is None else (_filled_global, (name, list(obj.items())))


def _filled_global(name: str, items: list) -> OrderedDict:
    import importlib

    live = getattr(importlib.import_module(_MODULE), name)
    live.clear()
    live.update(items)
    return live


def capture() -> Optional[dict[str, Any]]:
    """The global hook dicts that hold hooks, and whether the backward ones are full hooks (None:
    torch not imported, or no global hook)."""
    module = sys.modules.get(_MODULE)
    if module is None:
        return None
    held = {name: getattr(module, name) for name in GLOBAL_DICTS if getattr(module, name, None)}
    return {"dicts": held, "full_backward": module._global_is_full_backward_hook} if held else None


def apply(saved: Optional[dict[str, Any]]) -> None:
    """The dicts were filled as they loaded; the flag is a plain value."""
    if saved:
        import importlib

        importlib.import_module(_MODULE)._global_is_full_backward_hook = saved["full_backward"]


def is_handle(obj: Any) -> bool:
    hooks = sys.modules.get("torch.utils.hooks")
    return hooks is not None and type(obj) is hooks.RemovableHandle


def reduce_handle(handle: Any) -> tuple:
    """A hook's handle with its dicts, each None where it was freed (its module is gone)."""
    extra = getattr(handle, "extra_dict_ref", ())
    return _handle, (handle.hooks_dict_ref(), handle.id, tuple(ref() for ref in extra))


def _handle(hooks: Optional[dict], handle_id: int, extra: tuple) -> Any:
    from torch.utils.hooks import RemovableHandle

    handle = RemovableHandle.__new__(RemovableHandle)
    dead: dict = OrderedDict()
    handle.hooks_dict_ref = weakref.ref(hooks if hooks is not None else dead)
    handle.id = handle_id
    handle.extra_dict_ref = tuple(weakref.ref(d if d is not None else dead) for d in extra)
    RemovableHandle.next_id = max(RemovableHandle.next_id, handle_id + 1)
    return handle
