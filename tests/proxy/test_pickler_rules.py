"""The checkpoint pickler asks its rules once per type where the answer depends on the type
alone: the rules that look at the instance must still be asked for every instance."""
from __future__ import annotations

import io
import pickle

from backend.proxy.engine.state import ClosedFile, ProxyPickler


def dumps(obj) -> bytes:
    buf = io.BytesIO()
    ProxyPickler(buf, protocol=5).dump(obj)
    return buf.getvalue()


def roundtrip(obj):
    return pickle.loads(dumps(obj))


class Borg:
    _shared_state: dict = {}

    def __init__(self, shared: bool) -> None:
        if shared:
            self.__dict__ = self._shared_state
        self.value = 1


def test_a_shared_state_instance_after_a_plain_one_of_its_class_is_still_saved_as_shared():
    plain, shared = Borg(False), Borg(True)
    roundtrip(plain)
    shared.value = 7
    saved = dumps(shared)
    Borg._shared_state = {}  # what a new process has
    back = pickle.loads(saved)
    assert back.value == 7 and back.__dict__ is Borg._shared_state


def test_an_open_file_after_a_closed_one_of_the_same_type_is_reopened(tmp_path):
    closed = open(tmp_path / "a.txt", "w")
    closed.close()
    assert isinstance(roundtrip(closed), ClosedFile)
    f = open(tmp_path / "b.txt", "w")
    f.write("kept")
    back = roundtrip(f)
    try:
        assert not isinstance(back, ClosedFile) and back.name == f.name and back.tell() == 4
    finally:
        f.close(), back.close()


def test_instances_of_a_plain_class_pickle_with_their_own_state_each_time():
    a, b = Borg(False), Borg(False)
    b.value = 2
    assert [roundtrip(a).value, roundtrip(b).value, roundtrip(a).value] == [1, 2, 1]
