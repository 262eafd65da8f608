"""``functools.lru_cache`` and ``functools.cache`` on the program's own functions, saved with
their entries.

CPython's cache wrapper is a C object: it pickles as a reference to its name (``__main__.f``),
which a restore cannot look up while it is still loading the namespace that will hold ``f``, and
its entries cannot be read at all. Recomputing them after a restore would not be exact either:
a cached ``load_split()`` that draws random numbers, or a cached object the program mutated,
would come back different. So while a program runs, a cache decorator applied to one of its own
functions (the script's, a cell's, or a module of the job's folder) makes a `CachedFunction`:
the same behaviour and ``cache_info()``, in Python, with its entries, order and counters saved
like any other object. Caches on any other function (a library's) are CPython's, untouched.
"""
from __future__ import annotations

import collections
import functools
import threading
import types
from typing import Any, Callable, Optional

from .ownership import PROGRAM

_ORIGINAL = functools.lru_cache


class _KeywordMark:
    """Separates positional from keyword arguments in a key; one per process, pickled by name,
    so keys saved in a checkpoint match the restored process's calls."""

    def __reduce__(self) -> str:
        return "KEYWORD_MARK"


KEYWORD_MARK = _KeywordMark()


class CachedFunction:
    """``functools.lru_cache(maxsize, typed)(fn)``, in Python, picklable with its entries."""

    def __init__(self, fn: Callable[..., Any], maxsize: Optional[int], typed: bool) -> None:
        self.maxsize = maxsize
        self.typed = typed
        self._entries: Optional[collections.OrderedDict] = collections.OrderedDict()
        self._saved: list = []  # the entries of a checkpoint until the first use (`entries`)
        self.hits = 0
        self.misses = 0
        self._lock = threading.RLock()
        functools.update_wrapper(self, fn)

    @property
    def entries(self) -> collections.OrderedDict:
        """The cache. Restored entries are put in on first use, not while unpickling: a key may
        hold an instance of a class of the program whose ``__hash__`` is not set yet then (the
        cache of a method is restored as part of its class)."""
        if self._entries is None:
            self._entries = collections.OrderedDict(self._saved)
            self._saved = []
        return self._entries

    def _key(self, args: tuple, kwargs: dict) -> Any:
        key = args
        if kwargs:
            key += (KEYWORD_MARK,) + tuple(kwargs.items())
        if self.typed:
            key += tuple(type(v) for v in args) + tuple(type(v) for v in kwargs.values())
        return key

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.maxsize == 0:
            self.misses += 1
            return self.__wrapped__(*args, **kwargs)
        key = self._key(args, kwargs) if kwargs or self.typed else args
        entries = self._entries if self._entries is not None else self.entries
        try:
            result = entries[key]
        except KeyError:
            pass
        else:
            self.hits += 1
            if self.maxsize is not None:
                entries.move_to_end(key)
            return result
        self.misses += 1
        result = self.__wrapped__(*args, **kwargs)
        with self._lock:  # two threads may both have missed: keep the first result, as CPython does
            if key not in entries:
                entries[key] = result
                if self.maxsize is not None and len(entries) > self.maxsize:
                    entries.popitem(last=False)
        return result

    def __get__(self, obj: Any, owner: Optional[type] = None) -> Any:
        return self if obj is None else types.MethodType(self, obj)

    def cache_info(self) -> Any:
        return functools._CacheInfo(self.hits, self.misses, self.maxsize, len(self.entries))

    def cache_clear(self) -> None:
        with self._lock:
            self.entries.clear()
            self.hits = self.misses = 0

    def cache_parameters(self) -> dict:
        return {"maxsize": self.maxsize, "typed": self.typed}

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        del state["_lock"]
        state["_saved"] = list(self.entries.items())
        state["_entries"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        return f"<cached function {self.__qualname__}>"


def _decorate(fn: Any, maxsize: Optional[int], typed: bool) -> Any:
    if PROGRAM(fn):
        return CachedFunction(fn, maxsize, typed)
    return _ORIGINAL(maxsize, typed)(fn)


def lru_cache(maxsize: Any = 128, typed: bool = False) -> Any:
    """`functools.lru_cache` with its argument rules, for the program's functions a `CachedFunction`."""
    if isinstance(maxsize, int):
        maxsize = max(maxsize, 0)
    elif callable(maxsize) and isinstance(typed, bool):
        return _decorate(maxsize, 128, typed)
    elif maxsize is not None:
        raise TypeError("Expected first argument to be an integer, a callable, or None")
    return lambda fn: _decorate(fn, maxsize, typed)


lru_cache.__wrapped__ = _ORIGINAL  # type: ignore[attr-defined]


def install() -> None:
    """From now until `uninstall`, cache decorators applied to the program's own functions
    (`ownership.PROGRAM`) make `CachedFunction` s (``functools.cache`` calls ``lru_cache`` through
    functools' globals)."""
    functools.lru_cache = lru_cache  # type: ignore[assignment]


def uninstall() -> None:
    functools.lru_cache = _ORIGINAL  # type: ignore[assignment]
