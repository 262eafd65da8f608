"""The server's task that keeps an agent on every GPU node of the Ray cluster.

Credentials are minted here, on the server's event loop (the store is not shared across
threads): each placement gets a fresh one for its node, which revokes any earlier one."""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

from .placer import RayPlacer

log = logging.getLogger("singularity.ray")
POLL_S = 1.0


async def keep_agents(placer: RayPlacer, issue_credential: Callable[[str], str], drain: Callable[[str], object],
                      poll_s: float = POLL_S) -> None:
    """Every ``poll_s``: place an agent on each GPU node that has none (new nodes, and nodes
    whose actor died), and drain the node of each agent whose Ray node is draining, so its
    jobs migrate while it still runs. A node that left needs nothing here: its agent's
    connection drops with it and the server marks it lost, as for any agent."""
    drained: set[str] = set()
    while True:
        try:
            for node in await asyncio.to_thread(placer.missing):
                await asyncio.to_thread(placer.place, node, issue_credential(node.name))
            for name in await asyncio.to_thread(placer.draining):
                if name not in drained:
                    drain(name)  # raises while the agent has not said hello yet: tried again next poll
                    drained.add(name)
                    log.info("Ray is draining %s: its jobs move elsewhere", name)
        except Exception:
            log.exception("keeping agents on the Ray cluster failed; retrying")
        await asyncio.sleep(poll_s)
