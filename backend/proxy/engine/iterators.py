"""Iterators of resumable ``for`` loops: how each is created, described and rebuilt.

A loop's iterable is a tree: `Node` for ``enumerate``/``zip``/``iter`` (rebuilt from their
children) and `Leaf` for anything else.  Each leaf gets a strategy when the loop starts:

``seq``        a builtin sequence/collection, array or tensor, or an object iterated by index
               (``__getitem__`` and no ``__iter__``): ``iter()`` again and skip k items (O(1) via
               ``__setstate__`` for list/tuple/range/str/bytes/array and by-index iterators).
``dataloader`` a ``torch.utils.data.DataLoader``: ``iter()`` again under the RNG state saved when
               the loop began (same shuffle, same worker seeds), then with ``num_workers == 0``
               and a map-style dataset advance only its index sampler (no batch is loaded);
               otherwise replay k batches through the workers (exact, costs their load time).
``iterator``   an iterator object.  At checkpoint time: saved as-is if it pickles (its position
               is inside the pickle); else, if the loop's own expression created it (a call or a
               generator expression whose names the loop cannot rebind), re-created by
               re-evaluating that expression under the loop-start RNG and advanced by k
               ``next()`` calls; else the checkpoint fails naming it (hidden state).
``iterable``   any other iterable: ``iter()`` again under the loop-start RNG, then k ``next()``.

Replays check that the skipped items drew no random numbers after the first one; if they did,
their draws were interleaved with the loop body's and cannot be reproduced, so the restore fails
loudly instead of resuming wrongly.  They also check that the skipped items are the ones the loop
took (`item_digest`): an iterator that reads state the loop body changes yields others.
"""
from __future__ import annotations

import array
import builtins
import collections
import contextlib
import io
import itertools
import types
import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence

from . import item_digest, lazy, manual_next, ownership, replay_effects, resumable_generators, rng, worker_rng
from ..checkpoint.errors import CheckpointError, CheckpointFailure

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch.utils.data import DataLoader


class _SequenceProtocol:
    """Iterated through ``__getitem__``: its iterator type is the one ``iter(ndarray)`` returns."""

    def __getitem__(self, index: int) -> Any:
        raise IndexError(index)


#: numpy arrays and torch tensors count as sequences too (`lazy.is_array`)
_SEQ_TYPES = (list, tuple, range, str, bytes, bytearray, dict, set, frozenset, array.array,
              collections.deque, type({}.keys()), type({}.values()), type({}.items()))
_SETSTATE_ITERS = tuple({type(iter(x)) for x in ([], (), range(1), "", "\u20ac", b"", bytearray(),
                                                  _SequenceProtocol())})
#: builtin iterators over builtin collections: their pickle holds their position and they draw no RNG
_POSITION_ITERS = _SETSTATE_ITERS + tuple({type(iter(x)) for x in ({}, {}.values(), {}.items(), set())})


#: attribute of a DataLoader iterator recording how to re-create it (set by training_state.install)
LOADER_ORIGIN = "_sg_origin"


class Leaf:
    """One evaluated sub-expression of a loop's iterable (``index`` = its maker slot)."""

    __slots__ = ("index", "value", "kind", "mode", "iterator", "digest", "start")

    def __init__(self, index: int, value: Any) -> None:
        self.index = index
        self.value = value
        self.kind = ""  # seq | dataloader | iterator | iterable, set when the loop starts
        self.mode = ""  # for a dataloader: skip | replay
        self.iterator: Optional[Iterator[Any]] = None  # iter(value), made when the loop starts
        self.start: Optional[tuple] = None  # where a file stood when the loop began (manual_next.py)
        self.digest: Optional[item_digest.Digesting] = None  # the items taken, if it may be replayed


class Node:
    """``enumerate``/``zip``/``iter`` applied to children that are rebuilt separately."""

    __slots__ = ("index", "kind", "children", "kwargs")

    def __init__(self, index: int, kind: str, children: tuple, kwargs: dict) -> None:
        self.index = index
        self.kind = kind
        self.children = children
        self.kwargs = kwargs


