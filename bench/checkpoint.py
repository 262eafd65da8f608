"""Checkpoint (preempt) and restore (resume) latency for ~10 MB, 100 MB and 1 GB of state,
beside the disk's own sequential write and read time for the same bytes, measured in the same run.

    python bench/checkpoint.py [--sizes 10,100,1000] [--reps 5] [--quick] [--device cuda]

A job on a 1-node LocalCluster builds a namespace of ``size`` MB of float32 tensors (16 MiB each)
and then loops: a tiny update, ``print``, sleep 10 ms. Each repetition preempts it (``job.preempt()``)
and resumes it (``job.resume()``), then writes and reads back the same number of bytes as its
checkpoint in the cluster's checkpoint folder (same filesystem), with fsync. With ``--device cuda``
the tensors live on the GPU, and the disk's write time counts the device -> host copy of the same
bytes into page-locked memory too (the fastest copy there is, timed in this process).

Preempt: ``preempting`` (request) -> ``preempted`` (all ranks exited, devices freed), split by the
events in between: to the safe point (``checkpoint_started``; includes server -> agent -> worker
delivery; the worker's own ``wait_s`` in brackets), writing (``checkpointed``), worker exit
(``worker_exited``) and the server settling it (``preempted``).

Restore: ``scheduled`` (placement of the new attempt) -> the first line the resumed loop prints,
split into agent start (``started``: worker process launched), ``started`` -> ``resumed`` (the
worker's start-up and checking the checkpoint's manifest: it sends ``resumed`` once
``CheckpointStore.latest()`` has verified it, before loading it) and ``resumed`` -> first line
(loading it, walking back into the loop, the first iteration; and ``import
torch`` wherever the worker has not imported it yet). While the job is preempted, a fresh process
times the restore's own steps one by one on the same checkpoint (``import torch``, verify,
loading the rank file): the "anatomy" table.

Disk: ``write`` = write + fsync of the file; ``read`` = reading it back right after (page cache
warm, as it is for the restore, which reads the checkpoint just written); ``cold`` = reading it
again after ``posix_fadvise(DONTNEED)`` dropped its pages. This VM's disk varies a lot from one
second to the next (1 GB + fsync in 0.4 s to 2.7 s), so it is measured just before each preempt
and again just after each resume, and the faster of the two counts (the ratios are conservative). The fixed cost is what the smallest
size takes beyond its disk time; the target is ``total <= 1.5 x disk + fixed``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from singularity_sdk import EventType, LocalCluster  # noqa: E402

MB = 1_000_000
CHUNK = 16 << 20

JOB = '''\
import time
import torch
torch.manual_seed(0)
left = {nbytes} // 4
state = []
while left > 0:
    n = min(left, {chunk} // 4)
    state.append({wrap_open}torch.rand(n, device="{device}"){wrap_close})
    left -= n
w = torch.zeros(1024, device="{device}")
for step in range(10_000_000):
    w += state[step % len(state)][:1024]
    print(f"step {{step}} {{time.time():.6f}}", flush=True)
    time.sleep(0.01)
'''


def job_source(size_mb: int, device: str = "cpu", frozen: bool = False) -> str:
    """The job: ``size_mb`` of tensors it reads every step; ``frozen``: as frozen parameters
    (``requires_grad=False``), the weights of a fine-tuning job, which checkpoints keep in blobs."""
    wrap = ("torch.nn.Parameter(", ", requires_grad=False)") if frozen else ("", "")
    return JOB.format(nbytes=size_mb * MB, chunk=CHUNK, device=device, wrap_open=wrap[0], wrap_close=wrap[1])


def device_to_host_s(nbytes: int, reps: int = 3) -> float:
    """Median time to copy ``nbytes`` from the GPU into reused page-locked host memory."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    del src, dst
    torch.cuda.empty_cache()
    return statistics.median(times)


