"""The agent side of the service: registration, exactly-once event intake, rank exits, and what
follows when workers or whole nodes disappear (retries from the newest checkpoint)."""
from __future__ import annotations

import base64
import json
import logging
import time
from typing import Any, Callable, Iterator, Optional

from pydantic import ValidationError

from singularity_sdk import payloads
from singularity_sdk.protocol import (
    MAX_RESULT_BYTES,
    AgentEvent,
    AgentHeartbeat,
    AgentHello,
    Event,
    EventType,
    JobInfo,
    JobState,
    NodeState,
    StopJob,
    Welcome,
)

from . import lifecycle, log_replay
from .core import AgentLink, Core, Movers, Starts
from .lifecycle import MOVES, JobRecord
from .moves import call_off_prefetch

log = logging.getLogger("singularity.server")

#: Agent events that only add to the log (no state change), accepted for the current attempt.
PASS_THROUGH = {EventType.LOG, EventType.PROGRESS, EventType.TELEMETRY, EventType.CHECKPOINT_STARTED,
                EventType.INTERRUPTIBLE, EventType.EXACTNESS}
#: What the server waits beyond a move's bound before answering for ranks that said nothing
#: (a rank whose watchdog cannot run, e.g. a C call holding the GIL): its own answer comes first.
BACKSTOP_SLACK_S = 10.0
#: a node check this late means the server itself was not running (stopped, suspended, blocked)
#: and has not read what waits in its sockets yet: connected nodes are not judged silent then
FROZEN_GAP_S = 2.0


def fenced(row: Any, node: str, ae: AgentEvent) -> str:
    """Why ``node`` may not speak for this event's job ("" when it may): a node speaks only
    for jobs placed on it, in their current attempt."""
    if row is None:
        return "no such job"
    if row["attempt"] != ae.attempt:
        return f"attempt {ae.attempt} is not the job's current one ({row['attempt']})"
    if node not in {p["node"] for p in json.loads(row["placement_json"] or "[]")}:
        return f"the job is not placed on {node}"
    return ""


def _log_runs(events: list[AgentEvent]) -> Iterator[list[AgentEvent]]:
    """``events`` in order, as runs: consecutive log lines of one job's attempt together (they
    need only be appended), every other event alone."""
    run: list[AgentEvent] = []
    for ae in events:
        if run and (ae.type != EventType.LOG or (ae.job_id, ae.attempt) != (run[0].job_id, run[0].attempt)):
            yield run
            run = []
        if ae.type != EventType.LOG:
            yield [ae]
        else:
            run.append(ae)
    if run:
        yield run


def read(ae: AgentEvent) -> Any:
    """The typed payload of an agent's event, through the models the SDK's renderers read
    (``singularity_sdk/payloads.py``), strictly: a field of a wrong type raises pydantic's
    ValidationError (a ValueError), and the event is refused as malformed."""
    return payloads.decode(ae.type, ae.data, strict=True)


def malformed(exc: Exception) -> str:
    """Why an event could not be applied, in words for the agent's log: the fields at fault."""
    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'data'}: {e['msg']}" for e in exc.errors()[:3])
    if isinstance(exc, ValueError) and str(exc):  # the server's own words on what the event breaks
        return str(exc)[:300]
    return type(exc).__name__


