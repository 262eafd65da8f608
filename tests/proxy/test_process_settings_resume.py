"""Process settings a script makes once before its loop and that live outside its variables, through
a chain of stops: ``logging.captureWarnings(True)`` (after a restore warnings went to stderr, not the
log file), ``os.umask(0o077)`` (files made after it were 0o644), ``TZ`` with ``time.tzset()`` (the
variable came back, the zone did not: UTC times) and a ``SIGUSR1`` handler (the default action
ended the resumed process), ``sys.set_int_max_str_digits(0)`` and ``np.seterrcall`` (each made the
resumed process raise)."""
from __future__ import annotations

import shutil
import stat
import textwrap

from harness import pick_stops, run_chain, trace_of

SETTINGS = """
import gc, logging, os, signal, stat, sys, time, warnings
import numpy as np
sys.set_int_max_str_digits(0)                    # str() of a big integer
np.seterrcall(lambda kind, flag: print("fp error:", kind, flush=True))
np.seterr(divide="call")
gc.disable()
gc.set_threshold(1000, 20, 20)
here = os.path.dirname(os.path.abspath(__file__))
logging.basicConfig(filename=os.path.join(here, "train.log"), filemode="w", level=logging.INFO,
                    format="%(levelname)s %(message)s")
logging.captureWarnings(True)
os.umask(0o077)
os.environ["TZ"] = "Asia/Kolkata"
time.tzset()
got = []

def on_usr1(signum, frame):
    got.append(signum)
    print("got SIGUSR1: dumping stats", flush=True)

signal.signal(signal.SIGUSR1, on_usr1)
os.makedirs(os.path.join(here, "out"), exist_ok=True)
for step in range(12):
    if step == 9:
        warnings.warn(f"loss plateaued at step {step}")
        os.kill(os.getpid(), signal.SIGUSR1)
    path = os.path.join(here, "out", f"step{step}.txt")
    with open(path, "w") as f:
        f.write(time.strftime("%Y-%m-%d %H:%M %Z", time.localtime(1_700_000_000 + 3600 * step)) + "\\n")
    logging.info("step %d", step)
    print("step", step, len(str(10 ** 5000 + step)), np.float64(1.0) / np.float64(0.0), oct(stat.S_IMODE(os.stat(path).st_mode)),
          time.strftime("%H:%M %Z", time.localtime(1_700_000_000)), got, gc.isenabled(), gc.get_threshold(),
          flush=True)
"""


def _job(tmp_path, src: str) -> tuple:
    """A job folder holding ``src`` as train.py (what it writes lands beside it), and the target."""
    job = tmp_path / "job"
    job.mkdir()
    (job / "train.py").write_text(textwrap.dedent(src))
    return job, [str(job / "train.py")]


def _outputs(folder) -> dict[str, tuple[str, int]]:
    """Each file the script wrote: its text and its permissions."""
    return {p.name: (p.read_text(), stat.S_IMODE(p.stat().st_mode)) for p in sorted((folder / "out").iterdir())}


def test_warnings_capture_umask_time_zone_and_a_signal_handler_survive_a_chain_of_stops(launcher, tmp_path):
    job, target = _job(tmp_path, SETTINGS)
    base, trace = trace_of(launcher, target, tmp_path)
    log, files = (job / "train.log").read_text(), _outputs(job)
    assert "step 11 5001 inf 0o600 03:43 IST [10]" in base.stdout and "fp error: divide by zero" in base.stdout and "got SIGUSR1" in base.stdout, base.describe()
    assert "UserWarning: loss plateaued at step 9" in log and {mode for _, mode in files.values()} == {0o600}

    (job / "train.log").unlink()
    shutil.rmtree(job / "out")  # a file written again keeps the mode it was created with
    loops = [t["step"] for t in trace if t["kind"] == "loop"]
    stops = sorted(set(pick_stops(trace, 1, extra=2)) | {loops[9]})  # one restore just before the signal
    out, runs = run_chain(launcher, target, stops, tmp_path / "ck")
    assert out == base.stdout, f"stops {stops}\n{runs[-1].describe()}"
    assert (job / "train.log").read_text() == log
    assert _outputs(job) == files
    assert all("loss plateaued" not in r.stderr for r in runs)


LOGGING_EXTRAS = """
import logging, os
here = os.path.dirname(os.path.abspath(__file__))
NOTICE = 25
logging.addLevelName(NOTICE, "NOTICE")
state = {"step": -1}
base_factory = logging.getLogRecordFactory()

def record_factory(*args, **kwargs):
    record = base_factory(*args, **kwargs)
    record.step = state["step"]
    return record

logging.setLogRecordFactory(record_factory)

class EveryOther(logging.Filter):
    def __init__(self):
        super().__init__()
        self.seen = 0

    def filter(self, record):
        self.seen += 1
        return self.seen % 3 != 0

log = logging.getLogger("train")
handler = logging.FileHandler(os.path.join(here, "train.log"), mode="w")
handler.setFormatter(logging.Formatter("%(levelname)s step=%(step)s %(message)s"))
log.addHandler(handler)
log.setLevel(logging.INFO)
log.addFilter(EveryOther())
log.addFilter(lambda record: "skip" not in record.getMessage())
for step in range(10):
    state["step"] = step
    log.log(NOTICE, "loss %d", 100 - step)
    log.info("skip me %d", step)
    print(step, logging.getLevelName(NOTICE), flush=True)
"""


def test_logger_filters_level_names_and_the_record_factory_survive_a_chain_of_stops(launcher, tmp_path):
    job, target = _job(tmp_path, LOGGING_EXTRAS)
    base, trace = trace_of(launcher, target, tmp_path)
    log = (job / "train.log").read_text()
    assert "NOTICE step=8 loss 92" in log and "skip" not in log, log
    assert "step=1 " not in log and "step=4 " not in log and "step=5 " in log, log
    (job / "train.log").unlink()
    stops = pick_stops(trace, 3, extra=3)
    out, runs = run_chain(launcher, target, stops, tmp_path / "ck")
    assert out == base.stdout, f"stops {stops}\n{runs[-1].describe()}"
    assert (job / "train.log").read_text() == log


DUP2 = """
import os, sys
here = os.path.dirname(os.path.abspath(__file__))
print("to the terminal", flush=True)
log = open(os.path.join(here, "all.log"), "w")
os.dup2(log.fileno(), 1)                         # what C code prints lands in the log too
for step in range(6):
    print("step", step, flush=True)
    os.write(1, f"raw {step}\\n".encode())
"""


def test_stdout_pointed_at_a_file_with_dup2_stays_pointed_there(launcher, tmp_path):
    """``os.dup2(log.fileno(), 1)``: after a restore the lines went to the process's own stdout and
    the log missed them (silently)."""
    job, target = _job(tmp_path, DUP2)
    base, trace = trace_of(launcher, target, tmp_path)
    log = (job / "all.log").read_text()
    assert base.stdout == "to the terminal\n" and log.count("raw") == 6, base.describe()
    (job / "all.log").unlink()
    loops = [t["step"] for t in trace if t["kind"] == "loop"]
    out, runs = run_chain(launcher, target, [loops[1], loops[3]], tmp_path / "ck")
    assert out == base.stdout and (job / "all.log").read_text() == log, runs[-1].describe()
