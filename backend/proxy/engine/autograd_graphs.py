"""Tensors whose autograd graph is still to be used: a safe point while one is held is no place
for a checkpoint.

A checkpoint saves a tensor's values, not the graph that made it: restored, ``loss`` (or a sum
of micro-batch losses, ``total = total + loss / accum``, or a loss with an L2 penalty added
parameter by parameter) is a leaf, and ``backward()`` through it reaches no parameter: that
update is lost, silently. So a checkpoint is not taken while a variable holds a tensor whose graph
can still be backpropagated (its saved tensors are not yet freed by a ``backward()``); a request
waits for the next safe point (taking.py), which in a training loop comes once ``backward()``
has run. A graph that was used (its buffers freed) or holds no saved tensor does not block.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

from . import lazy

#: grad_fn nodes looked at per tensor before deciding (the first with a saved tensor decides)
_MAX_NODES = 64


def _graph_in_use(t: Any) -> bool:
    """Whether ``t``'s graph can still be backpropagated: its first node that saved a tensor
    still gives it back (after a ``backward()`` without ``retain_graph`` that raises)."""
    seen = 0
    todo = [t.grad_fn]
    while todo and seen < _MAX_NODES:
        node = todo.pop()
        if node is None:
            continue
        seen += 1
        for attr in dir(node):
            if not attr.startswith("_saved_"):
                continue
            try:
                value = getattr(node, attr)
            except RuntimeError:  # "... saved tensors after they have already been freed"
                return False
            except Exception:
                continue
            if isinstance(value, lazy.torch_types().tensor):
                return True
        todo.extend(fn for fn, _ in getattr(node, "next_functions", ()))
    return False


def _tensors(value: Any) -> Iterable[Any]:
    """``value`` if a tensor, or the tensors directly in a list, tuple or dict."""
    tensor = lazy.torch_types().tensor
    if isinstance(value, tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        yield from (v for v in value[:256] if isinstance(v, tensor))
    elif isinstance(value, dict):
        yield from (v for v in list(value.values())[:256] if isinstance(v, tensor))


def in_use(scopes: Iterable[tuple[str, dict]]) -> Optional[str]:
    """Why no checkpoint can be taken here (the variables holding graphs still to be used), or None."""
    if lazy.torch_types() is None:
        return None
    held = [f"`{name}`" + (f" ({where})" if where else "")
            for where, scope in scopes for name, value in scope.items()
            if any(t.grad_fn is not None and _graph_in_use(t) for t in _tensors(value))]
    if not held:
        return None
    return (f"{', '.join(held)} hold{'s' if len(held) == 1 else ''} a tensor whose autograd graph is still to "
            f"be backpropagated, and a checkpoint saves values, not graphs (a restored one would reach no "
            f"parameter). Checkpoints wait for a safe point after backward(); evaluate under "
            f"torch.no_grad() or keep loss.item() for logging so that one comes")
