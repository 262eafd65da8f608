"""The scheduler service's core: job lifecycle, agent bookkeeping, applying policy actions.

No HTTP here. The web layer (``app.py``) turns requests into calls on :class:`Service`, and
the agent channel turns WebSocket messages into ``agent_*`` calls. Every state change is
written to the store together with the event that explains it, then published.
"""
from __future__ import annotations

import base64
import json
import logging
import secrets
import socket
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

from pydantic import BaseModel

from backend.scheduler.fifo import fifo_policy
from backend.scheduler.types import Action, JobView, Migrate, NodeView, Place, Preempt, Resize, Snapshot
from singularity_sdk.protocol import (
    EXIT_PREEMPTED,
    MAX_CODE_BYTES,
    MAX_INPUTS_BYTES,
    MAX_RESULT_BYTES,
    AgentEvent,
    AgentHeartbeat,
    AgentHello,
    CheckpointJob,
    Event,
    EventType,
    JobInfo,
    JobState,
    NodeInfo,
    NodeState,
    Placement,
    RankSpec,
    ResultPayload,
    StartJob,
    StopJob,
    SubmitRequest,
    Welcome,
)

from .hub import Hub
from .store import Store

log = logging.getLogger("singularity.server")

#: Agent events that only add to the log (no state change), accepted for the current attempt.
PASS_THROUGH = {EventType.LOG, EventType.PROGRESS, EventType.TELEMETRY, EventType.CHECKPOINT_STARTED}


