"""Streams and files around a loop, in the shapes scripts use (each resumed wrongly or crashed at
restore before): ``with open(log, "w") as f, redirect_stdout(f):`` around training (the file was
saved as the console, the log came back empty and the last print failed); ``gzip.open`` in a
``with`` (re-opened at restore, truncating what the loop wrote: now refused, naming it); a
``csv.writer`` left in a variable over a file closed before the checkpoint (the restore failed); a
file written with ``newline="\\r\\n"`` and one read with ``newline=""`` (re-opened with the default
newline: the rest of the file got ``\\n`` line ends, the reader lost its ``\\r``)."""
from __future__ import annotations

import gzip
import textwrap

from harness import EXIT_PREEMPTED, run_chain, trace_of

REDIRECTED = """
import contextlib, os
out = os.path.join(os.path.dirname(__file__), "train_log.txt")
print("start")
with open(out, "w") as f, contextlib.redirect_stdout(f):
    for epoch in range(3):
        for i in range(4):
            print(epoch, i, epoch * 10 + i)
print("end")
"""

GZIP_AND_CLOSED_CSV = """
import csv, gzip, os
here = os.path.dirname(__file__)
f = open(os.path.join(here, "metrics.csv"), "w", newline="")
writer = csv.writer(f)
for epoch in range(3):
    writer.writerow([epoch, epoch * 0.5])
f.close()
with gzip.open(os.path.join(here, "log.jsonl.gz"), "wt") as log:
    for step in range(6):
        log.write(f"{step}\\n")
        print("step", step)
for k in range(3):
    print("eval", k)
"""

NEWLINES = """
import os
here = os.path.dirname(__file__)
report = open(os.path.join(here, "report.txt"), "w", newline="\\r\\n")
rows = open(os.path.join(here, "rows.txt"), newline="")
for step in range(8):
    line = rows.readline()
    report.write(f"{step} {line!r}\\n")
    print(step, repr(line))
report.close()
"""


def _script(tmp_path, name: str, src: str) -> list[str]:
    (tmp_path / name).write_text(textwrap.dedent(src))
    return [str(tmp_path / name)]


def test_a_loop_inside_redirect_stdout_resumes_with_its_log_file(launcher, tmp_path):
    target = _script(tmp_path, "redirected.py", REDIRECTED)
    base, trace = trace_of(launcher, target, tmp_path)
    log = (tmp_path / "train_log.txt").read_text()
    assert base.stdout == "start\nend\n" and len(log.splitlines()) == 12
    stops = [t["step"] for t in trace if t["kind"] == "loop"][3::4]
    out, _ = run_chain(launcher, target, stops, tmp_path / "ck")
    assert out == base.stdout and (tmp_path / "train_log.txt").read_text() == log


def test_a_gzip_stream_in_a_with_is_refused_and_a_csv_writer_over_a_closed_file_restores(launcher, tmp_path):
    target = _script(tmp_path, "files.py", GZIP_AND_CLOSED_CSV)
    base, trace = trace_of(launcher, target, tmp_path)
    lines = GZIP_AND_CLOSED_CSV.splitlines()
    loop_line = {name: next(i for i, x in enumerate(lines, 1) if x.strip().startswith(f"for {name} in"))
                 for name in ("step", "k")}
    in_gzip = [t["step"] for t in trace if t["kind"] == "loop" and t["line"] == loop_line["step"]][2]
    run = launcher.run(target + ["--checkpoint-dir", str(tmp_path / "ck1"), "--stop-at-step", str(in_gzip)])
    assert run.rc == 0 and run.stdout == base.stdout, run.describe()
    [failed] = [d["error"] for _, d in run.events("checkpoint_failed")]
    assert "gzip" in failed and "truncating what the loop wrote" in failed, failed
    assert gzip.open(tmp_path / "log.jsonl.gz", "rt").read() == "".join(f"{s}\n" for s in range(6))
    in_eval = [t["step"] for t in trace if t["kind"] == "loop" and t["line"] == loop_line["k"]][1]
    stopped = launcher.run(target + ["--checkpoint-dir", str(tmp_path / "ck2"), "--stop-at-step", str(in_eval)])
    assert stopped.rc == EXIT_PREEMPTED, stopped.describe()
    resumed = launcher.run(target + ["--checkpoint-dir", str(tmp_path / "ck2"), "--restore"])
    assert resumed.rc == 0 and stopped.stdout + resumed.stdout == base.stdout, resumed.describe()


def test_text_files_keep_their_newline_through_a_chain_of_stops(launcher, tmp_path):
    target = _script(tmp_path, "newlines.py", NEWLINES)
    (tmp_path / "rows.txt").write_bytes(b"".join(b"row %d\r\n" % i for i in range(8)))
    base, trace = trace_of(launcher, target, tmp_path)
    report = (tmp_path / "report.txt").read_bytes()
    assert report.count(b"\r\n") == 8 and "'row 7\\r\\n'" in base.stdout, base.describe()
    (tmp_path / "report.txt").unlink()
    stops = [t["step"] for t in trace if t["kind"] == "loop"][2::3]
    out, _ = run_chain(launcher, target, stops, tmp_path / "ck")
    assert out == base.stdout and (tmp_path / "report.txt").read_bytes() == report
