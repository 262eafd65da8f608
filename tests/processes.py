"""Helpers about operating-system processes, for tests of every folder (a plain module: test
files cannot rely on which ``conftest`` a bare ``import conftest`` finds)."""
from __future__ import annotations

import os
from pathlib import Path


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie is dead for our purposes)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def started_as(job) -> dict[str, str]:
    """How each rank of the job's last attempt began, from its started event: ``fork`` (of the
    node's warm spawner) or ``fresh`` (interpreter), with ``+sandbox`` when sandboxed."""
    from singularity_sdk import EventType

    return [e for e in job.events(follow=False) if e.type == EventType.STARTED][-1].data["spawn"]


def until_workers_fork(client, timeout: float = 120, slots: int = 1) -> None:
    """Run trivial jobs until workers start as forks of the warm spawner (it warms up in the
    background; the first workers of a node start fresh). With ``slots``, rounds of that many
    jobs at once, one per device of the cluster, until a whole round starts as forks: then
    every node's spawner is warm."""
    import time

    deadline = time.monotonic() + timeout
    code = "import time\ntime.sleep(0.3)" if slots > 1 else "print('warm?')"  # overlap: fill every slot
    while True:
        probes = [client.submit(code, name="warm-up") for _ in range(slots)]
        for probe in probes:
            probe.wait(60)
        how = [started_as(probe)["0"] for probe in probes]
        if all(h.startswith("fork") for h in how):
            return
        assert time.monotonic() < deadline, f"workers still begin as {how}"
