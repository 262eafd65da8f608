"""The agent's event buffer: numbered, kept until the server acknowledges them, replayed on
reconnect. No I/O here, so the exactly-once logic is testable on its own.

Sequence numbers are per agent *instance*; the server commits the highest one it applied in
the same transaction as the events, so a replay after a server crash neither loses nor
duplicates anything.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any, Optional

from singularity_sdk.protocol import AgentEvent, EventType


class Outbox:
    def __init__(self) -> None:
        self._next = 1
        self._pending: deque[AgentEvent] = deque()
        self._sent_upto = 0  # highest agent_seq sent on the current connection

    def add(self, job_id: str, attempt: int, type: EventType, data: dict[str, Any], when: Optional[float] = None) -> AgentEvent:
        ev = AgentEvent(agent_seq=self._next, job_id=job_id, attempt=attempt, type=type,
                        time=time.time() if when is None else when, data=data)
        self._next += 1
        self._pending.append(ev)
        return ev

    def ack(self, upto: int) -> None:
        while self._pending and self._pending[0].agent_seq <= upto:
            self._pending.popleft()

    def connected(self, server_acked: int) -> None:
        """A new connection: drop what the server already has, resend everything else."""
        self.ack(server_acked)
        self._sent_upto = server_acked

    def take_unsent(self, limit: int = 500) -> list[AgentEvent]:
        out = []
        for ev in self._pending:
            if ev.agent_seq > self._sent_upto:
                out.append(ev)
                if len(out) >= limit:
                    break
        if out:
            self._sent_upto = out[-1].agent_seq
        return out

    def jobs(self) -> set[tuple[str, int]]:
        return {(ev.job_id, ev.attempt) for ev in self._pending}

    def __len__(self) -> int:
        return len(self._pending)
