"""Open files in a checkpoint: written files come back with their bytes and place, read files
with their place; what cannot be re-opened is refused with a reason."""
from __future__ import annotations

import os
import pickle
import socket

import pytest

from backend.proxy.engine import context, handles, open_files
from backend.proxy.engine.state import ProxyPickler


@pytest.fixture()
def job_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    context.begin()
    return tmp_path


def dumps(obj) -> bytes:
    import io

    buf = io.BytesIO()
    ProxyPickler(buf, protocol=4).dump(obj)
    return buf.getvalue()


@pytest.mark.parametrize("mode", ["w", "a", "w+", "wb", "ab"])
def test_a_written_file_is_put_back_as_it_was_at_the_checkpoint(job_folder, mode):
    text = "b" not in mode
    line = (lambda s: s) if text else (lambda s: s.encode())
    log = open("log.txt", mode)
    log.write(line("one\ntwo\n"))  # still in the buffer: the checkpoint flushes it
    saved = dumps({"log": log, "again": log})
    log.write(line("lost after the checkpoint\n"))
    log.close()

    state = pickle.loads(saved)
    assert state["log"] is state["again"]  # one file, shared
    state["log"].write(line("three\n"))
    state["log"].close()
    assert (job_folder / "log.txt").read_bytes() == b"one\ntwo\nthree\n"


def test_a_file_open_to_append_and_read_keeps_its_reading_place(job_folder):
    """``open(path, "a+")``: writes go to the end, reads from where it was; the restore left it at
    the end, so what the program read back after it was empty (silently)."""
    f = open("history.txt", "a+")
    f.write("one\ntwo\n")
    f.seek(0)
    assert f.readline() == "one\n"
    saved = dumps(f)
    f.close()
    again = pickle.loads(saved)
    assert again.readline() == "two\n"
    again.write("three\n")
    again.seek(0)
    assert again.read() == "one\ntwo\nthree\n"
    again.close()


@pytest.mark.parametrize("newline", [None, "", "\n", "\r", "\r\n"])
def test_a_text_file_comes_back_with_the_newline_it_was_opened_with(job_folder, newline):
    """``newline=""`` is how a CSV file is opened; reopened with the default it would translate."""
    import csv

    log = open("log.csv", "w", newline=newline, buffering=1)
    csv.writer(log).writerow(["step", "loss"])
    log.write("note\n")
    saved = dumps(log)
    log.close()
    again = pickle.loads(saved)
    assert again.line_buffering
    csv.writer(again).writerow([1, 0.5])
    again.write("end\n")
    again.close()
    expected = open("expected.csv", "w", newline=newline)
    csv.writer(expected).writerow(["step", "loss"]), expected.write("note\n")
    csv.writer(expected).writerow([1, 0.5]), expected.write("end\n")
    expected.close()
    assert (job_folder / "log.csv").read_bytes() == (job_folder / "expected.csv").read_bytes()


def test_a_read_file_keeps_its_newline_translation(job_folder):
    (job_folder / "data.txt").write_bytes(b"a\r\nb\r\nc\r\n")
    f = open("data.txt", newline="")
    assert f.readline() == "a\r\n"
    again = pickle.loads(dumps(f))
    f.close()
    assert again.readline() == "b\r\n"
    again.close()


def test_a_file_held_at_another_path_resolves_in_the_new_job_folder(job_folder, tmp_path_factory, monkeypatch):
    (job_folder / "runs").mkdir()
    log = open("runs/log.txt", "w")
    log.write("a\n")
    saved = dumps(log)
    log.close()
    elsewhere = tmp_path_factory.mktemp("other-node")
    monkeypatch.chdir(elsewhere)
    context.begin()
    reopened = pickle.loads(saved)
    reopened.write("b\n")
    reopened.close()
    assert (elsewhere / "runs" / "log.txt").read_text() == "a\nb\n"


def test_a_read_file_resumes_at_its_place(job_folder):
    (job_folder / "data.txt").write_text("".join(f"row {i}\n" for i in range(10)))
    f = open("data.txt")
    assert [f.readline() for _ in range(3)][-1] == "row 2\n"
    saved = dumps(f)
    f.close()
    assert pickle.loads(saved).readline() == "row 3\n"


def test_a_csv_reader_pickles_with_its_file_at_its_place(job_folder):
    """In one process: the copy reads on from the row after the original's, with its line count."""
    path = job_folder / "d.csv"
    path.write_text("a,b\n1,2\n3,4\n5,6\n")
    with open(path, newline="") as f:
        reader = handles.CsvReader(f, delimiter=",")
        assert next(reader) == ["a", "b"] and next(reader) == ["1", "2"]
        assert f.tell() == 8  # the file's place is readable: the reader took its lines by readline()
        copy = pickle.loads(dumps(reader))
        assert list(copy) == [["3", "4"], ["5", "6"]] and copy.line_num == 4
        assert copy.dialect.delimiter == "," and list(reader) == [["3", "4"], ["5", "6"]]
        copy._made_from[0].close()



