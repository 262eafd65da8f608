"""`reading.ParallelReads`: large reads split across threads give exactly the file's bytes,
leave the position where a plain read would, and stop at the file's end."""
from __future__ import annotations

import os
import threading

import pytest

from backend.proxy.checkpoint import reading

MB = 1 << 20


@pytest.fixture
def data_file(tmp_path):
    data = os.urandom(3 * MB) * 7 + b"tail"  # 21 MB and a few bytes: several pieces, uneven
    path = tmp_path / "data.bin"
    path.write_bytes(data)
    return path, data


def test_a_large_read_is_exact_and_leaves_the_position_after_it(data_file, monkeypatch):
    path, data = data_file
    threads: set[int] = set()
    pread = os.preadv

    def watched(fd, buffers, offset):
        threads.add(threading.get_ident())
        return pread(fd, buffers, offset)

    monkeypatch.setattr(reading.os, "preadv", watched)
    with open(path, "rb") as raw, reading.ParallelReads(raw, threads=4) as f:
        assert f.read(10) == data[:10]  # the file object has buffered more than it handed out
        buf = bytearray(20 * MB)
        assert f.readinto(buf) == len(buf)
        assert bytes(buf) == data[10:10 + 20 * MB]
        assert f.read() == data[10 + 20 * MB:]
    assert len(threads) > 1, "the pieces of a large read were not read by several threads"


def test_a_read_past_the_end_returns_only_the_bytes_there(data_file):
    path, data = data_file
    with open(path, "rb") as raw, reading.ParallelReads(raw, threads=4) as f:
        raw.seek(len(data) - 9 * MB)
        buf = bytearray(16 * MB)
        assert f.readinto(buf) == 9 * MB
        assert bytes(buf[:9 * MB]) == data[-9 * MB:]
        assert f.read() == b""


def test_small_reads_and_lines_go_to_the_file_as_they_are(data_file):
    path, data = data_file
    with open(path, "rb") as raw, reading.ParallelReads(raw) as f:
        buf = bytearray(1000)
        assert f.readinto(buf) == 1000 and bytes(buf) == data[:1000]
        assert f.readline() == data[1000:data.index(b"\n", 1000) + 1]


@pytest.mark.parametrize("damaged", [False, True])
def test_hashing_while_reading_in_parallel_checks_every_byte(data_file, damaged):
    from backend.proxy.checkpoint import digest

    path, data = data_file
    expected = digest.of_bytes(data)
    if damaged:  # one flipped byte inside a piece read by a thread
        path.write_bytes(data[:15 * MB] + bytes([data[15 * MB] ^ 1]) + data[15 * MB + 1:])
    with open(path, "rb") as raw, reading.ParallelReads(raw, threads=4) as parallel:
        f = digest.HashingReader(parallel, digest.NAME)
        assert len(f.read(100)) == 100
        assert f.readinto(bytearray(10 * MB)) == 10 * MB
        assert f.readinto(bytearray(9 * MB)) == 9 * MB
        f.readline()
        assert f.finish(expected) is not damaged
