"""The content hash of checkpoint files and blobs.

Every byte of a checkpoint is hashed on the critical path twice: while it is written (a preempted
job's devices are freed only after) and when a restore checks it.  sha256 runs at ~0.5 GB/s on
one core here, as slow as the disk; xxh3-128 at ~6 GB/s.  The hash guards against torn and
corrupted files and names deduplicated blobs (an accidental collision of 128 bits is not a
concern); it is not a defence against someone who can write the checkpoint folder, who could
rewrite the manifest too.  Checkpoints written with sha256 by earlier engines still verify: an
entry says which algorithm made it, and a blob's name tells by its length.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Protocol

import xxhash

#: the algorithm new checkpoints use; the manifest's file entries are keyed by it
NAME = "xxh3_128"
#: every algorithm a manifest entry may name, newest first
KNOWN = ("xxh3_128", "sha256")
_HEX_LENGTH = {"xxh3_128": 32, "sha256": 64}


class Hasher(Protocol):
    def update(self, data: Any) -> None: ...
    def hexdigest(self) -> str: ...


def new(name: str = NAME) -> Hasher:
    if name == "xxh3_128":
        return xxhash.xxh3_128()
    if name == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown checkpoint hash {name!r}; known: {', '.join(KNOWN)}")


def of_bytes(data: Any) -> str:
    """The digest of ``data`` (bytes-like) with the current algorithm."""
    return xxhash.xxh3_128_hexdigest(data)


def algorithm_of(hexdigest: str) -> str:
    """Which algorithm made a blob's name (its length tells)."""
    for name, length in _HEX_LENGTH.items():
        if len(hexdigest) == length:
            return name
    raise ValueError(f"{hexdigest!r} is not a digest of any known algorithm")


def of_file(path: Path, name: str = NAME) -> str:
    h = new(name)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class HashingReader:
    """A binary file read through once by an unpickler, hashed on the way (no second pass).

    `finish` hashes whatever the reader left and says whether the whole file had ``expected``.
    """

    def __init__(self, f: Any, algorithm: str) -> None:
        self._f = f
        self._hash = new(algorithm)

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self._hash.update(data)
        return data

    def readinto(self, buffer: Any) -> int:
        n = self._f.readinto(buffer)
        self._hash.update(memoryview(buffer)[:n])
        return n

    def readline(self, limit: int = -1) -> bytes:
        data = self._f.readline(limit)
        self._hash.update(data)
        return data

    def finish(self, expected: str) -> bool:
        for chunk in iter(lambda: self._f.read(1 << 20), b""):
            self._hash.update(chunk)
        return self._hash.hexdigest() == expected
