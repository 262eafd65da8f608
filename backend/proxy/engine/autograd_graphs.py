"""Tensors whose autograd graph is still to be used: a safe point while one is held is no place
for a checkpoint.

A checkpoint saves a tensor's values, not the graph that made it: restored, ``loss`` (or a sum
of micro-batch losses, ``total = total + loss / accum``, or a loss with an L2 penalty added
parameter by parameter) is a leaf, and ``backward()`` through it reaches no parameter: that
update is lost, silently. So a checkpoint is not taken while a variable holds a tensor whose graph
can still be backpropagated (its saved tensors are not yet freed by a ``backward()``); a request
waits for the next safe point (taking.py), which in a training loop comes once ``backward()``
has run. A graph that was used (its buffers freed) does not block. A graph in which no node
saved a tensor (``w.sum()``, a custom Function keeping its inputs as ``ctx`` attributes) frees
nothing when used, so nothing tells: the save puts a hook on its last node and waits until a
``backward()`` has run through it (`_backpropagated_since_met`), then saves it cut (below), since
such a graph can be backpropagated again: one made once before the loop and backpropagated at
every step fails loudly after a restore, naming it.

A graph that is never backpropagated (a validation loss computed without ``torch.no_grad()``, a
diagnostic ``penalty = w.abs().sum()`` kept for printing) would hold checkpoints off for good.
So after `PATIENCE_SAFE_POINTS` safe points or `PATIENCE_S` seconds of waiting, the checkpoint is
taken with those tensors *cut* (`cutting`): each comes back with its values and a graph of one
node whose backward raises, naming the variable. A program that never backpropagates it resumes
exactly; one that does fails there, loudly, instead of updating nothing. A safe point at which the
held graph has *grown* from the one held at the last (`grows`: ``total = total + loss`` over many
micro-batches, losses appended to a list) does not count against the safe points' patience, only
against the seconds': an accumulation of more than 50 micro-batches is waited for, not cut.

The variables are looked at first, cheaply (`in_use`: a tensor, or one directly in a list, tuple
or dict). A graph held deeper (REINFORCE's ``policy.saved_log_probs.append(m.log_prob(a))``, a
trainer's ``self.accum_loss``, a list of ``(log_prob, value)`` tuples) is found by the save
itself, which meets every tensor it writes (`watching`, `check_saved`): it raises `GraphFound`,
the checkpoint is not taken, and the request waits as above (taking.py).
"""
from __future__ import annotations

import contextlib
import contextvars
import weakref
from typing import Any, Iterable, Iterator, NamedTuple, Optional

from ..checkpoint.errors import CheckpointFailure
from . import lazy

#: a request waits this many safe points, or seconds, for one without graphs before cutting them
PATIENCE_SAFE_POINTS = 50
PATIENCE_S = 30.0
_CUT: contextvars.ContextVar[Optional[dict[int, str]]] = contextvars.ContextVar("sg_cut_graphs", default=None)
#: while a checkpoint is saved: whether a tensor in use that no variable holds directly is cut
#: (True: patience is over) or stops the save (False); None outside a save (a probe's pickling)
_WATCH: contextvars.ContextVar[Optional[bool]] = contextvars.ContextVar("sg_watch_graphs", default=None)
#: what labels a tensor found by the save: it was reached through some object of the state
DEEP_LABEL = "a tensor inside an object or a nested container of the program's state"


class GraphsHeld(NamedTuple):
    """Why a safe point is no place for a checkpoint, and the tensors (id -> variable) to blame."""

    why: str
    tensors: dict[int, str]
    keep: list  # the tensors themselves, so their ids stay theirs while the checkpoint is taken

#: grad_fn nodes looked at per tensor before deciding (the first with a saved tensor decides)
_MAX_NODES = 64


def _graph_in_use(t: Any) -> bool:
    """Whether ``t``'s graph can still be backpropagated: its first node that saved a tensor
    still holds it (a ``backward()`` without ``retain_graph`` frees them)."""
    return bool(_graph_state(t))


