"""What the rewrite that makes suspended generators savable costs a generator that runs.

Generator functions of the program are rewritten so that where one is suspended can be saved
(backend/proxy/engine/generator_rewrite.py): each yield records its number, each statement tests
whether a restore is under way. This times the same generators plain and rewritten, side by side
in rounds (this machine is noisy: the ratio is what to read), for shapes from cheap to realistic:
an item per loop turn, lists of 32 items, and 64-row batches of a tensor.

    python bench/generators.py [--rounds 7] [--items 1000000]
"""
from __future__ import annotations

import argparse
import ast
import statistics
import sys
import textwrap
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from backend.proxy.engine import generator_rewrite  # noqa: E402

SOURCE = textwrap.dedent('''
def items(n):
    for i in range(n):
        if i % 2:
            yield i
        else:
            yield -i

def lists(rows, k):
    buf = []
    for r in rows:
        buf.append(r)
        if len(buf) == k:
            yield buf
            buf = []

def batches(data, k):
    while True:
        for i in range(0, len(data), k):
            yield data[i:i + k] * 2
''')


def load(rewritten: bool) -> dict:
    tree = ast.parse(SOURCE)
    if rewritten:
        for fdef in tree.body:
            assert generator_rewrite.rewrite(fdef) is None
    ns: dict = {}
    exec(compile(ast.fix_missing_locations(tree), "<bench>", "exec"), ns)
    return ns


def timed(make: Callable[[], object], take: int) -> float:
    start = time.perf_counter()
    for _ in zip(range(take), make()):
        pass
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--items", type=int, default=1_000_000)
    args = ap.parse_args()
    torch.set_num_threads(1)
    data = torch.randn(4096, 256)
    n = args.items
    shapes = {
        "items (one int per turn)": (lambda ns: ns["items"](n), n),
        "lists of 32": (lambda ns: ns["lists"](range(n), 32), n // 32),
        "batches of 64x256 (x2)": (lambda ns: ns["batches"](data, 64), 2000),
    }
    plain, rewritten = load(False), load(True)
    print(f"{'generator':28} {'plain ms':>9} {'rewritten ms':>13} {'ratio':>6} {'ns/item more':>13}")
    for name, (make, take) in shapes.items():
        a, b = [], []
        for _ in range(args.rounds):  # side by side: each round times both
            a.append(timed(lambda: make(plain), take))
            b.append(timed(lambda: make(rewritten), take))
        ratio = statistics.median(tb / ta for ta, tb in zip(a, b))
        more = statistics.median(tb - ta for ta, tb in zip(a, b)) / take * 1e9
        print(f"{name:28} {statistics.median(a) * 1e3:9.1f} {statistics.median(b) * 1e3:13.1f} {ratio:6.2f} {more:13.0f}")


if __name__ == "__main__":
    main()
