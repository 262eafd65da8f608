# A helper module with state of its own: a call counter and a running record.
from typing import TypeVar

import config

T = TypeVar("T")
calls = 0


def bump() -> float:
    global calls
    calls += 1
    config.history.append(calls)
    return calls * config.scale