def materialize(x: Any) -> Any:
    """The plain object a `Leaf`/`Node` stands for (used when a special name was shadowed)."""
    if isinstance(x, Leaf):
        return x.value
    if isinstance(x, Node):
        kids = [materialize(c) for c in x.children]
        if x.kind == "enumerate":
            return enumerate(kids[0], **x.kwargs)
        if x.kind == "zip":
            return zip(*kids, **x.kwargs)
        return iter(kids[0])
    return x


def make_node(index: int, fn: Any, children: tuple, kwargs: dict) -> Any:
    """``node()`` of the rewrite: keep builtin enumerate/zip/iter apart, call anything else."""
    if fn is builtins.enumerate:
        return Node(index, "enumerate", children, kwargs)
    if fn is builtins.zip:
        return Node(index, "zip", children, kwargs)
    if fn is builtins.iter:
        return Node(index, "iter", children, kwargs)
    return Leaf(index, fn(*[materialize(c) for c in children], **kwargs))


# --------------------------------------------------------------------------- loop start
def loader_generators(loader: DataLoader) -> list[Any]:
    """The generator objects a loader's ``iter()`` may draw from: its own, its sampler's and its
    batch sampler's (``generator=`` or any attribute of a custom sampler, e.g. ``self.rng``)."""
    return _generators_of([loader, loader.sampler, getattr(loader.batch_sampler, "sampler", None),
                           loader.batch_sampler])


def held_generators(value: Any) -> list[Any]:
    """The generator objects (`rng.is_generator_object`) that iterating ``value`` may draw from,
    beyond the global ones: a DataLoader's (`loader_generators`); for a Python generator, those
    in its frame and in the module globals its code names (``rng = np.random.default_rng(0)``
    beside ``def batches(): ... rng.permutation(n)``); for another object, its attributes'."""
    if lazy.is_dataloader(value):
        return loader_generators(value)
    frame = getattr(value, "gi_frame", None)
    if isinstance(value, types.GeneratorType) and frame is not None:
        names: set[str] = set()
        codes = [value.gi_code]
        while codes:
            code = codes.pop()
            names.update(code.co_names)
            codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
        found = list(frame.f_locals.values()) + [frame.f_globals[n] for n in names if n in frame.f_globals]
        return _generators_of(found, holders=False) + _generators_of(found)
    return _generators_of([value])


def _attribute_values(obj: Any) -> list[Any]:
    """The values of ``obj``'s attributes (none for a module or a class)."""
    if isinstance(obj, (types.ModuleType, type)):
        return []
    attrs = getattr(obj, "__dict__", None)
    return list(attrs.values()) if isinstance(attrs, dict) else []


def _generators_of(objs: Sequence[Any], holders: bool = True) -> list[Any]:
    """Generator objects among ``objs`` (``holders=False``) or among their attributes, two levels
    deep (``self.rng``, and ``self.cfg.rng``: a sampler holding its settings object)."""
    out: list[Any] = []
    for obj in objs:
        if holders and isinstance(obj, types.ModuleType):
            continue  # `torch` or `np` named in a generator's code: the global generators are saved apart
        candidates = [obj]
        if holders:
            candidates = _attribute_values(obj)
            candidates += [v for c in candidates if not rng.is_generator_object(c) for v in _attribute_values(c)]
        for g in candidates:
            if rng.is_generator_object(g) and all(g is not x for x in out):
                out.append(g)
    return out


def classify(leaf: Leaf) -> str:
    """Pick a leaf's strategy and say what RNG snapshot it needs: '', 'torch' or 'full'."""
    v = leaf.value
    if lazy.is_dataloader(v):
        leaf.kind = "dataloader"
        mapstyle = not lazy.is_iterable_dataset(v.dataset)
        leaf.mode = "skip" if v.num_workers == 0 and mapstyle else "replay"
        custom = not lazy.is_builtin_sampler(v.sampler) or (
            v.batch_sampler is not None and not lazy.is_builtin_sampler(v.batch_sampler))
        in_process_replay = leaf.mode == "replay" and v.num_workers == 0
        return "full" if custom or in_process_replay else "torch"
    if isinstance(v, _SEQ_TYPES) or lazy.is_array(v) or _iterated_by_index(type(v)):
        leaf.kind = "seq"
        return ""
    if hasattr(type(v), "__next__"):  # an iterator; calling iter() here could have side effects
        leaf.kind = "iterator"
        if type(v) in _POSITION_ITERS:
            return ""
        if lazy.is_rng_free_generator(v):
            return ""
        return "full"
    leaf.kind = "iterable"
    return "full"


