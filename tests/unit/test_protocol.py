"""Wire models reject unknown fields and wrong types with a message that names the field."""
import pytest
from pydantic import ValidationError

from singularity_sdk.protocol import (
    AgentEvents, Event, EventType, JobState, StartJob, SubmitRequest, agent_message_adapter, describe_validation_error,
    server_message_adapter,
)


def message(exc_info) -> str:
    return describe_validation_error(exc_info.value)[0]


def test_unknown_field_named():
    with pytest.raises(ValidationError) as e:
        SubmitRequest(source="1", gpuz=1)
    assert message(e) == "unknown field 'gpuz'"


def test_wrong_type_named():
    with pytest.raises(ValidationError) as e:
        SubmitRequest(source="1", gpus=[1])
    assert message(e).startswith("field 'gpus':")


def test_agent_messages_are_discriminated_and_strict():
    msg = agent_message_adapter.validate_json('{"type": "events", "events": []}')
    assert isinstance(msg, AgentEvents)
    with pytest.raises(ValidationError):
        agent_message_adapter.validate_json('{"type": "events", "events": [], "extra": 1}')
    start = StartJob(job_id="j", attempt=1, world_size=1, local_world_size=1, ranks=[])
    assert isinstance(server_message_adapter.validate_json(start.model_dump_json()), StartJob)


def test_terminal_states():
    assert {s for s in JobState if s.is_terminal} == {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}
    assert JobState.PREEMPTED.holds_devices is False and JobState.MIGRATING.holds_devices is True


@pytest.mark.parametrize("text, lines", [
    ("one\n", ["one\n"]),
    ("a\nb\nc\n", ["a\n", "b\n", "c\n"]),
    ("a\n\nb\n", ["a\n", "\n", "b\n"]),
    ("piece of a long line", ["piece of a long line"]),
    ("a\nrest", ["a\n", "rest"]),
    ("", [""]),
])
def test_a_log_event_of_several_lines_reads_as_those_lines(text, lines):
    ev = Event(job_id="j", seq=1, type=EventType.LOG, time=0.0, data={"rank": 0, "stream": "stdout", "line": text})
    assert ev.lines == lines and "".join(ev.lines) == text
    assert Event(job_id="j", seq=2, type=EventType.PROGRESS, time=0.0, data={"step": 1}).lines == []
