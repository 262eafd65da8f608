"""Human-readable one-liners for events and jobs, shared by the CLI and the notebook widget."""
from __future__ import annotations

import time
from typing import Any

from .protocol import Event, EventType, JobInfo


def _where(placement: list[dict[str, Any]]) -> str:
    return ", ".join(f"{p['node']} {p['devices']}" for p in placement)


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
    d, t = ev.data, ev.type
    if t == EventType.SUBMITTED:
        return f"submitted by {d.get('user')}: {d.get('gpus')} device(s), {d.get('ranks')} rank(s), sla {d.get('sla')}"
    if t == EventType.SCHEDULED:
        return f"scheduled on {_where(d.get('placement', []))} (attempt {d.get('attempt')}; {d.get('reason', '')})"
    if t == EventType.STARTED:
        return f"started on {d.get('node')}: ranks {d.get('ranks')}, pids {list((d.get('pids') or {}).values())}"
    if t == EventType.LOG:
        line = str(d.get("line", "")).rstrip("\n")
        return f"log[{d.get('rank', 0)}{'' if d.get('stream') == 'stdout' else ' ' + str(d.get('stream'))}] {line}"
    if t == EventType.RESULT:
        return f"result: {d.get('repr', '')[:200]}" + (f" (not kept: {d['error']})" if d.get("error") else "")
    if t == EventType.WORKER_EXITED:
        how = f"signal {d['signal']}" if d.get("signal") else f"code {d.get('code')}"
        return f"rank {d.get('rank')} exited on {d.get('node')} with {how}"
    if t == EventType.SUCCEEDED:
        return f"succeeded after {_secs(d.get('seconds'))}"
    if t == EventType.FAILED:
        err = str(d.get("error", "")).strip().splitlines()
        return f"failed: {err[-1] if err else ''}"
    if t == EventType.CANCEL_REQUESTED:
        return f"cancel requested by {d.get('by')}: {d.get('reason', '')}"
    if t == EventType.CANCELLED:
        return f"cancelled ({d.get('reason', '')})"
    if t == EventType.CHECKPOINT_STARTED:
        return f"checkpoint started ({d.get('reason') or 'requested'})"
    if t == EventType.CHECKPOINTED:
        return (f"checkpointed at step {d.get('step')}: {_size(d.get('bytes'))} in {_secs(d.get('seconds'))} "
                f"(safe point reached after {_secs(d.get('wait_s'))})")
    if t == EventType.CHECKPOINT_FAILED:
        return f"checkpoint failed: {d.get('error')}"
    if t == EventType.PREEMPTING:
        return f"preempting: {d.get('reason', '')}"
    if t == EventType.PREEMPTED:
        return f"preempted at step {d.get('step', '?')} ({d.get('reason', '')}; by {d.get('by', 'scheduler')})"
    if t == EventType.RESUMED:
        took = f" (restored in {_secs(d['seconds'])})" if d.get("seconds") is not None else ""
        return f"resumed at step {d.get('step', '?')} on {_where(d.get('placement', []))}{took}"
    if t == EventType.MIGRATING:
        return f"migrating from {d.get('from')} ({d.get('reason', '')})"
    if t == EventType.MIGRATED:
        return f"migrated {d.get('from')} -> {d.get('to')} in {_secs(d.get('seconds'))}"
    if t == EventType.RESIZING:
        return f"resizing {d.get('from')} -> {d.get('to')} devices ({d.get('reason', '')})"
    if t == EventType.RESIZED:
        if d.get("queued"):
            return f"resized {d.get('from')} -> {d.get('to')} devices while waiting"
        phases = ", ".join(f"{k} {_secs(v)}" for k, v in (d.get("phases") or {}).items())
        return (f"resized {d.get('from')} -> {d.get('to')} devices ({d.get('splicing')} rank(s) per device) "
                f"in {_secs(d.get('seconds'))}" + (f": {phases}" if phases else ""))
    if t == EventType.NODE_LOST:
        return f"node {d.get('node')} lost (silent {d.get('silent_s', '?')} s)"
    if t == EventType.RETRYING:
        return f"retrying as attempt {d.get('attempt')}: {d.get('why', '')}"
    if t == EventType.PROGRESS:
        return f"progress: step {d.get('step')}"
    if t == EventType.INTERRUPTIBLE:
        return str(d.get("message") or ("interruptible" if d.get("interruptible") else "no safe point"))
    if t == EventType.EXACTNESS:
        return exactness_text(d)
    if t == EventType.SUPERSEDED:
        who = "every rank" if d.get("ranks") is None else f"rank(s) {d.get('ranks')}"
        return (f"{d.get('lines')} log line(s) of {who} superseded: the steps after the restored checkpoint "
                f"printed them again")
    return f"{t.value} {d}"


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
