"""Output marks put a checkpoint's event exactly between the lines printed before and after it,
even when the agent reads the output pipe before the control pipe (what exactly-once logs
need; a CI run once kept a repeated line because of that order)."""
from __future__ import annotations

import asyncio
import os
import sys
import textwrap

import pytest

from backend.agent.workers import JobRun
from backend.worker import output_marks
from singularity_sdk.protocol import EventType, StartJob, log_lines

# A rank that prints, takes a checkpoint's state, prints again at once, and only then gets its
# control message out: the agent surely has the later line before the message.
RANK = textwrap.dedent("""
    import json, os, sys, time
    from backend.worker import output_marks
    control = os.fdopen(int(sys.argv[1]), "w", buffering=1)
    print("before", flush=True)
    print("partial ", end="", flush=True)
    streams = output_marks.write(1)
    print("after", flush=True)
    print("on stderr", file=sys.stderr, flush=True)
    time.sleep({delay})
    if {send}:
        control.write(json.dumps({{"type": "checkpoint_started",
                                   "data": {{"step": 3, "output_mark": {{"number": 1, "streams": streams}}}}}}) + "\\n")
""")


# A rank whose lines reach the agent in one burst, a mark among them.
BURST = textwrap.dedent("""
    import json, os, sys, time
    from backend.worker import output_marks
    control = os.fdopen(int(sys.argv[1]), "w", buffering=1)
    before = "".join(f"before {{i}}\\n" for i in range(200)).encode()
    after = "".join(f"after {{i}}\\n" for i in range(200)).encode()
    os.write(1, before + output_marks.PREFIX + b"1" + output_marks.SUFFIX + after)
    time.sleep({delay})
    if {send}:
        control.write(json.dumps({{"type": "checkpoint_started",
                                   "data": {{"step": 3, "output_mark": {{"number": 1, "streams": ["stdout"]}}}}}}) + "\\n")
""")


async def _follow(tmp_path, send: bool, rank: str = RANK) -> list[tuple[str, dict]]:
    events: list[tuple[str, dict]] = []
    spec = StartJob(job_id="j", attempt=1, world_size=1, local_world_size=1, ranks=[])
    run = JobRun(spec, tmp_path, [], 1, tmp_path, lambda t, d: events.append((t.value, d)))
    r_fd, w_fd = os.pipe()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", rank.format(delay=0.3, send=send), str(w_fd), pass_fds=(w_fd,),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=os.getcwd())
    os.close(w_fd)
    rp = await run.follow(0, proc, r_fd)
    await proc.wait()
    await asyncio.wait_for(asyncio.gather(*rp.readers), 30)
    return events


def _shown(events) -> list[str]:
    return [d["line"] if t == EventType.LOG.value else t for t, d in events]


def test_the_event_lies_between_the_lines_before_and_after_its_mark(tmp_path):
    events = asyncio.run(_follow(tmp_path, send=True))
    stdout = [d["line"] if t == "log" else t for t, d in events if t != "log" or d["stream"] == "stdout"]
    assert stdout == ["before\n", "checkpoint_started", "partial after\n"]
    assert "on stderr\n" in _shown(events)
    assert _shown(events).index("on stderr\n") > _shown(events).index("checkpoint_started")
    started = next(d for t, d in events if t == "checkpoint_started")
    assert "output_mark" not in started and started["step"] == 3
    assert not any(output_marks.PREFIX.decode() in line for line in _shown(events))


def test_a_mark_whose_message_never_comes_holds_nothing_back_for_good(tmp_path):
    events = asyncio.run(_follow(tmp_path, send=False))  # the rank died between mark and message
    stdout = [d["line"] for t, d in events if t == "log" and d["stream"] == "stdout"]
    assert stdout == ["before\n", "partial after\n"] and "on stderr\n" in _shown(events)


def test_a_burst_of_lines_travels_in_few_events_and_never_across_a_mark(tmp_path):
    events = asyncio.run(_follow(tmp_path, send=True, rank=BURST))
    shown = [t if t != "log" else d["line"] for t, d in events]
    lines = [line for item in shown for line in (log_lines(item) if item != "checkpoint_started" else [item])]
    assert lines == [f"before {i}\n" for i in range(200)] + ["checkpoint_started"] + [f"after {i}\n" for i in range(200)]
    assert len(events) < 20  # 400 lines, read together: a handful of events, not one per line


@pytest.mark.parametrize("line", [b"plain\n", b"x" + output_marks.PREFIX + b"7" + output_marks.SUFFIX])
def test_split(line):
    text, number = output_marks.split(line)
    assert (text, number) == ((b"plain\n", None) if line == b"plain\n" else (b"x", 7))
