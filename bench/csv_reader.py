"""Benchmark: reading a CSV file under the engine (`handles.CsvReader`) against the C reader.

    .venv/bin/python bench/csv_reader.py [--rows 500000] [--reps 5]

While a program runs, ``csv.reader(f)`` returns a `handles.CsvReader` that reads the file through
``readline()`` (so the file keeps its ``tell()`` and the reader can be saved at its row). Three
ways over the same file, alternated rep by rep so the machine's moods fall on all alike:

  C reader      ``_csv.reader(f)``, what a plain run does
  CsvReader     as shipped: the C reader over ``iter(f.readline, "")`` in a saveable wrapper
  LineReader    the first version: the C reader over a Python iterator calling ``readline()``

Minimum seconds to iterate every row; ratio to the C reader in the same run.
"""
from __future__ import annotations

import argparse
import csv
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backend.proxy.engine import handles, manual_next  # noqa: E402


def _time(make, path: Path) -> float:
    with open(path, newline="") as f:
        start = time.perf_counter()
        for _ in make(f):
            pass
        return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=500_000)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    ways = {"C reader": handles._csv_reader, "CsvReader": handles.CsvReader,
            "LineReader": lambda f: handles._csv_reader(manual_next.LineReader(f))}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rows.csv"
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            for i in range(a.rows):
                writer.writerow([i, i * 0.5, "text", "a,b"])
        best = {name: float("inf") for name in ways}
        for _ in range(a.reps):
            for name, make in ways.items():
                best[name] = min(best[name], _time(make, path))
    base = best["C reader"]
    print(f"{a.rows:,} rows of 4 fields, best of {a.reps}; seconds, ratio to the C reader")
    print(f"{'way':<12} {'seconds':>8} {'ratio':>6} {'ns/row':>7}")
    for name, seconds in best.items():
        print(f"{name:<12} {seconds:8.3f} {seconds / base:6.2f} {seconds / a.rows * 1e9:7.0f}")


if __name__ == "__main__":
    main()
