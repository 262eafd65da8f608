"""``singularityctl demo``: a local cluster; a real training job preempted, resumed and
migrated while it runs, then a 4-rank data-parallel job resized 4 -> 2 -> 1 -> 4 devices; each
loss curve beside an uninterrupted run's: identical."""
from __future__ import annotations

import re
import sys
import time
from pathlib import Path
from typing import Optional

from singularity_sdk.client import Client, Job
from singularity_sdk.local import LocalCluster
from singularity_sdk.protocol import EventType, JobState
from singularity_sdk.render import format_event

LOSS = re.compile(r"step\s+(\d+) loss ([0-9.]+)")


def find_example(name: str) -> Path:
    """The examples folder of a source checkout (the demo is run from one, see README)."""
    for base in (Path.cwd(), Path(__file__).resolve().parents[1]):
        path = base / "examples" / name
        if path.is_file():
            return path
    raise FileNotFoundError(f"examples/{name} not found; run the demo from the project's checkout")


def losses(job: Job) -> list[tuple[int, str]]:
    out = []
    for ev in job.events(follow=False):
        for line in ev.lines:
            if m := LOSS.search(line):
                out.append((int(m.group(1)), m.group(2)))
    return out


def show(ev) -> None:
    if ev.type not in (EventType.LOG, EventType.PROGRESS):
        print("   ", format_event(ev), flush=True)


def follow_until(job: Job, since: int, lines: int) -> int:
    """Print the job's events until it has printed ``lines`` more loss lines; returns the last seq."""
    seen = 0
    for ev in job.events(since=since):
        show(ev)
        since = ev.seq
        seen += sum(1 for line in ev.lines if LOSS.search(line))
        if seen >= lines:
            break
    return since


def run_demo(nodes: int = 2, devices_per_node: int = 2) -> int:
    script = find_example("train_mlp.py")
    print(f"1. starting a local cluster: {nodes} nodes x {devices_per_node} devices ...", flush=True)
    t0 = time.time()
    with LocalCluster(nodes=nodes, devices_per_node=devices_per_node) as cluster, cluster.client() as client:
        print(f"   server {cluster.url} ready in {time.time() - t0:.1f}s (home {cluster.home})")
        for n in client.nodes():
            print(f"   {n.name}: {len(n.devices)} x {n.devices[0].kind} ({n.devices[0].name})")
        return _scenario(client, script)


def _scenario(client: Client, script: Path) -> int:
    print(f"\n2. the reference: {script.name} run straight through")
    reference = _run_through(client, script, "mlp-reference")
    if reference is None:
        return 1

    print("\n3. the same script again; preempted, resumed, then migrated while it trains")
    job = client.submit(script, name="mlp-moved")
    since = follow_until(job, 0, 20)
    print("   -> preempt (checkpoint at the next safe point, free the device)")
    job.preempt(reason="demo: making room")
    for ev in job.events(since=since, follow=False):
        show(ev)
        since = ev.seq
    print("   -> resume")
    job.resume()
    since = follow_until(job, since, 20)
    here = job.refresh().placement[0].node
    there = next((n.name for n in client.nodes() if n.name != here), None)
    if there:
        print(f"   -> migrate {here} -> {there}")
        job.migrate(there, reason="demo: moving to another node")
    if not _finish(job, since):
        return 1
    same = compare(reference, job, "preempted+migrated")
    kinds = [e.type for e in job.events(follow=False)]
    print(f"   preemptions {kinds.count(EventType.PREEMPTED)}, resumes {kinds.count(EventType.RESUMED)}, "
          f"migrations {kinds.count(EventType.MIGRATED)}; result {job.result()}")
    return 0 if same and _data_parallel(client) else 1


def _data_parallel(client: Client) -> bool:
    """Section 4: a 4-rank DDP job resized while it trains, against one that never was."""
    script = find_example("ddp_train.py")
    print(f"\n4. data parallel: {script.name}, 4 ranks (DDP over gloo), first straight through on 4 devices")
    reference = _run_through(client, script, "ddp-reference", gpus=4)
    if reference is None:
        return False
    print("   again, resized 4 -> 2 -> 1 -> 4 devices while it trains (2 and 4 ranks share a device)")
    job = client.submit(script, name="ddp-resized", gpus=4)
    since = 0
    for gpus in (2, 1, 4):
        since = follow_until(job, since, 15)
        print(f"   -> resize to {gpus} device(s)")
        job.resize(gpus, reason="demo")
    if not _finish(job, since):
        return False
    return compare(reference, job, "resized 4-2-1-4")


def _run_through(client: Client, script: Path, name: str, gpus: int = 1) -> Optional[Job]:
    job = client.submit(script, name=name, gpus=gpus)
    for ev in job.events():
        show(ev)
    if job.wait() != JobState.SUCCEEDED:
        print(f"{name} failed:\n{job.info.error}", file=sys.stderr)
        return None
    return job


def _finish(job: Job, since: int) -> bool:
    for ev in job.events(since=since):
        show(ev)
    if job.wait() != JobState.SUCCEEDED:
        print(f"job failed:\n{job.info.error}", file=sys.stderr)
        return False
    return True


def compare(reference: Job, job: Job, label: str) -> bool:
    """Print both loss curves side by side (a sample of steps) and whether they are identical."""
    a, b = losses(reference), losses(job)
    print(f"\n   {'step':>4}  {'uninterrupted':>13}  {label:>18}")
    for (sa, la), (_sb, lb) in zip(a, b):
        if sa < 2 or sa % 15 == 0 or sa >= len(a) - 1:
            print(f"   {sa:>4}  {la:>13}  {lb:>18}  {'same' if la == lb else 'DIFFERENT'}")
    same = a == b and len(a) > 0
    print(f"   steps compared {len(a)}; identical: {'yes' if same else 'NO'}")
    ck = [e for e in job.events(follow=False) if e.type == EventType.CHECKPOINTED]
    if ck:
        print(f"   checkpoints {len(ck)}, {ck[-1].data.get('bytes', 0) / 1e3:.1f} KB each")
    return same