# --------------------------------------------------------------------------- events
class Collector:
    """Follows a job's events on a thread; the main thread waits for the ones it needs."""

    def __init__(self, job: Any) -> None:
        self.job = job
        self.events: list[Any] = []
        self.cond = threading.Condition()
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for ev in self.job.events():
                with self.cond:
                    self.events.append(ev)
                    self.cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - reported to the waiting thread
            self.error = e
        finally:
            with self.cond:
                self.cond.notify_all()

    @property
    def last_seq(self) -> int:
        with self.cond:
            return self.events[-1].seq if self.events else 0

    def wait(self, pred: Callable[[Any], bool], after: int = 0, timeout: float = 300) -> Any:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for ev in self.events:
                    if ev.seq > after and pred(ev):
                        return ev
                if self.error is not None:
                    raise RuntimeError(f"event stream failed: {self.error!r}")
                if not self.thread.is_alive():
                    raise RuntimeError(f"job {self.job.id} ended before the awaited event; last: "
                                       f"{[e.type.value for e in self.events[-8:]]}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"job {self.job.id}: no awaited event within {timeout}s; last: "
                                       f"{[e.type.value for e in self.events[-8:]]}")
                self.cond.wait(left)

    def first(self, etype: EventType, after: int, timeout: float = 300) -> Any:
        return self.wait(lambda e: e.type == etype, after, timeout)

    def step_line(self, after: int, timeout: float = 300) -> Any:
        return self.wait(lambda e: e.data.get("stream") == "stdout"
                         and any(line.startswith("step ") for line in e.lines), after, timeout)


def stop_point(c: Collector, since: int) -> dict[str, float]:
    """Split of one stop (preempt or the source half of a migration) from the events after ``since``."""
    started = c.first(EventType.CHECKPOINT_STARTED, since)
    done = c.first(EventType.CHECKPOINTED, started.seq)
    exited = c.first(EventType.WORKER_EXITED, started.seq)
    return {"started_t": started.time, "done_t": done.time, "exited_t": exited.time,
            "wait_s": float(done.data.get("wait_s", 0)), "write_s": float(done.data.get("seconds", 0)),
            "upload_s": float(done.data.get("upload_s", 0) or 0), "bytes": int(done.data.get("bytes", 0)),
            "done_seq": done.seq, "exited_seq": exited.seq}


def restart_point(c: Collector, since: int) -> dict[str, float]:
    """Split of one restore from the events after ``since`` (placement of the new attempt on)."""
    sched = c.first(EventType.SCHEDULED, since)
    started = c.first(EventType.STARTED, sched.seq)
    resumed = c.first(EventType.RESUMED, started.seq)
    line = c.step_line(resumed.seq)
    return {"sched_t": sched.time, "started_t": started.time, "resumed_t": resumed.time, "line_t": line.time,
            "node": str(resumed.data.get("node", "")), "line_seq": line.seq,
            # through a store: the bytes the destination copied before the checkpoint was complete
            "prefetched": float(started.data.get("prefetched_bytes") or 0)}


# --------------------------------------------------------------------------- the disk's own time
def read_time(path: Path) -> float:
    """Seconds to read ``path`` through, 16 MiB at a time into one reused buffer."""
    into = bytearray(CHUNK)
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(into):
            pass
    return time.perf_counter() - t


def drop_cache(path: Path) -> None:
    """Drop ``path``'s pages from the page cache, so the next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def disk_time(folder: Path, nbytes: int) -> dict[str, float]:
    """Sequential write (+fsync) and read of ``nbytes`` in ``folder``; the file is removed after."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f".disk-baseline-{os.getpid()}.bin"
    buf = memoryview(os.urandom(CHUNK))
    try:
        t = time.perf_counter()
        with open(path, "wb") as f:
            left = nbytes
            while left > 0:
                left -= f.write(buf[:min(left, CHUNK)])
            f.flush()
            os.fsync(f.fileno())
        write = time.perf_counter() - t
        warm = read_time(path)
        drop_cache(path)
        cold = read_time(path)
    finally:
        path.unlink(missing_ok=True)
    return {"write": write, "read": warm, "cold": cold}


ANATOMY = r"""
import json, sys, time
t = time.perf_counter()
import torch
t_import = time.perf_counter() - t
from backend.proxy.engine.state import _read_graph
from backend.proxy.checkpoint.store import CheckpointStore
t = time.perf_counter()
ref = CheckpointStore(sys.argv[1]).latest()
t_verify = time.perf_counter() - t
t = time.perf_counter()
graph = _read_graph(ref.rank_file(0), ref.blob_dir)
t_load = time.perf_counter() - t
print(json.dumps({"import_torch": t_import, "verify": t_verify, "load": t_load}))
"""


