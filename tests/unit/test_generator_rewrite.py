"""Rewritten generators (generator_rewrite.py) saved at every point they can stop and made again
(resumable_generators.py) give the rest of their items exactly, and the shapes the rewrite does
not cover are left as they were, saying why."""
from __future__ import annotations

import ast
import io
import itertools
import pickle
import textwrap

import pytest

from backend.proxy.engine import generator_rewrite, resumable_generators
from backend.proxy.engine.state import ProxyPickler

PROGRAM = '''
import random

def cycle(items):
    while True:
        yield from items

def augment(stream, scale):
    n = 0
    for x, y in stream:
        n += 1
        if n % 3 == 0:
            yield x * scale, y
        elif n % 5 == 0:
            continue
        else:
            yield x, y
    yield "tail", n

def windows(rows, *sizes, stride=1, **extra):
    total = 0
    for size in sizes:
        for i in range(0, len(rows) - size + 1, stride):
            window = [r + extra.get("shift", 0) for r in rows[i:i + size]]
            total += sum(window)
            yield size, window
        yield "end of", size, total

def noisy(seed):
    rng = random.Random(seed)
    level = 0
    while level < 6:
        level += rng.random() < 0.5
        if level % 2:
            yield level, rng.random()
        yield -level

def numbered(stream):
    with stream as f:
        n = 0
        for line in f:
            n += 1
            yield n, line.strip()
    yield "closed", f.closed

class Feeder:
    def __init__(self, data):
        self.data = data
    @staticmethod
    def evens(n):
        for i in range(n):
            if i % 2 == 0:
                yield i

    def chunks(self, k):
        __seen, __buf = 0, []
        for x in self.data:
            __buf.append(x)
            __seen += 1
            if len(__buf) == k:
                yield list(__buf)
                __buf = []
        if __buf:
            yield __seen, __buf
'''

CASES = {
    "cycle with yield from": lambda ns: ns["cycle"]([1, 2, 3]),
    "branches, continue and a tail": lambda ns: ns["augment"](iter([(i, -i) for i in range(12)]), 10),
    "nested loops, *args, **kwargs": lambda ns: ns["windows"](list(range(6)), 2, 4, stride=2, shift=100),
    "while over a private random.Random": lambda ns: ns["noisy"](3),
    "a staticmethod": lambda ns: ns["Feeder"].evens(30),
    "with over a file": lambda ns: ns["numbered"](io.StringIO("".join(f"line {i}\n" for i in range(9)))),
    "a method with a private name": lambda ns: ns["Feeder"](list(range(23))).chunks(3),
}


def _load(src: str) -> dict:
    tree = ast.parse(textwrap.dedent(src))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for fdef in node.body:
                if isinstance(fdef, ast.FunctionDef) and any(isinstance(n, ast.Yield) for n in ast.walk(fdef)):
                    assert generator_rewrite.rewrite(fdef, node.name) is None
    for fdef in tree.body:
        if isinstance(fdef, ast.FunctionDef):
            assert generator_rewrite.rewrite(fdef) is None, fdef.name
    ns: dict = {"__name__": "job"}
    exec(compile(ast.fix_missing_locations(tree), "<job>", "exec"), ns)
    return ns


def _restored(gen):
    """``gen`` saved as a checkpoint saves it (its function aside: the test's namespace is no
    module) and made again."""
    made, args = resumable_generators.reduce(gen)
    if not args:  # finished
        return made()
    buffer = io.BytesIO()
    ProxyPickler(buffer).dump(args[1:])
    return made(args[0], *pickle.loads(buffer.getvalue()))


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_generator_restored_after_any_item_gives_the_rest_exactly(case):
    expected = list(itertools.islice(CASES[case](_load(PROGRAM)), 40))
    assert len(expected) > 5
    for taken in range(len(expected) + 1):
        # a namespace each time: unpickling a class by value in the process that defined it
        # replaces its methods with copies bound to other globals (cloudpickle's class tracking)
        gen = CASES[case](_load(PROGRAM))
        head = list(itertools.islice(gen, taken))
        rest = list(itertools.islice(_restored(gen), 40 - taken))
        assert head + rest == expected, (case, taken)
    # restored twice: what a restored generator saves before it runs again
    assert list(itertools.islice(_restored(_restored(CASES[case](_load(PROGRAM)))), 3)) == expected[:3]


def test_a_restored_generator_leaves_the_original_alone():
    ns = _load(PROGRAM)
    gen = ns["Feeder"](list(range(10))).chunks(3)
    assert next(gen) == [0, 1, 2]
    again = _restored(gen)
    assert next(again) == [3, 4, 5] and next(gen) == [3, 4, 5]
    assert list(again) == list(gen) == [[6, 7, 8], (10, [9])]
    assert list(_restored(gen)) == []  # finished: made again finished


@pytest.mark.parametrize("src, reason", [
    ("def g():\n    x = yield 1\n    print(x)", "send"),
    ("def g(f):\n    try:\n        pass\n    finally:\n        yield 1", "try statement"),
    ("def g():\n    try:\n        yield 1\n    except ValueError:\n        yield 2", "try statement"),
    ("def g(p):\n    with open(p) as p.f:\n        yield 1", "with target"),
    ("@cache\ndef g():\n    yield 1", "decorated"),
    ("def g():\n    for x in range(3):\n        pass\n    else:\n        yield x", "else block"),
    ("def g(xs):\n    for xs[0] in xs:\n        yield 1", "loop target"),
    ("def g():\n    n = 0\n    f = lambda: n\n    n = 1\n    yield f", "closure"),
])
def test_generators_outside_the_shape_are_left_as_they_are_saying_why(src, reason):
    fdef = ast.parse(src).body[0]
    before = ast.dump(fdef)
    why = generator_rewrite.rewrite(fdef)
    assert why and reason in why, why
    assert ast.dump(fdef) == before


def test_a_generator_left_as_it_is_is_saved_only_before_it_starts():
    ns: dict = {"__name__": "job"}
    exec("def g(n):\n    try:\n        yield from range(n)\n    finally:\n        pass\n", ns)
    fresh = ns["g"](3)
    assert list(_restored(fresh)) == [0, 1, 2]
    next(fresh)
    assert resumable_generators.reduce(fresh) is None  # a checkpoint names it and fails (handles.py)


def test_a_generator_inside_a_with_other_than_a_file_is_not_saved():
    """A manager's ``__enter__`` may set state (grad mode, a lock) that a restore, which does not
    enter it again, would lack: such a generator is refused, not resumed without it."""
    ns = _load("import contextlib\ndef g():\n    with contextlib.nullcontext():\n        yield 1\n        yield 2\n")
    gen = ns["g"]()
    assert resumable_generators.reduce(gen) is not None  # not started: nothing entered yet
    next(gen)
    assert resumable_generators.reduce(gen) is None


def test_a_local_that_cannot_be_saved_is_named_in_the_advice():
    from backend.proxy.engine import handles
    from backend.proxy.engine.state import probe

    ns = _load("import socket\ndef served(items):\n    s = socket.socket()\n    for x in items:\n        yield x\n")
    gen = ns["served"]([1, 2])
    next(gen)
    try:
        advice = handles.explain("gen", gen, probe, top_level=False)
    finally:
        gen.gi_frame.f_locals["s"].close()
    assert "saved where it stopped with its locals, but its local `s` (socket) cannot be saved" in advice, advice
    assert "`s` (socket)" in advice.rsplit(": ", 1)[-1]  # and what to do about `s`