def _iterated_by_index(t: type) -> bool:
    """A class with ``__getitem__`` and no ``__iter__`` (a map-style Dataset, an old-style
    sequence): Python iterates it by index, and its iterator's position is that index. A restore
    sets the index again instead of calling ``__getitem__`` for the items already taken, which
    loaded them for nothing and ran whatever else they do (a counter advanced twice)."""
    return getattr(t, "__iter__", None) is None and hasattr(t, "__getitem__") and not hasattr(t, "__next__")


def leaves_of(tree: Any) -> list[Leaf]:
    if isinstance(tree, Leaf):
        return [tree]
    out: list[Leaf] = []
    for c in tree.children:
        out.extend(leaves_of(c))
    return out


def _to_tree(src: Any) -> Any:
    return src if isinstance(src, (Leaf, Node)) else Leaf(0, src)


class LoopSource:
    """The created iterator of one loop activation plus what is needed to rebuild it."""

    __slots__ = ("tree", "iterator", "rng", "generators", "owners", "digests")

    def __init__(self, tree: Any, iterator: Iterator[Any], rng_state: Optional[dict],
                 generators: list[tuple[Any, Any]], owners: list[tuple[Any, dict]]) -> None:
        self.tree = tree
        self.iterator = iterator
        self.rng = rng_state
        self.generators = generators
        self.owners = owners  # `owner_states` of the objects whose __iter__ a replay runs again
        #: leaf index -> the digest of the items taken from a leaf a restore may replay
        self.digests = {leaf.index: leaf.digest for leaf in leaves_of(tree) if leaf.digest is not None}

    @classmethod
    def start(cls, src: Any) -> "LoopSource":
        """Called where Python's ``for`` would call ``iter()``."""
        tree = _to_tree(src)
        leaves = leaves_of(tree)
        need = {classify(leaf) for leaf in leaves}
        snapshot = rng.capture(full="full" in need) if need - {""} else None
        gens: list[tuple[Any, Any]] = []
        for leaf in leaves:
            if leaf.kind != "seq" and not lazy.is_rng_free_generator(leaf.value):
                gens.extend((g, rng.object_state(g)) for g in held_generators(leaf.value)
                            if all(g is not h for h, _ in gens))
        owners = owner_states([o for leaf in leaves if leaf.kind in ("iterable", "dataloader")
                               for o in iter_owners(leaf.value)])
        return cls(tree, _build(tree), snapshot, gens, owners)


# --------------------------------------------------------------------------- objects __iter__ changes
def iter_owners(value: Any) -> list[Any]:
    """The objects whose ``__iter__`` a re-creation of ``value``'s iterator runs again and that
    ``__iter__`` is the program's own (`ownership.PROGRAM`): the iterable itself, or a DataLoader's
    custom sampler, batch sampler and iterable dataset. Such an ``__iter__`` may change its object
    (``self.epoch += 1``, a reshuffle seeded by it). A library's iterable (a tqdm bar) is left to
    the library."""
    candidates = [value]
    if lazy.is_dataloader(value):
        candidates = [value.sampler, value.batch_sampler]
        if lazy.is_iterable_dataset(value.dataset):
            candidates.append(value.dataset)
    return [o for o in candidates if o is not None and isinstance(getattr(o, "__dict__", None), dict)
            and ownership.PROGRAM(getattr(type(o), "__iter__", None))]


#: containers up to this many entries (arrays up to this many bytes) are copied by `owner_states`
_COPIED_LEN = 1_000_000
_COPIED_BYTES = 1 << 20


def _as_now(value: Any) -> Any:
    """``value``, or a copy of it if it is a container an ``__iter__`` may change in place
    (``random.shuffle(self.batches)``, ``np.random.shuffle(self.index)``)."""
    t = type(value)
    if t in (list, dict, set, bytearray) and len(value) <= _COPIED_LEN:
        return t(value)
    if lazy.is_array(value) and value.nbytes <= _COPIED_BYTES:
        if hasattr(value, "copy"):  # numpy
            return value.copy()
        if not value.requires_grad:  # a tensor (a parameter stays itself)
            return value.clone()
    return value


