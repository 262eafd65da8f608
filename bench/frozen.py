"""Benchmark: checkpoints of a fine-tuning job, whose frozen parameters do not change.

    .venv/bin/python bench/frozen.py                      # 100 and 500 MB frozen, 3 reps
    .venv/bin/python bench/frozen.py --frozen 1000 --trained 20 --reps 5 --tensor-mb 4

A one-rank job holds F MB of frozen parameters (``requires_grad=False``) and T MB that training
changes (trained parameters and an optimizer's moments). Each repetition writes two consecutive
checkpoints through the checkpoint store (write, hash, fsync, commit), the trained tensors
changed in between, three ways side by side:

  inline    everything in the rank file (what one-rank checkpoints did before frozen blobs)
  blobs     frozen parameters in blobs, linking turned off (each checkpoint writes them again)
  linked    as shipped: the second checkpoint hashes the frozen blobs and links them

``in line`` is the second checkpoint written at the safe point (a preemption: the job's devices
are freed after it); ``snapshot`` is how long a periodic checkpoint written behind the loop
holds the loop for the second checkpoint (`background.Snapshot`). Times are medians in seconds;
the ratios are to ``inline`` in the same run.

``--tables store`` (or ``local,store``) gives a second table: the same job moving through an fsspec store (a ``file://``
folder, ``--store-dir`` to put it on another device). Each repetition uploads a first checkpoint
and fetches it onto a second node, trains, then times the upload of the second checkpoint and its
fetch onto that node (a job migrating back to a node it left), two ways side by side:

  whole     ``CheckpointTransfer(reuse_blobs=False)``: every blob sent and fetched again
  reused    as shipped: unchanged blobs copied within the store and linked from the cache
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from backend.agent.transfer import CheckpointTransfer  # noqa: E402
from backend.proxy.checkpoint.store import CheckpointStore  # noqa: E402
from backend.proxy.engine import background, state  # noqa: E402

WAYS = ("inline", "blobs", "linked")


class _InlineOnly:
    """A rank file (or snapshot) that names no blob folder: every storage goes inline."""

    def __init__(self, f) -> None:
        self.write = f.write


def _graph(frozen_mb: int, trained_mb: int, tensor_mb: int) -> dict:
    torch.manual_seed(0)
    frozen = [torch.nn.Parameter(torch.randn(tensor_mb << 18), requires_grad=False)
              for _ in range(max(1, frozen_mb // tensor_mb))]
    trained = torch.nn.Parameter(torch.randn(max(1, trained_mb) << 18))
    return {"frozen": frozen, "trained": trained, "moment": torch.zeros_like(trained), "step": 0}


def _store(root: Path, way: str) -> CheckpointStore:
    store = CheckpointStore(root, keep=2)
    if way == "blobs":
        store.reusable_blob_dirs = lambda: []  # type: ignore[method-assign]
    return store


def _in_line(store: CheckpointStore, step: int, graph: dict, way: str) -> float:
    def writer(f) -> None:
        if way == "inline":
            state.save_graph(graph, _InlineOnly(f))
        else:
            state.save_graph(graph, f, blobs=f.blobs, one_rank=True)
    t = time.perf_counter()
    store.write(step, 0, 1, writer)
    return time.perf_counter() - t


def _behind(store: CheckpointStore, step: int, graph: dict, way: str) -> float:
    """Seconds the loop is held (the snapshot); the write follows, untimed."""
    t = time.perf_counter()
    if way == "inline":
        snap = background.Snapshot()
        state.save_graph(graph, _InlineOnly(snap))
    else:
        snap = background.Snapshot(store.reusable_blob_dirs())
        state.save_graph(graph, snap, one_rank=True)
    held = time.perf_counter() - t
    store.write(step, 0, 1, snap.write_to)
    return held


def _train(graph: dict) -> None:
    with torch.no_grad():
        graph["trained"].add_(0.01)
        graph["moment"].mul_(0.9).add_(0.1)
    graph["step"] += 1


def _through_store(base: Path, store_dir: Path, graph: dict, reuse: bool) -> tuple[float, int, float, int]:
    """Seconds and bytes of the second checkpoint's upload, then of its fetch onto the node that
    holds the first."""
    store = store_dir.as_uri()
    src = CheckpointTransfer(store, base / "src", reuse_blobs=reuse)
    dst = CheckpointTransfer(store, base / "dst", reuse_blobs=reuse)
    src.fence("job", 1)
    ckpts = CheckpointStore(base / "src" / "job", keep=2)
    _in_line(ckpts, 1, graph, "linked")
    src.upload("job", 1, ckpts.checkpoints()[0])
    dst.download("job")
    _train(graph)
    _in_line(ckpts, 2, graph, "linked")
    t = time.perf_counter()
    up = src.upload("job", 1, ckpts.checkpoints()[0])
    t_up = time.perf_counter() - t
    total = sum(f.stat().st_size for f in ckpts.checkpoints()[0].rglob("*") if f.is_file())
    t = time.perf_counter()
    linked = dst.download("job")
    t_down = time.perf_counter() - t
    return t_up, up.sent_bytes, t_down, total - linked


def _store_table(base: Path, store_base: Path, sizes: list[int], args: argparse.Namespace) -> None:
    print("through a store: the second checkpoint's upload, and its fetch onto a node holding the first")
    print(f"{'frozen':>8} {'way':>7} {'upload':>8} {'sent MB':>8} {'ratio':>7} {'fetch':>8} {'fetched MB':>11} {'ratio':>7}")
    for frozen_mb in sizes:
        graph = _graph(frozen_mb, args.trained, args.tensor_mb)
        got: dict[str, list[tuple[float, int, float, int]]] = {"whole": [], "reused": []}
        for rep in range(args.reps):
            for way in got:  # alternated, as above
                root, store = base / f"nodes-{frozen_mb}-{way}-{rep}", store_base / f"store-{frozen_mb}-{way}-{rep}"
                got[way].append(_through_store(root, store, graph, reuse=way == "reused"))
                shutil.rmtree(root, ignore_errors=True)
                shutil.rmtree(store, ignore_errors=True)
        med = {w: [statistics.median(r[i] for r in rows) for i in range(4)] for w, rows in got.items()}
        for way, (up, sent, down, fetched) in med.items():
            print(f"{frozen_mb:>5} MB {way:>7} {up:>8.3f} {sent / 2**20:>8.1f} {up / med['whole'][0]:>6.2f}x"
                  f" {down:>8.3f} {fetched / 2**20:>11.1f} {down / med['whole'][2]:>6.2f}x")
        print()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frozen", default="100,500", help="MB of frozen parameters, comma-separated")
    ap.add_argument("--trained", type=int, default=10, help="MB of trained parameters (and as much optimizer state)")
    ap.add_argument("--tensor-mb", type=int, default=32,
                    help="MB per frozen tensor (a 7B model's weight matrices are 32-90 MB in bf16)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", help="where to write (default: a temporary folder)")
    ap.add_argument("--tables", default="local", help="local (checkpoints on one node), store (moves through an"
                    " fsspec store), or both: local,store")
    ap.add_argument("--store-dir", help="where the store's folder goes (default: beside the checkpoints)")
    args = ap.parse_args(argv)
    tables = args.tables.split(",")
    if not tables or set(tables) - {"local", "store"}:
        ap.error(f"--tables {args.tables}: choose from local, store (comma-separated)")
    base = Path(args.dir or tempfile.mkdtemp(prefix="sg-frozen-"))
    print(f"folder {base}; frozen tensors of {args.tensor_mb} MB; trained {args.trained} MB (+ as much optimizer"
          f" state); {args.reps} reps; medians\n")
    sizes = [int(x) for x in args.frozen.split(",")]
    if "store" in tables:
        _store_table(base, Path(args.store_dir) if args.store_dir else base, sizes, args)
    if "local" in tables:
        print(f"{'frozen':>8} {'way':>7} {'in line 1st':>12} {'in line 2nd':>12} {'ratio':>7} {'snapshot 2nd':>13}"
              f" {'ratio':>7}")
    for frozen_mb in sizes if "local" in tables else []:
        graph = _graph(frozen_mb, args.trained, args.tensor_mb)
        first: dict[str, list[float]] = {w: [] for w in WAYS}
        second: dict[str, list[float]] = {w: [] for w in WAYS}
        held: dict[str, list[float]] = {w: [] for w in WAYS}
        for rep in range(args.reps):
            for way in WAYS:  # alternated, so the disk's moods fall on every way alike
                root = base / f"{frozen_mb}-{way}-{rep}"
                store = _store(root, way)
                first[way].append(_in_line(store, 1, graph, way))
                _train(graph)
                second[way].append(_in_line(store, 2, graph, way))
                _train(graph)
                held[way].append(_behind(store, 3, graph, way))
                shutil.rmtree(root, ignore_errors=True)
        med = {w: (statistics.median(first[w]), statistics.median(second[w]), statistics.median(held[w])) for w in WAYS}
        for way in WAYS:
            a, b, c = med[way]
            print(f"{frozen_mb:>5} MB {way:>7} {a:>12.3f} {b:>12.3f} {b / med['inline'][1]:>6.2f}x"
                  f" {c:>13.3f} {c / med['inline'][2]:>6.2f}x")
        print()
    if not args.dir:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