def restore_anatomy(job_root: Path) -> dict[str, float]:
    """In a fresh process, what the restore does with the newest checkpoint under ``job_root``, timed
    one by one: ``import torch``, verifying the checkpoint (``CheckpointStore.latest``: sizes for one
    rank, whose digest is checked while it loads), and
    loading the rank file (``state._read_graph``)."""
    import json

    out = subprocess.run([sys.executable, "-c", ANATOMY, str(job_root)], check=True, cwd=ROOT,
                         capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def best(*runs: dict[str, float]) -> dict[str, float]:
    """The disk's capacity at the time: the fastest of several baseline runs, per figure."""
    return {k: min(r[k] for r in runs) for k in runs[0]}


def start_floor(n: int = 5) -> dict[str, float]:
    """Median time to spawn ``python -c 'import torch'`` and ``python -c 'import backend.proxy'``."""
    out = {}
    for name, code in (("python -c pass", "pass"), ("python -c 'import torch'", "import torch"),
                       ("python -c 'import backend.proxy'", "import backend.proxy")):
        times = []
        for _ in range(n):
            t = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
            times.append(time.perf_counter() - t)
        out[name] = statistics.median(times)
    return out


def med(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def fmt_s(x: float) -> str:
    return f"{round(x, 3) + 0.0:.3f}"  # no "-0.000"


def print_table(title: str, header: list[tuple[str, int]], rows: list[list[str]]) -> None:
    print(title)
    print("  ".join(f"{h:>{w}}" for h, w in header))
    for r in rows:
        print("  ".join(f"{v:>{w}}" for v, (_h, w) in zip(r, header)))
    print()


def disk_free_gb(folder: Path) -> float:
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize / 1e9


# --------------------------------------------------------------------------- the measurement
def measure_size(client: Any, ckpt_folder: Path, size_mb: int, reps: int, device: str = "cpu") -> dict[str, Any]:
    d2h = device_to_host_s(size_mb * MB) if device == "cuda" else 0.0
    job = client.submit(job_source(size_mb, device), name=f"ckpt-{size_mb}MB", filename="state.py")
    c = Collector(job)
    rows: list[dict[str, float]] = []
    try:
        c.step_line(0, timeout=600)
        nbytes = size_mb * MB
        for _ in range(reps):
            disk_before = disk_time(ckpt_folder, nbytes)
            since = c.last_seq
            job.preempt(timeout=600)
            req = c.first(EventType.PREEMPTING, since)
            sp = stop_point(c, req.seq)
            pre = c.first(EventType.PREEMPTED, sp["exited_seq"] - 1)
            anat = restore_anatomy(ckpt_folder / job.id)  # while preempted: nothing else runs
            since = c.last_seq
            job.resume()
            rp = restart_point(c, since)
            nbytes = sp["bytes"]
            disk = best(disk_before, disk_time(ckpt_folder, nbytes))
            disk["write"] += d2h
            rows.append({
                "bytes": sp["bytes"], "wait_s": sp["wait_s"], "write_s": sp["write_s"],
                "to_safe": sp["started_t"] - req.time, "write": sp["done_t"] - sp["started_t"],
                "exit": sp["exited_t"] - sp["done_t"], "report": pre.time - sp["exited_t"],
                "stop_total": pre.time - req.time,
                "agent_start": rp["started_t"] - rp["sched_t"], "to_resumed": rp["resumed_t"] - rp["started_t"],
                "to_line": rp["line_t"] - rp["resumed_t"], "restore_total": rp["line_t"] - rp["sched_t"],
                "disk_write": disk["write"], "disk_read": disk["read"], "disk_cold": disk["cold"],
                "a_import": anat["import_torch"], "a_verify": anat["verify"], "a_load": anat["load"],
            })
            print(f"  {size_mb} MB rep {len(rows)}: preempt {rows[-1]['stop_total']:.3f} s "
                  f"(disk write {disk['write']:.3f} s), restore {rows[-1]['restore_total']:.3f} s "
                  f"(disk read {disk['read']:.3f} s, cold {disk['cold']:.3f} s)", flush=True)
    finally:
        try:
            job.cancel()
        except Exception:  # noqa: BLE001 - already ended
            pass
    return {"size": size_mb, "rows": rows}


def report(results: list[dict], floor: dict[str, float]) -> None:
    print("\nmedians over the repetitions; times in seconds; disk = the same bytes, same filesystem, same run\n")
    head = [("size", 7), ("bytes", 11), ("to safe pt", 10), ("(wait_s)", 8), ("write", 7), ("exit", 6),
            ("report", 6), ("total", 7), ("disk write", 10), ("total/disk", 10), ("write/disk", 10)]
    rows = []
    for r in results:
        x = r["rows"]
        rows.append([f"{r['size']} MB", f"{int(med(x, 'bytes')):,}", fmt_s(med(x, "to_safe")), fmt_s(med(x, "wait_s")),
                     fmt_s(med(x, "write")), fmt_s(med(x, "exit")), fmt_s(med(x, "report")),
                     fmt_s(med(x, "stop_total")), fmt_s(med(x, "disk_write")),
                     f"{med(x, 'stop_total') / med(x, 'disk_write'):.2f}x",
                     f"{med(x, 'write') / med(x, 'disk_write'):.2f}x"])
    print_table("preempt: request -> devices freed", head, rows)
    head = [("size", 7), ("agent start", 11), ("start->resumed", 14), ("resumed->line", 13), ("total", 7),
            ("disk read", 9), ("(cold)", 7), ("total/read", 10), ("total/cold", 10)]
    rows = []
    for r in results:
        x = r["rows"]
        rows.append([f"{r['size']} MB", fmt_s(med(x, "agent_start")), fmt_s(med(x, "to_resumed")),
                     fmt_s(med(x, "to_line")), fmt_s(med(x, "restore_total")), fmt_s(med(x, "disk_read")),
                     fmt_s(med(x, "disk_cold")), f"{med(x, 'restore_total') / med(x, 'disk_read'):.1f}x",
                     f"{med(x, 'restore_total') / med(x, 'disk_cold'):.1f}x"])
    print_table("restore: placement -> first new iteration", head, rows)
    head = [("size", 7), ("import torch", 12), ("verify", 13), ("load", 10), ("sum", 6),
            ("restore total", 13), ("verify/read", 11), ("load/read", 9)]
    rows = []
    for r in results:
        x = r["rows"]
        parts = med(x, "a_import") + med(x, "a_verify") + med(x, "a_load")
        rows.append([f"{r['size']} MB", fmt_s(med(x, "a_import")), fmt_s(med(x, "a_verify")), fmt_s(med(x, "a_load")),
                     fmt_s(parts), fmt_s(med(x, "restore_total")),
                     f"{med(x, 'a_verify') / med(x, 'disk_read'):.1f}x", f"{med(x, 'a_load') / med(x, 'disk_read'):.1f}x"])
    print_table("restore anatomy: the same steps timed one by one in a fresh process, on the same checkpoint",
                head, rows)
    print("start-up floor (same run): " + ", ".join(f"{k} {v:.3f} s" for k, v in floor.items()))
    base = results[0]["rows"]
    fixed_stop = med(base, "stop_total") - med(base, "disk_write")
    fixed_restore = med(base, "restore_total") - med(base, "disk_read")
    print(f"fixed cost, from the {results[0]['size']} MB case minus its disk time: preempt {fixed_stop:.3f} s, "
          f"restore {fixed_restore:.3f} s\n")
    head = [("size", 7), ("preempt", 8), ("1.5 x write + fixed", 19), ("", 7), ("restore", 8),
            ("1.5 x read + fixed", 18), ("(cold)", 18), ("", 7)]
    rows = []
    for r in results:
        x = r["rows"]
        bound_s = 1.5 * med(x, "disk_write") + fixed_stop
        bound_r = 1.5 * med(x, "disk_read") + fixed_restore
        bound_c = 1.5 * med(x, "disk_cold") + fixed_restore
        rows.append([f"{r['size']} MB", fmt_s(med(x, "stop_total")), fmt_s(bound_s),
                     "met" if med(x, "stop_total") <= bound_s else "MISSED",
                     fmt_s(med(x, "restore_total")), fmt_s(bound_r), fmt_s(bound_c),
                     "met" if med(x, "restore_total") <= bound_r else "MISSED"])
    print_table("target: within 1.5x the disk time plus the fixed cost (restore judged against the warm read)",
                head, rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="10,100,1000", help="state sizes in MB, comma-separated (smallest first)")
    p.add_argument("--reps", type=int, default=5, help="preempt/resume cycles per size")
    p.add_argument("--quick", action="store_true", help="10 and 100 MB, one cycle each")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the job's tensors live")
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.quick:
        sizes, args.reps = [s for s in sizes if s <= 100] or [10], 1
    t0 = time.monotonic()
    with LocalCluster(nodes=1, devices_per_node=1) as cluster, cluster.client() as client:
        ckpt = cluster.home / "checkpoints"
        ckpt.mkdir(parents=True, exist_ok=True)
        need = 3 * max(sizes) * MB / 1e9 + 1
        free = disk_free_gb(ckpt)
        if free < need:
            sys.exit(f"{ckpt}: {free:.1f} GB free, {need:.1f} GB needed for {max(sizes)} MB; use --sizes")
        print(f"checkpoint folder {ckpt} ({free:.0f} GB free); sizes {sizes} MB, {args.reps} cycles each", flush=True)
        floor = start_floor()
        results = [measure_size(client, ckpt, s, args.reps, args.device) for s in sizes]
    report(results, floor)
    print(f"({time.monotonic() - t0:.0f} s in all; load average now {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
