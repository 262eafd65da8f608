"""Wire models reject unknown fields and wrong types with a message that names the field."""
import pytest
from pydantic import ValidationError

from singularity_sdk.protocol import (
    AgentEvents, JobState, StartJob, SubmitRequest, agent_message_adapter, describe_validation_error,
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