def owner_states(objects: Sequence[Any]) -> list[tuple[Any, dict]]:
    """Each object with its attributes as they are now, lists, dicts, sets and small arrays
    copied (the rest shared): taken where the loop calls ``iter()``, so a replay starts from them."""
    return [(o, {name: _as_now(value) for name, value in o.__dict__.items()}) for o in objects]


@contextlib.contextmanager
def as_at_start(states: Sequence[tuple[Any, dict]], where: str) -> Iterator[None]:
    """While a restore replays an iterator: its owners' attributes as they were when the loop
    called ``iter()``; then the checkpoint's again. An attribute the replay changed in place
    anyway (a list inside a list, a big array), which no copy taken then undoes, makes the restore
    refuse instead of resuming with another order."""
    if not states:
        yield
        return
    now = [(o, dict(o.__dict__)) for o, _ in states]
    marks = [(o, name, item_digest.fold(0, value)) for o, attrs in now for name, value in attrs.items()]
    for o, attrs in states:  # copies again: the states stay as they were, for later restores
        o.__dict__.clear()
        o.__dict__.update({name: _as_now(value) for name, value in attrs.items()})
    try:
        yield
    finally:
        for o, attrs in now:
            o.__dict__.clear()
            o.__dict__.update(attrs)
    changed = [f"{type(o).__name__}.{name}" for o, name, mark in marks
               if item_digest.fold(0, o.__dict__.get(name)) != mark]
    if changed:
        raise CheckpointError(
            f"cannot resume {where} exactly: re-creating its iterator ran `__iter__` "
            f"again, which changed `{changed[0]}` in place, and a restore cannot undo that. Rebind the "
            f"attribute instead (`self.order = rng.permutation(n)` rather than shuffling what it holds "
            f"in place), or restart the job from the beginning.")


class WatchedDigesting(item_digest.Digesting):
    """`item_digest.Digesting` for a loop's own replayable leaf, which also notes whether taking
    its second to fourth items drew from the global random generators (``drew``): a restore would
    refuse to replay it (`_skip`), so the checkpoint refuses first, while the job can run on.

    ``taken``: items a restore's replay took already (and checked, `_skip`); the watch goes on
    from there, so a checkpoint after a restore refuses what the next restore would."""

    __slots__ = ("left", "drew", "first")

    def __init__(self, it: Iterator[Any], value: int = 0, taken: int = 0) -> None:
        super().__init__(it, value)
        self.left = max(0, 4 - taken)  # the first item may draw: a replay starts from the loop-start RNG
        self.first = taken == 0
        self.drew = False

    def __next__(self) -> Any:
        if not self.left:
            item = next(self.it)
            self.value = item_digest.fold(self.value, item)
            return item
        self.left -= 1
        if self.first:
            self.first = False
            return super().__next__()
        before = rng.capture(full=True)
        item = super().__next__()
        if not rng.equal(before, rng.capture(full=True)):
            self.drew, self.left = True, 0
        return item


def refuse_drawn(digest: Any, text: str, type_name: str, line: int, loader: bool) -> None:
    """A replay of a leaf whose items drew (``digest.drew``) would be refused at restore (`_skip`):
    refuse the checkpoint now, while the job can run on."""
    if isinstance(digest, WatchedDigesting) and digest.drew:
        advice = _LOADER_ADVICE if loader else _DRAW_UP_FRONT
        raise CheckpointFailure(
            f"the loop at line {line} iterates over `{text}`, whose items drew random numbers after the "
            f"first: a restore re-creates it and skips the items taken, and those draws, interleaved "
            f"with the loop body's, could not be reproduced. {advice}, or let the checkpoint come at "
            f"another loop.", [[text, type_name]])