def _graph_state(t: Any) -> Optional[bool]:
    """`_graph_in_use`, or None where no node saved a tensor (``w.sum()``, ``torch.cat`` of
    parameters, a custom Function that keeps its inputs as ``ctx`` attributes; or none within
    `_MAX_NODES`): nothing tells whether such a graph was used, and it can be backpropagated
    again and again."""
    seen = 0
    todo = [t.grad_fn]
    while todo and seen < _MAX_NODES:
        node = todo.pop()
        if node is None:
            continue
        seen += 1
        if type(node) in _CUT_NODES:
            return False  # nothing to wait for: a backward() through it raises
        held = _holds_saved(node)
        if held is not None:
            return held
        todo.extend(fn for fn, _ in getattr(node, "next_functions", ()))
    return None


def _holds_saved(node: Any) -> Optional[bool]:
    """Whether ``node`` still holds a tensor it saved (None: it saved none we can see).

    Read through the raw saved variables (``_raw_saved_*``): their packed ``data`` is the
    tensor, or what a saved-tensors hook packed, until freed. Unpacking them instead
    (``_saved_*``) would run the unpack hooks: ``torch.utils.checkpoint(use_reentrant=False)``
    computes its block's forward again there, and a BatchNorm inside counts a batch more."""
    found = None
    for attr in dir(node):
        if not attr.startswith("_raw_saved_"):
            continue
        try:
            raw = getattr(node, attr)
        except RuntimeError:  # a custom Function's: "... saved tensors after they have already been freed"
            return False
        except Exception:
            continue
        for saved in raw if isinstance(raw, (list, tuple)) else (raw,):
            data = getattr(saved, "data", None)
            if data is not None:
                return True
            found = False  # freed, or an optional tensor the op did not get
    return found


