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


async def keep_agents(placer: RayPlacer, issue_credential: Callable[[str], str], poll_s: float = POLL_S) -> None:
    """Every ``poll_s``: place an agent on each GPU node that has none (new nodes, and nodes
    whose actor died). A node that left needs nothing here: its agent's connection drops with
    it and the server marks it lost, as for any agent."""
    while True:
        try:
            for node in await asyncio.to_thread(placer.missing):
                await asyncio.to_thread(placer.place, node, issue_credential(node.name))
        except Exception:
            log.exception("keeping agents on the Ray cluster failed; retrying")
        await asyncio.sleep(poll_s)
