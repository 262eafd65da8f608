"""The server reads agents' event payloads through the SDK's typed models (payloads.py), strictly:
what agents send is accepted as is, a field of a wrong type is refused with the field named."""
from __future__ import annotations

import time

import pytest
from pydantic import ValidationError

from backend.server.agent_side import malformed, read
from singularity_sdk.protocol import AgentEvent, EventType


def _ev(type: EventType, data: dict) -> AgentEvent:
    return AgentEvent(agent_seq=1, job_id="j-1", attempt=1, type=type, time=time.time(), data=data)


def test_what_agents_send_is_read_with_its_fields_typed():
    exited = read(_ev(EventType.WORKER_EXITED, {"rank": 1, "code": 3, "error": "boom", "user_error": True,
                                                 "signal": "SIGKILL", "stopped": "cancelled"}))
    assert (exited.rank, exited.code, exited.error, exited.user_error) == (1, 3, "boom", True)
    assert read(_ev(EventType.WORKER_EXITED, {})).model_fields_set == set()
    result = read(_ev(EventType.RESULT, {"outputs_b64": None, "outputs_skipped": {}, "pickle_b64": "gAQu",
                                         "repr": "42", "error": None}))
    assert (result.pickle_b64, result.repr, result.outputs_skipped) == ("gAQu", "42", {})
    resumed = read(_ev(EventType.RESUMED, {"rank": 0, "step": 7, "seconds": 0.5, "rebuilt": [], "checkpoint": "/c"}))
    assert (resumed.rank, resumed.step, resumed.checkpoint) == (0, 7, "/c")
    ckpt = read(_ev(EventType.CHECKPOINTED, {"rank": 0, "step": 7, "bytes": 10, "seconds": 1, "wait_s": 0.0,
                                             "path": "/c", "rebuilt": [], "fingerprint": {"python": "3.11"}}))
    assert ckpt.step == 7 and ckpt.fingerprint == {"python": "3.11"}


@pytest.mark.parametrize("type, data, field", [
    (EventType.WORKER_EXITED, {"rank": "0", "code": 0}, "rank"),
    (EventType.WORKER_EXITED, {"rank": 0, "code": True}, "code"),
    (EventType.WORKER_EXITED, {"rank": 0, "code": 1, "user_error": "yes"}, "user_error"),
    (EventType.RESULT, {"pickle_b64": 5}, "pickle_b64"),
    (EventType.RESULT, {"repr": None}, "repr"),
    (EventType.RESUMED, {"step": 1.5}, "step"),
    (EventType.CHECKPOINTED, {"step": "x", "path": "/c"}, "step"),
])
def test_a_field_of_a_wrong_type_is_refused_naming_it(type, data, field):
    with pytest.raises(ValidationError) as exc:
        read(_ev(type, data))
    assert isinstance(exc.value, ValueError)  # logged without a traceback, the event refused
    assert malformed(exc.value).startswith(f"{field}: ")
