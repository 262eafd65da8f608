"""Submit->running and print->SDK event latency on a LocalCluster, beside their floors.

    python bench/latency.py [--jobs 200] [--events 10000]

Submit->running: from the SDK's submit call to the worker process having been launched (its
``started`` event time), and to the job's first printed line arriving in the SDK, next to the time a bare ``python -c pass`` takes to spawn, measured
in the same run. Event latency: a worker prints ``time.time()`` on each line; the SDK's
WebSocket stream receives it; the difference is the latency (same clock, same machine).
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from singularity_sdk import EventType, LocalCluster


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def spawn_floor(n: int = 20) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.time()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        out.append(time.time() - t0)
    return out


def submit_to_running(client, n: int) -> tuple[list[float], list[float]]:
    """(submit -> worker process launched, submit -> first line of the job's output reached the SDK)."""
    started, first_line = [], []
    for _ in range(n):
        t0 = time.time()
        job = client.submit("print('up')")
        for ev in job.events():
            if ev.type == EventType.STARTED:
                started.append(ev.time - t0)
            if ev.type == EventType.LOG:
                first_line.append(time.time() - t0)
            if ev.type in (EventType.SUCCEEDED, EventType.FAILED):
                break
    return started, first_line


def event_latency(client, n: int) -> list[float]:
    code = (f"import time\nfor i in range({n}):\n    print(repr(time.time()), flush=True)\n"
            f"    if i % 10 == 9:\n        time.sleep(0.005)\n")
    job = client.submit(code)
    out = []
    for ev in job.events():
        if ev.data.get("stream") == "stdout":
            now = time.time()
            out += [now - float(line) for line in ev.lines]
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--jobs", type=int, default=200)
    p.add_argument("--events", type=int, default=10_000)
    args = p.parse_args()
    with LocalCluster(nodes=2, devices_per_node=2) as cluster, cluster.client() as client:
        client.submit("pass").wait(60)  # warm up
        floor = spawn_floor()
        s2r, s2out = submit_to_running(client, args.jobs)
        ev = event_latency(client, args.events)
    rows = [
        ("bare python spawn (floor)", floor, None),
        (f"submit -> running ({len(s2r)} jobs)", s2r, floor),
        ("submit -> first output line in SDK", s2out, floor),
        (f"print -> SDK event ({len(ev)} events)", ev, None),
    ]
    print(f"{'measure':<36} {'p50 ms':>9} {'p99 ms':>9} {'mean ms':>9} {'p50 / floor':>12}")
    for name, values, base in rows:
        ratio = f"{statistics.median(values) / statistics.median(base):.2f}x" if base else "-"
        print(f"{name:<36} {pct(values, 50) * 1e3:9.2f} {pct(values, 99) * 1e3:9.2f} "
              f"{statistics.mean(values) * 1e3:9.2f} {ratio:>12}")
    print(f"\nevent latency p99 target < 50 ms: {'met' if pct(ev, 99) < 0.05 else 'NOT met'}")


if __name__ == "__main__":
    main()
