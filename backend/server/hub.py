"""In-process fan-out of committed events to WebSocket subscribers.

Events are published only after their transaction commits, so a subscriber never sees an
event that a crash could take back. Subscribers are plain callables; the WebSocket layer
decides how to write. Each event is serialized once, however many subscribers it has
(``bench/load.py``: a hundred clients following twenty chatty jobs).
"""
from __future__ import annotations

import json
from collections import defaultdict
from typing import Callable

from singularity_sdk.protocol import Event

#: called with the event and its JSON text (what a WebSocket sends)
Subscriber = Callable[[Event, str], None]


class Hub:
    def __init__(self) -> None:
        self._by_job: dict[str, set[Subscriber]] = defaultdict(set)
        self._by_user: dict[str, set[Subscriber]] = defaultdict(set)

    def subscribe_job(self, job_id: str, fn: Subscriber) -> Callable[[], None]:
        self._by_job[job_id].add(fn)
        return lambda: self._discard(self._by_job, job_id, fn)

    def subscribe_user(self, user: str, fn: Subscriber) -> Callable[[], None]:
        self._by_user[user].add(fn)
        return lambda: self._discard(self._by_user, user, fn)

    def publish(self, user: str, events: list[Event]) -> None:
        for ev in events:
            subscribers = [*self._by_job.get(ev.job_id, ()), *self._by_user.get(user, ())]
            if subscribers:
                text = json.dumps(ev.model_dump(mode="json"))
                for fn in subscribers:
                    fn(ev, text)

    @staticmethod
    def _discard(table: dict[str, set[Subscriber]], key: str, fn: Subscriber) -> None:
        subs = table.get(key)
        if subs is not None:
            subs.discard(fn)
            if not subs:
                table.pop(key, None)