def refuse_drawn_after_restore(desc: dict, digests: dict[int, item_digest.Digesting],
                               leaf_texts: Sequence[str], line: int) -> None:
    """`refuse_drawn` for a loop a restore re-created: its description is the checkpoint's, and
    the leaves it replays are watched from where the replay left them (`rebuild`)."""
    def walk(state: dict) -> None:
        for child in state.get("children", ()):
            walk(child)
        index = state.get("index")
        if "children" not in state and index in digests:
            text = leaf_texts[index] if index < len(leaf_texts) else "?"
            value = state.get("loader", state.get("iterable", state.get("iterator")))
            if state["how"] == "pickled" and LOADER_ORIGIN not in getattr(value, "__dict__", {}):
                return  # restored from its pickle, not replayed (`iter(src.next_batch, None)`)
            loader = state["how"] in ("dataloader", "pickled")
            if loader and getattr(value, "num_workers", getattr(value, "_num_workers", 0)):
                return  # its workers' draws are replayed exactly (`advance_loader_iterator`)
            kind = type(value).__name__ if value is not None else "iterator"  # an `expr` leaf is made again
            refuse_drawn(digests[index], text, kind, line, loader)

    if desc and "tree" in desc:
        walk(desc["tree"])


def _may_be_replayed(leaf: Leaf) -> bool:
    """Whether a restore may re-create this leaf and skip the items taken (not pickle it)."""
    if resumable_generators.keeps_place(leaf.iterator if leaf.kind == "iterable" else leaf.value):
        return False  # saved where it stopped
    if leaf.kind == "iterable" or (leaf.kind == "dataloader" and leaf.mode == "replay"):
        return True
    if leaf.kind != "iterator" or type(leaf.value) in _POSITION_ITERS or lazy.is_rng_free_generator(leaf.value):
        return False
    return LOADER_ORIGIN not in getattr(leaf.value, "__dict__", {})  # a DataLoader's pickles itself


def _build(tree: Any) -> Iterator[Any]:
    if isinstance(tree, Leaf):
        tree.start = manual_next.start_of(tree.value)
        tree.iterator = manual_next.reader_of(tree.value)
        if _may_be_replayed(tree):
            tree.digest = WatchedDigesting(tree.iterator)
            return tree.digest
        return tree.iterator
    kids = [_build(c) for c in tree.children]
    if tree.kind == "enumerate":
        return enumerate(kids[0], **tree.kwargs)
    if tree.kind == "zip":
        return zip(*kids, **tree.kwargs)
    return kids[0]


# --------------------------------------------------------------------------- checkpoint time
def describe(source: LoopSource, leaf_texts: Sequence[str], reevaluable: Sequence[bool],
             why_not: Sequence[str], line: int, probe: Callable[[Any], Optional[str]]) -> dict:
    """The picklable description of ``source`` that `rebuild` turns back into an iterator.

    Raises `CheckpointFailure` for an iterator with hidden state that cannot be re-created.
    """
    def refuse_draws(leaf: Leaf, text: str, loader: bool) -> None:
        refuse_drawn(leaf.digest, text, type(leaf.value).__name__, line, loader)

    def leaf_state(leaf: Leaf) -> dict:
        text = leaf_texts[leaf.index] if leaf.index < len(leaf_texts) else "?"
        if leaf.kind == "seq":
            return {"how": "seq", "index": leaf.index, "iterable": leaf.value}
        if leaf.kind == "dataloader":
            if (leaf.value.persistent_workers and leaf.value.num_workers > 0
                    and worker_rng.recorder_of(leaf.iterator) is None):
                warnings.warn(
                    f"the loop at line {line} iterates a DataLoader with persistent_workers=True whose workers "
                    f"were not forked (multiprocessing_context={leaf.value.multiprocessing_context!r}): a "
                    f"restore starts new workers, so randomness drawn inside the workers after the loader's "
                    f"first epoch will differ from an uninterrupted run; leave the context at its default "
                    f"('fork') to have their generators saved", RuntimeWarning, stacklevel=2)
            if leaf.mode == "replay" and leaf.value.num_workers == 0:
                refuse_draws(leaf, text, loader=True)
            if LOADER_ORIGIN in getattr(leaf.iterator, "__dict__", {}):
                # the live iterator knows the RNG of its creation and of its first batch, which
                # `zip(loader_a, loader_b)` interleaves: it pickles itself (training_state.py)
                return {"how": "pickled", "index": leaf.index, "iterator": leaf.iterator}
            return {"how": "dataloader", "index": leaf.index, "loader": leaf.value, "mode": leaf.mode}
        if leaf.kind == "iterable":
            if resumable_generators.keeps_place(leaf.iterator):  # `__iter__` is such a generator
                return {"how": "pickled", "index": leaf.index, "iterator": leaf.iterator}
            refuse_draws(leaf, text, loader=False)
            return {"how": "iterable", "index": leaf.index, "iterable": leaf.value}
        reevaluated = leaf.index < len(reevaluable) and reevaluable[leaf.index]
        if reevaluated and isinstance(leaf.value, io.IOBase):
            # a file the with statement around the loop opens again: a pickled copy would be
            # another file than the one the body reads through its name (`tgt = next(f)`)
            return {"how": "expr", "index": leaf.index, "start": leaf.start}
        if isinstance(leaf.value, types.GeneratorType):
            # one of the program's generators that generator_rewrite made resumable is saved as
            # it stands (its loops' iterators with it); any other cannot be pickled
            error: Optional[str] = None if resumable_generators.keeps_place(leaf.value) else \
                "generators cannot be pickled"
        else:
            error = probe(leaf.value)
        if error is None:
            return {"how": "pickled", "index": leaf.index, "iterator": leaf.value}
        if reevaluated:
            refuse_draws(leaf, text, loader=False)
            return {"how": "expr", "index": leaf.index, "start": leaf.start}
        reason = why_not[leaf.index] if leaf.index < len(why_not) else ""
        raise CheckpointFailure(
            f"the loop at line {line} iterates over `{text}`, a {type(leaf.value).__name__} with hidden "
            f"state: its position cannot be saved ({error}) and it "
            f"cannot be re-created ({reason}). Create the iterator in the for statement itself "
            f"(`for x in make_items():`) or iterate over a list, Dataset or DataLoader.",
            [[text, type(leaf.value).__name__]])

    def walk(tree: Any) -> dict:
        if isinstance(tree, Leaf):
            return leaf_state(tree)
        return {"how": tree.kind, "index": tree.index, "kwargs": tree.kwargs,
                "children": [walk(c) for c in tree.children]}

    return {"tree": walk(source.tree), "rng": source.rng, "generators": source.generators, "owners": source.owners}


