"""Checkpointing many tiny tensors, beside one buffer of the same bytes, in one run.

    python bench/small_tensors.py [--count 4096] [--bytes 512] [--reps 7]

A model with thousands of biases, norms and buffers is thousands of tiny storages.  Each row
writes the same state (``count`` float32 tensors of ``bytes`` each, plus one view per ten of them)
to a file with fsync and reads it back, through:

* ``engine, 1 rank``: what a one-rank checkpoint writes (`state.save_graph`: storages inline);
* ``engine, 2 ranks``: a data-parallel rank's file beside a shared blob folder;
* ``torch.save``: the zip archive the engine wrote before for one rank (a record per storage);
* ``blob per storage``: what it wrote before for several ranks (a file and an fsync per storage);

and ``one buffer``, the same bytes as a single tensor through the engine.  Medians of ``reps``;
the ratio column is against ``one buffer``.  Process CPU time is shown too: this machine is shared
and wall time moves a lot, while the CPU time of pickling does not.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from backend.proxy.checkpoint import dedup
from backend.proxy.engine import state, training_state  # noqa: E402


def _write(path: Path, fill: Callable) -> None:
    with open(path, "wb") as f:
        fill(f)
        f.flush()
        os.fsync(f.fileno())


def measure(name: str, folder: Path, graph_of: Callable[[], dict], save: Callable, load: Callable,
            reps: int) -> dict:
    walls, cpus, reads = [], [], []
    for i in range(reps):
        path = folder / f"{name.replace(' ', '_').replace(',', '')}-{i}.bin"
        graph = graph_of()
        wall, cpu = time.perf_counter(), time.process_time()
        _write(path, lambda f: save(graph, f, folder / f"blobs-{i}"))
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
        start = time.perf_counter()
        load(path, folder / f"blobs-{i}")
        reads.append(time.perf_counter() - start)
    return {"name": name, "write": statistics.median(walls), "cpu": statistics.median(cpus),
            "read": statistics.median(reads), "bytes": path.stat().st_size}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--count", type=int, default=4096)
    p.add_argument("--bytes", type=int, default=512)
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args()
    torch.manual_seed(0)
    tiny = [torch.randn(args.bytes // 4) for _ in range(args.count)]
    views = [t[1:3] for t in tiny[::10]]
    one = [torch.randn(args.bytes // 4 * args.count)]

    def graph(tensors: list) -> Callable[[], dict]:
        return lambda: {"tensors": tensors, "views": views if tensors is tiny else [],
                        "tail": training_state.Tail()}

    def engine(g: dict, f, _blobs: Path) -> None:
        state.save_graph(g, f)

    def engine_ranks(g: dict, f, blobs: Path) -> None:
        state.save_graph(g, f, blob_dir=blobs, blobs={})

    def torch_save(g: dict, f, _blobs: Path) -> None:
        torch.save({k: v for k, v in g.items() if k != "tail"}, f, pickle_module=state.PICKLE_MODULE,
                   pickle_protocol=4)

    def read(path: Path, blobs: Path) -> None:
        state._read_graph(path, blobs)

    with tempfile.TemporaryDirectory(prefix="sg-small-", dir=ROOT) as tmp:
        folder = Path(tmp)
        rows = [measure("one buffer", folder, graph(one), engine, read, args.reps),
                measure("engine, 1 rank", folder, graph(tiny), engine, read, args.reps),
                measure("engine, 2 ranks", folder, graph(tiny), engine_ranks, read, args.reps),
                measure("torch.save", folder, graph(tiny), torch_save, read, args.reps)]
        inline, dedup.INLINE_BYTES = dedup.INLINE_BYTES, -1
        try:
            rows.append(measure("blob per storage", folder, graph(tiny), engine_ranks, read, max(1, args.reps // 3)))
        finally:
            dedup.INLINE_BYTES = inline
    base = rows[0]
    print(f"{args.count} tensors of {args.bytes} B (+{len(views)} views) vs one buffer of the same bytes; "
          f"median of {args.reps}, torch {torch.__version__}")
    print(f"{'writer':<18}{'write+fsync':>13}{'CPU':>10}{'read':>10}{'file':>12}{'write ratio':>13}{'CPU ratio':>11}")
    for r in rows:
        print(f"{r['name']:<18}{r['write'] * 1e3:>10.1f} ms{r['cpu'] * 1e3:>7.1f} ms{r['read'] * 1e3:>7.1f} ms"
              f"{r['bytes'] / 1e6:>9.2f} MB{r['write'] / base['write']:>12.1f}x{r['cpu'] / base['cpu']:>10.1f}x")


if __name__ == "__main__":
    main()
