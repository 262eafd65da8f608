"""Scheduling rounds: the cluster snapshot the policy sees, applying its actions, and starting
an attempt of a job on its placement."""
from __future__ import annotations

import json
import logging
import time
from typing import Callable

from backend.scheduler.fifo import fifo_policy
from backend.scheduler.types import Action, JobView, Migrate, NodeView, Place, Preempt, Resize, Snapshot
from singularity_sdk.protocol import EventType, JobState, NodeState, Placement, RankSpec, StartJob

from . import exact_nodes, ranks
from .core import Core, Losses, Movers, Quotas, ServiceConfig, ServiceError
from .store import attained

log = logging.getLogger("singularity.server")

Policy = Callable[[Snapshot], list[Action]]


class Scheduling:
    """Rounds: the snapshot the policy sees, its actions applied, attempts started."""

    # wired by Service: the policy's preempt/migrate/resize actions are moves; a start that
    # cannot reach its node loses the attempt; the snapshot carries the quotas
    moves: Movers
    agents: Losses
    usage: Quotas

    def __init__(self, core: Core, policy: Policy) -> None:
        self.core = core
        self.store = core.store
        self.config = core.config
        self.policy = policy

    def snapshot(self) -> Snapshot:
        nodes_info = self.core.nodes()
        nodes = tuple(
            NodeView(
                name=n.name,
                devices=tuple(d.index for d in n.devices),
                used=dict(n.used),
                schedulable=n.state == NodeState.READY and n.name in self.core.links,
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
            attained_s, ran_s = attained(row, now)
            jobs.append(
                JobView(id=row["id"], user=row["user"], sla=row["sla"], state=JobState(row["state"]),
                        gpus=row["gpus"], elastic=ranks.elastic(row["ranks"], row["gpus"]),
                        submitted_at=row["created_at"], last_moved_at=row["moved_at"],
                        attained_s=attained_s, ran_s=ran_s,
                        last_checkpoint_at=json.loads(row["last_checkpoint_json"] or "{}").get("time"),
                        placement=placement if JobState(row["state"]).holds_devices else {},
                        nodes=exact_nodes.allowed(exact_nodes.recorded(row), nodes_info, self.core.fingerprints))
            )
        return Snapshot(now=now, nodes=nodes, jobs=tuple(jobs), quotas=self.usage.quotas())

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
                    allowed = next((j.nodes for j in snapshot.jobs if j.id == action.job_id), None)
                    if allowed is not None and not set(action.placement) <= allowed:
                        continue  # its checkpoint would not resume exactly there (whatever the policy chose)
                    self._apply_place(action)
                    held |= {(node, d) for node, devs in action.placement.items() for d in devs}
                elif isinstance(action, Preempt) and not moving:
                    info = self.store.job_info(action.job_id)
                    self.moves.preempt(info.user, info.id, action.reason, by="scheduler", requeue=True)
                elif isinstance(action, Migrate) and not moving:
                    info = self.store.job_info(action.job_id)
                    self.moves.migrate(info.user, info.id, next(iter(action.placement)), action.reason, by="scheduler")
                elif isinstance(action, Resize) and not moving:
                    info = self.store.job_info(action.job_id)
                    size = sum(len(d) for d in action.placement.values())
                    self.moves.resize(info.user, info.id, size, action.reason, by="scheduler", placement=action.placement)
            except ServiceError as exc:  # the world moved since the snapshot (a job ended meanwhile)
                log.info("skipped %s for %s: %s", type(action).__name__, action.job_id, exc.message)
        return actions

    def _apply_place(self, action: Place) -> None:
        row = self.store.job_row(action.job_id)
        if row is None or JobState(row["state"]) != JobState.QUEUED:
            return
        self.start_attempt(row, action.placement, action.reason, JobState.RUNNING)

    def start_attempt(self, row, placement: dict[str, tuple[int, ...]], reason: str, state: JobState) -> None:
        """Record a new attempt on ``placement`` and tell the agents involved to start its ranks.

        The attempt number fences everything the previous attempt's processes still send. Rank 0's
        node picks the rendezvous port itself (one free there, not here); where ranks run on other
        nodes too, they are started once it has said which (``rendezvous_chosen``)."""
        job_id = row["id"]
        attempt = row["attempt"] + 1
        # Ranks take devices in placement order, so co-located ranks are contiguous.
        flat = [(node, d) for node, devs in placement.items() for d in devs]
        placement_json = [p.model_dump() for p in _placements(ranks.assign(row["ranks"], flat))]
        with self.store.tx():
            self.store.update_job(job_id, state=state.value, attempt=attempt, stop_reason=None, exited_json="{}",
                                  placement_json=json.dumps(placement_json), error=None, not_before=None)
            ev = self.core.emit(job_id, EventType.SCHEDULED,
                            {"attempt": attempt, "reason": reason, "placement": placement_json})
        self.core.publish(row["user"], [ev])
        host, host_start = next(iter(self.start_messages(self.store.job_row(job_id), master_port=0).items()))
        self._send_start(host, host_start)

    def rendezvous_chosen(self, job_id: str, attempt: int, port: int) -> None:
        """Rank 0's node of ``attempt`` chose its rendezvous port: start the other nodes' ranks
        (once: the agent's events are applied exactly once), unless the attempt ended meanwhile."""
        row = self.store.job_row(job_id)
        if row is None or row["attempt"] != attempt or not JobState(row["state"]).holds_devices:
            return
        for node, msg in list(self.start_messages(row, master_port=port).items())[1:]:
            if not self._send_start(node, msg):
                return

    def start_messages(self, row, master_port: int) -> dict[str, StartJob]:
        """The start of each node of the job's current attempt, rank 0's node first, rebuilt from
        its row: the placement recorded there lists each node's devices in the order ranks took them."""
        job_id, world = row["id"], row["ranks"]
        per_rank = ranks.assign(world, [(p["node"], d) for p in json.loads(row["placement_json"])
                                        for d in p["devices"]])
        rank_specs: dict[str, list[RankSpec]] = {}
        for rank, mine in enumerate(per_rank):
            specs = rank_specs.setdefault(mine[0][0], [])
            specs.append(RankSpec(rank=rank, local_rank=len(specs), devices=[d for _n, d in mine]))
        layout = ranks.layout(per_rank) if world > 1 else None
        # Every rank, on any node, connects to rank 0's node's address.
        master_addr = next((n.address for n in self.store.nodes() if n.name == per_rank[0][0][0] and n.address),
                           "127.0.0.1")
        # The cluster's default period applies to every job: the parts of one spread over nodes
        # meet through the store or a shared folder, and where neither exists each checkpoint
        # fails at once, saying so, while the job runs on (docs/distributed.md).
        every = row["checkpoint_every"] or self.config.checkpoint_every
        return {node: StartJob(
            job_id=job_id, attempt=row["attempt"], world_size=world, local_world_size=len(specs), ranks=specs,
            master_addr=master_addr, master_port=master_port,
            source=row["source"], callable_b64=row["callable_b64"], filename=row["filename"],
            inputs_b64=row["inputs_b64"], outputs=json.loads(row["outputs_json"]),
            env=json.loads(row["env_json"]), args=json.loads(row["args_json"]), workdir=row["workdir"],
            workdir_b64=row["workdir_b64"],
            checkpoint_every=every,
            restore=bool(row["last_checkpoint_json"]), layout=layout,
            restore_step=json.loads(row["last_checkpoint_json"] or "{}").get("step"),
            # a job queued before its user was in the table: an account of the user's own name,
            # or the node refuses the start, saying so
            run_as=self.config.run_as.get(row["user"], row["user"]) if self.config.run_as is not None else None,
        ) for node, specs in rank_specs.items()}

    def _send_start(self, node: str, msg: StartJob) -> bool:
        if self.core.send(node, msg):
            return True
        self.agents.job_lost(self.store.job_info(msg.job_id), f"node {node} went away while the job was being started")
        return False


def _placements(per_rank: list[list[ranks.Device]]) -> list[Placement]:
    """Each node's share of a placement, in rank order: its devices and ranks."""
    placements: dict[str, Placement] = {}
    for rank, mine in enumerate(per_rank):
        p = placements.setdefault(mine[0][0], Placement(node=mine[0][0], devices=[], ranks=[]))
        p.devices.extend(d for _n, d in mine if d not in p.devices)
        p.ranks.append(rank)
    return list(placements.values())


def make_policy(config: ServiceConfig) -> Policy:
    """The live policy: the same code the simulator runs, with this service's move timings."""
    if config.policy == "fifo":
        return fifo_policy
    if config.policy != "singularity":
        raise ValueError(f"unknown policy {config.policy!r}; choose from: singularity, fifo")
    from backend.scheduler.singularity import SingularityPolicy
    from backend.scheduler.tiers import PolicyConfig

    return SingularityPolicy(PolicyConfig(min_move_interval_s=config.min_move_interval_s,
                                          overhead_s=config.move_cost_s))
