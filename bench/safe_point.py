"""What a safe point costs, in nanoseconds, at the top level and inside functions and methods.

    python bench/safe_point.py [--n 1000000] [--repeat 7]

A whole training step cannot resolve a 1 % difference on this machine, so this measures the
engine's additions one by one: each snippet runs as plain ``exec`` and under the engine
(`ResumableProgram`), alternately, ``--repeat`` times; the figure is (best engine time - best
plain time) / iterations.  Snippets: an empty ``for``/``while`` loop at the top level, the same
loop inside ``main()`` called under ``if __name__ == "__main__":``, inside a method called from
a method, and a loop whose body calls a small function of the program that has a call site of
its own (so it is rewritten: prologue, guards, a re-entry test per call).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backend.proxy import CheckpointStore, Controller, ResumableProgram  # noqa: E402

SNIPPETS = {
    "for, top level": "for i in range(N):\n    pass\n",
    "while, top level": "i = 0\nwhile i < N:\n    i += 1\n",
    "for, in main()": "def main():\n    for i in range(N):\n        pass\nif __name__ == '__main__':\n    main()\n",
    "while, in main()": ("def main():\n    i = 0\n    while i < N:\n        i += 1\n"
                         "if __name__ == '__main__':\n    main()\n"),
    "for, in Trainer.fit() <- main()": (
        "class Trainer:\n    def fit(self):\n        for i in range(N):\n            pass\n"
        "def main():\n    Trainer().fit()\nmain()\n"),
    "call of a rewritten function, per call": (
        "def helper(x):\n    return double(x)\ndef double(x):\n    return 2 * x\n"
        "def main():\n    for i in range(N):\n        helper(i)\nmain()\n"),
}


def measure(src: str, n: int, repeat: int, tmp: Path) -> tuple[float, float]:
    """Best plain and best engine seconds for ``src`` with N = n."""
    text = src.replace("N", str(n))
    code = compile(text, "<plain>", "exec")
    program = ResumableProgram.from_source(text, "<engine>")
    best_p = best_e = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        exec(code, {"__name__": "__main__"})
        best_p = min(best_p, time.perf_counter() - t)
        t = time.perf_counter()
        program.run({"__name__": "__main__"}, Controller(CheckpointStore(tmp / "ck")))
        best_e = min(best_e, time.perf_counter() - t)
    return best_p, best_e


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=1_000_000)
    p.add_argument("--repeat", type=int, default=7)
    args = p.parse_args()
    print(f"{'snippet':<42} {'plain ns/it':>12} {'engine ns/it':>13} {'added ns':>9}")
    with tempfile.TemporaryDirectory(prefix="bench-safe-point-") as tmp:
        for name, src in SNIPPETS.items():
            plain, engine = measure(src, args.n, args.repeat, Path(tmp))
            per = 1e9 / args.n
            print(f"{name:<42} {plain * per:12.1f} {engine * per:13.1f} {(engine - plain) * per:9.1f}")


if __name__ == "__main__":
    main()
