"""What the replayed-items digest costs: per item, and per step of a loop fed by a generator.

A loop over a generator, an iterable or a replayed DataLoader folds each item it takes into a
digest (backend/proxy/engine/item_digest.py), so a restore can tell its replay yielded the same
items. This prints the cost of one fold for the items such loops take, and the ratio of a small
training step fed through the digest to the same step fed directly, measured side by side in
rounds (this machine is noisy: the ratio is what to read).

    python bench/replay_digest.py [--rounds 7] [--steps 300]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from backend.proxy.engine.item_digest import Digesting, fold  # noqa: E402


def per_item_us(item: object, n: int) -> float:
    start = time.perf_counter()
    d = 0
    for _ in range(n):
        d = fold(d, item)
    return (time.perf_counter() - start) / n * 1e6


def batches(x: torch.Tensor, y: torch.Tensor, b: int, steps: int):
    order = torch.randperm(len(x))
    for i in range(steps):
        idx = order[(i * b) % len(x):(i * b) % len(x) + b]
        yield x[idx], y[idx]


def train(steps: int, digest: bool) -> float:
    """Seconds per step of an MLP + Adam step fed by a generator of (x, y) batches."""
    torch.manual_seed(0)
    x, y = torch.randn(4096, 64), torch.randn(4096, 1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
    opt = torch.optim.Adam(model.parameters())
    source = batches(x, y, 64, steps)
    it = Digesting(source) if digest else source
    start = time.perf_counter()
    for xb, yb in it:
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return (time.perf_counter() - start) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args()
    torch.set_num_threads(1)

    items = [("an int", 12345, 200_000), ("a line of text (60 chars)", "x" * 59 + "\n", 200_000),
             ("a list of 64 ints", list(range(64)), 20_000),
             ("(x, y) batch: 64x64 float + 64x1", (torch.randn(64, 64), torch.randn(64, 1)), 20_000),
             ("image batch: 64x3x224x224 float", torch.randn(64, 3, 224, 224), 2_000),
             ("a view X[i:i+64] of a 4096x64 tensor", torch.randn(4096, 64)[64:128], 20_000)]
    print(f"{'item':40s} {'us per fold':>12s}")
    for name, item, n in items:
        print(f"{name:40s} {min(per_item_us(item, n) for _ in range(3)):12.2f}")

    train(50, False)  # warm up
    plain, digested = [], []
    for _ in range(args.rounds):  # side by side: each round runs both
        plain.append(train(args.steps, False))
        digested.append(train(args.steps, True))
    ratios = [d / p for p, d in zip(plain, digested)]
    print()
    print(f"{'loop fed by a generator':40s} {'ms/step':>9s} {'ratio':>7s}")
    print(f"{'direct':40s} {statistics.median(plain) * 1e3:9.3f} {1.0:7.3f}")
    print(f"{'through the digest':40s} {statistics.median(digested) * 1e3:9.3f} "
          f"{statistics.median(ratios):7.3f}  (per-round {min(ratios):.3f}..{max(ratios):.3f})")


if __name__ == "__main__":
    main()