def test_a_restore_goes_on_with_the_saved_handle_after_its_header_truncated_the_file(job_folder):
    import csv

    handles.install()  # as the program's run does: csv writers become ones that pickle
    log = open("log.csv", "w", newline="")
    rows = csv.writer(log)  # refers to the handle: it must go on writing where the log is
    rows.writerow(["step", "loss"])
    saved = dumps({"log": log, "rows": rows})
    log.close()
    state = pickle.loads(saved)
    fresh = open("log.csv", "w", newline="")  # what re-running `with open("log.csv", "w") as log:` does
    log = open_files.take_over(fresh, state["log"], "the with statement at line 1")
    assert log is state["log"] and fresh.closed
    state["rows"].writerow([0, 0.5])
    log.close()
    assert (job_folder / "log.csv").read_bytes() == b"step,loss\r\n0,0.5\r\n"


def test_what_cannot_be_reopened_is_refused_with_a_reason(job_folder):
    a, b = socket.socketpair()
    try:
        stream = a.makefile("w")
        with pytest.raises(pickle.PicklingError, match="not a regular file"):
            dumps(stream)
    finally:
        a.close(), b.close()
    r, w = os.pipe()
    with os.fdopen(w, "w") as pipe:
        with pytest.raises(pickle.PicklingError, match="not a regular file"):
            dumps(pipe)
    os.close(r)
    gone = open("gone.txt", "w")
    os.unlink("gone.txt")
    with pytest.raises(pickle.PicklingError, match="was deleted"):
        dumps(gone)
    gone.close()


def test_a_read_only_memmap_is_saved_as_its_file_not_its_bytes(job_folder):
    import numpy as np

    from backend.proxy.checkpoint.errors import CheckpointError

    np.arange(100_000, dtype=np.uint16).tofile("train.bin")
    tokens = np.memmap("train.bin", dtype=np.uint16, mode="r")
    saved = dumps({"tokens": tokens, "window": tokens[10:20]})
    assert len(saved) < 2_000  # the slice is copied (20 bytes); the 200 kB mapping is not
    state = pickle.loads(saved)
    assert isinstance(state["tokens"], np.memmap) and state["tokens"][12345] == 12345
    assert list(state["window"]) == list(range(10, 20))
    with open("train.bin", "ab") as f:
        f.write(b"\0\0")  # the dataset changed since the checkpoint
    with pytest.raises(CheckpointError, match="held 200000 bytes at the checkpoint and holds 200002"):
        pickle.loads(saved)


def test_a_writable_memmap_comes_back_mapped_with_the_file_as_it_was(job_folder):
    """Rows a loop writes out through `np.lib.format.open_memmap(..., mode="w+")`: the map came back
    as an array in memory, and rows written after a restore never reached the file."""
    import numpy as np

    out = np.lib.format.open_memmap("emb.npy", mode="w+", dtype=np.float32, shape=(4, 2))
    out[0] = 1.5
    saved = dumps({"out": out})
    out[1] = 9.0  # after the checkpoint: not in the restored file
    del out
    state = pickle.loads(saved)
    back = state["out"]
    assert isinstance(back, np.memmap) and back.mode == "r+"
    assert back[1].tolist() == [0.0, 0.0]
    back[2] = 3.0
    back.flush()
    del back, state
    assert np.load("emb.npy").tolist() == [[1.5, 1.5], [0.0, 0.0], [3.0, 3.0], [0.0, 0.0]]


def test_a_view_of_a_writable_memmap_writes_through_to_its_file_after_a_restore(job_folder):
    """``np.memmap(..., mode="w+").reshape(n, d)``: the view was saved as an array in memory, and
    what the loop wrote through it after a restore never reached the file (silently)."""
    import numpy as np

    emb = np.memmap("emb.dat", dtype=np.float32, mode="w+", shape=(4,)).reshape(2, 2)
    emb[0] = 1.0
    state = pickle.loads(dumps({"emb": emb}))
    del emb
    state["emb"][1] = 2.0
    state["emb"].flush()
    assert isinstance(state["emb"], np.memmap) and state["emb"].filename.endswith("emb.dat")
    assert np.fromfile("emb.dat", dtype=np.float32).tolist() == [1.0, 1.0, 2.0, 2.0]


def test_an_open_npz_archive_is_saved_as_its_file(job_folder):
    """`d = np.load("train.npz")` kept in a variable holds an open zip: every checkpoint of such a
    program was refused with advice that did not fit (give NpzFile __getstate__)."""
    import numpy as np

    from backend.proxy.checkpoint.errors import CheckpointError

    np.savez("train.npz", x=np.arange(50_000, dtype=np.float32), y=np.arange(7))
    d = np.load("train.npz")
    first = d["y"]
    saved = dumps({"d": d, "first": first})
    assert len(saved) < 2_000  # the name, not the 200 kB of arrays
    back = pickle.loads(saved)["d"]
    assert back.files == ["x", "y"] and back["x"][49_999] == 49_999 and list(back["y"]) == list(range(7))
    back.close()
    d.close()
    assert pickle.loads(dumps({"closed": d}))["closed"].fid is None  # a closed one pickles as it is
    np.savez("train.npz", x=np.arange(3))  # the dataset changed since the checkpoint
    with pytest.raises(CheckpointError, match=r"\(np.load of an .npz\), which held \d+ bytes at the checkpoint"):
        pickle.loads(saved)
