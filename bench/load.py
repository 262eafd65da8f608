"""Many followers, chatty jobs: is every event delivered once and in order, and how late?

    python bench/load.py [--clients 100] [--jobs 20] [--lines 500] [--submits 200] [--pause-ms 0]

A LocalCluster with a device per job runs ``--jobs`` jobs that each print ``--lines`` lines as
fast as they can (or pausing ``--pause-ms`` after every 10), each line carrying ``time.time()``
at the print. The jobs start printing together, ``--connect-s`` after the submissions, by which
time every follower is subscribed (the bench checks it and says so otherwise): a line printed
before its follower connected would measure the client's connection, not the event path. "lines/s" is every client's lines together over the run's duration. ``--clients`` followers
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
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from processes import until_workers_fork  # noqa: E402

from singularity_sdk import LocalCluster  # noqa: E402


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def program(lines: int, pause_ms: float, start_at: float) -> str:
    pause = f"    if i % 10 == 9:\n        time.sleep({pause_ms / 1000})\n" if pause_ms else ""
    return (f"import time\ntime.sleep(max(0.0, {start_at!r} - time.time()))\n"
            f"for i in range({lines}):\n    print(repr(time.time()), flush=True)\n{pause}")


async def follow_all(cluster: LocalCluster, jobs: int, clients: int, lines: int, pause_ms: float,
                     connect_s: float) -> tuple[list[float], list[str], float]:
    """Latencies of every line at every client, what went wrong (gaps, repeats, lost lines, a
    follower subscribed after the lines began), and the seconds from the first line to the last
    client's end."""
    start_at = time.time() + connect_s
    async with cluster.async_client() as submitter:
        submitted = [await submitter.submit(program(lines, pause_ms, start_at), name=f"load-{i}")
                     for i in range(jobs)]
        latencies: list[float] = []
        problems: list[str] = []

        async def one_client(k: int) -> None:
            async with cluster.async_client() as client:
                job = await client.get(submitted[k % jobs].id)
                seqs, got = [], 0
                async for batch in job.follow(tick_s=0.5, batch_s=0.0):
                    now = time.time()
                    if not seqs and now > start_at:
                        problems.append(f"client {k}: subscribed {now - start_at:.2f} s after the lines began")
                    for ev in batch:
                        seqs.append(ev.seq)
                        if ev.data.get("stream") == "stdout":
                            got += len(ev.lines)
                            latencies.extend(now - float(line) for line in ev.lines)
                if seqs != list(range(1, len(seqs) + 1)):
                    problems.append(f"client {k}: events not 1..n once each")
                if got != lines:
                    problems.append(f"client {k}: {got} of {lines} lines")

        await asyncio.gather(*(one_client(k) for k in range(clients)))
        return latencies, problems, time.time() - start_at


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
    ap.add_argument("--connect-s", type=float, default=5.0,
                    help="seconds between the submissions and the first line: every follower subscribes meanwhile")
    ap.add_argument("--pause-ms", type=float, default=0.0,
                    help="a pause after every 10 lines (0: print as fast as the job can)")
    args = ap.parse_args()
    with LocalCluster(nodes=2, devices_per_node=(args.jobs + 1) // 2, env={"SINGULARITY_PIN_CPU_SLOTS": "0"}) as cluster:
        with cluster.client() as client:  # measure the event path, not the spawners' warm-up
            until_workers_fork(client, slots=2 * ((args.jobs + 1) // 2))
        base, base_problems, base_s = asyncio.run(follow_all(cluster, args.jobs, args.jobs, args.lines, args.pause_ms,
                                                               args.connect_s))
        many, problems, many_s = asyncio.run(follow_all(cluster, args.jobs, args.clients, args.lines, args.pause_ms,
                                                          args.connect_s))
        rate = asyncio.run(submissions(cluster, args.submits))
    print(f"{args.jobs} jobs x {args.lines} lines (pause {args.pause_ms:g} ms per 10 lines); "
          f"latency print -> client, ms")
    print(f"{'followers':>10} {'lines':>8} {'lines/s':>8} {'p50':>8} {'p99':>8} {'max':>8} {'lost/dup':>9}")
    for n, lat, bad, secs in ((args.jobs, base, base_problems, base_s), (args.clients, many, problems, many_s)):
        print(f"{n:>10} {len(lat):>8} {len(lat) / secs:>8.0f} {statistics.median(lat) * 1e3:>8.1f} "
              f"{pct(lat, 99) * 1e3:>8.1f} {max(lat) * 1e3:>8.1f} {len(bad):>9}")
    print(f"p99 ratio {args.clients} followers / {args.jobs}: {pct(many, 99) / pct(base, 99):.2f}x")
    print(f"submissions: {rate:.0f}/s ({args.submits} back to back, one client)")
    for line in (base_problems + problems)[:10]:
        print("PROBLEM:", line)


if __name__ == "__main__":
    main()
