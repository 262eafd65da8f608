"""The parts of a training program's state that plain pickling drops, and how we keep them.

`torch.save` of a program's namespace loses exactly the state a resumed training step depends
on, silently or with a crash several lines later:

* a tensor's ``.grad`` (a safe point between ``backward()`` and the update, or in the middle of
  gradient accumulation);
* everything an optimizer built in ``__init__`` beyond ``defaults``/``state``/``param_groups``
  (``Optimizer.__getstate__`` keeps only those three: LBFGS loses ``_params``), and the
  ``optimizer.step`` wrapper an LR scheduler installs;
* a `GradScaler`'s per-optimizer bookkeeping between ``unscale_``/``step`` and ``update()``
  (keyed by ``id(optimizer)``, which a restore changes; its own ``__getstate__`` refuses);
* a live DataLoader iterator held in a variable or an attribute (``self.it = iter(loader)``):
  not picklable at all, so it used to be "rebuilt" from the start of the epoch;
* a module with parametrizations (``weight_norm``, ``spectral_norm``): its class is made on the
  fly, and its ``__getstate__`` refuses (torch only supports its ``state_dict()``);
* hooks on a tensor (``p.register_hook(clip)``, ``register_post_accumulate_grad_hook``):
  torch never pickles them ("Don't serialize hooks"), so a gradient-clamping hook silently
  stopped after a restore; and the counter their handles' ids come from
  (``RemovableHandle.next_id``), so a hook registered after a restore does not take the id, and
  replace, one the checkpoint brought back (a module's hooks too);
* a dict or set keyed by ``id(obj)`` (id_keys.py): its keys are the old process's addresses.

`reduce` gives the checkpoint pickler a reduction for each of these, and `Tail` is the last
entry of the checkpoint graph: by the time it is pickled every tensor and optimizer of the graph
has been seen (pickle memoizes them), so it can refer to them by identity and carry what must be
attached to them after they exist (gradients, the scaler's per-optimizer states).
"""
from __future__ import annotations

import collections
import contextlib
import contextvars
import copyreg
import functools
import pickle
import sys
import weakref
from typing import Any, Iterator, Optional

from . import autograd_graphs, canonical_strings, id_keys, iterators, lazy, rng, worker_rng

_NOTES: contextvars.ContextVar[Optional["Tail"]] = contextvars.ContextVar("sg_training_tail", default=None)