class AgentSide:
    """What agents report: their connections, exactly-once intake of their events, rank exits
    (settled by lifecycle.py), lost nodes and moves that found no safe point."""

    moves: Movers  # wired by Service: a migration or resize continues there once its ranks stopped
    starts: Starts  # wired by Service: the other nodes' ranks start once rank 0's node chose its port

    def __init__(self, core: Core) -> None:
        self.core = core
        self.store = core.store
        self.config = core.config
        #: when check_nodes last ran, and since when the server has been running without a gap
        self._checked_at: Optional[float] = None
        self._awake_since = 0.0

    def agent_hello(self, link: AgentLink, hello: AgentHello) -> Welcome:
        with self.store.tx():
            acked = self.store.upsert_node(hello.node, hello.devices, hello.instance, hello.address)
        self.core.links[hello.node] = link
        self.core.dropped.pop(hello.node, None)
        self.core.fingerprints[hello.node] = dict(hello.fingerprint)
        log.info("agent %s connected (%d devices, instance %s)", hello.node, len(hello.devices), hello.instance)
        self._reconcile(hello.node, {tuple(k) for k in hello.known_jobs})
        self.core.schedule()
        return Welcome(acked_seq=acked, heartbeat_s=self.config.heartbeat_s)

    def _reconcile(self, node: str, known: set[tuple[str, int]]) -> None:
        """Agree with a (re)connected agent about which workers should exist on its node."""
        placed_here = {}
        for row in self.store.active_job_rows():
            info = self.store.job_info(row["id"])
            if info.state.holds_devices and any(p.node == node for p in info.placement):
                placed_here[info.id] = info
        # Workers the agent has that we did not place (stale attempt, finished job): fence them.
        for job_id, attempt in known:
            info = placed_here.get(job_id)
            if info is None or info.attempt != attempt:
                self.core.send(node, StopJob(job_id=job_id, attempt=attempt, reason="stale: not placed here",
                                         grace_s=self.config.stop_grace_s))
        # Jobs we placed there whose workers the agent does not know: they are gone.
        for job_id, info in placed_here.items():
            if (job_id, info.attempt) not in known:
                self.job_lost(info, f"its workers on {node} are gone (the node agent restarted)")

    def agent_disconnected(self, link: AgentLink, dropped: bool = False) -> None:
        """``dropped``: the connection broke without a close frame, as when the agent's process
        dies; unless it reconnects within ``drop_grace_s`` its node is lost (check_nodes)."""
        if self.core.links.get(link.node) is link:
            del self.core.links[link.node]
            if dropped:
                self.core.dropped[link.node] = time.time()
            log.info("agent %s disconnected%s", link.node, " (connection dropped)" if dropped else "")

    def agent_leaving(self, node: str, reason: str) -> None:
        """A planned stop: nothing more is placed on ``node`` (DOWN; its next hello makes it ready
        again unless an admin drained it). Its jobs checkpoint and stop on their own and are
        queued again (lifecycle.on_rank_exit)."""
        log.info("agent %s is leaving: %s", node, reason or "planned stop")
        with self.store.tx():
            if self.store.node_state(node) != NodeState.DRAINING:
                self.store.set_node(node, state=NodeState.DOWN.value)

    def agent_heartbeat(self, node: str, hb: AgentHeartbeat) -> None:
        self.store.set_node(node, heartbeat_at=time.time())

    def agent_events(self, node: str, events: list[AgentEvent],
                     reject: Callable[[int, str], None] = lambda seq, why: None) -> int:
        """Apply a batch of agent events exactly once; returns the highest applied agent_seq.

        An event that cannot be applied (malformed data, or about a job this node does not run
        in its current attempt) is skipped, logged and passed to ``reject``; it is acked all the
        same, so a replay cannot fail on it forever."""
        published: list[tuple[str, Event]] = []
        followups: list[Callable[[], None]] = []
        with self.store.tx():
            acked = self.store.node_acked(node)
            fresh: list[AgentEvent] = []
            for ae in events:
                if ae.agent_seq > acked:  # else a replay of something already committed
                    fresh.append(ae)
                    acked = ae.agent_seq
            for run in _log_runs(fresh):
                ae = run[0]
                why = fenced(self.store.job_row(ae.job_id), node, ae)
                if why:
                    for refused in run:
                        log.warning("event %s %s from node %s refused: %s", refused.type, refused.job_id, node, why)
                        reject(refused.agent_seq, why)
                    continue
                if len(run) > 1:  # lines: appended together, nothing else to apply
                    user = self.store.job_row(ae.job_id)["user"]
                    published += [(user, ev) for ev in self.store.append_events(
                        ae.job_id, [(EventType.LOG, line.data, line.time) for line in run])]
                    continue
                marks = (len(published), len(followups))
                self.store.db.execute("SAVEPOINT agent_event")
                try:
                    self._apply_agent_event(node, ae, published, followups)
                except Exception as exc:  # one bad event must not stall the node's whole stream
                    self.store.db.execute("ROLLBACK TO agent_event")
                    del published[marks[0]:], followups[marks[1]:]
                    log.warning("event %s %s from node %s not applied: %r", ae.type, ae.job_id, node, exc,
                                exc_info=not isinstance(exc, ValueError))
                    reject(ae.agent_seq, f"its data could not be applied ({malformed(exc)})")
                finally:
                    self.store.db.execute("RELEASE agent_event")
            self.store.set_node(node, acked_seq=acked, heartbeat_at=time.time())
        by_user: dict[str, list[Event]] = {}
        for user, ev in published:
            by_user.setdefault(user, []).append(ev)
        for user, evs in by_user.items():
            self.core.publish(user, evs)
        for fn in followups:
            fn()
        return acked

    def _apply_agent_event(
        self, node: str, ae: AgentEvent, out: list[tuple[str, Event]], followups: list[Callable[[], None]]
    ) -> None:
        row = self.store.job_row(ae.job_id)
        if row is None or row["attempt"] != ae.attempt:
            log.info("dropping %s for %s attempt %s (stale or unknown)", ae.type, ae.job_id, ae.attempt)
            return
        user = row["user"]
        state = JobState(row["state"])

        def emit(type: EventType, data: dict[str, Any], when: Optional[float] = None) -> None:
            out.append((user, self.core.emit(ae.job_id, type, data, when)))

        if ae.type in PASS_THROUGH:
            if ae.type == EventType.CHECKPOINT_STARTED and JobRecord.from_row(row).stop in MOVES:
                # a safe point took the request: writing may take long, the backstop stands down
                detail = json.loads(row["stop_detail_json"] or "{}")
                self.store.update_job(ae.job_id, stop_detail_json=json.dumps({**detail, "answered": True}))
            emit(ae.type, ae.data, ae.time)
        elif ae.type == EventType.CHECKPOINTED:
            read(ae)  # kept as sent; lifecycle and exact_nodes read it back as a Checkpointed
            self.store.update_job(ae.job_id, last_checkpoint_json=json.dumps({**ae.data, "time": ae.time}))
            emit(ae.type, ae.data, ae.time)
        elif ae.type == EventType.CHECKPOINT_FAILED:
            emit(ae.type, ae.data, ae.time)
            # A move is answered with the error; the job runs on untouched, at its old size.
            job = JobRecord.from_row(row)
            if called_off := lifecycle.move_called_off(job):
                self.store.update_job(ae.job_id, **called_off)
                call_off_prefetch(self.core, ae.job_id, row["attempt"], job.stop_detail)
        elif ae.type == EventType.RESUMED:
            resumed = read(ae)
            if resumed.rank != 0:
                # another rank of a data-parallel job: rank 0 speaks for the job; this one only
                # says where its own output resumes
                if superseded := log_replay.after_restore(self.store.db, ae.job_id, ae.attempt, resumed):
                    emit(EventType.SUPERSEDED, superseded)
                return
            emit(ae.type, {**ae.data, "node": node, "attempt": ae.attempt,
                           "placement": json.loads(row["placement_json"])}, ae.time)
            if superseded := log_replay.after_restore(self.store.db, ae.job_id, ae.attempt, resumed):
                emit(EventType.SUPERSEDED, superseded)
            moved = json.loads(row["migration_json"] or "{}")
            seconds = round(ae.time - moved.get("requested_at", ae.time), 3)
            if state == JobState.MIGRATING:
                to = ",".join(p["node"] for p in json.loads(row["placement_json"]))
                self.store.update_job(ae.job_id, state=JobState.RUNNING.value)
                emit(EventType.MIGRATED, {"from": moved.get("from"), "to": to, "step": resumed.step,
                                          "seconds": seconds})
            elif state == JobState.RESIZING:
                self.store.update_job(ae.job_id, state=JobState.RUNNING.value)
                emit(EventType.RESIZED, {**{k: moved.get(k) for k in ("from", "to", "splicing", "reason", "by")},
                                         "step": resumed.step, "seconds": seconds,
                                         "phases": self._resize_phases(ae.job_id, moved, ae.time)})
        elif ae.type == EventType.STARTED:
            if row["started_at"] is None:
                self.store.update_job(ae.job_id, started_at=ae.time)
            emit(EventType.STARTED, {**ae.data, "node": node}, ae.time)
            if not row["last_checkpoint_json"] and (superseded := log_replay.before_fresh_start(
                    self.store.db, ae.job_id, ae.attempt)):
                emit(EventType.SUPERSEDED, superseded)
        elif ae.type == EventType.RENDEZVOUS:
            chosen = read(ae)
            host = json.loads(row["placement_json"])[0]
            if host["node"] != node or 0 not in host["ranks"]:
                raise ValueError(f"only rank 0's node ({host['node']}) chooses the job's rendezvous port")
            if not 0 < chosen.port < 65536 or not state.holds_devices:
                raise ValueError(f"a rendezvous port is 1-65535 and for a job being started, not {chosen.port}")
            emit(EventType.RENDEZVOUS, {"node": node, "port": chosen.port}, ae.time)
            followups.append(lambda: self.starts.rendezvous_chosen(ae.job_id, ae.attempt, chosen.port))
        elif ae.type == EventType.RESULT:
            result = read(ae)
            raw = base64.b64decode(result.pickle_b64) if result.pickle_b64 else None
            err = result.error
            if raw is not None and len(raw) > MAX_RESULT_BYTES:
                raw, err = None, f"the result is {len(raw) / 1e6:.1f} MB, over the {MAX_RESULT_BYTES / 1e6:.0f} MB limit; save large outputs to files instead"
            outs_raw = base64.b64decode(result.outputs_b64) if result.outputs_b64 else None
            skipped = dict(result.outputs_skipped or {})
            if outs_raw is not None and len(outs_raw) > MAX_RESULT_BYTES:
                skipped["*"] = f"the variables to return are {len(outs_raw) / 1e6:.1f} MB, over the limit"
                outs_raw = None
            self.store.update_job(ae.job_id, result_pickle=raw, result_repr=result.repr, result_error=err,
                                  outputs_pickle=outs_raw, outputs_skipped_json=json.dumps(skipped))
            emit(EventType.RESULT, {"repr": result.repr[:2000], "bytes": len(raw or b""), "error": err},
                 ae.time)
        elif ae.type == EventType.WORKER_EXITED:
            exited = read(ae)
            emit(EventType.WORKER_EXITED, {**ae.data, "node": node}, ae.time)
            if state.holds_devices:
                self._rank_exited(row, exited, emit, followups)
        else:
            log.warning("agent %s sent an event type the server does not take: %s", node, ae.type)

    @property
    def retry_policy(self) -> lifecycle.RetryPolicy:
        return lifecycle.RetryPolicy(self.config.max_retries, self.config.retry_backoff_s)

    def _rank_exited(self, row, exited: payloads.WorkerExited, emit, followups: list[Callable[[], None]]) -> None:
        """Record one rank's exit; once all ranks are down, the job settles by why it stopped
        (the rules: lifecycle.on_rank_exit)."""
        # absent: rank 0, code -1 (died unseen); present, they must be integers (not null)
        rank = exited.rank if "rank" in exited.model_fields_set else 0
        code = exited.code if "code" in exited.model_fields_set else -1
        if type(rank) is not int or type(code) is not int or abs(code) > 255:
            raise ValueError(f"worker_exited needs an integer rank below {row['ranks']} and an exit code")
        t = lifecycle.on_rank_exit(JobRecord.from_row(row), rank, code, time.time(), self.retry_policy,
                                   error=exited.error, user_error=exited.user_error, planned=exited.planned_stop)
        self.apply(row["id"], t, emit, followups)

    def apply(self, job_id: str, t: lifecycle.Transition, emit, followups: list[Callable[[], None]]) -> None:
        """Write a transition inside the caller's transaction; its follow-ups run after it."""
        if t.updates:
            self.store.update_job(job_id, **t.updates)
        for etype, data in t.events:
            emit(etype, data)
        info = self.store.job_info(job_id)
        for f in t.then:
            if f.kind == "stop_everywhere":
                followups.append(lambda info=info, why=f.why: self.core.stop_everywhere(info, why))
            elif f.kind == "migrate_onwards":
                followups.append(lambda detail=f.detail: self.moves.migrate_onwards(job_id, detail))
            elif f.kind == "resize_onwards":
                followups.append(lambda detail=f.detail: self.moves.resize_onwards(job_id, detail))
            elif f.kind == "wake_at":
                followups.append(lambda when=f.when: self.core.wake_at(when))
            elif f.kind == "schedule":
                followups.append(self.core.schedule)
            else:
                raise ValueError(f"unknown follow-up {f.kind!r}")

    def _resize_phases(self, job_id: str, detail: dict[str, Any], resumed_at: float) -> dict[str, float]:
        """Where a resize's time went: agreeing on the step (barrier), writing the checkpoint,
        stopping and starting the ranks (restart), loading it back (restore)."""
        first: dict[EventType, float] = {}
        for ev in self.store.events(job_id, int(detail.get("since_seq", 0))):
            if ev.type in (EventType.CHECKPOINT_STARTED, EventType.CHECKPOINTED, EventType.STARTED):
                first.setdefault(ev.type, ev.time)
        marks = [detail.get("requested_at"), first.get(EventType.CHECKPOINT_STARTED),
                 first.get(EventType.CHECKPOINTED), first.get(EventType.STARTED), resumed_at]
        if any(m is None for m in marks):
            return {}
        names = ("barrier", "checkpoint", "restart", "restore")
        return {name: round(b - a, 3) for name, a, b in zip(names, marks, marks[1:])}

    def job_lost(self, info: JobInfo, why: str) -> None:
        """Workers vanished without reporting an exit: retry or fail, and free the devices."""
        events: list[Event] = []
        followups: list[Callable[[], None]] = []

        def emit(type: EventType, data: dict[str, Any]) -> None:
            events.append(self.core.emit(info.id, type, data))

        with self.store.tx():
            job = JobRecord.from_row(self.store.job_row(info.id))
            self.apply(info.id, lifecycle.on_workers_lost(job, why, time.time(), self.retry_policy), emit, followups)
        self.core.publish(info.user, events)
        for fn in followups:
            fn()

    def check_moves(self, now: Optional[float] = None) -> None:
        """Answer moves whose ranks reached no safe point and said nothing within their bound
        (plus slack): ``checkpoint_failed``, and the job is RUNNING again. The ranks drop such a
        request themselves once its bound passes, so none stops later for it."""
        now = time.time() if now is None else now
        moving = [JobState.PREEMPTING.value, JobState.MIGRATING.value, JobState.RESIZING.value]
        for info in self.store.list_jobs(states=moving):
            row = self.store.job_row(info.id)
            job = JobRecord.from_row(row)
            if job.stop not in MOVES or row["moved_at"] is None:
                continue
            bound = float(job.stop_detail.get("checkpoint_timeout") or self.config.checkpoint_timeout_s)
            if job.stop_detail.get("answered") or now - row["moved_at"] < bound + BACKSTOP_SLACK_S:
                continue
            call_off_prefetch(self.core, info.id, row["attempt"], job.stop_detail)
            with self.store.tx():
                self.store.update_job(info.id, **lifecycle.move_called_off(job))
                ev = self.core.emit(info.id, EventType.CHECKPOINT_FAILED, {
                    "error": f"no rank reached a safe point or answered within {bound:.0f} s; the "
                             f"{job.stop.value} is called off and the job runs on", "variables": [],
                    "timeout": True})
            self.core.publish(info.user, [ev])

    def check_nodes(self, now: Optional[float] = None) -> None:
        """Mark nodes whose agent has been silent too long as lost, and move their jobs on."""
        now = time.time() if now is None else now
        if self._checked_at is not None and now - self._checked_at > FROZEN_GAP_S:
            self._awake_since = now
        self._checked_at = now
        for n in self.store.nodes():
            if n.state in (NodeState.LOST, NodeState.DOWN):
                continue
            link = self.core.links.get(n.name)
            if link is not None:
                # Connected but silent: a partition (no FIN, no RST: the socket stays open for as
                # long as TCP takes to give up) or a frozen agent. Its workers stop on their lease.
                if now - max(n.heartbeat_at or 0.0, self._awake_since) < self.config.node_timeout_s:
                    continue
                del self.core.links[n.name]
                try:
                    link.close(4408, "no heartbeat")
                except Exception:
                    pass
                why = "its agent is connected but silent"
            else:
                dropped_at = self.core.dropped.get(n.name)
                dropped = dropped_at is not None and now - dropped_at >= self.config.drop_grace_s
                if not dropped and n.heartbeat_at is not None and now - n.heartbeat_at < self.config.node_timeout_s:
                    continue
                why = "its agent's connection dropped and it did not come back" if dropped else "no heartbeat"
            self.core.dropped.pop(n.name, None)
            with self.store.tx():
                self.store.set_node(n.name, state=NodeState.LOST.value)
            log.warning("node %s lost: %s (silent %.0f s)", n.name, why, now - (n.heartbeat_at or 0))
            for info in self.store.list_jobs(states=[s.value for s in JobState if s.holds_devices]):
                if any(p.node == n.name for p in info.placement):
                    with self.store.tx():
                        ev = self.core.emit(info.id, EventType.NODE_LOST,
                                        {"node": n.name, "silent_s": round(now - (n.heartbeat_at or now), 1),
                                         "why": why})
                    self.core.publish(info.user, [ev])
                    self.job_lost(info, f"node {n.name} was lost")
