"""Which Ray nodes get a node agent, and what the agent is called there (pure: no Ray import,
so the rules are tested without a cluster)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

NAME_PREFIX = "ray-"


@dataclass(frozen=True)
class RayNode:
    """An alive Ray node that declares GPUs."""

    node_id: str
    address: str
    gpus: int

    @property
    def name(self) -> str:
        """The agent's node name: stable for the Ray node's life, short enough to read."""
        return node_name(self.node_id)


def node_name(node_id: str) -> str:
    """``ray-`` and the first 8 hex digits of the Ray node id."""
    return NAME_PREFIX + node_id[:8]


def gpu_nodes(table: Iterable[dict[str, Any]]) -> dict[str, RayNode]:
    """The alive nodes of ``ray.nodes()`` that declare at least one whole GPU, by node id.

    A node without GPUs (a head node that only schedules, say) gets no agent: the service's
    devices are GPUs, and a CPU-only node would offer work nowhere to run."""
    out = {}
    for row in table:
        gpus = int((row.get("Resources") or {}).get("GPU", 0))
        if row.get("Alive") and gpus > 0:
            out[row["NodeID"]] = RayNode(row["NodeID"], row.get("NodeManagerAddress") or "", gpus)
    return out
