"""The scheduler service's core: job lifecycle, agent bookkeeping, applying policy actions.

No HTTP here. The web layer (``app.py``) turns requests into calls on :class:`Service`, and
the agent channel turns WebSocket messages into ``agent_*`` calls. Every state change is
written to the store together with the event that explains it, then published. The service
is composed of parts, one module each, that share one ``core.Core``: ``agent_side`` (what
agents report), ``moves`` (preempt, migrate, resize, drain), ``scheduling`` (rounds and
placements) and ``usage`` (quotas); what a job becomes on each event is ``lifecycle``'s.
"""
from __future__ import annotations

import base64
import json
import secrets
import time
from typing import Callable, Optional

from singularity_sdk.protocol import (
    MAX_CODE_BYTES,
    MAX_INPUTS_BYTES,
    MAX_RANKS_PER_DEVICE,
    MAX_WORKDIR_BYTES,
    Event,
    EventType,
    JobInfo,
    JobState,
    ResultPayload,
    SubmitRequest,
)

from . import lifecycle, ranks
from .agent_side import AgentSide
from .core import AgentLink, Core, ServiceConfig, ServiceError
from .credentials import ADMIN_ROLE, JOIN_ROLE, LEGACY_JOIN_ROLE, NODE_ROLE, USER_ROLE, node_user
from .lifecycle import JobRecord
from .moves import Moves
from .scheduling import Policy, Scheduling, make_policy
from .store import Store
from .usage import Usage

__all__ = ["AgentLink", "Service", "ServiceConfig", "ServiceError"]


class Service:
    """The service: users and jobs here; what agents report, moves, scheduling rounds and usage
    in their own parts, which share one `Core` and reach each other only through the narrow
    interfaces core.py declares."""

    def __init__(self, store: Store, config: ServiceConfig = ServiceConfig(), policy: Optional[Policy] = None):
        self.core = core = Core(store, config)
        self.store, self.config, self.hub = store, config, core.hub
        self.agents = AgentSide(core)
        self.moves = Moves(core)
        self.scheduling = Scheduling(core, policy or make_policy(config))
        self.accounts = Usage(core)
        # the parts' references to each other (each declares the interface it uses)
        self.agents.moves, self.agents.starts = self.moves, self.scheduling
        self.moves.scheduling = self.scheduling
        self.scheduling.moves, self.scheduling.agents, self.scheduling.usage = self.moves, self.agents, self.accounts
        core.schedule = self.scheduling.schedule_now
        # what the web layer and serve call, answered by each part
        agents, moves = self.agents, self.moves
        self.agent_hello, self.agent_events, self.agent_heartbeat = agents.agent_hello, agents.agent_events, agents.agent_heartbeat
        self.agent_leaving, self.agent_disconnected = agents.agent_leaving, agents.agent_disconnected
        self.check_moves, self.check_nodes = agents.check_moves, agents.check_nodes
        self.preempt, self.resume, self.checkpoint = moves.preempt, moves.resume, moves.checkpoint
        self.migrate, self.resize, self.drain, self.undrain = moves.migrate, moves.resize, moves.drain, moves.undrain
        self.schedule_now, self.snapshot = self.scheduling.schedule_now, self.scheduling.snapshot
        self.usage, self.set_quota, self.quotas = self.accounts.usage, self.accounts.set_quota, self.accounts.quotas
        self.job, self.nodes = core.job, core.nodes

    @property
    def links(self) -> dict[str, AgentLink]:
        return self.core.links

    @property
    def ray_node_ids(self) -> dict[str, str]:
        return self.core.ray_node_ids

    @property
    def policy(self) -> Policy:
        return self.scheduling.policy

    def set_schedule_hook(self, hook: Callable[[], None], wake_at: Callable[[float], None]) -> None:
        """Lets the asyncio layer coalesce many triggers into one scheduling round, and run
        one at a given time (when a retry's backoff ends)."""
        self.core.schedule = hook
        self.core.wake_at = wake_at

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

    def submit(self, user: str, req: SubmitRequest) -> JobInfo:
        if self.config.run_as is not None and user not in self.config.run_as:
            raise ServiceError(403, f"user {user!r} has no OS account to run jobs as: the admin adds one to the "
                                    f"table given to 'serve --run-as'", "user")
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
        cap = self.core.capacity()
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
            ev = self.core.emit(
                job_id, EventType.SUBMITTED,
                {"user": user, "name": name, "gpus": req.gpus, "ranks": world, "sla": req.sla.value,
                 "kind": "source" if req.source is not None else "callable"},
                now,
            )
        self.core.publish(user, [ev])
        self.core.schedule()
        return self.store.job_info(job_id)

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
            self.agents.apply(job_id, lifecycle.on_cancel(job, time.time(), data),
                        lambda t, d: events.append(self.core.emit(job_id, t, d)), followups)
        self.core.publish(user, events)
        for fn in followups:
            fn()
        return self.store.job_info(job_id)
