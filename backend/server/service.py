"""The scheduler service's core: job lifecycle, agent bookkeeping, applying policy actions.

No HTTP here. The web layer (``app.py``) turns requests into calls on :class:`Service`, and
the agent channel turns WebSocket messages into ``agent_*`` calls. Every state change is
written to the store together with the event that explains it, then published. The class is
assembled from one module per concern: ``agent_side`` (what agents report), ``moves``
(preempt, migrate, drain) and ``scheduling`` (rounds and placements).
"""
from __future__ import annotations

import base64
import json
import logging
import secrets
import time
from typing import Any, Callable, Optional

from pydantic import BaseModel

from singularity_sdk.protocol import (
    MAX_CODE_BYTES,
    MAX_INPUTS_BYTES,
    MAX_RANKS_PER_DEVICE,
    MAX_WORKDIR_BYTES,
    Event,
    EventType,
    JobInfo,
    JobState,
    NodeInfo,
    NodeState,
    ResultPayload,
    StopJob,
    SubmitRequest,
)

from . import lifecycle, ranks
from .agent_side import AgentSide
from .core import AgentLink, ServiceConfig, ServiceError
from .credentials import ADMIN_ROLE, JOIN_ROLE, LEGACY_JOIN_ROLE, NODE_ROLE, USER_ROLE, node_user
from .hub import Hub
from .lifecycle import JobRecord
from .moves import Moves
from .scheduling import Policy, Scheduling, make_policy
from .store import Store
from .usage import Usage

__all__ = ["AgentLink", "Service", "ServiceConfig", "ServiceError"]

log = logging.getLogger("singularity.server")
#: What a user sees in ``nodes`` for a device held by another user's job.
OTHER_JOB = "(other)"


class Service(AgentSide, Moves, Scheduling, Usage):
    def __init__(self, store: Store, config: ServiceConfig = ServiceConfig(), policy: Optional[Policy] = None):
        self.store = store
        self.config = config
        self.policy = policy or make_policy(config)
        self.hub = Hub()
        self.links: dict[str, AgentLink] = {}
        #: node -> when its agent's connection broke without a close frame (see check_nodes)
        self.dropped: dict[str, float] = {}
        #: node -> what a resumed job's result depends on there (versions, device model), from its hello
        self.fingerprints: dict[str, dict[str, Any]] = {}
        #: node -> the Ray node its agent was placed on (serve --ray fills it in)
        self.ray_node_ids: dict[str, str] = {}
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
        return self.store.issue_token(user, USER_ROLE)

    def enroll(self, caller_role: str, node: str) -> str:
        """Issue ``node``'s own credential. The join token enrolls a name once, so nobody holding
        it can take over a node that has one; the admin may issue a new one (the old one stops
        working and its live connection is dropped)."""
        if caller_role not in (JOIN_ROLE, LEGACY_JOIN_ROLE, ADMIN_ROLE):
            raise ServiceError(403, "enrolling a node needs the join token (agent_token in server.json) "
                                    "or the admin token")
        if self.store.user_exists(node_user(node)) and caller_role != ADMIN_ROLE:
            raise ServiceError(409, f"node '{node}' is already enrolled: its agent keeps its credential in "
                                    f"its home ('credential'); an admin can issue a new one", "node")
        token = self.store.issue_token(node_user(node), NODE_ROLE)
        link = self.links.pop(node, None)
        if link is not None:
            link.close()
        return token

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
            except ValueError as exc:  # e.g. a NUL byte, on Pythons that do not call it a SyntaxError
                raise ServiceError(422, f"the code does not compile: {exc}", "source") from None
        world = req.ranks or req.gpus
        if not ranks.fits(world, req.gpus):
            raise ServiceError(
                422, f"--ranks {world} and --gpus {req.gpus}: one must divide the other (each rank gets the same "
                     f"number of devices, or each device the same number of ranks)", "ranks",
            )
        if world > req.gpus * MAX_RANKS_PER_DEVICE:
            raise ServiceError(
                422, f"--ranks {world} on {req.gpus} device(s) puts more than {MAX_RANKS_PER_DEVICE} ranks on a "
                     f"device; ask for more devices (--gpus) or fewer ranks", "ranks")
        if req.inputs_b64 is not None and len(req.inputs_b64) * 3 // 4 > MAX_INPUTS_BYTES:
            raise ServiceError(
                413, f"the variables sent with the job are {len(req.inputs_b64) * 3 / 4e6:.1f} MB; the limit is "
                     f"{MAX_INPUTS_BYTES / 1e6:.0f} MB. Save large objects to a file the job loads.", "inputs_b64")
        if req.workdir is not None and not req.workdir.startswith("/"):
            raise ServiceError(422, f"workdir {req.workdir!r} is not an absolute path; send the absolute path of "
                                    f"the folder the job runs in (the SDK sends its current directory)", "workdir")
        if req.workdir_b64 is not None and len(req.workdir_b64) * 3 // 4 > MAX_WORKDIR_BYTES:
            raise ServiceError(
                413, f"the copy of the job's folder is {len(req.workdir_b64) * 3 / 4 / 2**20:.1f} MiB; the limit is "
                     f"{MAX_WORKDIR_BYTES / 2**20:.0f} MiB. Keep data sets out of the folder (read them from storage "
                     f"every node sees), or submit without a copy to nodes that share the folder", "workdir_b64")
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
                    gpus=req.gpus, ranks=world, source=req.source, callable_b64=req.callable_b64,
                    inputs_b64=req.inputs_b64, outputs_json=json.dumps(req.outputs),
                    filename=req.filename, env_json=json.dumps(req.env), args_json=json.dumps(req.args), workdir=req.workdir,
                    workdir_b64=req.workdir_b64,
                    checkpoint_every=req.checkpoint_every,
                    created_at=now, updated_at=now,
                )
            )
            ev = self._emit(
                job_id, EventType.SUBMITTED,
                {"user": user, "name": name, "gpus": req.gpus, "ranks": world, "sla": req.sla.value,
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
        events: list[Event] = []
        followups: list[Callable[[], None]] = []
        data = {"by": user, "reason": reason or "cancelled by user"}
        with self.store.tx():
            job = JobRecord.from_row(self.store.job_row(job_id))
            self._apply(job_id, lifecycle.on_cancel(job, time.time(), data),
                        lambda t, d: events.append(self._emit(job_id, t, d)), followups)
        self._publish(user, events)
        for fn in followups:
            fn()
        return self.store.job_info(job_id)

    def _stop_everywhere(self, info: JobInfo, reason: str) -> None:
        for p in info.placement:
            self._send(p.node, StopJob(job_id=info.id, attempt=info.attempt, reason=reason,
                                       grace_s=self.config.stop_grace_s))

    # ------------------------------------------------------------------ nodes

    def nodes(self, user: Optional[str] = None) -> list[NodeInfo]:
        """The cluster's nodes; a device held by someone else's job shows as ``"(other)"`` unless
        ``user`` is None (the admin), so job ids do not leak across users."""
        used: dict[str, dict[int, str]] = {}
        for info in self.store.list_jobs(states=[s.value for s in JobState if s.holds_devices]):
            for p in info.placement:
                for d in p.devices:
                    used.setdefault(p.node, {})[d] = info.id if user in (None, info.user) else OTHER_JOB
        out = []
        for n in self.store.nodes():
            n.used = used.get(n.name, {})
            n.ray_node_id = self.ray_node_ids.get(n.name)
            out.append(n)
        return out