class Tail:
    """Collects, while the graph is pickled, what has to be re-attached after loading."""

    def __init__(self) -> None:
        self.grads: list[tuple[Any, Any]] = []
        self.hooks: list[tuple[Any, Any, Any]] = []  # (leaf tensor, backward hooks, post-accumulate hooks)
        self._seen: dict[int, Any] = {}  # id -> every tensor the graph holds
        #: what the program's state is reached from (set by the graph): walked for id-keyed dicts
        self.roots: list[Any] = []
        self.optimizers: dict[int, Any] = {}
        self.scalers: list[tuple[Any, dict[int, Any]]] = []
        #: (DataLoader, the persistent-workers iterator it keeps): pickled here rather than in the
        #: loader's state, where the iterator (whose reduction names the loader) would be reached
        #: in a cycle and saved twice, one copy for the loop and another for the loader
        self.kept_iterators: list[tuple[Any, Any]] = []
        #: DataLoaders a loop iterates again at restore (iterators.reiterated_loaders), by id:
        #: whether the loop has begun; if so, their kept iterator is saved as it was before it began
        self.reiterated: dict[int, bool] = {}

    def __enter__(self) -> "Tail":
        self._token = _NOTES.set(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _NOTES.reset(self._token)

    def note_tensor(self, t: Any) -> None:
        if id(t) in self._seen:
            return
        self._seen[id(t)] = t
        grad = t.grad if t.is_leaf or t.retains_grad else None
        if grad is not None:
            self.grads.append((t, grad))
        if t.grad_fn is None:  # a non-leaf's hooks belong to a graph, which is never saved
            hooks, post = t._backward_hooks, getattr(t, "_post_accumulate_grad_hooks", None)
            if hooks or post:
                self.hooks.append((t, hooks or None, post or None))

    def __reduce__(self) -> tuple:
        # pickled last: every tensor and optimizer below is a memo reference to the same object
        scalers = []
        for scaler, states in self.scalers:
            missing = [k for k in states if k not in self.optimizers]
            if missing:
                raise pickle.PicklingError(
                    "a GradScaler is between scaler.unscale_()/step() and scaler.update() for an "
                    "optimizer that is not part of the job's state; checkpoint at the next iteration")
            scalers.append((scaler, [(self.optimizers[k], v) for k, v in states.items()]))
        rekeys = id_keys.find(self.roots, self._seen)  # {id(p): ...}: keyed again by the new ids
        kept = [(loader, _KeptAtLoopStart(it) if self.reiterated.get(id(loader)) else it)
                for loader, it in self.kept_iterators]
        return _attach, (self.grads, scalers, self.hooks, _next_hook_id(), rekeys, kept)


def _next_hook_id() -> int:
    hooks = sys.modules.get("torch.utils.hooks")  # not loaded: no handle was made (torch stays unloaded)
    return hooks.RemovableHandle.next_id if hooks is not None else 0


def note_tensor(t: Any) -> Optional[tuple]:
    """Called by the picklers for every tensor they write (once per tensor); returns the
    reduction to save it with instead, when its autograd graph is being cut; raises
    `autograd_graphs.GraphFound` when a save meets a graph still to be used (autograd_graphs.py)."""
    tail = _NOTES.get()
    if tail is not None:
        tail.note_tensor(t)
    return autograd_graphs.check_saved(t) if t.grad_fn is not None else None


def note_kept_iterator(loader: Any, it: Any) -> None:
    """Save ``loader``'s kept iterator with the tail (when a checkpoint is being written)."""
    tail = _NOTES.get()
    if tail is not None:
        tail.kept_iterators.append((loader, it))


def _attach(grads: list, scalers: list, hooks: list = (), next_hook_id: int = 0, rekeys: list = (),
            kept_iterators: list = ()) -> None:
    id_keys.rekey(rekeys)
    for loader, it in kept_iterators:
        if it is not None:
            loader._iterator = it  # a shell until `finish_loading` makes it in place
    for t, g in grads:
        t.grad = g
    for t, backward, post in hooks:
        # the saved dicts themselves: a saved handle's `remove()` still finds its hook
        if backward is not None:
            t._backward_hooks = backward
        if post is not None:
            t._post_accumulate_grad_hooks = post
    if next_hook_id:
        from torch.utils.hooks import RemovableHandle

        RemovableHandle.next_id = max(RemovableHandle.next_id, next_hook_id)
    for scaler, states in scalers:
        scaler._per_optimizer_states.update({id(opt): st for opt, st in states})
    return None


# --------------------------------------------------------------------------- reductions
def reduce(obj: Any) -> Any:
    """A reduction for training objects whose default pickling loses state; NotImplemented otherwise."""
    t = lazy.torch_types()
    if t is None:
        return NotImplemented
    torch = lazy.torch()
    if isinstance(obj, t.tensor):
        cut = note_tensor(obj)
        return NotImplemented if cut is None else cut
    if isinstance(obj, torch.optim.Optimizer):
        return _reduce_optimizer(obj)
    if isinstance(obj, torch.optim.lr_scheduler.LRScheduler) or \
            type(obj).__name__ == "ReduceLROnPlateau":
        return _reduce_plain(obj)
    if _is_grad_scaler(obj):
        return _reduce_scaler(obj)
    if isinstance(obj, _loader_iter_type()):
        return _reduce_loader_iter(obj)
    if isinstance(obj, torch.nn.Module) and _parametrized_class(type(obj)):
        return _reduce_parametrized(obj)
    return NotImplemented


# --------------------------------------------------------------------------- parametrized modules
def _parametrized_class(cls: type) -> bool:
    """Whether ``cls`` is the class `torch.nn.utils.parametrize` made for one module (``weight_norm``,
    ``spectral_norm``, ``orthogonal``): made on the fly, it cannot be pickled by name, and its
    ``__getstate__`` refuses."""
    getstate = cls.__dict__.get("__getstate__")
    return getattr(getstate, "__qualname__", "") == "_inject_new_class.<locals>.getstate"


def _reduce_parametrized(module: Any) -> tuple:
    # the module's own state (its `parametrizations` hold the original tensors and, for
    # spectral_norm, the power iteration's vectors), on a class made again the way torch makes it
    names = tuple(module.parametrizations.keys())
    return _parametrized_module, (type(module).__bases__[0], names), dict(module.__dict__)


def _parametrized_module(base: type, names: tuple[str, ...]) -> Any:
    from torch.nn.utils import parametrize

    module = base.__new__(base)
    parametrize._inject_new_class(module)
    for name in names:
        parametrize._inject_property(module, name)
    return module


def _reduce_plain(obj: Any) -> tuple:
    """The whole ``__dict__``, whatever ``__getstate__`` would keep."""
    return copyreg.__newobj__, (type(obj),), dict(obj.__dict__), None, None, _set_dict


def _set_dict(obj: Any, state: dict) -> None:
    obj.__dict__.update(state)


def _reduce_optimizer(opt: Any) -> tuple:
    tail = _NOTES.get()
    if tail is not None:
        tail.optimizers[id(opt)] = opt
    state = dict(opt.__dict__)
    wrapped = getattr(state.get("step"), "_wrapped_by_lr_sched", False)
    if wrapped:  # an LR scheduler's counting wrapper (holds a weakref): re-made on load
        del state["step"]
    return copyreg.__newobj__, (type(opt),), (state, wrapped, _keys_not_interned(_key_dicts(opt))), \
        None, None, _set_optimizer


def _set_optimizer(opt: Any, saved: tuple) -> None:
    state, wrapped, *rest = saved
    opt.__setstate__(state)  # the class's own hook: re-registers hooks, patches step profiling
    _intern_keys(_key_dicts(opt), rest[0] if rest else {})
    if wrapped:
        _wrap_step_like_lr_scheduler(opt)


def _key_dicts(opt: Any) -> list[Any]:
    return [opt.defaults, *opt.param_groups, *opt.state.values()]


def _keys_not_interned(dicts: list[Any]) -> dict[int, tuple[str, ...]]:
    """{position in ``dicts``: its identifier-like string keys that are not the interned strings}:
    keys a ``torch.load`` of the job's own checkpoint made, which must stay such after a restore."""
    out = {}
    for i, d in enumerate(dicts):
        if isinstance(d, dict):
            keys = tuple(k for k in d if type(k) is str and sys.intern(k) is not k)
            if keys:
                out[i] = keys
    return out


def _intern_keys(dicts: list[Any], not_interned: dict[int, tuple[str, ...]]) -> None:
    """Make the identifier-like string keys of ``dicts`` the interned strings, in place, but for
    those ``not_interned`` lists (by position), which were other objects at the checkpoint.

    An optimizer keys its state with constants of its code (``"exp_avg"``, ``"lr"``), which are
    the interned strings; unpickled keys are other objects. A parameter whose state is made after
    a restore then gets the code's key while the others keep theirs, and ``torch.save(
    opt.state_dict())`` writes the key twice where the uninterrupted run referred back to it.
    Keys the job's own ``torch.load`` made are not the code's: interned, a later ``torch.save``
    would refer back to them where the uninterrupted run wrote them again.
    """
    for i, d in enumerate(dicts):
        if not isinstance(d, dict) or all(type(k) is not str or sys.intern(k) is k for k in d):
            continue
        keep = not_interned.get(i, ())
        items = list(d.items())
        d.clear()
        d.update((sys.intern(k) if type(k) is str and k not in keep and canonical_strings.identifier_like(k) else k, v)
                 for k, v in items)


def _wrap_step_like_lr_scheduler(opt: Any) -> None:
    """What ``LRScheduler.__init__`` does to ``opt.step``: note that the optimizer stepped."""
    opt_ref = weakref.ref(opt)
    func = type(opt).step

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        o = opt_ref()
        o._opt_called = True  # type: ignore[union-attr]
        return func.__get__(o, o.__class__)(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    opt.step = wrapper


def _is_grad_scaler(obj: Any) -> bool:
    cls = type(obj)
    return cls.__name__ == "GradScaler" and cls.__module__.startswith("torch.")


def _reduce_scaler(scaler: Any) -> tuple:
    """Every attribute, tensors included (its ``__getstate__`` refuses mid-iteration)."""
    state = dict(scaler.__dict__)
    pending = dict(state.pop("_per_optimizer_states", {}))
    if pending:
        tail = _NOTES.get()
        if tail is None:
            raise pickle.PicklingError("a GradScaler between unscale_/step and update() needs the checkpoint pickler")
        tail.scalers.append((scaler, pending))
    return copyreg.__newobj__, (type(scaler),), state, None, None, _set_scaler


def _set_scaler(scaler: Any, state: dict) -> None:
    from torch.amp.grad_scaler import _refresh_per_optimizer_state

    scaler.__dict__.update(state)
    scaler._per_optimizer_states = collections.defaultdict(_refresh_per_optimizer_state)


# --------------------------------------------------------------------------- DataLoader iterators
_ORIGIN = iterators.LOADER_ORIGIN


class LoaderOrigin:
    """How one DataLoader iterator came to be: enough to make it again and bring it to a batch.

    Two RNG moments matter.  ``iter(loader)`` draws the workers' base seed (and, with workers,
    the first indices); a single-process iterator draws its sampler's shuffle seed only at its
    first batch, which for an iterator held in a variable can be much later, after other draws.
    Each is a snapshot of the global generators plus the loader's own generators.
    """

    __slots__ = ("loader", "mode", "full", "created", "first", "owners", "base")

    def __init__(self, loader: Any, mode: str, full: bool, created: tuple, owners: list,
                 base: Optional[tuple] = None) -> None:
        self.loader = loader
        self.mode = mode
        self.full = full
        self.created = created
        self.first: Optional[tuple] = None
        #: a custom sampler's (...) attributes at ``iter(loader)``: its __iter__ may change them
        self.owners = owners
        #: with persistent workers, from the second ``iter(loader)`` on: the snapshot the iterator
        #: was first made under (its workers' base seed); ``created`` is then where it was reset
        self.base = base


def _loader_iter_type() -> type:
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    return _BaseDataLoaderIter


def loader_snapshot(loader: Any, full: bool) -> tuple:
    """The RNG state and the states of ``loader``'s own generators: what its next iterator will draw."""
    return rng.capture(full=full), [(g, rng.object_state(g)) for g in iterators.loader_generators(loader)]


def apply_loader_snapshot(snapshot: tuple) -> None:
    """Put back what `loader_snapshot` took."""
    state, gens = snapshot
    rng.apply(state)
    for g, s in gens:
        rng.set_object_state(g, s)


def install() -> None:
    """Record, for every DataLoader iterator created from now on, how to re-create it exactly.

    Costs one RNG snapshot per ``iter(loader)`` and one per iterator's first batch (per epoch),
    and a dictionary look-up per batch.
    """
    lazy.when_imported("torch.utils.data", _patch_dataloader)


def _patch_dataloader(module: Any) -> None:
    loader_cls = module.DataLoader
    iter_cls = module.dataloader._BaseDataLoaderIter
    if getattr(loader_cls.__iter__, "_sg_patched", False):
        return
    original_iter = loader_cls.__iter__
    original_next_index = iter_cls._next_index

    @functools.wraps(original_iter)
    def __iter__(self: Any) -> Any:
        leaf = iterators.Leaf(0, self)
        full = iterators.classify(leaf) == "full"
        base = kept_iterator_base(self)  # reset, not made: no base seed drawn
        origin = LoaderOrigin(self, leaf.mode, full, loader_snapshot(self, full),
                              iterators.owner_states(iterators.iter_owners(self)), base)
        it = original_iter(self)  # indices a worker iterator fetches here follow from `created`
        it.__dict__[_ORIGIN] = origin
        return it

    @functools.wraps(original_next_index)
    def _next_index(self: Any) -> Any:
        origin = self.__dict__.get(_ORIGIN)
        if origin is not None and origin.first is None:
            origin.first = loader_snapshot(origin.loader, origin.full)
        return original_next_index(self)

    __iter__._sg_patched = True  # type: ignore[attr-defined]
    loader_cls.__iter__ = __iter__
    iter_cls._next_index = _next_index
    worker_rng.install(module)


def kept_iterator_base(loader: Any) -> Optional[tuple]:
    """With persistent workers, the snapshot the iterator ``loader`` keeps was first made under
    (the next ``iter(loader)`` resets it rather than make one); None when there is none."""
    kept = getattr(loader, "_iterator", None) if loader.persistent_workers and loader.num_workers > 0 else None
    origin = kept.__dict__.get(_ORIGIN) if kept is not None else None
    return (origin.base or origin.created) if origin is not None else None


def _reduce_loader_iter(it: Any) -> tuple:
    origin = it.__dict__.get(_ORIGIN)
    if origin is None:
        raise pickle.PicklingError(
            "a DataLoader iterator created before the job's engine started cannot be saved")
    return _shell_of(it, origin, origin.created, origin.first, int(getattr(it, "_num_yielded", 0)),
                     worker_rng.saved_states(it))


def _shell_of(it: Any, origin: "LoaderOrigin", created: tuple, first: Optional[tuple], yielded: int,
              workers: Optional[tuple]) -> tuple:
    """The reduction that makes ``it`` again (`_rebuild_loader_iter`) from ``created`` at ``yielded``."""
    return _loader_iter_shell, (type(it), origin.loader, origin.mode, origin.full, created, first, yielded,
                                origin.owners, origin.base, workers)


class _KeptAtLoopStart:
    """The persistent-workers iterator a DataLoader keeps, saved as it was before the loop iterating
    the loader began its epoch: that loop's restore calls ``iter(loader)`` again, which must reset an
    iterator its previous epoch ended (or, in the first epoch, make one), not the one the loop had
    reached."""

    def __init__(self, it: Any) -> None:
        self.it = it

    def __reduce__(self) -> tuple:
        origin = self.it.__dict__.get(_ORIGIN)
        if origin is None or origin.base is None:  # the loop made it: none was kept yet
            return _none, ()
        return _shell_of(self.it, origin, origin.base, None, 0,
                         ("ended", worker_rng.states_of(self.it, worker_rng.START)))


def _none() -> None:
    return None


#: iterators unpickled while a checkpoint loads, made for real once the namespace is in place
_DEFERRED: contextvars.ContextVar[Optional[list]] = contextvars.ContextVar("sg_deferred_iterators", default=None)


@contextlib.contextmanager
def deferring() -> Iterator[list]:
    """While a checkpoint is unpickled: DataLoader iterators are empty shells until `finish_loading`.

    Re-creating one runs the program's own code (its dataset's ``__getitem__``, in worker
    processes too), which needs the program's globals: they are in place only after the load.
    """
    pending: list = []
    token = _DEFERRED.set(pending)
    try:
        yield pending
    finally:
        _DEFERRED.reset(token)


def finish_loading(pending: list) -> None:
    """Make the shells of `deferring` the iterators they stand for, in the order they were met."""
    while pending:
        shell, args = pending.pop(0)
        _rebuild_loader_iter(*args, into=shell)


def _loader_iter_shell(cls: type, *args: Any) -> Any:
    pending = _DEFERRED.get()
    if pending is None:
        return _rebuild_loader_iter(*args)
    shell = cls.__new__(cls)
    pending.append((shell, args))
    return shell


def _rebuild_loader_iter(loader: Any, mode: str, full: bool, created: tuple, first: Optional[tuple],
                         yielded: int, owners: list = (), base: Optional[tuple] = None,
                         workers: Optional[tuple] = None, into: Any = None) -> Any:
    """``iter(loader)`` again under the RNG it was created under, advanced to the same batch
    (made in ``into``, an empty instance of the iterator's class, when given).

    The loader's generators are put back as they were; the global generators are left as this
    leaves them: the restore sets them to their checkpointed states once the graph is loaded.
    """
    gens_now = [(g, rng.object_state(g)) for g in iterators.loader_generators(loader)]
    try:
        with iterators.as_at_start(owners, "a DataLoader iterator"):
            return _remake_loader_iter(loader, mode, full, created, first, yielded, owners, into, base, workers)
    finally:
        for g, s in gens_now:
            rng.set_object_state(g, s)


def _remake_loader_iter(loader: Any, mode: str, full: bool, created: tuple, first: Optional[tuple],
                        yielded: int, owners: list, into: Any, base: Optional[tuple] = None,
                        workers: Optional[tuple] = None) -> Any:
    apply_loader_snapshot(base if base is not None else created)
    if into is None:
        it = iter(loader)
    else:  # what DataLoader.__iter__ does, in place
        it = into
        type(it).__init__(it, loader)
        if loader.persistent_workers and loader.num_workers > 0:
            loader._iterator = it
        it.__dict__[_ORIGIN] = LoaderOrigin(loader, mode, full, created, owners)
    origin: LoaderOrigin = it.__dict__[_ORIGIN]
    which, states = workers if workers is not None else (None, None)
    recorder = worker_rng.recorder_of(it)
    if which == "ended":
        # persistent workers whose loop had ended: the next ``iter(loader)`` resets this iterator
        # (no replay of the epoch), and its new workers begin that epoch where the old ones stopped
        worker_rng.resume_ended(it, states)
        origin.created, origin.base = created, base
        it._num_yielded = yielded
        # ended as the original was: ``next(it)`` raises StopIteration (the batches its creation
        # asked the workers for are dropped by the next reset, as a reset drops any in flight)
        it._sampler_iter = iter(())
        it._rcvd_idx = it._send_idx
        return it
    if base is not None:
        if which == "inside" and recorder is not None and states:
            # the epoch's replay starts from the generators the old workers began it with
            recorder.override(states, it.__dict__[worker_rng.EPOCH] + 1)
        # persistent workers after the first epoch: the uninterrupted run made this iterator
        # once (its workers' base seed from ``base``) and reset it where the loop began; making
        # it afresh under ``created`` drew one number more, and the sampler shuffled otherwise
        apply_loader_snapshot(created)
        origin.first = None
        it._reset(loader)
        origin.created, origin.base = created, base
    elif first is not None and origin.first is None:
        apply_loader_snapshot(first)  # the RNG at the original's first batch, when its sampler drew its seed
        origin.first = first
    return iterators.advance_loader_iterator(it, loader, mode, yielded, 0, "a DataLoader iterator")
