"""id_keys: containers keyed by ``id(obj)`` are found and keyed again by the restored objects' ids."""
from __future__ import annotations

import collections
import pickle

from backend.proxy.engine import id_keys


class Param:
    def __init__(self, name: str) -> None:
        self.name = name


class Holder:
    def __init__(self, params: list) -> None:
        self.params = params
        self.buffers = collections.OrderedDict((id(p), p.name.upper()) for p in params)
        self.frozen = {id(params[1])}


def test_found_through_attributes_and_rekeyed_after_a_round_trip_in_order():
    params = [Param(n) for n in "abc"]
    holder = Holder(params)
    names = {id(p): p.name for p in params}
    stale = {id(Param("gone")): 1}  # its object is freed: nothing to key it by
    counts = {3: "x", 10**6: "y"}  # small ints: not addresses
    roots = [{"holder": holder, "names": names, "stale": stale, "counts": counts}]
    found = id_keys.find(roots, {})
    assert {id(c) for c, _ in found} == {id(holder.buffers), id(holder.frozen), id(names)}

    ns, rekeys = pickle.loads(pickle.dumps((roots[0], found)))
    id_keys.rekey(rekeys)
    new = ns["holder"]
    assert list(new.buffers) == [id(p) for p in new.params]  # order kept
    assert list(new.buffers.values()) == ["A", "B", "C"]
    assert new.frozen == {id(new.params[1])}
    assert ns["names"] == {id(p): p.name for p in new.params}
    assert ns["counts"] == counts


def test_the_walk_is_bounded(monkeypatch):
    params = [Param(str(i)) for i in range(5)]
    deep = {id(p): i for i, p in enumerate(params)}
    roots = [[[[[deep]]]], params]
    assert id_keys.find(roots, {})
    monkeypatch.setattr(id_keys, "LIMIT", 3)
    assert id_keys.find(roots, {}) == []
