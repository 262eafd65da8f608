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

#: the most text one log event gathers: lines read together (workers.py) or waiting to be sent
LOG_EVENT_CHARS = 1 << 16


class Outbox:
    """Events not yet acknowledged, in order: those sent on the current connection, then those
    not sent yet (two queues, so taking the next batch does not walk past thousands of sent
    but unacknowledged lines of a chatty job)."""

    def __init__(self) -> None:
        self._next = 1
        #: the highest sequence number the server acknowledged (it committed everything up to it)
        self.acked = 0
        self._sent: deque[AgentEvent] = deque()  # sent on the current connection, not acked
        self._unsent: deque[AgentEvent] = deque()

    def add(self, job_id: str, attempt: int, type: EventType, data: dict[str, Any], when: Optional[float] = None) -> AgentEvent:
        """Queue an event. Whole log lines join the last unsent event when it holds lines of the
        same rank and stream: while the server is slow to take them, a chatty job's lines travel
        as fewer, larger events instead of queueing one by one (nothing else can lie between
        them, and an event already sent is never changed)."""
        last = self._unsent[-1] if self._unsent and type == EventType.LOG else None
        if last is not None and _joins(last, job_id, attempt, data):
            last.data["line"] += data["line"]
            return last
        # built without validation: every field is the agent's own, of the right type by
        # construction (validating each line cost a third of a chatty node's agent CPU)
        ev = AgentEvent.model_construct(agent_seq=self._next, job_id=job_id, attempt=attempt, type=EventType(type),
                                        time=time.time() if when is None else float(when), data=data)
        self._next += 1
        self._unsent.append(ev)
        return ev

    def ack(self, upto: int) -> None:
        self.acked = max(self.acked, upto)
        for queue in (self._sent, self._unsent):
            while queue and queue[0].agent_seq <= upto:
                queue.popleft()

    def connected(self, server_acked: int) -> None:
        """A new connection: drop what the server already has, resend everything else."""
        self._sent.extend(self._unsent)
        self._sent, self._unsent = deque(), self._sent
        self.ack(server_acked)

    def take_unsent(self, limit: int = 500) -> list[AgentEvent]:
        out = [self._unsent.popleft() for _ in range(min(limit, len(self._unsent)))]
        self._sent.extend(out)
        return out

    def jobs(self) -> set[tuple[str, int]]:
        return {(ev.job_id, ev.attempt) for queue in (self._sent, self._unsent) for ev in queue}

    def __len__(self) -> int:
        return len(self._sent) + len(self._unsent)


def _joins(last: AgentEvent, job_id: str, attempt: int, data: dict[str, Any]) -> bool:
    """Whether log ``data`` may be appended to the log event ``last``: same job, attempt, rank
    and stream, ``last`` ends with a whole line, and the two fit in one event."""
    before, text = last.data.get("line"), data.get("line")
    return (last.type == EventType.LOG and (last.job_id, last.attempt) == (job_id, attempt)
            and isinstance(before, str) and isinstance(text, str) and before.endswith("\n")
            and (last.data.get("rank"), last.data.get("stream")) == (data.get("rank"), data.get("stream"))
            and len(before) + len(text) <= LOG_EVENT_CHARS)
