"""Loading a rank file with one reading thread against several, side by side in one run.

    python bench/restore_read.py [--size 1000] [--reps 5]

Writes one rank file of ``size`` MB of float32 tensors (16 MiB each, as bench/checkpoint.py's
job holds them) the way the engine does (`dedup.dump`), then loads it ``reps`` times each way,
alternating, every load in a fresh process (a restore fills fresh memory) through the engine's
own reader (`state._read_graph`, digest checked as it reads):

* ``one thread``: `reading.MAX_THREADS` = 1, every storage read by the unpickler's thread, as before;
* ``parallel``: the default, large reads split across threads (`reading.ParallelReads`).

``warm`` loads right after a read of the whole file; ``cold`` after ``posix_fadvise(DONTNEED)``
dropped it from the page cache. ``disk`` is a plain read of the same file into one reused
16 MiB buffer (no fresh memory, no unpickling), measured the same way in the same run.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from checkpoint import CHUNK, MB, drop_cache, read_time  # noqa: E402  (bench/checkpoint.py)

MAKE = '''
import os, sys, torch
sys.path.insert(0, {root!r})
from backend.proxy.checkpoint import dedup
torch.manual_seed(0)
left, state = {nbytes} // 4, []
while left > 0:
    n = min(left, {chunk} // 4)
    state.append(torch.rand(n))
    left -= n
with open({path!r}, "wb") as f:
    dedup.dump({{"state": state}}, f, None, protocol=5)
    f.flush()
    os.fsync(f.fileno())
'''

LOAD = '''
import sys, time
sys.path.insert(0, {root!r})
from pathlib import Path
import torch
from backend.proxy.checkpoint import digest, reading
from backend.proxy.engine import state
if {one_thread}:
    reading.MAX_THREADS = 1
t = time.perf_counter()
graph = state._read_graph(Path({path!r}), Path({path!r} + ".no-blobs"), (digest.NAME, {expected!r}))
print(time.perf_counter() - t)
assert sum(s.numel() for s in graph["state"]) * 4 >= {nbytes}
'''


def load(path: Path, expected: str, nbytes: int, one_thread: bool) -> float:
    code = LOAD.format(root=str(ROOT), path=str(path), expected=expected, nbytes=nbytes, one_thread=one_thread)
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=1000, help="MB of tensors in the rank file")
    p.add_argument("--reps", type=int, default=5, help="loads per way and cache state")
    args = p.parse_args()
    from backend.proxy.checkpoint import digest

    nbytes = args.size * MB
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-restore-read-") as tmp:
        path = Path(tmp) / "rank-0.pt"
        subprocess.run([sys.executable, "-c", MAKE.format(root=str(ROOT), nbytes=nbytes, chunk=CHUNK, path=str(path))],
                       check=True)
        expected = digest.of_file(path)
        times: dict[tuple[str, str], list[float]] = {}
        for rep in range(args.reps):
            for way in ("one thread", "parallel"):
                for cache in ("warm", "cold"):
                    if cache == "cold":
                        drop_cache(path)
                    else:
                        read_time(path)
                    times.setdefault((way, cache), []).append(load(path, expected, nbytes, way == "one thread"))
            read_time(path)
            times.setdefault(("disk", "warm"), []).append(read_time(path))
            drop_cache(path)
            times.setdefault(("disk", "cold"), []).append(read_time(path))
            print(f"rep {rep + 1}/{args.reps}: " + ", ".join(f"{w} {c} {v[-1]:.3f}" for (w, c), v in times.items()),
                  flush=True)
        size = path.stat().st_size
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\nloading a {size:,}-byte rank file in a fresh process; medians of {args.reps}, seconds "
          f"(min-max); {os.cpu_count()} CPUs\n")
    print(f"{'way':<12}{'warm':>22}{'cold':>22}{'warm/disk':>11}{'cold/disk':>11}")
    for way in ("one thread", "parallel", "disk"):
        cells = [f"{med[(way, c)]:.3f} ({min(times[(way, c)]):.3f}-{max(times[(way, c)]):.3f})" for c in ("warm", "cold")]
        print(f"{way:<12}{cells[0]:>22}{cells[1]:>22}"
              f"{med[(way, 'warm')] / med[('disk', 'warm')]:>10.1f}x{med[(way, 'cold')] / med[('disk', 'cold')]:>10.1f}x")
    print(f"\nparallel / one thread: warm {med[('parallel', 'warm')] / med[('one thread', 'warm')]:.2f}x, "
          f"cold {med[('parallel', 'cold')] / med[('one thread', 'cold')]:.2f}x")
    print(f"({time.monotonic() - t0:.0f} s in all; load average now {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
