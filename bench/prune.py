"""Benchmark: what removing the oldest checkpoint costs a commit (a preemption's critical path).

    .venv/bin/python bench/prune.py [--sizes 100,1000] [--reps 5] [--dir DIR]

A one-rank checkpoint of ``size`` MB (16 MB tensors, written inline) is written again and again
through the checkpoint store (``keep=2``), so from the third on each commit prunes a checkpoint
of the same size. Two ways, alternated write by write so the disk's moods fall on both alike:

  in line   the pruned folder removed before the commit returns (what every commit did before)
  behind    as shipped: renamed out of sight, removed by a thread at a lower priority

``commit`` is the whole `CheckpointStore.write` (pickle, hash, write, fsync, commit, prune);
``disk`` is a plain write + fsync of the same bytes in the same folder, just before. Medians in
seconds; ratios to ``in line`` and to the disk in the same run.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from backend.proxy.checkpoint.store import CheckpointStore  # noqa: E402
from backend.proxy.engine import state  # noqa: E402

WAYS = ("in line", "behind")


class _PruneInLine(CheckpointStore):
    """The store as it pruned before: the removal inside the commit."""

    def prune(self) -> None:
        super().prune()
        self.remove_pruned()


def _disk(folder: Path, graph: dict) -> float:
    path = folder / ".disk-baseline.bin"
    t = time.perf_counter()
    with open(path, "wb") as f:
        for x in graph["state"]:
            f.write(memoryview(x.numpy()).cast("B"))
        f.flush()
        os.fsync(f.fileno())
    took = time.perf_counter() - t
    path.unlink()
    return took


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="100,1000", help="MB per checkpoint, comma-separated")
    ap.add_argument("--reps", type=int, default=5, help="timed commits per way and size (after two untimed)")
    ap.add_argument("--dir", help="where to write (default: a temporary folder)")
    args = ap.parse_args(argv)
    base = Path(args.dir or tempfile.mkdtemp(prefix="sg-prune-"))
    print(f"folder {base}; keep=2; {args.reps} timed commits per way; medians\n")
    print(f"{'size':>8} {'way':>8} {'commit':>8} {'ratio':>7} {'disk':>8} {'commit/disk':>12}")
    for size in (int(x) for x in args.sizes.split(",")):
        torch.manual_seed(0)
        graph = {"state": [torch.rand(4 << 20) for _ in range(max(1, size // 16))], "step": 0}
        stores = {"in line": _PruneInLine(base / f"{size}-in-line", keep=2),
                  "behind": CheckpointStore(base / f"{size}-behind", keep=2)}
        took: dict[str, list[float]] = {w: [] for w in WAYS}
        disk: dict[str, list[float]] = {w: [] for w in WAYS}
        for step in range(args.reps + 2):
            for way in WAYS:
                store = stores[way]
                store.root.mkdir(parents=True, exist_ok=True)
                d = _disk(store.root, graph)
                t = time.perf_counter()
                store.write(step, 0, 1, lambda f: state.save_graph(graph, f, blobs=f.blobs, one_rank=True))
                if step >= 2:  # from the third commit on, each prunes one of the same size
                    took[way].append(time.perf_counter() - t)
                    disk[way].append(d)
                store.remove_pruned()  # the thread's work, done before the next way's turn
        ref = statistics.median(took["in line"])
        for way in WAYS:
            c, d = statistics.median(took[way]), statistics.median(disk[way])
            print(f"{size:>5} MB {way:>8} {c:>8.3f} {c / ref:>6.2f}x {d:>8.3f} {c / d:>11.2f}x")
        print()
    if not args.dir:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
