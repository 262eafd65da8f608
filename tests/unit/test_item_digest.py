"""What a loop item contributes to the digest a restore compares its replay against: the values
that decide which items an iterator chose, never what the loop body may change afterwards."""
from __future__ import annotations

import numpy as np
import torch

from backend.proxy.engine.item_digest import Digesting, fold


def _same(a, b) -> bool:
    return fold(0, a) == fold(0, b)


def test_values_of_numbers_strings_and_containers_count():
    assert _same([1, 2, (3.5, "a")], [1, 2, (3.5, "a")])
    assert not _same([1, 2, 3], [1, 2, 4])
    assert not _same({"k": 1}, {"k": 2})
    assert not _same("ab", b"ab") and not _same(1, 1.0) and not _same(1, "1")
    assert fold(fold(0, "a"), "b") != fold(0, "ab")


def test_a_fresh_tensor_or_array_counts_by_its_values_a_view_by_where_it_points():
    x = torch.arange(12.0).reshape(6, 2)
    assert not _same(x[[0, 1]], x[[0, 2]])            # fancy indexing makes a fresh batch
    assert _same(x[[0, 1]], x[[0, 1]].clone())
    view = fold(0, x[2:4])
    x.mul_(2)                                          # the body updates the base in place
    assert fold(0, x[2:4]) == view and fold(0, x[3:5]) != view
    a = np.arange(2000.0)
    assert not _same(a[[5, 1999]], a[[5, 1998]])
    assert _same(a[10:20], a[10:20]) and not _same(a[10:20], a[11:21])
    big = torch.zeros(5000)
    other = big.clone()
    other[4000] = 1.0                                  # on a sampled position (every 4th value)
    assert not _same(big, other)
    assert not _same(torch.ones(3, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.bfloat16))


def test_parameters_and_other_objects_count_by_type_only():
    p = torch.nn.Parameter(torch.ones(3))
    before = fold(0, p)
    with torch.no_grad():
        p.add_(1)
    assert fold(0, p) == before
    assert _same(object(), object()) and not _same(object(), Exception())


def test_the_chain_depends_on_every_item_and_its_order():
    a = Digesting(iter([1, 2, 3]))
    b = Digesting(iter([1, 3, 2]))
    assert list(a) == [1, 2, 3] and list(b) == [1, 3, 2]
    assert a.value != b.value and isinstance(a.value, int)
    c = Digesting(iter([3]), fold(fold(0, 1), 2))  # continued after a restore
    list(c)
    assert c.value == a.value


def test_a_parameter_digests_the_same_frozen_or_not():
    """A loop freezing parameters (`for p in model.parameters(): p.requires_grad_(False)`) takes them
    trainable; its replay after a restore takes them frozen: the same items."""
    p = torch.nn.Parameter(torch.arange(4.0))
    trainable = fold(0, p)
    p.requires_grad_(False)
    assert fold(0, p) == trainable
