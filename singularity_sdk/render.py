"""Human-readable one-liners for events and jobs, shared by the CLI and the notebook widget."""
from __future__ import annotations

import time
from typing import Any

from pydantic import ValidationError

from . import payloads
from .protocol import Event, EventType, JobInfo, Placement, log_lines


def _where(placement: list[Placement]) -> str:
    return ", ".join(f"{p.node} {p.devices}" for p in placement)


def _size(n: Any) -> str:
    try:
        n = float(n)
    except (TypeError, ValueError):
        return "?"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def _secs(value: Any) -> str:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return "?"
    return f"{v * 1000:.1f} ms" if v < 1 else f"{v:.2f} s"


def describe(ev: Event) -> str:
    """One line that says what happened, e.g. ``scheduled on node-1 [0] (fifo: ...)``."""
    t = ev.type
    try:
        p = payloads.of(ev)
    except ValidationError:  # a field of an unexpected type: show what came, do not fail
        return f"{t.value} {ev.data}"
    if t == EventType.SUBMITTED:
        return f"submitted by {p.user}: {p.gpus} device(s), {p.ranks} rank(s), sla {p.sla}"
    if t == EventType.SCHEDULED:
        return f"scheduled on {_where(p.placement)} (attempt {p.attempt}; {p.reason})"
    if t == EventType.STARTED:
        early = f", {_size(p.prefetched_bytes)} of it while it was written" if p.prefetched_bytes else ""
        early += f", {_size(p.linked_bytes)} of unchanged blobs already here" if p.linked_bytes else ""
        fetched = "" if p.fetch_s is None else f"; checkpoint fetched in {_secs(p.fetch_s)}{early}"
        return f"started on {p.node}: ranks {p.ranks}, pids {list(p.pids.values())}{fetched}"
    if t == EventType.LOG:
        where = f"log[{p.rank}{'' if p.stream == 'stdout' else ' ' + p.stream}]"
        return "\n".join(f"{where} {line.rstrip(chr(10))}" for line in log_lines(p.line))
    if t == EventType.RESULT:
        return f"result: {p.repr[:200]}" + (f" (not kept: {p.error})" if p.error else "")
    if t == EventType.WORKER_EXITED:
        how = f"signal {p.signal}" if p.signal else f"code {p.code}"
        return f"rank {p.rank} exited on {p.node} with {how}"
    if t == EventType.SUCCEEDED:
        return f"succeeded after {_secs(p.seconds)}"
    if t == EventType.FAILED:
        err = p.error.strip().splitlines()
        return f"failed: {err[-1] if err else ''}"
    if t == EventType.CANCEL_REQUESTED:
        return f"cancel requested by {p.by}: {p.reason}"
    if t == EventType.CANCELLED:
        return f"cancelled ({p.reason})"
    if t == EventType.CHECKPOINT_STARTED:
        who = f"rank {p.rank}: " if p.rank else ""
        return f"{who}checkpoint started ({p.reason or 'requested'})"
    if t == EventType.CHECKPOINTED:
        unsent = f"; {_size(p.reused_bytes)} of unchanged blobs not uploaded again" if p.reused_bytes else ""
        return (f"checkpointed at step {p.step}: {_size(p.bytes)} in {_secs(p.seconds)} "
                f"(safe point reached after {_secs(p.wait_s)}){unsent}")
    if t == EventType.CHECKPOINT_FAILED:
        return f"checkpoint failed: {p.error}"
    if t == EventType.PREEMPTING:
        return f"preempting: {p.reason}"
    if t == EventType.PREEMPTED:
        step = "?" if p.step is None else p.step
        return f"preempted at step {step} ({p.reason}; by {p.by or 'scheduler'})"
    if t == EventType.RESUMED:
        took = f" (restored in {_secs(p.seconds)})" if p.seconds is not None else ""
        return f"resumed at step {'?' if p.step is None else p.step} on {_where(p.placement)}{took}"
    if t == EventType.MIGRATING:
        return f"migrating from {p.from_} ({p.reason})"
    if t == EventType.MIGRATED:
        return f"migrated {p.from_} -> {p.to} in {_secs(p.seconds)}"
    if t == EventType.RESIZING:
        return f"resizing {p.from_} -> {p.to} devices ({p.reason})"
    if t == EventType.RESIZED:
        if p.queued:
            return f"resized {p.from_} -> {p.to} devices while waiting"
        phases = ", ".join(f"{k} {_secs(v)}" for k, v in p.phases.items())
        return (f"resized {p.from_} -> {p.to} devices ({p.splicing} rank(s) per device) "
                f"in {_secs(p.seconds)}" + (f": {phases}" if phases else ""))
    if t == EventType.NODE_LOST:
        return f"node {p.node} lost (silent {'?' if p.silent_s is None else p.silent_s} s)"
    if t == EventType.RETRYING:
        return f"retrying as attempt {p.attempt}: {p.why}"
    if t == EventType.PROGRESS:
        return f"progress: step {p.step}"
    if t == EventType.INTERRUPTIBLE:
        return str(p.message or ("interruptible" if p.interruptible else "no safe point"))
    if t == EventType.EXACTNESS:
        return exactness_text(ev.data)
    if t == EventType.SUPERSEDED:
        who = "every rank" if p.ranks is None else f"rank(s) {p.ranks}"
        return (f"{p.lines} log line(s) of {who} superseded: the steps after the restored checkpoint "
                f"printed them again")
    if t == EventType.RENDEZVOUS:
        return f"rendezvous on {p.node or '?'} port {p.port}: the ranks on other nodes start"
    return f"{t.value} {ev.data}"


def exactness_text(d: dict[str, Any]) -> str:
    """What an exact resume of the job depends on, and what puts it at risk."""
    fp = d.get("fingerprint") or {}
    deps = ", ".join(f"{k} {fp[k]}" for k in ("python", "torch", "numpy", "device") if fp.get(k))
    warnings = list(d.get("warnings") or [])
    return (f"resumes exactly where {deps} match" if deps else "exactness") + \
        ("; WARNING: " + "; ".join(warnings) if warnings else "")


def format_event(ev: Event) -> str:
    stamp = time.strftime("%H:%M:%S", time.localtime(ev.time)) + f".{int(ev.time * 1000) % 1000:03d}"
    return f"{stamp} #{ev.seq:<4} {ev.type.value:<17} {describe(ev)}"


def age(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


def job_row(info: JobInfo, now: float) -> list[str]:
    devices = ",".join(str(d) for p in info.placement for d in p.devices) if info.state.holds_devices else "-"
    nodes = ",".join(p.node for p in info.placement) if info.state.holds_devices else "-"
    return [info.id, info.name, info.state.value, info.sla.value, f"{info.gpus}:{devices}", nodes,
            age(now - info.created_at)]


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.upper().ljust(w) for h, w in zip(headers, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)
