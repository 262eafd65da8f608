"""CPU slots stand for cores: the share each slot's ranks are pinned to."""
from __future__ import annotations

from backend.agent.devices import slot_cores


def test_slots_share_the_cores_evenly_or_round_robin():
    assert [slot_cores(i, 2, list(range(8))) for i in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [slot_cores(i, 3, list(range(8))) for i in range(3)] == [[0, 1], [2, 3], [4, 5]]
    assert [slot_cores(i, 4, [0, 1]) for i in range(4)] == [[0], [1], [0], [1]]
    assert slot_cores(0, 1, [3, 5]) == [3, 5]