def reiterated_loaders(position: Sequence[dict]) -> dict[int, bool]:
    """The DataLoaders that loops of ``position`` will iterate again at a restore (``iter(loader)``
    then skip or replay; a loop over accelerate's prepared loader, whose iterator is a generator),
    by id: whether the loop has taken an item yet (so called ``iter()`` on the loader)."""
    found: dict[int, bool] = {}

    def walk(node: dict, began: bool) -> None:
        if node.get("how") == "dataloader":
            found[id(node["loader"])] = began
            inner = getattr(node["loader"], "base_dataloader", None)  # accelerate's DataLoaderAdapter
            if inner is not None:
                found[id(inner)] = began
        for child in node.get("children", ()):
            walk(child, began)

    for rec in position:
        if rec.get("kind") == "for" and rec.get("source"):
            walk(rec["source"]["tree"], rec.get("fetched", 0) > 0)
    return found


#: the leaves a restore may replay: a DataLoader in replay mode is one, in its own state or pickled
#: as its live iterator (training_state.py), and so is an iterator that turns out not to pickle
_REPLAYED_HOWS = ("expr", "iterable", "dataloader", "pickled")
#: where `advance_loader_iterator` leaves the digest of the batches it replayed, for `rebuild`
_REPLAYED = "_sg_replayed_items"


def with_item_digests(desc: dict, digests: dict[int, item_digest.Digesting], extra: dict[int, int]) -> dict:
    """``desc`` with the current digest of the items taken from each replayed leaf, and the items
    the loop body took from it with ``next()`` (manual_next.py)."""
    if not digests or not desc:
        return desc

    def walk(state: dict) -> dict:
        if "children" in state:
            return {**state, "children": [walk(c) for c in state["children"]]}
        if state["how"] in _REPLAYED_HOWS and state["index"] in digests:
            return {**state, "items": digests[state["index"]].value, "extra": extra.get(state["index"], 0)}
        return state

    return {**desc, "tree": walk(desc["tree"])}


# --------------------------------------------------------------------------- restore time
_DRAW_UP_FRONT = "Draw the randomness up front (e.g. shuffle a list, or use a DataLoader)"
_LOADER_ADVICE = ("Give the DataLoader num_workers=1 or more (its workers' randomness is replayed "
                  "exactly), draw the randomness up front")


