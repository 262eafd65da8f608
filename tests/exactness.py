"""Helpers for the exact-resume tests: run a program uninterrupted, then with interruptions at
random moments, and compare what it printed and returned."""
from __future__ import annotations

import random
from pathlib import Path
from typing import Callable, Optional

from singularity_sdk import Client, EventType, Job, JobState

PROGRAMS = Path(__file__).parent / "e2e" / "programs"


def source(name: str) -> str:
    return (PROGRAMS / name).read_text()


def wait_for_lines(job: Job, count: int) -> None:
    """Follow the job until it has printed ``count`` lines in all (0: until it has started)."""
    seen = 0
    for ev in job.events():
        if ev.data.get("stream") == "stdout":
            seen += len(ev.lines)
        if (count == 0 and ev.type == EventType.STARTED) or (count > 0 and seen >= count):
            return


def stdout_lines(job: Job) -> list[str]:
    return [line for e in job.events(follow=False) if e.data.get("stream") == "stdout" for line in e.lines]


def rank_lines(job: Job) -> dict[int, list[str]]:
    """What each rank printed, in order (ranks' lines interleave differently from run to run)."""
    out: dict[int, list[str]] = {}
    for e in job.events(follow=False):
        if e.type == EventType.LOG and e.data.get("stream") == "stdout":
            out.setdefault(int(e.data.get("rank", 0)), []).extend(e.lines)
    return out


def run_plain(client: Client, code: str, env: Optional[dict] = None, name: str = "plain") -> tuple[list[str], object]:
    job = client.submit(code, env=env, name=name)
    assert job.wait(180) == JobState.SUCCEEDED, job.info.error
    return stdout_lines(job), job.result()


def assert_retried_from_a_checkpoint(job: Job, expected_lines: list[str], expected_result: object) -> None:
    """A job whose worker was killed: it was retried, restored from a checkpoint written before
    the kill, and what it printed after the restore ends an uninterrupted run's output."""
    assert job.wait(180) == JobState.SUCCEEDED, job.info.error
    events = list(job.events(follow=False))
    assert any(e.type == EventType.RETRYING for e in events)
    resumed = [e for e in events if e.type == EventType.RESUMED]
    assert resumed, "the retry restored from a checkpoint written before the kill"
    after = [line for e in events if e.seq > resumed[-1].seq for line in e.lines]
    assert after and after == expected_lines[-len(after):]
    assert job.result() == expected_result


def random_stops(seed: int, total_lines: int, count: int) -> list[int]:
    """``count`` distinct moments, as 'after this many printed lines', within the run."""
    rng = random.Random(seed)
    return sorted(rng.sample(range(0, total_lines - 1), count))


def run_interrupted(client: Client, code: str, stops: list[int], interrupt: Callable[[Job, int], None],
                    env: Optional[dict] = None, name: str = "interrupted") -> tuple[Job, list[str], object]:
    """Run ``code`` and call ``interrupt(job, i)`` once it has printed ``stops[i]`` lines in all."""
    job = client.submit(code, env=env, name=name)
    for i, target in enumerate(stops):
        wait_for_lines(job, target)
        if job.refresh().state.is_terminal:
            break
        interrupt(job, i)
    assert job.wait(180) == JobState.SUCCEEDED, job.info.error
    return job, stdout_lines(job), job.result()


def preempt_and_resume(job: Job, _i: int) -> None:
    job.preempt(timeout=60)
    if job.state == JobState.PREEMPTED:
        events = list(job.events(follow=False))
        assert events[-1].type == EventType.PREEMPTED
        assert events[-1].data.get("step") is not None
        job.resume()


def files_of(folder: Path, skip: tuple[str, ...] = ()) -> dict[str, bytes]:
    """Every file under ``folder`` (relative name -> bytes), minus ``__pycache__`` and the
    top-level folders named in ``skip``."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts and p.relative_to(folder).parts[0] not in skip}


def other_node(job: Job) -> str:
    return "node-2" if job.refresh().placement[0].node == "node-1" else "node-1"


def migrate(job: Job, _i: int) -> None:
    """Move a job whose ranks all run on one node to the other node of a 2-node cluster."""
    job.migrate(other_node(job), timeout=60)


def interrupt_at(job: Job, stops: list[int], actions: list[Callable[[Job, int], None]]) -> int:
    """Call ``actions[i](job, i)`` once the job has printed ``stops[i]`` lines in all (all ranks
    together); return how many ran before the job ended."""
    done = 0
    for i, (target, action) in enumerate(zip(stops, actions)):
        wait_for_lines(job, target)
        if job.refresh().state.is_terminal:
            break
        action(job, i)
        done += 1
    return done
