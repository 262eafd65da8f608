"""Answers the pickling rules remember per type, forgotten when the program ends.

A checkpoint meets the same few types thousands of times, so the rules ask their questions once
per type. A memo keyed by the program's own class holds the class, its methods and through them
the script's globals: after a checkpoint the namespace could not be collected at exit, and a
``__del__`` that read a global raised ``NameError`` (a plain run prints). In a kernel, every
cell's classes piled up. A weak memo would cost a weak reference per lookup on the hottest path
of pickling; the program's end is a moment when nothing pickles, so the memos are emptied there.
"""
from __future__ import annotations

from typing import Any

_MEMOS: list[Any] = []


def new_dict() -> dict:
    """A dict keyed by type, emptied by `forget`."""
    memo: dict = {}
    _MEMOS.append(memo)
    return memo


def new_set() -> set:
    """A set of types, emptied by `forget`."""
    memo: set = set()
    _MEMOS.append(memo)
    return memo


def forget() -> None:
    """Called as the program ends (stopped or finished): no memo holds its classes any more."""
    for memo in _MEMOS:
        memo.clear()