def _skip(it: Iterator[Any], k: int, check_rng: bool, what: str, line: int,
          watched: Sequence[Any] = (), moved: Optional[list] = None, advice: str = _DRAW_UP_FRONT) -> None:
    """Advance ``it`` by k items; with ``check_rng`` refuse replays whose items drew RNG. The
    generator objects of ``watched`` that items after the first drew from are added to ``moved``."""
    if k <= 0:
        return
    try:
        with replay_effects.quietly():  # the run printed what making these items prints
            next(it)
            if k == 1 or not (check_rng or watched):
                collections.deque(itertools.islice(it, k - 1), maxlen=0)
                return
            before = rng.capture(full=True) if check_rng else None
            objects_before = [rng.object_state(g) for g in watched]
            collections.deque(itertools.islice(it, k - 1), maxlen=0)
    except StopIteration:
        return
    if moved is not None:
        moved.extend(g for g, s in zip(watched, objects_before) if not rng.same_state(s, rng.object_state(g)))
    if before is not None and not rng.equal(before, rng.capture(full=True)):
        where = f"the loop at line {line}" if line else what  # 0: an iterator held outside a loop
        raise CheckpointError(
            f"cannot resume {where} exactly: re-creating `{what}` and skipping its "
            f"first {k} items drew random numbers after the first item, so those draws were "
            f"interleaved with the loop body's and cannot be reproduced. {advice}, "
            f"or restart the job from the beginning.")


def _advance_dataloader(loader: DataLoader, mode: str, k: int, line: int, text: str) -> Iterator[Any]:
    return advance_loader_iterator(iter(loader), loader, mode, k, line, text)


def advance_loader_iterator(it: Iterator[Any], loader: DataLoader, mode: str, k: int, line: int,
                            text: str) -> Iterator[Any]:
    """Move a fresh iterator of ``loader`` past ``k`` batches: skip indices, or replay (see `classify`)."""
    if k <= 0:
        return it
    sampler_iter = getattr(it, "_sampler_iter", None)
    if mode == "skip" and sampler_iter is not None and hasattr(it, "_num_yielded"):
        for _ in range(k):
            try:
                next(sampler_iter)
            except StopIteration:
                break
        it._num_yielded += k
        return it
    tracked = item_digest.Digesting(it)
    _skip(tracked, k, check_rng=loader.num_workers == 0, what=text, line=line, advice=_LOADER_ADVICE)
    if isinstance(getattr(it, "__dict__", None), dict):
        it.__dict__[_REPLAYED] = tracked.value
    return it


