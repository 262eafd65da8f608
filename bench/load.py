"""Many followers, chatty jobs: is every event delivered once and in order, and how late?

    python bench/load.py [--clients 100] [--jobs 20] [--lines 500] [--submits 200]

A LocalCluster with a device per job runs ``--jobs`` jobs that each print ``--lines`` lines as
fast as they can, each line carrying ``time.time()`` at the print. ``--clients`` followers
(``AsyncJob.follow``, all in one event loop, spread evenly over the jobs) receive them; for each
client the bench checks that the event numbers are 1, 2, 3, ... with no gap or repeat and that
every line arrived, and measures print -> client latency (same machine, same clock). The same
latency with one follower per job is printed beside it: the ratio is what fanning out to many
clients costs. Then ``--submits`` jobs are submitted back to back: submissions per second.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from singularity_sdk import EventType, LocalCluster


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def program(lines: int) -> str:
    return f"import time\nfor i in range({lines}):\n    print(repr(time.time()), flush=True)\n"


async def follow_all(cluster: LocalCluster, jobs: int, clients: int, lines: int) -> tuple[list[float], list[str]]:
    """Latencies of every line at every client, and what went wrong (gaps, repeats, lost lines)."""
    async with cluster.async_client() as submitter:
        submitted = [await submitter.submit(program(lines), name=f"load-{i}") for i in range(jobs)]
        latencies: list[float] = []
        problems: list[str] = []

        async def one_client(k: int) -> None:
            async with cluster.async_client() as client:
                job = await client.get(submitted[k % jobs].id)
                seqs, got = [], 0
                async for batch in job.follow(tick_s=0.5, batch_s=0.0):
                    now = time.time()
                    for ev in batch:
                        seqs.append(ev.seq)
                        if ev.type == EventType.LOG and ev.data.get("stream") == "stdout":
                            got += 1
                            latencies.append(now - float(ev.data["line"]))
                if seqs != list(range(1, len(seqs) + 1)):
                    problems.append(f"client {k}: events not 1..n once each")
                if got != lines:
                    problems.append(f"client {k}: {got} of {lines} lines")

        await asyncio.gather(*(one_client(k) for k in range(clients)))
        return latencies, problems


async def submissions(cluster: LocalCluster, n: int) -> float:
    async with cluster.async_client() as client:
        t0 = time.perf_counter()
        for i in range(n):
            await client.submit("1", name=f"s{i}")
        return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--jobs", type=int, default=20)
    ap.add_argument("--lines", type=int, default=500)
    ap.add_argument("--submits", type=int, default=200)
    args = ap.parse_args()
    with LocalCluster(nodes=2, devices_per_node=(args.jobs + 1) // 2, env={"SINGULARITY_PIN_CPU_SLOTS": "0"}) as cluster:
        base, base_problems = asyncio.run(follow_all(cluster, args.jobs, args.jobs, args.lines))
        many, problems = asyncio.run(follow_all(cluster, args.jobs, args.clients, args.lines))
        rate = asyncio.run(submissions(cluster, args.submits))
    print(f"{args.jobs} jobs x {args.lines} lines; latency print -> client, ms")
    print(f"{'followers':>10} {'events':>8} {'p50':>8} {'p99':>8} {'max':>8} {'lost/dup':>9}")
    for n, lat, bad in ((args.jobs, base, base_problems), (args.clients, many, problems)):
        print(f"{n:>10} {len(lat):>8} {statistics.median(lat) * 1e3:>8.1f} {pct(lat, 99) * 1e3:>8.1f} "
              f"{max(lat) * 1e3:>8.1f} {len(bad):>9}")
    print(f"p99 ratio {args.clients} followers / {args.jobs}: {pct(many, 99) / pct(base, 99):.2f}x")
    print(f"submissions: {rate:.0f}/s ({args.submits} back to back, one client)")
    for line in (base_problems + problems)[:10]:
        print("PROBLEM:", line)


if __name__ == "__main__":
    main()
