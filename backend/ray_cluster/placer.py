"""The server's side of Ray: join the cluster as a driver, keep one agent actor per GPU node.

Every call here blocks on Ray; the server calls them from a thread (``loop.py``)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional
from urllib.parse import urlsplit, urlunsplit

from .nodes import RayNode, gpu_nodes

log = logging.getLogger("singularity.ray")
NAMESPACE = "singularity"


@dataclass
class Placed:
    """An actor placed on a node, and the call that starts its agent."""

    node: RayNode
    actor: Any
    started: Any = field(default=None)
    pid: Optional[int] = None


def reachable_url(url: str, driver_ip: str) -> str:
    """The server's URL as agents on other nodes use it: a wildcard bind becomes this node's
    address as Ray knows it (``0.0.0.0`` is nobody's address)."""
    parts = urlsplit(url)
    if parts.hostname in ("0.0.0.0", "::", ""):
        netloc = f"{driver_ip}:{parts.port}" if parts.port else driver_ip
        return urlunsplit(parts._replace(netloc=netloc))
    return url


class RayPlacer:
    """Places a ``NodeAgent`` actor on every alive Ray node with GPUs and forgets dead ones."""

    def __init__(self, address: str, server_url: str, store: Optional[str] = None, ca: Optional[str] = None,
                 placed_on: Optional[dict[str, str]] = None):
        self.address = address
        self.server_url = server_url
        self.store = store
        self.ca = ca
        self.placed: dict[str, Placed] = {}
        #: agent name -> the full id of the Ray node it was placed on, kept after the node leaves
        #: (``singularityctl nodes`` shows it for a lost node too); the server passes its own dict
        self.placed_on: dict[str, str] = placed_on if placed_on is not None else {}

    def connect(self) -> None:
        """Join the cluster as a driver: the actors we create share our fate (Ray removes them
        when this driver exits, even when it is killed)."""
        import ray

        ray.init(address=self.address, namespace=NAMESPACE, log_to_driver=False, ignore_reinit_error=True)
        self.server_url = reachable_url(self.server_url, ray.util.get_node_ip_address())
        if self.store is None:
            log.warning("serve --ray without --store: the agents keep checkpoints in SINGULARITY_HOME's "
                        "checkpoints/ on each Ray node; unless that is one folder all nodes share, a job cannot "
                        "move to another node, resume after its node is lost, or span nodes. Pass --store URL "
                        "(docs/deploy.md)")

    def missing(self) -> list[RayNode]:
        """Alive GPU nodes without an agent actor; forgets actors whose node left or that died."""
        import ray

        alive = gpu_nodes(ray.nodes())
        for node_id, placed in list(self.placed.items()):
            if node_id not in alive:
                log.info("Ray node %s (%s) left", node_id, placed.node.name)
                del self.placed[node_id]
            elif placed.started is not None and placed.pid is None:
                ready, _ = ray.wait([placed.started], timeout=0)
                if ready:
                    try:
                        placed.pid = ray.get(ready[0])
                        log.info("agent %s started on Ray node %s (pid %s)", placed.node.name, node_id, placed.pid)
                    except ray.exceptions.RayError as exc:
                        log.warning("agent actor on %s failed (%s); placing another", placed.node.name, exc)
                        del self.placed[node_id]
        return [n for node_id, n in alive.items() if node_id not in self.placed]

    def draining(self) -> list[str]:
        """Agents whose Ray node is being drained (a KubeRay scale-down, ``ray start`` stopped
        with SIGTERM, a preemption notice), so their jobs can move before the node goes."""
        import ray

        try:  # no public API tells a driver which nodes drain; the GCS's own table does
            ids = ray._private.state.state.get_draining_nodes()
        except Exception:
            log.debug("cannot read Ray's draining nodes", exc_info=True)
            return []
        return [p.node.name for node_id, p in self.placed.items() if node_id in ids]

    def place(self, node: RayNode, credential: str) -> None:
        """Create the node's actor, pinned to it and holding all its GPUs, and start its agent."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from .actor import NodeAgent

        actor_cls = ray.remote(NodeAgent).options(
            num_cpus=0, num_gpus=node.gpus, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False))
        actor = actor_cls.remote(self.server_url, node.name, node.address, self.store, self.ca)
        placed = Placed(node, actor)
        placed.started = actor.start.remote(credential)
        self.placed[node.node_id] = placed
        self.placed_on[node.name] = node.node_id
        log.info("placing agent %s on Ray node %s (%s, %d GPUs)", node.name, node.node_id, node.address, node.gpus)

    def close(self) -> None:
        """Stop every agent we started and remove its actor, then leave the cluster."""
        import ray

        stops = []
        for placed in self.placed.values():
            try:
                stops.append(placed.actor.stop.remote())
            except Exception:
                pass
        try:
            ray.wait(stops, num_returns=len(stops), timeout=15)
        except Exception:
            pass
        for placed in self.placed.values():
            try:
                ray.kill(placed.actor)
            except Exception:
                pass
        self.placed.clear()
        ray.shutdown()