def rebuild(desc: dict, k: int, makers: Sequence[Optional[Callable[[], Any]]],
            leaf_texts: Sequence[str], line: int,
            digests: Optional[dict[int, item_digest.Digesting]] = None,
            extra: Optional[dict[int, int]] = None) -> Iterator[Any]:
    """Re-create the iterator described by `describe` positioned after ``k`` items. The digests
    of the replayed leaves' items, which go on counting, are put in ``digests``, and the items
    the loop body took from them with ``next()`` in ``extra``."""
    # The generator objects are the checkpoint's (restored with the program's variables): put
    # them back as they were when the loop began for the replay, then as the checkpoint has them.
    watched = [g for g, _ in desc["generators"]]
    owners = [o for o, _ in desc.get("owners", ())]  # their replay's changes are undone (`as_at_start`)
    saved_gen_states = [(g, rng.object_state(g)) for g in watched]
    moved: list[Any] = []
    differing: list[str] = []  # the replayed leaves whose items are not the ones the loop took
    if desc["rng"] is not None:
        rng.apply(desc["rng"])
    for g, state in desc["generators"]:
        rng.set_object_state(g, state)

    def text_of(state: dict) -> str:
        i = state["index"]
        return leaf_texts[i] if i < len(leaf_texts) else "?"

    def make(state: dict) -> Iterator[Any]:
        how = state["how"]
        if how in ("enumerate", "zip", "iter"):
            kids = [make(c) for c in state["children"]]
            if how == "enumerate":
                start = state["kwargs"].get("start", 0)
                return enumerate(kids[0], start + k)
            if how == "zip":
                return zip(*kids, **state["kwargs"])
            return kids[0]
        if how == "pickled":  # a DataLoader's iterator replayed its batches as it was unpickled
            return compared(state, manual_next.reader_of(state["iterator"]))
        if how == "dataloader":
            return compared(state, _advance_dataloader(state["loader"], state["mode"], k, line, text_of(state)))
        if how == "seq":
            it = iter(state["iterable"])
            if k and isinstance(it, _SETSTATE_ITERS):
                it.__setstate__(k)  # type: ignore[attr-defined]
            else:
                _skip(it, k, check_rng=False, what=text_of(state), line=line)
            return it
        if how == "expr":
            maker = makers[state["index"]] if state["index"] < len(makers) else None
            if maker is None:
                raise CheckpointError(f"the loop at line {line} cannot re-create `{text_of(state)}`")
            made = maker()
            manual_next.apply_start(made, state.get("start"))  # a header read before the loop
            return replay(state, manual_next.reader_of(made), fresh=made)
        assert how == "iterable", how
        return replay(state, iter(state["iterable"]))

    def compared(state: dict, it: Iterator[Any]) -> Iterator[Any]:
        """A DataLoader iterator `advance_loader_iterator` replayed: its batches against the loop's."""
        if "items" not in state:
            return it
        replayed = getattr(it, "__dict__", {}).pop(_REPLAYED, None)
        if replayed is not None and replayed != state["items"]:
            differing.append(text_of(state))
        tracked = WatchedDigesting(it, state["items"], taken=k)
        if digests is not None:
            digests[state["index"]] = tracked
        return tracked

    def replay(state: dict, it: Iterator[Any], fresh: Any = None) -> Iterator[Any]:
        taken = state.get("extra", 0)  # by next() in the body, besides the loop's own k
        tracked = WatchedDigesting(it)
        tracked.left = 0  # the replay checks its own draws (`_skip`); the watch resumes after it
        if extra is not None and taken:
            extra[state["index"]] = taken
        # what the expression made afresh (an object whose __iter__ advances it) may change
        effects = replay_effects.watch(it, [*owners, fresh]) if k + taken else None
        _skip(tracked, k + taken, check_rng=True, what=text_of(state), line=line, watched=watched, moved=moved)
        changed = effects.changed() if effects is not None else []
        if changed:
            raise CheckpointError(
                f"cannot resume the loop at line {line} exactly: re-creating `{text_of(state)}` and skipping "
                f"its first {k + taken} items changed {', '.join(changed)}: the generator does work as it "
                f"yields (a training step before each yield), and replaying it would do that work a second "
                f"time on the restored state. Do the work in the loop body (yield the batch, update after), "
                f"or restart the job from the beginning.")
        if "items" in state and tracked.value != state["items"]:
            differing.append(text_of(state))
        tracked.left, tracked.first = max(0, 4 - (k + taken)), k + taken == 0
        if digests is not None:
            digests[state["index"]] = tracked
        return tracked

    try:
        with as_at_start(desc.get("owners", ()), f"the loop at line {line}"):
            rebuilt = make(desc["tree"])
        # An object the skipped items drew from must have drawn nothing else meanwhile (the loop
        # body): then the replay ends where the checkpoint has it. Else the draws interleaved.
        interleaved = [g for g, s in saved_gen_states if any(g is m for m in moved)
                       and not rng.same_state(s, rng.object_state(g))]
        if interleaved:
            raise CheckpointError(
                f"cannot resume the loop at line {line} exactly: re-creating its iterator and skipping "
                f"its first {k} items drew from {', '.join(type(g).__name__ for g in interleaved)} "
                f"objects the loop body drew from too, so the draws interleaved and cannot be replayed. "
                f"Give the iterator a generator of its own, draw its randomness up front (shuffle a "
                f"list), or restart the job from the beginning.")
        if differing:
            raise CheckpointError(
                f"cannot resume the loop at line {line} exactly: re-creating `{differing[0]}` and "
                f"skipping its first {k} items gave other items than the loop had taken, so the "
                f"iterator reads state that changed since the loop began (a list, dict or attribute "
                f"the loop body updates, such as losses or weights it picks examples by). Keep its "
                f"position where it can be saved: an iterator class holding its state in attributes "
                f"(it is pickled with its position), or pick the items in the loop body; or restart "
                f"the job from the beginning.")
        return rebuilt
    finally:
        for g, state in saved_gen_states:
            rng.set_object_state(g, state)