class ServiceError(Exception):
    """An error a client caused, with the HTTP status and the field it concerns."""

    def __init__(self, status: int, message: str, field: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.field = field


class AgentLink(Protocol):
    """The server's handle on one connected agent (a WebSocket in production)."""

    node: str

    def send(self, message: BaseModel) -> None: ...


@dataclass
class ServiceConfig:
    heartbeat_s: float = 1.0
    node_timeout_s: float = 10.0
    max_retries: int = 3
    retry_backoff_s: float = 0.5
    stop_grace_s: float = 1.0
    #: cluster default for jobs that do not set checkpoint_every (None: only on request)
    checkpoint_every: Optional[float] = None
    #: the scheduling policy: "singularity" (tiers, preemption, defragmentation) or "fifo"
    policy: str = "singularity"
    #: a job preempted or moved less than this long ago is not moved again (anti-thrash)
    min_move_interval_s: float = 60.0


Policy = Callable[[Snapshot], list[Action]]


class Service:
    def __init__(self, store: Store, config: ServiceConfig = ServiceConfig(), policy: Optional[Policy] = None):
        self.store = store
        self.config = config
        self.policy = policy or make_policy(config)
        self.hub = Hub()
        self.links: dict[str, AgentLink] = {}
        self._schedule_hook: Callable[[], None] = self.schedule_now
        self._wake_at: Callable[[float], None] = lambda when: None

    # ------------------------------------------------------------------ plumbing

    def set_schedule_hook(self, hook: Callable[[], None], wake_at: Callable[[float], None]) -> None:
        """Lets the asyncio layer coalesce many triggers into one scheduling round, and run
        one at a given time (when a retry's backoff ends)."""
        self._schedule_hook = hook
        self._wake_at = wake_at

    def _emit(self, job_id: str, type: EventType, data: dict[str, Any], when: Optional[float] = None) -> Event:
        return self.store.append_event(job_id, type, data, when)

    def _publish(self, user: str, events: list[Event]) -> None:
        if events:
            self.hub.publish(user, events)

    def _send(self, node: str, message: BaseModel) -> bool:
        link = self.links.get(node)
        if link is None:
            return False
        try:
            link.send(message)
            return True
        except Exception as exc:  # a dying socket must not break the caller's transaction
            log.warning("could not send %s to %s: %s", type(message).__name__, node, exc)
            return False

    # ------------------------------------------------------------------ users

    def authenticate(self, token: Optional[str]) -> tuple[str, str]:
        if not token:
            raise ServiceError(
                401,
                "missing token: send 'Authorization: Bearer <token>' (the SDK and CLI read "
                "SINGULARITY_TOKEN or $SINGULARITY_HOME/server.json)",
            )
        found = self.store.user_for_token(token)
        if found is None:
            raise ServiceError(
                401,
                "token not recognised by this server: check SINGULARITY_TOKEN, or the token in "
                "$SINGULARITY_HOME/server.json of the server you mean to reach",
            )
        return found

    def create_user(self, caller_role: str, user: str) -> str:
        if caller_role != "admin":
            raise ServiceError(403, "only the admin token (written to server.json by 'serve') can create users")
        if self.store.user_exists(user):
            raise ServiceError(409, f"user '{user}' already exists", "user")
        return self.store.ensure_user(user, "user")

    # ------------------------------------------------------------------ jobs: user side

    def capacity(self) -> int:
        return sum(len(n.devices) for n in self.store.nodes() if n.state != NodeState.DOWN)

    def submit(self, user: str, req: SubmitRequest) -> JobInfo:
        if (req.source is None) == (req.callable_b64 is None):
            raise ServiceError(422, "give exactly one of 'source' and 'callable_b64'", "source")
        code = req.source if req.source is not None else req.callable_b64
        size = len(code.encode("utf-8", "surrogatepass"))
        if size > MAX_CODE_BYTES:
            raise ServiceError(
                413,
                f"the job's code is {size / 1e6:.1f} MB; the limit is {MAX_CODE_BYTES / 1e6:.1f} MB. "
                "Keep data out of the code: write it to a file the job reads, or load it inside the job.",
                "source" if req.source is not None else "callable_b64",
            )
        if req.source is not None:
            try:
                compile(req.source, req.filename, "exec", dont_inherit=True)
            except SyntaxError as exc:
                raise ServiceError(
                    422, f"the code does not compile: {exc.msg} ({req.filename}, line {exc.lineno})", "source"
                ) from None
        ranks = req.ranks or req.gpus
        if req.gpus % ranks:
            raise ServiceError(
                422, f"--ranks {ranks} must divide --gpus {req.gpus} (each rank gets the same number of devices)",
                "ranks",
            )
        if req.inputs_b64 is not None and len(req.inputs_b64) * 3 // 4 > MAX_INPUTS_BYTES:
            raise ServiceError(
                413, f"the variables sent with the job are {len(req.inputs_b64) * 3 / 4e6:.1f} MB; the limit is "
                     f"{MAX_INPUTS_BYTES / 1e6:.0f} MB. Save large objects to a file the job loads.", "inputs_b64")
        cap = self.capacity()
        if cap and req.gpus > cap:
            nodes = self.store.nodes()
            shape = ", ".join(f"{n.name}: {len(n.devices)}" for n in nodes)
            raise ServiceError(
                422,
                f"the job asks for {req.gpus} devices but the whole cluster has {cap} ({shape}); "
                f"ask for at most {cap}",
                "gpus",
            )
        now = time.time()
        job_id = "j-" + secrets.token_hex(3)
        while self.store.job_row(job_id) is not None:
            job_id = "j-" + secrets.token_hex(4)
        name = req.name or (req.filename.rsplit("/", 1)[-1] if not req.filename.startswith("<") else job_id)
        with self.store.tx():
            self.store.insert_job(
                dict(
                    id=job_id, user=user, name=name, state=JobState.QUEUED.value, sla=req.sla.value,
                    gpus=req.gpus, ranks=ranks, source=req.source, callable_b64=req.callable_b64,
                    inputs_b64=req.inputs_b64, outputs_json=json.dumps(req.outputs),
                    filename=req.filename, env_json=json.dumps(req.env), checkpoint_every=req.checkpoint_every,
                    created_at=now, updated_at=now,
                )
            )
            ev = self._emit(
                job_id, EventType.SUBMITTED,
                {"user": user, "name": name, "gpus": req.gpus, "ranks": ranks, "sla": req.sla.value,
                 "kind": "source" if req.source is not None else "callable"},
                now,
            )
        self._publish(user, [ev])
        self._schedule_hook()
        return self.store.job_info(job_id)

    def job(self, user: str, job_id: str) -> JobInfo:
        info = self.store.job_info(job_id)
        if info is None or info.user != user:
            raise ServiceError(
                404, f"no job '{job_id}' among {user}'s jobs; 'singularityctl jobs' lists them", "job_id"
            )
        return info

    def jobs(self, user: str, states: Optional[list[str]] = None) -> list[JobInfo]:
        if states:
            valid = {s.value for s in JobState}
            bad = [s for s in states if s not in valid]
            if bad:
                raise ServiceError(422, f"unknown state '{bad[0]}'; choose from {', '.join(sorted(valid))}", "state")
        return self.store.list_jobs(user=user, states=states)

    def events(self, user: str, job_id: str, since: int = 0) -> list[Event]:
        self.job(user, job_id)
        return self.store.events(job_id, since)

    def logs(self, user: str, job_id: str) -> str:
        info = self.job(user, job_id)
        lines = self.store.log_lines(job_id)
        if info.ranks > 1:
            return "".join(f"[rank {r}] {line}" for r, _s, line in lines)
        return "".join(line for _r, _s, line in lines)

    def result(self, user: str, job_id: str) -> ResultPayload:
        self.job(user, job_id)
        row = self.store.job_row(job_id)
        b64 = lambda raw: base64.b64encode(raw).decode() if raw else None  # noqa: E731
        return ResultPayload(job_id=job_id, pickle_b64=b64(row["result_pickle"]), repr=row["result_repr"] or "",
                             error=row["result_error"], outputs_b64=b64(row["outputs_pickle"]),
                             outputs_skipped=json.loads(row["outputs_skipped_json"] or "{}"))

    def cancel(self, user: str, job_id: str, reason: str = "") -> JobInfo:
        info = self.job(user, job_id)
        if info.state.is_terminal:
            raise ServiceError(409, f"job {job_id} already {info.state.value}; nothing to cancel", "job_id")
        row = self.store.job_row(job_id)
        events: list[Event] = []
        with self.store.tx():
            data = {"by": user, "reason": reason or "cancelled by user"}
            if not info.state.holds_devices:
                self.store.update_job(job_id, state=JobState.CANCELLED.value, ended_at=time.time())
                events.append(self._emit(job_id, EventType.CANCELLED, data))
            elif row["stop_reason"] != "cancel":
                self.store.update_job(job_id, stop_reason="cancel", state=JobState.RUNNING.value
                                      if info.state == JobState.PREEMPTING else info.state.value)
                events.append(self._emit(job_id, EventType.CANCEL_REQUESTED, data))
        self._publish(user, events)
        if info.state.holds_devices:
            self._stop_everywhere(info, "cancelled")
        else:
            self._schedule_hook()
        return self.store.job_info(job_id)

    def preempt(self, user: str, job_id: str, reason: str = "", by: Optional[str] = None,
                requeue: bool = False) -> JobInfo:
        """Ask the job's ranks to checkpoint at their next safe point and exit; devices are
        freed when all have. A checkpoint that fails leaves the job running (event says why).
        ``requeue``: queue it again at once (scheduler and drain), instead of waiting for resume."""
        info = self._require(user, job_id, JobState.RUNNING, "preempted")
        detail = {"reason": reason or "preempted by user", "by": by or user, "requeue": requeue}
        with self.store.tx():
            self.store.update_job(job_id, state=JobState.PREEMPTING.value, stop_reason="preempt",
                                  stop_detail_json=json.dumps(detail), moved_at=time.time())
            ev = self._emit(job_id, EventType.PREEMPTING, detail)
        self._publish(info.user, [ev])
        self._checkpoint_everywhere(info, "stop", detail["reason"])
        return self.store.job_info(job_id)

    def resume(self, user: str, job_id: str) -> JobInfo:
        """Put a preempted job back in the queue; it continues from its newest checkpoint."""
        self._require(user, job_id, JobState.PREEMPTED, "resumed")
        with self.store.tx():
            self.store.update_job(job_id, state=JobState.QUEUED.value, placement_json="[]")
        self._schedule_hook()
        return self.store.job_info(job_id)

    def checkpoint(self, user: str, job_id: str, reason: str = "") -> JobInfo:
        """A checkpoint at the next safe point; the job keeps running."""
        info = self._require(user, job_id, JobState.RUNNING, "checkpointed")
        self._checkpoint_everywhere(info, "continue", reason or f"requested by {user}")
        return info

    def _require(self, user: str, job_id: str, state: JobState, verb: str) -> JobInfo:
        info = self.job(user, job_id)
        if info.state != state:
            raise ServiceError(409, f"job {job_id} is {info.state.value}; only a {state.value} job can be {verb}",
                               "job_id")
        return info

    def _checkpoint_everywhere(self, info: JobInfo, then: str, reason: str) -> None:
        for p in info.placement:
            self._send(p.node, CheckpointJob(job_id=info.id, attempt=info.attempt, then=then, reason=reason))

    def _stop_everywhere(self, info: JobInfo, reason: str) -> None:
        for p in info.placement:
            self._send(p.node, StopJob(job_id=info.id, attempt=info.attempt, reason=reason,
                                       grace_s=self.config.stop_grace_s))

    # ------------------------------------------------------------------ nodes

    def nodes(self) -> list[NodeInfo]:
        used: dict[str, dict[int, str]] = {}
        for info in self.store.list_jobs(states=[s.value for s in JobState if s.holds_devices]):
            for p in info.placement:
                for d in p.devices:
                    used.setdefault(p.node, {})[d] = info.id
        out = []
        for n in self.store.nodes():
            n.used = used.get(n.name, {})
            out.append(n)
        return out

    # ------------------------------------------------------------------ agent side

    def agent_hello(self, link: AgentLink, hello: AgentHello) -> Welcome:
        with self.store.tx():
            acked = self.store.upsert_node(hello.node, hello.devices, hello.instance)
        self.links[hello.node] = link
        log.info("agent %s connected (%d devices, instance %s)", hello.node, len(hello.devices), hello.instance)
        self._reconcile(hello.node, {tuple(k) for k in hello.known_jobs})
        self._schedule_hook()
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
                self._send(node, StopJob(job_id=job_id, attempt=attempt, reason="stale: not placed here",
                                         grace_s=self.config.stop_grace_s))
        # Jobs we placed there whose workers the agent does not know: they are gone.
        for job_id, info in placed_here.items():
            if (job_id, info.attempt) not in known:
                self._job_lost(info, f"its workers on {node} are gone (the node agent restarted)")

    def agent_disconnected(self, link: AgentLink) -> None:
        if self.links.get(link.node) is link:
            del self.links[link.node]
            log.info("agent %s disconnected", link.node)

    def agent_heartbeat(self, node: str, hb: AgentHeartbeat) -> None:
        self.store.set_node(node, heartbeat_at=time.time())

    def agent_events(self, node: str, events: list[AgentEvent]) -> int:
        """Apply a batch of agent events exactly once; returns the highest applied agent_seq."""
        published: list[tuple[str, Event]] = []
        followups: list[Callable[[], None]] = []
        with self.store.tx():
            acked = self.store.node_acked(node)
            for ae in events:
                if ae.agent_seq <= acked:
                    continue  # a replay of something already committed
                acked = ae.agent_seq
                self._apply_agent_event(node, ae, published, followups)
            self.store.set_node(node, acked_seq=acked, heartbeat_at=time.time())
        by_user: dict[str, list[Event]] = {}
        for user, ev in published:
            by_user.setdefault(user, []).append(ev)
        for user, evs in by_user.items():
            self._publish(user, evs)
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
            out.append((user, self._emit(ae.job_id, type, data, when)))

        if ae.type in PASS_THROUGH:
            emit(ae.type, ae.data, ae.time)
        elif ae.type == EventType.CHECKPOINTED:
            self.store.update_job(ae.job_id, last_checkpoint_json=json.dumps({**ae.data, "time": ae.time}))
            emit(ae.type, ae.data, ae.time)
        elif ae.type == EventType.CHECKPOINT_FAILED:
            emit(ae.type, ae.data, ae.time)
            if state == JobState.PREEMPTING and row["stop_reason"] == "preempt":
                # The preemption is answered with the error; the job runs on untouched.
                self.store.update_job(ae.job_id, state=JobState.RUNNING.value, stop_reason=None,
                                      stop_detail_json=None)
        elif ae.type == EventType.RESUMED:
            emit(ae.type, {**ae.data, "node": node, "attempt": ae.attempt,
                           "placement": json.loads(row["placement_json"])}, ae.time)
            if state == JobState.MIGRATING:
                moved = json.loads(row["migration_json"] or "{}")
                to = ",".join(p["node"] for p in json.loads(row["placement_json"]))
                self.store.update_job(ae.job_id, state=JobState.RUNNING.value)
                emit(EventType.MIGRATED, {"from": moved.get("from"), "to": to, "step": ae.data.get("step"),
                                          "seconds": round(ae.time - moved.get("requested_at", ae.time), 3)})
        elif ae.type == EventType.STARTED:
            if row["started_at"] is None:
                self.store.update_job(ae.job_id, started_at=ae.time)
            emit(EventType.STARTED, {**ae.data, "node": node}, ae.time)
        elif ae.type == EventType.RESULT:
            blob = ae.data.get("pickle_b64")
            raw = base64.b64decode(blob) if blob else None
            err = ae.data.get("error")
            if raw is not None and len(raw) > MAX_RESULT_BYTES:
                raw, err = None, f"the result is {len(raw) / 1e6:.1f} MB, over the {MAX_RESULT_BYTES / 1e6:.0f} MB limit; save large outputs to files instead"
            outs = ae.data.get("outputs_b64")
            outs_raw = base64.b64decode(outs) if outs else None
            skipped = dict(ae.data.get("outputs_skipped") or {})
            if outs_raw is not None and len(outs_raw) > MAX_RESULT_BYTES:
                skipped["*"] = f"the variables to return are {len(outs_raw) / 1e6:.1f} MB, over the limit"
                outs_raw = None
            self.store.update_job(ae.job_id, result_pickle=raw, result_repr=ae.data.get("repr", ""), result_error=err,
                                  outputs_pickle=outs_raw, outputs_skipped_json=json.dumps(skipped))
            emit(EventType.RESULT, {"repr": (ae.data.get("repr") or "")[:2000], "bytes": len(raw or b""), "error": err},
                 ae.time)
        elif ae.type == EventType.WORKER_EXITED:
            emit(EventType.WORKER_EXITED, {**ae.data, "node": node}, ae.time)
            if state.holds_devices:
                self._rank_exited(row, ae, emit, followups)
        else:
            log.warning("agent %s sent an event type the server does not take: %s", node, ae.type)

    def _rank_exited(self, row, ae: AgentEvent, emit, followups: list[Callable[[], None]]) -> None:
        """Record one rank's exit; once all ranks are down, settle the job by why it stopped."""
        job_id = row["id"]
        exited = json.loads(row["exited_json"])
        rank = int(ae.data.get("rank", 0))
        code = int(ae.data.get("code", -1))
        exited[str(rank)] = code
        updates: dict[str, Any] = {"exited_json": json.dumps(exited)}
        stop_reason = row["stop_reason"]
        if code not in (0, EXIT_PREEMPTED) and stop_reason not in ("cancel", "failed", "crashed"):
            # First failure: the user's code raised (fail) or the process died (retry).
            why = ae.data.get("error") or f"rank {rank} exited with code {code}"
            stop_reason = "failed" if ae.data.get("user_error") else "crashed"
            updates.update(stop_reason=stop_reason, error=why)
            info = self.store.job_info(job_id)
            followups.append(lambda info=info: self._stop_everywhere(info, f"rank {rank} {stop_reason}"))
        if len(exited) < row["ranks"]:
            self.store.update_job(job_id, **updates)
            return
        codes = set(exited.values())
        stopped_at_checkpoint = EXIT_PREEMPTED in codes and codes <= {0, EXIT_PREEMPTED}
        detail = json.loads(row["stop_detail_json"] or "{}")
        updates.update(stop_reason=None, stop_detail_json=None)
        now = time.time()
        if stop_reason == "cancel":
            self._settle(job_id, updates, JobState.CANCELLED, EventType.CANCELLED, {"reason": "workers stopped"}, emit)
        elif stop_reason == "failed":
            err = updates.get("error", row["error"])
            self._settle(job_id, updates, JobState.FAILED, EventType.FAILED, {"error": err}, emit)
        elif stop_reason == "crashed":
            self.store.update_job(job_id, **updates)
            self._retry_or_fail(row, updates.get("error", row["error"]), emit)
        elif stop_reason == "preempt" and stopped_at_checkpoint:
            ckpt = json.loads(self.store.job_row(job_id)["last_checkpoint_json"] or "{}")
            self._settle(job_id, updates, JobState.QUEUED if detail.get("requeue") else JobState.PREEMPTED,
                         EventType.PREEMPTED,
                         {**detail, "step": ckpt.get("step"), "bytes": ckpt.get("bytes"), "checkpoint": ckpt.get("path")},
                         emit)
        elif stop_reason == "migrate" and stopped_at_checkpoint:
            self.store.update_job(job_id, **updates)
            followups.append(lambda: self._migrate_onwards(job_id, detail))
        else:
            self._settle(job_id, updates, JobState.SUCCEEDED, EventType.SUCCEEDED,
                         {"seconds": round(now - (row["started_at"] or now), 3)}, emit)
        followups.append(self._schedule_hook)

    def _settle(self, job_id: str, updates: dict[str, Any], state: JobState, etype: EventType,
                data: dict[str, Any], emit) -> None:
        updates["state"] = state.value
        if state.is_terminal:
            updates["ended_at"] = time.time()
        self.store.update_job(job_id, **updates)
        emit(etype, data)

    def _retry_or_fail(self, row, why: str, emit) -> None:
        """Requeue a job whose processes died (not its code), with backoff, from its newest checkpoint."""
        retries = row["retries"] + 1
        if retries > self.config.max_retries:
            err = f"{why}\n(gave up after {row['retries']} retries)"
            self.store.update_job(row["id"], state=JobState.FAILED.value, ended_at=time.time(), error=err)
            emit(EventType.FAILED, {"error": err})
            return
        delay = min(self.config.retry_backoff_s * 2 ** (retries - 1), 60.0)
        ckpt = json.loads(row["last_checkpoint_json"] or "{}")
        self.store.update_job(row["id"], state=JobState.QUEUED.value, retries=retries, stop_reason=None,
                              exited_json="{}", not_before=time.time() + delay, error=None)
        emit(EventType.RETRYING, {"attempt": row["attempt"] + 1, "why": why.strip().splitlines()[-1] if why else "",
                                  "retries": retries, "backoff_s": delay, "from_step": ckpt.get("step")})
        self._wake_at(time.time() + delay)

    def _job_lost(self, info: JobInfo, why: str) -> None:
        """Workers vanished without reporting an exit: retry or fail, and free the devices."""
        row = self.store.job_row(info.id)
        events: list[Event] = []

        def emit(type: EventType, data: dict[str, Any]) -> None:
            events.append(self._emit(info.id, type, data))

        with self.store.tx():
            if row["stop_reason"] == "cancel":
                self.store.update_job(info.id, state=JobState.CANCELLED.value, ended_at=time.time(), stop_reason=None)
                emit(EventType.CANCELLED, {"reason": why})
            else:
                self._retry_or_fail(row, why, emit)
        self._publish(info.user, events)
        self._schedule_hook()

    def check_nodes(self, now: Optional[float] = None) -> None:
        """Mark nodes whose agent has been silent too long as lost, and move their jobs on."""
        now = time.time() if now is None else now
        for n in self.store.nodes():
            if n.state in (NodeState.LOST, NodeState.DOWN) or n.name in self.links:
                continue
            if n.heartbeat_at is not None and now - n.heartbeat_at < self.config.node_timeout_s:
                continue
            with self.store.tx():
                self.store.set_node(n.name, state=NodeState.LOST.value)
            log.warning("node %s lost: no heartbeat for %.0f s", n.name, now - (n.heartbeat_at or 0))
            for info in self.store.list_jobs(states=[s.value for s in JobState if s.holds_devices]):
                if any(p.node == n.name for p in info.placement):
                    with self.store.tx():
                        ev = self._emit(info.id, EventType.NODE_LOST,
                                        {"node": n.name, "silent_s": round(now - (n.heartbeat_at or now), 1)})
                    self._publish(info.user, [ev])
                    self._job_lost(info, f"node {n.name} was lost")

    # ------------------------------------------------------------------ scheduling

    def snapshot(self) -> Snapshot:
        nodes_info = self.nodes()
        nodes = tuple(
            NodeView(
                name=n.name,
                devices=tuple(d.index for d in n.devices),
                used=dict(n.used),
                schedulable=n.state == NodeState.READY and n.name in self.links,
            )
            for n in nodes_info
        )
        jobs = []
        now = time.time()
        for row in self.store.active_job_rows():
            if row["not_before"] is not None and row["not_before"] > now:
                continue  # backing off before a retry
            if row["state"] == JobState.PREEMPTED.value:
                continue  # preempted by its user: it waits for them to resume it
            placement = {p["node"]: tuple(p["devices"]) for p in json.loads(row["placement_json"])}
            jobs.append(
                JobView(id=row["id"], user=row["user"], sla=row["sla"], state=JobState(row["state"]),
                        gpus=row["gpus"], submitted_at=row["created_at"], last_moved_at=row["moved_at"],
                        last_checkpoint_at=json.loads(row["last_checkpoint_json"] or "{}").get("time"),
                        placement=placement if JobState(row["state"]).holds_devices else {})
            )
        return Snapshot(now=time.time(), nodes=nodes, jobs=tuple(jobs))

    def schedule_now(self) -> list[Action]:
        """One round: the policy's actions, applied in order.

        Preemptions and migrations complete asynchronously (a checkpoint first), so while any is
        in flight no new one starts: the next round, triggered when the devices come free, sees
        the outcome instead of taking more victims for the same need. A Place whose devices are
        still held waits for that round too."""
        snapshot = self.snapshot()
        actions = self.policy(snapshot)
        moving = any(j.state in (JobState.PREEMPTING, JobState.MIGRATING, JobState.RESIZING) for j in snapshot.jobs)
        held = {(n.name, d) for n in snapshot.nodes for d in n.used}
        for action in actions:
            try:
                if isinstance(action, Place):
                    if any((node, d) in held for node, devs in action.placement.items() for d in devs):
                        continue
                    self._apply_place(action)
                    held |= {(node, d) for node, devs in action.placement.items() for d in devs}
                elif isinstance(action, Preempt) and not moving:
                    info = self.store.job_info(action.job_id)
                    self.preempt(info.user, info.id, action.reason, by="scheduler", requeue=True)
                elif isinstance(action, Migrate) and not moving:
                    info = self.store.job_info(action.job_id)
                    self.migrate(info.user, info.id, next(iter(action.placement)), action.reason, by="scheduler")
                elif isinstance(action, Resize):
                    log.info("policy asked to resize %s; elastic resize is not available yet", action.job_id)
            except ServiceError as exc:  # the world moved since the snapshot (a job ended meanwhile)
                log.info("skipped %s for %s: %s", type(action).__name__, action.job_id, exc.message)
        return actions

    def _apply_place(self, action: Place) -> None:
        row = self.store.job_row(action.job_id)
        if row is None or JobState(row["state"]) != JobState.QUEUED:
            return
        self._start_attempt(row, action.placement, action.reason, JobState.RUNNING)

    def _start_attempt(self, row, placement: dict[str, tuple[int, ...]], reason: str, state: JobState) -> None:
        """Record a new attempt on ``placement`` and tell each agent involved to start its ranks.

        The attempt number fences everything the previous attempt's processes still send."""
        job_id = row["id"]
        attempt = row["attempt"] + 1
        world = row["ranks"]
        per_rank = row["gpus"] // world
        # Ranks take devices in placement order, so co-located ranks are contiguous.
        flat = [(node, d) for node, devs in placement.items() for d in devs]
        placements: dict[str, Placement] = {}
        rank_specs: dict[str, list[RankSpec]] = {}
        for rank in range(world):
            mine = flat[rank * per_rank:(rank + 1) * per_rank]
            node = mine[0][0]
            p = placements.setdefault(node, Placement(node=node, devices=[], ranks=[]))
            p.devices.extend(d for _n, d in mine)
            p.ranks.append(rank)
            specs = rank_specs.setdefault(node, [])
            specs.append(RankSpec(rank=rank, local_rank=len(specs), devices=[d for _n, d in mine]))
        placement_json = [p.model_dump() for p in placements.values()]
        with self.store.tx():
            self.store.update_job(job_id, state=state.value, attempt=attempt, stop_reason=None, exited_json="{}",
                                  placement_json=json.dumps(placement_json), error=None, not_before=None)
            ev = self._emit(job_id, EventType.SCHEDULED,
                            {"attempt": attempt, "reason": reason, "placement": placement_json})
        self._publish(row["user"], [ev])
        checkpoint = json.loads(row["last_checkpoint_json"])["path"] if row["last_checkpoint_json"] else None
        master_port = _free_port()
        for node, specs in rank_specs.items():
            msg = StartJob(
                job_id=job_id, attempt=attempt, world_size=world, local_world_size=len(specs), ranks=specs,
                master_addr="127.0.0.1", master_port=master_port,
                source=row["source"], callable_b64=row["callable_b64"], filename=row["filename"],
                inputs_b64=row["inputs_b64"], outputs=json.loads(row["outputs_json"]),
                env=json.loads(row["env_json"]), checkpoint_every=row["checkpoint_every"] or self.config.checkpoint_every,
                restore=checkpoint,
            )
            if not self._send(node, msg):
                info = self.store.job_info(job_id)
                self._job_lost(info, f"node {node} went away while the job was being started")
                return

    # ------------------------------------------------------------------ migration and drain

    def migrate(self, user: str, job_id: str, to: Optional[str] = None, reason: str = "",
                by: Optional[str] = None) -> JobInfo:
        """Checkpoint the job where it runs, then restore it on ``to`` (or wherever fits)."""
        info = self._require(user, job_id, JobState.RUNNING, "migrated")
        sources = {p.node for p in info.placement}
        if to is not None:
            node = next((n for n in self.store.nodes() if n.name == to), None)
            if node is None:
                names = ", ".join(n.name for n in self.store.nodes())
                raise ServiceError(404, f"no node '{to}'; nodes are: {names}", "node")
            if to in sources:
                raise ServiceError(409, f"job {job_id} already runs on {to}", "node")
        target = self._find_room(info.gpus, exclude=sources, only=to)
        if target is None:
            where = to or "any other node"
            raise ServiceError(409, f"{where} has no room for {info.gpus} device(s) now; free some or drain later",
                               "node")
        detail = {"from": ",".join(sorted(sources)), "to": to, "reason": reason or f"requested by {by or user}",
                  "by": by or user, "requested_at": time.time()}
        with self.store.tx():
            self.store.update_job(job_id, state=JobState.MIGRATING.value, stop_reason="migrate",
                                  stop_detail_json=json.dumps(detail), migration_json=json.dumps(detail),
                                  moved_at=time.time())
            ev = self._emit(job_id, EventType.MIGRATING, detail)
        self._publish(info.user, [ev])
        self._checkpoint_everywhere(info, "stop", detail["reason"])
        return self.store.job_info(job_id)

    def _find_room(self, gpus: int, exclude: set[str] = frozenset(), only: Optional[str] = None):
        from backend.scheduler.fifo import pick_devices

        snap = self.snapshot()
        nodes = [n for n in snap.nodes if n.schedulable and n.name not in exclude and (only is None or n.name == only)]
        return pick_devices(nodes, {n.name: list(n.free) for n in nodes}, gpus)

    def _migrate_onwards(self, job_id: str, detail: dict[str, Any]) -> None:
        """The source ranks stopped at a checkpoint: start the job at its destination."""
        row = self.store.job_row(job_id)
        sources = set(detail.get("from", "").split(","))
        target = self._find_room(row["gpus"], exclude=sources, only=detail.get("to"))
        if target is None:  # the room went away meanwhile: wait in the queue, resume anywhere
            with self.store.tx():
                self.store.update_job(job_id, state=JobState.QUEUED.value)
                ev = self._emit(job_id, EventType.PREEMPTED,
                                {"reason": "migration target is full; waiting for room", "by": "scheduler"})
            self._publish(row["user"], [ev])
            self._schedule_hook()
            return
        where = ", ".join(f"{n} {list(d)}" for n, d in target.items())
        self._start_attempt(row, target, f"migration to {where}", JobState.MIGRATING)

    def drain(self, caller_role: str, node: str) -> NodeInfo:
        """Move every job off ``node`` and take no new work there until undrained."""
        self._admin(caller_role, "drain")
        self._node(node)
        with self.store.tx():
            self.store.set_node(node, state=NodeState.DRAINING.value)
        for info in self.store.list_jobs(states=[JobState.RUNNING.value]):
            if any(p.node == node for p in info.placement):
                try:
                    self.migrate(info.user, info.id, reason=f"node {node} is draining", by="drain")
                except ServiceError as exc:  # no room elsewhere now: checkpoint, queue, resume when there is
                    log.info("drain %s: %s; preempting %s instead", node, exc.message, info.id)
                    self.preempt(info.user, info.id, reason=f"node {node} is draining (no room elsewhere)",
                                 by="drain", requeue=True)
        self._schedule_hook()
        return self._node(node)

    def undrain(self, caller_role: str, node: str) -> NodeInfo:
        self._admin(caller_role, "undrain")
        if self._node(node).state == NodeState.DRAINING:
            with self.store.tx():
                self.store.set_node(node, state=NodeState.READY.value)
        self._schedule_hook()
        return self._node(node)

    def _admin(self, role: str, verb: str) -> None:
        if role != "admin":
            raise ServiceError(403, f"only the admin token (server.json of 'serve') may {verb} nodes")

    def _node(self, name: str) -> NodeInfo:
        for n in self.nodes():
            if n.name == name:
                return n
        raise ServiceError(404, f"no node '{name}'; nodes are: {', '.join(n.name for n in self.store.nodes())}",
                           "node")


def make_policy(config: ServiceConfig) -> Policy:
    """The live policy. Jobs are not shrunk (every tier's minimum is its full size) until
    elastic resize lands: capacity is taken back by preemption and migration only."""
    if config.policy == "fifo":
        return fifo_policy
    if config.policy != "singularity":
        raise ValueError(f"unknown policy {config.policy!r}; choose from: singularity, fifo")
    from backend.scheduler.singularity import SingularityPolicy
    from backend.scheduler.tiers import PolicyConfig

    return SingularityPolicy(PolicyConfig(standard_min_fraction=1.0, basic_min_fraction=1.0,
                                          min_move_interval_s=config.min_move_interval_s, overhead_s=5.0))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
