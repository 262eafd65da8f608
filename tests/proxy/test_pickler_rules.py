"""The checkpoint pickler asks its rules once per type where the answer depends on the type
alone: the rules that look at the instance must still be asked for every instance."""
from __future__ import annotations

import collections
import gc
import io
import pickle
import weakref

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


class LRU(collections.OrderedDict):
    def __init__(self, cap):
        super().__init__()
        self.cap = cap


class Vocab(collections.defaultdict):
    def __init__(self, name):
        super().__init__(int)
        self.name = name


class Window(collections.deque):
    def __init__(self, size, label):
        super().__init__(maxlen=size)
        self.label = label


class Tally(collections.Counter):
    def __init__(self, owner):
        super().__init__()
        self.owner = owner


def test_subclasses_of_ordered_dict_defaultdict_counter_and_deque_with_their_own_init_load():
    """They pickle as a call of their class with the base's arguments, which their __init__ does
    not take (the checkpoint was written and could not be loaded), and defaultdict's drops the
    subclass's attributes."""
    cache, vocab, window, tally = LRU(2), Vocab("words"), Window(3, "recent"), Tally("me")
    cache.update(a=1, b=2)
    cache.move_to_end("a")
    vocab["x"] += 2
    window.extend(range(5))
    tally.update("abca")
    cache2, vocab2, window2, tally2 = roundtrip((cache, vocab, window, tally))
    assert type(cache2) is LRU and list(cache2.items()) == [("b", 2), ("a", 1)] and cache2.cap == 2
    assert type(vocab2) is Vocab and vocab2 == {"x": 2} and vocab2.name == "words" and vocab2["y"] == 0
    assert type(window2) is Window and list(window2) == [2, 3, 4] and window2.maxlen == 3 and window2.label == "recent"
    assert type(tally2) is Tally and tally2.most_common(1) == [("a", 2)] and tally2.owner == "me"


class Feature:
    def __init__(self, key):
        self.key = key


def test_a_weak_value_dictionary_keeps_the_entries_whose_values_the_checkpoint_holds():
    cache = weakref.WeakValueDictionary()
    keep = [Feature(0), Feature(1)]
    cache[0], cache[1] = keep
    cache2, keep2 = roundtrip((cache, keep))
    assert type(cache2) is weakref.WeakValueDictionary and cache2[0] is keep2[0] and cache2[1] is keep2[1]
    del keep2[1]
    gc.collect()
    assert list(cache2) == [0]
