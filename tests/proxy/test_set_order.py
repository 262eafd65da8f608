"""A set iterates, pops and grows after a restore exactly as in the uninterrupted run.

Unpickling rebuilds a set by adding its elements in iteration order; with deletions or
collisions in its history the rebuilt table differs and so does the order (`set_layouts.py`
writes the recorded table back). Restores here run in new interpreters with the fixed
``PYTHONHASHSEED`` a worker gets, as on a real node.
"""
from __future__ import annotations

import textwrap

from harness import pick_stops, run_chain, trace_of

from backend.proxy.engine import set_layouts, state

VOCAB = """
import random

random.seed(3)
words = [f"tok{random.randrange(300)}" for _ in range(1500)]
seen = set()
tags = frozenset()


class Bag(set):
    pass


bag = Bag()
for step, w in enumerate(words):
    if w in seen and random.random() < 0.3:
        seen.discard(w)
    else:
        seen.add(w)
    bag.add(w[-2:])
    if step % 7 == 0:
        bag.discard(w[-1:] + "0")
    if step % 150 == 0:
        tags = frozenset(seen)  # sized at once for its elements, unlike a rebuild
        print(step, list(seen)[:6], list(tags)[:4], list(bag)[:4], len(seen))
    if step % 200 == 199:
        print("popped", seen.pop(), seen.pop())
vocab = {w: i for i, w in enumerate(seen)}
print(list(vocab)[:10], sorted(vocab.items())[:3], list(bag))
"""


def test_sets_iterate_in_the_same_order_after_restores(fresh_launcher, tmp_path):
    script = tmp_path / "vocab.py"
    script.write_text(textwrap.dedent(VOCAB))
    env = {"PYTHONHASHSEED": "0"}
    base, trace = trace_of(fresh_launcher, [str(script)], tmp_path, env)
    assert "popped" in base.stdout
    for seed in (1, 2):
        stops = pick_stops(trace, seed, extra=2)
        out, _ = run_chain(fresh_launcher, [str(script)], stops, tmp_path / f"ck-{seed}", env)
        assert out == base.stdout, f"seed {seed}, stops {stops}"


def _history(n: int, seed: int) -> set:
    import random

    rng = random.Random(seed)
    s: set = set()
    for _ in range(n):
        w = f"w{rng.randrange(3 * n)}"
        if w in s and rng.random() < 0.4:
            s.discard(w)
        else:
            s.add(w)
    return s


def test_a_checkpoint_writes_back_the_table_of_every_set_a_rebuild_would_change(tmp_path):
    sets = [_history(n, seed) for n in (3, 12, 40, 300) for seed in range(6)]
    popped = _history(60, 9)
    popped.pop()  # the finger, which says where the next pop() looks, moved
    grown = frozenset(_history(50, 1))
    # ints are not memoised: the layout holds copies (these collide: an int hashes to itself)
    numbers = {n * 4096 + n % 5 for n in range(200)}
    for n in range(0, 200, 3):
        numbers.discard(n * 4096 + n % 5)
    sets.append(numbers)
    graph = {"sets": sets, "popped": popped, "grown": grown, "again": sets[5],
             "tail": None, "set_layouts": set_layouts.Pending()}
    rebuilt_differs = [list(set(list(s))) != list(s) for s in sets]
    assert rebuilt_differs[-1]
    assert sum(rebuilt_differs) >= 6  # the case at hand: a plain rebuild reorders these
    path = tmp_path / "rank-0.pt"
    with open(path, "wb") as f:
        state.save_graph(graph, f)
    loaded = state._read_graph(path, tmp_path / "no-blobs")
    assert loaded["again"] is loaded["sets"][5]
    for before, after in zip(sets + [popped, grown], loaded["sets"] + [loaded["popped"], loaded["grown"]]):
        assert list(after) == list(before)
    for before, after in zip(sets + [popped], loaded["sets"] + [loaded["popped"]]):
        for extra in ("x1", "x2", "y", "zz"):  # later additions land where they would have
            before.add(extra)
            after.add(extra)
        assert list(after) == list(before)
        assert [before.pop() for _ in range(len(before))] == [after.pop() for _ in range(len(after))]


def test_sets_of_objects_hashed_by_address_are_left_as_rebuilt(tmp_path):
    class Node:
        pass

    nodes = [Node() for _ in range(30)]
    s = set(nodes)
    for n in nodes[::4]:
        s.discard(n)
    path = tmp_path / "rank-0.pt"
    with open(path, "wb") as f:
        state.save_graph({"s": s, "nodes": nodes, "set_layouts": set_layouts.Pending()}, f)
    loaded = state._read_graph(path, tmp_path / "no-blobs")
    assert set(map(id, loaded["s"])) == {id(n) for i, n in enumerate(loaded["nodes"]) if i % 4}
    assert all(n in loaded["s"] for i, n in enumerate(loaded["nodes"]) if i % 4)  # lookups work