def _tensors(value: Any) -> Iterable[Any]:
    """``value`` if a tensor, or the tensors directly in a list, tuple or dict."""
    tensor = lazy.torch_types().tensor
    if isinstance(value, tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        yield from (v for v in value[:256] if isinstance(v, tensor))
    elif isinstance(value, dict):
        yield from (v for v in list(value.values())[:256] if isinstance(v, tensor))


def in_use(scopes: Iterable[tuple[str, dict]]) -> Optional[GraphsHeld]:
    """The variables holding graphs still to be used here, or None."""
    if lazy.torch_types() is None:
        return None
    labels: list[str] = []
    tensors: dict[int, str] = {}
    keep: list = []
    for where, scope in scopes:
        for name, value in scope.items():
            label = f"`{name}`" + (f" ({where})" if where else "")
            found = [t for t in _tensors(value) if t.grad_fn is not None and _graph_in_use(t)]
            if found:
                labels.append(label)
                tensors.update((id(t), label) for t in found)
                keep.extend(found)
    if not labels:
        return None
    return GraphsHeld(_why(labels), tensors, keep)


def _why(labels: list[str]) -> str:
    return (f"{', '.join(labels)} hold{'s' if len(labels) == 1 else ''} a tensor whose autograd graph is still to "
            f"be backpropagated, and a checkpoint saves values, not graphs (a restored one would reach no "
            f"parameter). Checkpoints wait for a safe point after backward(); evaluate under "
            f"torch.no_grad() or keep loss.item() for logging so that one comes")


class GraphFound(CheckpointFailure):
    """Raised by the checkpoint's save at a tensor whose graph is still to be used (`check_saved`)."""

    def __init__(self, tensor: Any) -> None:
        self.held = _held_deep(tensor)
        super().__init__(self.held.why)
        self.tensor_ref = weakref.ref(tensor)


def _held_deep(t: Any) -> GraphsHeld:
    label = f"{DEEP_LABEL} (shape {tuple(t.shape)}, made by {type(t.grad_fn).__name__})"
    return GraphsHeld(_why([label]), {id(t): DEEP_LABEL}, [t])


def still_held(found: Optional[Any]) -> Optional[GraphsHeld]:
    """The tensor a save found (a weak reference, `GraphFound.tensor_ref`) while its graph is still
    to be used: the next save would stop at it again, so none is tried (a big state would be
    pickled at every safe point of an accumulation for nothing)."""
    t = found() if found is not None else None
    if t is None or t.grad_fn is None:
        return None
    state = _graph_state(t)
    if state is False or state is None and not _waits_for_backward(t):
        return None
    return _held_deep(t)


@contextlib.contextmanager
def watching(cut_all: Optional[bool]) -> Iterator[None]:
    """While a checkpoint's state is saved: `check_saved` looks at each tensor it writes (None:
    it does not, for a probe's pickling inside the save)."""
    token = _WATCH.set(cut_all)
    try:
        yield
    finally:
        _WATCH.reset(token)


def check_saved(t: Any) -> Optional[tuple]:
    """For a tensor with a graph that the save meets: raise `GraphFound` when its graph is still
    to be used, or return the reduction that cuts it once patience is over, or that makes a view
    of a parameter again (`_view_of_leaf`); None: save it as usual."""
    node = t.grad_fn
    if type(node) in _CUT_NODES:  # cut by an earlier checkpoint: cut again, for the same reason
        return _cut_tensor, (t.detach(), node.label, type(node).__name__, node.why)
    cut = _CUT.get()
    if cut and id(t) in cut:
        return _cut_tensor, (t.detach(), cut[id(t)], type(t.grad_fn).__name__)
    view = _view_of_leaf(t)
    if view is not None:
        return view
    watch = _WATCH.get()
    if watch is None:
        return None
    state = _graph_state(t)
    if state is None:  # saved as values, a backward() through it would reach nothing: silently
        if watch or _backpropagated_since_met(t):
            return _cut_tensor, (t.detach(), _unsaved_label(t), type(t.grad_fn).__name__, "unsaved")
        raise GraphFound(t)
    if not state:  # used: cut too, so that it prints, and is no leaf, as before (`hist.append(loss)`)
        return _cut_tensor, (t.detach(), USED_LABEL, type(t.grad_fn).__name__, "used")
    if watch:
        return _cut_tensor, (t.detach(), DEEP_LABEL, type(t.grad_fn).__name__)
    raise GraphFound(t)


#: what labels a tensor whose graph a backward() has used already
USED_LABEL = "a tensor whose graph was backpropagated before the checkpoint"


def _unsaved_label(t: Any) -> str:
    return f"a tensor made by {type(t.grad_fn).__name__} through operations that save no tensor"


#: tensors with a graph that saves no tensor which a save has met: id -> (the tensor, its node's
#: id, whether a backward() ran through that node since)
_MET: dict[int, tuple[Any, int, list]] = {}


def _backpropagated_since_met(t: Any) -> bool:
    """Whether a ``backward()`` ran through ``t``'s graph since a save first met it. Such a graph
    holds no saved tensor that a ``backward()`` frees, so nothing else tells whether it is still
    to be used (``loss = w.sum()``, a custom Function keeping its inputs as ``ctx`` attributes):
    the first meeting puts a hook on its last node, and the save waits until the hook has run
    (or the patience's seconds are over)."""
    entry = _MET.get(id(t))
    node = t.grad_fn
    if entry is not None and entry[0]() is t and entry[1] == id(node):
        return entry[2][0]
    ran = [False]
    key = id(t)
    node.register_prehook(lambda grad_outputs: ran.__setitem__(0, True))
    _MET[key] = (weakref.ref(t, lambda _ref: _MET.pop(key, None)), id(node), ran)
    return False


def _waits_for_backward(t: Any) -> bool:
    """Whether a save met ``t`` (a graph that saves no tensor) and no ``backward()`` ran through it since."""
    entry = _MET.get(id(t))
    return entry is not None and entry[0]() is t and entry[1] == id(t.grad_fn) and not entry[2][0]


def _view_of_leaf(t: Any) -> Optional[tuple]:
    """A view of a parameter (or another leaf that requires grad) made once and used at every
    step (``Wt = enc.weight.t()`` for a tied decoder, ``self.wq = w[:d]``): its graph holds no saved
    tensor, so nothing waits for it, and saved as values it came back as a view of the storage
    without its graph, through which no gradient reached the parameter (silently). Saved as its
    base's ``as_strided`` view instead: the same elements, a graph to the base again."""
    base = t._base if t._is_view() else None
    if base is None or not base.requires_grad or base.grad_fn is not None:
        return None
    return _view_again, (base, tuple(t.size()), tuple(t.stride()), t.storage_offset())


def _view_again(base: Any, size: tuple, stride: tuple, offset: int) -> Any:
    torch = lazy.torch()
    with torch.enable_grad():
        return base.as_strided(size, stride, offset)


def nodes(held: GraphsHeld) -> list:
    """The graph nodes ``held``'s tensors end in (kept by the waiting request, for `grows`)."""
    return [t.grad_fn for t in held.keep]


#: grad_fn nodes looked at per tensor when asking whether it grew from an earlier one
_MAX_GROWTH_NODES = 32


def grows(held: GraphsHeld, before: Optional[list]) -> bool:
    """Whether the graphs held now extend those held at the last safe point (``before``: `nodes`):
    some node is new, and a new one is an earlier one or reaches one within a few steps. The
    same graphs unchanged (a validation loss kept all epoch), or new ones made afresh (one
    recomputed every step), do not grow."""
    if not before:
        return False
    earlier = {id(n) for n in before}
    now = nodes(held)
    if {id(n) for n in now} <= earlier:
        return False
    for node in now:
        seen = 0
        todo = [node]
        while todo and seen < _MAX_GROWTH_NODES:
            n = todo.pop()
            if n is None:
                continue
            if id(n) in earlier:
                return True
            seen += 1
            todo.extend(fn for fn, _ in getattr(n, "next_functions", ()))
    return False


def patience_over(deferred: int, waited_s: float) -> bool:
    """Whether a request has waited long enough for a safe point without graphs: cut them."""
    return deferred >= PATIENCE_SAFE_POINTS or waited_s >= PATIENCE_S


@contextlib.contextmanager
def cutting(held: GraphsHeld) -> Iterator[None]:
    """While a checkpoint is taken: `check_saved` saves ``held``'s tensors with their graphs cut."""
    token = _CUT.set(held.tensors)
    try:
        yield
    finally:
        _CUT.reset(token)


def _cut_tensor(values: Any, label: str, node_name: Optional[str] = None, why: str = "waited") -> Any:
    """``why``: "waited" (the patience ran out), "unsaved" (a graph that saves no tensor, used
    since), "used" (its buffers were freed: a backward() through it raised already)."""
    torch = lazy.torch()
    with torch.enable_grad():
        return _cut_function(node_name).apply(values.requires_grad_(True), label, why)


_CUT_FUNCTIONS: dict[Optional[str], type] = {}
#: the node classes of `_CUT_FUNCTIONS`
_CUT_NODES: set[type] = set()


def _cut_function(node_name: Optional[str]) -> type:
    """An autograd function that passes its input through and refuses to backpropagate; its node
    is named as the cut graph's last node was (``print(loss)`` shows ``grad_fn=<MseLossBackward0>``
    as before the restore)."""
    if node_name not in _CUT_FUNCTIONS:
        torch = lazy.torch()

        class CutGraph(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, x: Any, label: str, why: str = "waited") -> Any:
                ctx.label, ctx.why = label, why
                return x.clone()  # not a view of its input: printed, a view would show AsStridedBackward0

            @staticmethod
            def backward(ctx: Any, grad: Any) -> Any:
                if ctx.why == "used":
                    raise RuntimeError(
                        f"Trying to backward through the graph a second time: {ctx.label}, whose saved "
                        f"tensors a backward() had freed (specify retain_graph=True on the first backward)")
                if ctx.why == "unsaved":
                    raise RuntimeError(
                        f"the autograd graph of {ctx.label} was cut by a checkpoint: it was backpropagated "
                        f"before the checkpoint (or not for {PATIENCE_S:g} s), and a checkpoint saves values, not "
                        f"graphs. A graph made once and backpropagated at every step (torch.cat of parameters "
                        f"before the loop) must be made again inside the loop, before its backward()")
                raise RuntimeError(
                    f"the autograd graph of {ctx.label} was cut by a checkpoint: the job waited "
                    f"{PATIENCE_SAFE_POINTS} safe points (or {PATIENCE_S:g} s) for one where no variable held "
                    f"a graph still to be backpropagated, then saved its values only. Compute it under torch.no_grad() "
                    f"(or keep .item()) if it is only logged, or call backward() before the next loop "
                    f"iteration")

        if node_name:
            CutGraph._backward_cls.__name__ = node_name  # type: ignore[attr-defined]
        _CUT_FUNCTIONS[node_name] = CutGraph
        _CUT_NODES.add(CutGraph._backward_cls)  # type: ignore[attr-defined]
    return _CUT_FUNCTIONS[node_name]
