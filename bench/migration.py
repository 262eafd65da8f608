"""Migration latency across two nodes for ~10 MB, 100 MB and 1 GB of state, split by phase,
beside the disk's own time for the same bytes, measured in the same run.

    python bench/migration.py [--sizes 10,100,1000] [--reps 5] [--modes shared,store] [--quick] [--store-dir DIR]

Two LocalClusters of 2 nodes x 1 device, one after the other:

* ``shared``: the default; both node agents use one checkpoint folder, so nothing is transferred;
* ``store``: ``LocalCluster(..., store="file://<tmp>/store")``: each node has its own checkpoint
  cache and checkpoints go through an fsspec store: the source agent streams each rank file to the
  store while the worker writes it and finishes the upload once it commits, before reporting it
  (``upload_s`` in the ``checkpointed`` event: what was left after the commit), the target agent
  copies the bytes as they arrive in the store and finishes the fetch before starting the worker;
* ``serial``: the same with streaming off (``SINGULARITY_STORE_STREAM=0``, the default) and no
  prefetch (``SINGULARITY_STORE_PREFETCH=0``): the whole upload starts at the commit and the
  destination fetches only when the job starts there, for a side-by-side comparison in one run;
* ``prefetch``: no streaming, but the destination copies the checkpoint as the upload puts it in
  the store (the default configuration); ``stream``: streaming without prefetch; ``store``: both.

The job is the one of ``bench/checkpoint.py`` (``size`` MB of float32 tensors, then a loop that
prints a line every ~10 ms); in a ``MODE+frozen`` mode its tensors are frozen parameters, as a
fine-tuning job's weights: the first migration writes and moves them, later ones link them on
disk and in the store, and the disk columns then stand for the whole state's bytes. It is migrated ``--reps`` times, alternately node-1 -> node-2 and
node-2 -> node-1 (``job.migrate(other)``). Phases, from the events:

  safe point  ``migrating`` (request) -> ``checkpoint_started`` (includes server -> agent -> worker)
  write       the worker's write time (``checkpointed.seconds``: pickle, sha256, fsync, commit)
  upload      ``checkpointed.upload_s`` (store mode; zero with a shared folder)
  handover    the rest until ``scheduled`` on the target: worker exit, server settles, places
  fetch+spawn ``scheduled`` -> ``started`` (the target agent downloads the checkpoint, store mode,
              then launches the worker)
  restore     ``started`` -> ``resumed`` (start-up, sha256 verify) -> first printed line (load, first
              iteration)
  total       ``migrating`` -> the first line printed on the target

Disk: write + fsync and read of the checkpoint's byte count in the cluster's checkpoint folder (see
bench/checkpoint.py for how), just before and just after each migration; the faster counts. The fixed cost is what the smallest size takes beyond its disk time;
"bound" = 1.5 x (disk write + read) + fixed, i.e. "bounded by bytes moved".
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint import (MB, Collector, best, disk_free_gb, disk_time, fmt_s, job_source,  # noqa: E402
                        med, print_table, restart_point, stop_point)

from backend.agent.prefetch import PREFETCH_ENV  # noqa: E402
from backend.agent.transfer import STREAM_ENV  # noqa: E402
from singularity_sdk import EventType, LocalCluster  # noqa: E402


def node_of(job: Any) -> str:
    return job.refresh().info.placement[0].node


def measure_size(client: Any, disk_folder: Path, size_mb: int, reps: int, frozen: bool = False) -> list[dict[str, float]]:
    job = client.submit(job_source(size_mb, frozen=frozen), name=f"mig-{size_mb}MB", filename="state.py")
    c = Collector(job)
    rows: list[dict[str, float]] = []
    try:
        c.step_line(0, timeout=600)
        nbytes = size_mb * MB
        for _ in range(reps):
            disk_before = disk_time(disk_folder, nbytes)
            src = node_of(job)
            dst = "node-2" if src == "node-1" else "node-1"
            since = c.last_seq
            job.migrate(dst, timeout=600)
            req = c.first(EventType.MIGRATING, since)
            sp = stop_point(c, req.seq)
            rp = restart_point(c, sp["done_seq"])
            moved = c.first(EventType.MIGRATED, req.seq)
            nbytes = max(sp["bytes"], size_mb * MB)  # what was written, or (blobs linked) the whole state
            disk = best(disk_before, disk_time(disk_folder, nbytes))
            ready_t = sp["started_t"] + sp["write_s"] + sp["upload_s"]
            rows.append({
                "bytes": sp["bytes"], "safe": sp["started_t"] - req.time, "wait_s": sp["wait_s"],
                "write": sp["write_s"], "upload": sp["upload_s"], "handover": rp["sched_t"] - ready_t,
                "fetch": rp["started_t"] - rp["sched_t"],
                "transfer": sp["upload_s"] + rp["started_t"] - rp["sched_t"],
                "disk_wr": disk["write"] + disk["read"], "to_resumed": rp["resumed_t"] - rp["started_t"],
                "to_line": rp["line_t"] - rp["resumed_t"], "total": rp["line_t"] - req.time,
                "migrated_s": float(moved.data.get("seconds") or 0),
                "disk_write": disk["write"], "disk_read": disk["read"], "disk_cold": disk["cold"],
                "route": f"{src}->{rp['node'] or dst}", "prefetched": rp["prefetched"] / max(1, sp["bytes"]),
            })
            r = rows[-1]
            print(f"  {size_mb} MB {r['route']}: total {r['total']:.3f} s (write {r['write']:.3f}, upload "
                  f"{r['upload']:.3f}, fetch+spawn {r['fetch']:.3f}, restore "
                  f"{r['to_resumed'] + r['to_line']:.3f}, {r['prefetched']:.0%} prefetched); "
                  f"disk write {disk['write']:.3f} read {disk['read']:.3f}",
                  flush=True)
    finally:
        try:
            job.cancel()
        except Exception:  # noqa: BLE001 - already ended
            pass
    return rows


#: the store modes: whether the source streams its upload during the write, whether the destination
#: copies the checkpoint as it arrives
STORE_MODES = {"serial": (False, False), "prefetch": (False, True), "stream": (True, False), "store": (True, True)}


def run_mode(mode: str, sizes: list[int], reps: int, tmp: Path, store_root: Path) -> list[dict[str, Any]]:
    store: Optional[str] = None
    base, _, state = mode.partition("+")
    if base in STORE_MODES:
        store = (store_root / mode).as_uri()
    streams, prefetches = STORE_MODES.get(base, (False, False))
    os.environ[STREAM_ENV] = "1" if streams else "0"  # the cluster's agents inherit them
    os.environ[PREFETCH_ENV] = "1" if prefetches else "0"
    with LocalCluster(nodes=2, devices_per_node=1, store=store) as cluster, cluster.client() as client:
        folder = (cluster.home / "agents" / "node-1" / "checkpoint-cache") if store else cluster.home / "checkpoints"
        folder.mkdir(parents=True, exist_ok=True)
        print(f"[{mode}] {'store ' + store + ', ' if store else ''}disk baseline in {folder}", flush=True)
        return [{"mode": mode, "size": s, "rows": measure_size(client, folder, s, reps, frozen=state == "frozen")}
                for s in sizes]


def report(results: list[dict[str, Any]]) -> None:
    print("\nmedians over the migrations (node-1 <-> node-2, alternating); times in seconds; "
          "disk = write+fsync and read of the same bytes, same run\n")
    head = [("mode", 15), ("size", 7), ("safe pt", 7), ("write", 6), ("upload", 6), ("handover", 8),
            ("fetch+spawn", 11), ("start->resumed", 14), ("resumed->line", 13), ("total", 6),
            ("(migrated)", 10), ("disk w+r", 8), ("total/disk", 10)]
    rows = []
    for r in results:
        x = r["rows"]
        disk = med(x, "disk_wr")
        rows.append([r["mode"], f"{r['size']} MB", fmt_s(med(x, "safe")), fmt_s(med(x, "write")),
                     fmt_s(med(x, "upload")), fmt_s(med(x, "handover")), fmt_s(med(x, "fetch")),
                     fmt_s(med(x, "to_resumed")), fmt_s(med(x, "to_line")), fmt_s(med(x, "total")),
                     fmt_s(med(x, "migrated_s")), fmt_s(disk), f"{med(x, 'total') / disk:.1f}x"])
    print_table("migration: request -> first new iteration on the target", head, rows)
    head = [("mode", 15), ("size", 7), ("bytes", 11), ("write/disk w", 12), ("transfer", 8),
            ("transfer/disk w+r", 17), ("total", 6), ("fixed", 6), ("bound", 6), ("", 6)]
    rows = []
    fixed: dict[str, float] = {}
    for r in results:
        x = r["rows"]
        disk = med(x, "disk_wr")
        fixed.setdefault(r["mode"], med(x, "total") - disk)  # the smallest size comes first
        transfer = med(x, "transfer")
        bound = 1.5 * disk + fixed[r["mode"]]
        rows.append([r["mode"], f"{r['size']} MB", f"{int(med(x, 'bytes')):,}",
                     f"{med(x, 'write') / med(x, 'disk_write'):.2f}x", fmt_s(transfer), f"{transfer / disk:.2f}x",
                     fmt_s(med(x, "total")), fmt_s(fixed[r["mode"]]), fmt_s(bound),
                     "met" if med(x, "total") <= bound else "MISSED"])
    print_table("bounded by bytes moved? transfer = upload + fetch+spawn; fixed = smallest size's total minus its "
                "disk time; bound = 1.5 x disk w+r + fixed", head, rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="10,100,1000", help="state sizes in MB, comma-separated (smallest first)")
    p.add_argument("--reps", type=int, default=5, help="migrations per size and mode")
    p.add_argument("--modes", default="shared,serial,store",
                   help="shared (one checkpoint folder); through an fsspec file:// store: serial (upload after the "
                        "commit, fetch at the start), prefetch (the destination copies as the upload arrives), "
                        "stream (the upload streams during the write), store (both); MODE+frozen: the job's state "
                        "is frozen parameters (a fine-tuning job), so unchanged blobs are linked and not sent again")
    p.add_argument("--quick", action="store_true", help="10 and 100 MB, one migration each")
    p.add_argument("--store-dir", type=Path, default=None,
                   help="where the store modes' store lives (default: beside the caches, on their disk); a folder "
                        "on another device, such as a tmpfs, stands in for a store that does not share the cache's disk")
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.quick:
        sizes, args.reps = [s for s in sizes if s <= 100] or [10], 1
    modes = [m for m in args.modes.split(",") if m]
    valid = ["shared", *STORE_MODES]
    for m in modes:
        base, _, state = m.partition("+")
        if base not in valid or state not in ("", "frozen"):
            p.error(f"--modes: {m!r} is not one of {', '.join(valid)} (each may end in +frozen)")
    t0 = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="bench-migration-"))
    store_root = Path(tempfile.mkdtemp(prefix="bench-migration-store-", dir=args.store_dir)) if args.store_dir else tmp
    try:
        need = 8 * max(sizes) * MB / 1e9 + 1  # store mode: source cache, store, target cache, 2 kept each
        if disk_free_gb(tmp) < need:
            sys.exit(f"{tmp}: {disk_free_gb(tmp):.1f} GB free, {need:.1f} GB needed for {max(sizes)} MB; use --sizes")
        results = []
        for mode in modes:
            results += run_mode(mode, sizes, args.reps, tmp, store_root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(store_root, ignore_errors=True)
    report(results)
    print(f"({time.monotonic() - t0:.0f} s in all; load average now {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
