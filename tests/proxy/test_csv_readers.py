"""CSV readers in the shapes scripts read data with, stopped and restored at random safe points.

``reader = csv.reader(f); header = next(reader); for row in reader:`` is the commonest way to read
a CSV, and a job doing it could never be checkpointed: the C reader does not pickle and, iterating
its file, disables the file's ``tell()``. The engine's `handles.CsvReader` reads the file through
``readline()`` and saves the reader as its file (at its place), dialect and line count."""
from __future__ import annotations

import csv
import io
import pickle
import subprocess
import sys
import textwrap

from harness import assert_chains_match, trace_of

from backend.proxy.engine import handles

READERS = """
import csv, os
here = os.path.dirname(os.path.abspath(__file__))
total = 0.0

def by_header_then_rows():
    global total
    f = open(os.path.join(here, "data.csv"), newline="")   # no with: a file in a variable
    header = next(f)                                         # a header taken from the file by hand
    reader = csv.reader(f)
    for i, row in enumerate(reader):
        total += float(row[1])
        print("a", i, reader.line_num, row[0], f"{total:.6f}")
        if i == 11:
            break
    return f

def dict_rows_with_quoted_newlines():
    with open(os.path.join(here, "multi.csv"), newline="") as g:
        rows = csv.DictReader(g)
        for row in rows:
            print("b", rows.line_num, row["id"], repr(row["text"]))

def main():
    f = by_header_then_rows()
    dict_rows_with_quoted_newlines()
    for r in csv.reader(["x;y", "1;2", "3;4", "5;6"] * 2, delimiter=";"):
        print("c", r)
    reader = csv.reader(f)                                  # the rest of the first file
    print("rest", sum(1 for _ in reader), reader.line_num)

main()
"""


def _folder(tmp_path) -> list[str]:
    (tmp_path / "train.py").write_text(textwrap.dedent(READERS))
    (tmp_path / "data.csv").write_text("id,x\n" + "".join(f"{i},{i * 0.37:.4f}\n" for i in range(30)))
    with open(tmp_path / "multi.csv", "w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["id", "text"])
        for i in range(10):
            writer.writerow([i, "two\nlines, and a comma" if i % 3 == 0 else f"t{i}"])
    return [str(tmp_path / "train.py")]


def test_csv_readers_in_variables_resume_exactly_at_random_safe_points(launcher, tmp_path):
    target = _folder(tmp_path)
    plain = subprocess.run([sys.executable, target[0]], capture_output=True, text=True, check=True)
    base, trace = trace_of(launcher, target, tmp_path)
    assert base.stdout == plain.stdout and "rest 18 18" in plain.stdout, base.describe()
    assert not base.events("checkpoint_failed"), base.describe()
    assert_chains_match(launcher, target, base, trace, tmp_path, seeds=(1, 2, 3), extra=4)


def test_a_csv_reader_over_strings_or_a_stream_keeps_its_place():
    reader = handles.CsvReader(["a,b", "1,2", "3,4"])
    next(reader)
    assert list(pickle.loads(pickle.dumps(reader))) == [["1", "2"], ["3", "4"]]
    stream = handles.CsvReader(io.StringIO("a\nb\n"))  # not a file: saved as the stream itself
    next(stream)
    assert list(pickle.loads(pickle.dumps(stream))) == [["b"]]  # StringIO pickles with its place
