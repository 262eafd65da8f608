"""``singularityctl demo``: a local cluster, a real training job, its events live, a summary."""
from __future__ import annotations

import sys
import time
from pathlib import Path

from .local import LocalCluster
from .protocol import EventType
from .render import format_event


def find_example(name: str) -> Path:
    """The examples folder of a source checkout (the demo is run from one, see README)."""
    for base in (Path.cwd(), Path(__file__).resolve().parents[1]):
        path = base / "examples" / name
        if path.is_file():
            return path
    raise FileNotFoundError(f"examples/{name} not found; run the demo from the project's checkout")


def run_demo(nodes: int = 2, devices_per_node: int = 2) -> int:
    script = find_example("train_mlp.py")
    print(f"starting a local cluster: {nodes} nodes x {devices_per_node} devices ...", flush=True)
    t0 = time.time()
    with LocalCluster(nodes=nodes, devices_per_node=devices_per_node) as cluster:
        print(f"server {cluster.url} ready in {time.time() - t0:.1f}s; home {cluster.home}")
        client = cluster.client()
        for n in client.nodes():
            print(f"  {n.name}: {len(n.devices)} x {n.devices[0].kind} ({n.devices[0].name})")
        job = client.submit(script, gpus=1, sla="standard", name="mlp")
        print(f"submitted {script.name} as {job.id}\n")
        for ev in job.events():
            print(format_event(ev), flush=True)
        state = job.wait()
        print()
        if state.value != "succeeded":
            print(f"job {job.id} ended {state.value}:\n{job.info.error}", file=sys.stderr)
            return 1
        result = job.result()
        events = list(job.events(follow=False))
        sched = next(e for e in events if e.type == EventType.SCHEDULED)
        steps = sum(1 for e in events if e.type == EventType.LOG and "loss" in e.data.get("line", ""))
        print("summary")
        print(f"  job          {job.id} ({job.name}) {state.value}")
        print(f"  placement    {', '.join(f'{p.node} {p.devices}' for p in job.placement)}")
        print(f"  queued->run  {sched.time - job.info.created_at:.3f} s")
        print(f"  run time     {job.info.ended_at - (job.info.started_at or job.info.created_at):.2f} s")
        print(f"  loss lines   {steps}; events {len(events)}")
        print(f"  result       {result}")
        client.close()
    return 0
