"""Moving running jobs: preempt, resume, checkpoint on request, migrate, and node drain.

Each is a checkpoint request to the job's agents; what happens once the ranks have stopped at
that checkpoint is settled in ``agent_side`` when their exits arrive."""
from __future__ import annotations

import json
import logging
import time
from dataclasses import replace
from typing import Any, Iterable, Optional

from backend.scheduler.placement import FreeDevices, fmt_placement
from singularity_sdk.protocol import (CheckpointJob, EventType, JobInfo, JobState, NodeInfo, NodeState,
                                      PrefetchCheckpoint)

from . import exact_nodes, ranks
from .core import Core, Rounds, ServiceError
from .lifecycle import Stop

log = logging.getLogger("singularity.server")


class Moves:
    """Preempt, resume, checkpoint, migrate, resize, drain: requests that stop a job's ranks at a
    checkpoint and place it again."""

    scheduling: Rounds  # wired by Service: where a moved job's next attempt starts

    def __init__(self, core: Core) -> None:
        self.core = core
        self.store = core.store
        self.config = core.config

    def preempt(self, user: str, job_id: str, reason: str = "", by: Optional[str] = None,
                requeue: bool = False, checkpoint_timeout: Optional[float] = None) -> JobInfo:
        """Ask the job's ranks to checkpoint at their next safe point and exit; devices are
        freed when all have. A checkpoint that fails leaves the job running (event says why).
        ``requeue``: queue it again at once (scheduler and drain), instead of waiting for resume."""
        info = self._require(user, job_id, JobState.RUNNING, "preempted")
        detail = {"reason": reason or "preempted by user", "by": by or user, "requeue": requeue,
                  "checkpoint_timeout": self._bound(checkpoint_timeout)}
        with self.store.tx():
            self.store.update_job(job_id, state=JobState.PREEMPTING.value, stop_reason=Stop.PREEMPT.value,
                                  stop_detail_json=json.dumps(detail), moved_at=time.time())
            ev = self.core.emit(job_id, EventType.PREEMPTING, detail)
        self.core.publish(info.user, [ev])
        self._checkpoint_everywhere(info, "stop", detail["reason"], detail["checkpoint_timeout"])
        return self.store.job_info(job_id)

    def resume(self, user: str, job_id: str) -> JobInfo:
        """Put a preempted job back in the queue; it continues from its newest checkpoint."""
        self._require(user, job_id, JobState.PREEMPTED, "resumed")
        with self.store.tx():
            self.store.update_job(job_id, state=JobState.QUEUED.value, placement_json="[]")
        self.core.schedule()
        return self.store.job_info(job_id)

    def checkpoint(self, user: str, job_id: str, reason: str = "",
                   checkpoint_timeout: Optional[float] = None) -> JobInfo:
        """A checkpoint at the next safe point; the job keeps running."""
        info = self._require(user, job_id, JobState.RUNNING, "checkpointed")
        self._checkpoint_everywhere(info, "continue", reason or f"requested by {user}",
                                    self._bound(checkpoint_timeout))
        return info

    def _bound(self, checkpoint_timeout: Optional[float]) -> float:
        """The request's bound on reaching a safe point: its own, else the server's."""
        return float(checkpoint_timeout or self.config.checkpoint_timeout_s)

    def _require(self, user: str, job_id: str, state: JobState, verb: str) -> JobInfo:
        info = self.core.job(user, job_id)
        if info.state != state:
            raise ServiceError(409, f"job {job_id} is {info.state.value}; only a {state.value} job can be {verb}",
                               "job_id")
        return info

    def _checkpoint_everywhere(self, info: JobInfo, then: str, reason: str, timeout_s: float) -> None:
        for p in {p.node for p in info.placement}:
            self.core.send(p, CheckpointJob(job_id=info.id, attempt=info.attempt, then=then, reason=reason,
                                        timeout_s=timeout_s))

    def migrate(self, user: str, job_id: str, to: Optional[str] = None, reason: str = "",
                by: Optional[str] = None, checkpoint_timeout: Optional[float] = None) -> JobInfo:
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
        fp = exact_nodes.moving(self.store.job_row(job_id), sources, self.core.fingerprints)
        among = exact_nodes.allowed(fp, self.store.nodes(), self.core.fingerprints)
        if to is not None and exact_nodes.why_not(fp, to, self.core.fingerprints):
            raise ServiceError(409, f"job {job_id} would not resume exactly on {to}: "
                                    f"{exact_nodes.why_not(fp, to, self.core.fingerprints)}", "node")
        if to is None and fp and among is None:
            others = "; ".join(f"{n.name}: {exact_nodes.why_not(fp, n.name, self.core.fingerprints)}"
                               for n in self.store.nodes() if n.name not in sources)
            raise ServiceError(409, f"no other node resumes job {job_id} exactly ({others})", "node")
        target = self._find_room(info.gpus, exclude=sources, only=to, among=among)
        if target is None:
            where = to or ("any other node" if among is None else
                           f"any other node where it resumes exactly ({', '.join(sorted(among - sources)) or 'none'})")
            raise ServiceError(409, f"{where} has no room for {info.gpus} device(s) now; free some or drain later",
                               "node")
        detail = {"from": ",".join(sorted(sources)), "to": to, "reason": reason or f"requested by {by or user}",
                  "by": by or user, "requested_at": time.time(), "checkpoint_timeout": self._bound(checkpoint_timeout),
                  "prefetching": sorted(target)}
        with self.store.tx():
            self.store.update_job(job_id, state=JobState.MIGRATING.value, stop_reason=Stop.MIGRATE.value,
                                  stop_detail_json=json.dumps(detail), migration_json=json.dumps(detail),
                                  moved_at=time.time())
            ev = self.core.emit(job_id, EventType.MIGRATING, detail)
        self.core.publish(info.user, [ev])
        for node in target:  # through a store, the destination copies the checkpoint as it is written
            self.core.send(node, PrefetchCheckpoint(job_id=job_id, attempt=info.attempt))
        self._checkpoint_everywhere(info, "stop", detail["reason"], detail["checkpoint_timeout"])
        return self.store.job_info(job_id)

    def resize(self, user: str, job_id: str, gpus: Optional[int], reason: str = "", by: Optional[str] = None,
               placement: Optional[dict[str, tuple[int, ...]]] = None,
               checkpoint_timeout: Optional[float] = None) -> JobInfo:
        """Run the job on ``gpus`` devices from now on, keeping its ranks: a consistent checkpoint,
        then all ranks restart on the new placement (several ranks per device when fewer devices
        than ranks). A queued or preempted job just changes size. ``placement``: where (the
        scheduler's choice); otherwise wherever fits, preferring to pack."""
        info = self.core.job(user, job_id)
        if gpus is None:
            raise ServiceError(422, "say how many devices: resize needs gpus", "gpus")
        valid = ranks.choices(info.ranks, self.core.capacity() or gpus)
        if gpus not in valid:
            hint = "" if info.ranks > 1 else "; submit with --ranks N for a job that can change size"
            raise ServiceError(422, f"job {job_id} has {info.ranks} rank(s), so it can run on "
                                    f"{', '.join(map(str, valid))} device(s), not {gpus}{hint}", "gpus")
        now_on = sum(len(p.devices) for p in info.placement) if info.state.holds_devices else info.gpus
        detail = {"from": now_on, "to": gpus, "splicing": info.ranks // gpus if gpus < info.ranks else 1,
                  "reason": reason or f"requested by {by or user}", "by": by or user, "requested_at": time.time(),
                  "checkpoint_timeout": self._bound(checkpoint_timeout)}
        # A user's resize changes what the job asks for; the scheduler's (shrink, grow back) only
        # where it runs for now, so the job grows back to its request when devices free up.
        by_user = placement is None
        if by_user:
            detail["request_was"] = info.gpus
        if info.state in (JobState.QUEUED, JobState.PREEMPTED) and by_user:
            with self.store.tx():
                self.store.update_job(job_id, gpus=gpus)
                ev = self.core.emit(job_id, EventType.RESIZED, {**detail, "seconds": 0.0, "queued": True})
            self.core.publish(info.user, [ev])
            self.core.schedule()
            return self.store.job_info(job_id)
        self._require(user, job_id, JobState.RUNNING, "resized")
        if gpus == now_on:
            raise ServiceError(409, f"job {job_id} already runs on {gpus} device(s)", "gpus")
        own = {p.node: tuple(p.devices) for p in info.placement}
        among = exact_nodes.allowed(exact_nodes.moving(self.store.job_row(job_id), own, self.core.fingerprints),
                                    self.store.nodes(), self.core.fingerprints)
        if placement is None and self._find_room(gpus, also=own, among=among) is None:
            raise ServiceError(409, f"no room for {gpus} device(s) now (counting the job's own {now_on}); "
                                    f"free some devices or try a smaller size", "gpus")
        detail.update(since_seq=info.last_seq, placement={n: list(d) for n, d in (placement or {}).items()})
        with self.store.tx():
            self.store.update_job(job_id, state=JobState.RESIZING.value, stop_reason=Stop.RESIZE.value,
                                  gpus=gpus if by_user else info.gpus,
                                  stop_detail_json=json.dumps(detail), migration_json=json.dumps(detail),
                                  moved_at=time.time())
            ev = self.core.emit(job_id, EventType.RESIZING, {k: v for k, v in detail.items() if k != "since_seq"})
        self.core.publish(info.user, [ev])
        self._checkpoint_everywhere(info, "stop", detail["reason"], detail["checkpoint_timeout"])
        return self.store.job_info(job_id)

    def resize_onwards(self, job_id: str, detail: dict[str, Any]) -> None:
        """All ranks stopped at a consistent checkpoint: start them again on the new placement."""
        row = self.store.job_row(job_id)
        own = {p["node"]: tuple(p["devices"]) for p in json.loads(row["placement_json"])}  # still "held" by it
        wanted = {n: tuple(d) for n, d in (detail.get("placement") or {}).items()}
        size = int(detail.get("to", row["gpus"]))
        among = exact_nodes.allowed(exact_nodes.recorded(row), self.store.nodes(), self.core.fingerprints)
        if wanted and among is not None and not set(wanted) <= among:
            wanted = {}  # the scheduler's choice predates the checkpoint: resume where it is exact
        target = wanted if wanted and self._is_free(wanted, own) else self._find_room(size, also=own, among=among)
        if target is None:  # someone took the room meanwhile: wait in the queue
            with self.store.tx():
                self.store.update_job(job_id, state=JobState.QUEUED.value)
                ev = self.core.emit(job_id, EventType.PREEMPTED,
                                {"reason": f"no room for {size} device(s) after the resize; waiting",
                                 "by": "scheduler"})
            self.core.publish(row["user"], [ev])
            self.core.schedule()
            return
        self.scheduling.start_attempt(row, target, f"resize to {size} device(s): {fmt_placement(target)}",
                                      JobState.RESIZING)

    def _is_free(self, placement: dict[str, tuple[int, ...]], also: dict[str, tuple[int, ...]]) -> bool:
        """Whether every device of ``placement`` is free now, counting ``also`` as free."""
        nodes = {n.name: n for n in self.scheduling.snapshot().nodes}
        return all(n in nodes and nodes[n].schedulable and set(d) <= {*nodes[n].free, *also.get(n, ())}
                   for n, d in placement.items())

    def _find_room(self, gpus: int, exclude: set[str] = frozenset(), only: Optional[str] = None,
                   also: Optional[dict[str, tuple[int, ...]]] = None, among: Optional[frozenset[str]] = None):
        """Devices for ``gpus`` now, by the scheduler's own placement rule (``placement.py``: one
        node when the job fits one, best fit), counting ``also`` as free; only on ``among`` when
        given (where the job's checkpoint resumes exactly), only on ``only`` when given, never on
        ``exclude`` (the nodes it leaves)."""
        extra = also or {}
        nodes = [replace(n, used={d: j for d, j in n.used.items() if d not in extra[n.name]}) if n.name in extra else n
                 for n in self.scheduling.snapshot().nodes]
        allowed = among
        if only is not None:
            allowed = frozenset({only}) if among is None else frozenset({only}) & among
        return FreeDevices(nodes).pick(gpus, only=allowed, exclude=exclude)

    def migrate_onwards(self, job_id: str, detail: dict[str, Any]) -> None:
        """The source ranks stopped at a checkpoint: start the job at its destination."""
        row = self.store.job_row(job_id)
        sources = set(detail.get("from", "").split(","))
        among = exact_nodes.allowed(exact_nodes.recorded(row), self.store.nodes(), self.core.fingerprints)
        target = self._find_room(row["gpus"], exclude=sources, only=detail.get("to"), among=among)
        call_off_prefetch(self.core, job_id, row["attempt"], detail, keep=set(target or ()))
        if target is None:  # the room went away meanwhile: wait in the queue, resume anywhere
            with self.store.tx():
                self.store.update_job(job_id, state=JobState.QUEUED.value)
                ev = self.core.emit(job_id, EventType.PREEMPTED,
                                {"reason": "migration target is full; waiting for room", "by": "scheduler"})
            self.core.publish(row["user"], [ev])
            self.core.schedule()
            return
        self.scheduling.start_attempt(row, target, f"migration to {fmt_placement(target)}", JobState.MIGRATING)

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
        self.core.schedule()
        return self._node(node)

    def undrain(self, caller_role: str, node: str) -> NodeInfo:
        self._admin(caller_role, "undrain")
        if self._node(node).state == NodeState.DRAINING:
            with self.store.tx():
                self.store.set_node(node, state=NodeState.READY.value)
        self.core.schedule()
        return self._node(node)

    def _admin(self, role: str, verb: str) -> None:
        if role != "admin":
            raise ServiceError(403, f"only the admin token (server.json of 'serve') may {verb} nodes")

    def _node(self, name: str) -> NodeInfo:
        for n in self.core.nodes():
            if n.name == name:
                return n
        raise ServiceError(404, f"no node '{name}'; nodes are: {', '.join(n.name for n in self.store.nodes())}",
                           "node")


def call_off_prefetch(core: Core, job_id: str, attempt: int, detail: dict[str, Any], keep: Iterable[str] = ()) -> None:
    """Tell the nodes that copy a migration's checkpoint (``detail["prefetching"]``), but where
    the job will not start after all (not in ``keep``), to stop and drop the copy."""
    for node in set(detail.get("prefetching") or ()) - set(keep):
        core.send(node, PrefetchCheckpoint(job_id=job_id, attempt=attempt, cancel=True))
