"""Plain-text output of a job while a cell waits for it.

Remote output lines are written as they arrive (stdout to stdout, stderr to stderr), so the
cell shows what the job prints. Without a widget (a terminal IPython, ``SINGULARITY_NONINTERACTIVE=1``
in CI) the job's other events are printed too, one line each, worded like the CLI's.
"""
from __future__ import annotations

import sys
import time
from typing import Iterable, Optional, TextIO

from singularity_sdk.protocol import Event, EventType
from singularity_sdk.render import describe

#: Too frequent, or said again by the events that follow, to print one line each.
CHATTY = {EventType.LOG, EventType.PROGRESS, EventType.TELEMETRY, EventType.RESULT}
TRACEBACK_START = "Traceback (most recent call last):"


class TextPrinter:
    def __init__(self, job_id: str, ranks: int, *, events: bool, out: Optional[TextIO] = None,
                 err: Optional[TextIO] = None):
        self.job_id = job_id
        self.ranks = ranks
        self.events = events
        self._out = out
        self._err = err
        #: stderr lines of a traceback, held back: if it is the one the job fails with, the
        #: cell shows it as its error and printing it here too would show it twice
        self._held: list[str] = []

    @property
    def out(self) -> TextIO:
        return self._out or sys.stdout  # looked up late: IPython swaps sys.stdout per cell

    @property
    def err(self) -> TextIO:
        return self._err or sys.stderr

    def show(self, batch: Iterable[Event]) -> None:
        for ev in batch:
            if ev.type == EventType.LOG:
                self._log(ev)
            elif ev.type == EventType.WORKER_EXITED and not ev.data.get("code") and not ev.data.get("signal"):
                continue
            elif self.events and ev.type not in CHATTY:
                self.out.write(self.event_line(ev) + "\n")
        self.out.flush()
        self.err.flush()

    def _log(self, ev: Event) -> None:
        prefix = f"[rank {ev.data.get('rank', 0)}] " if self.ranks > 1 else ""
        stderr = ev.data.get("stream") == "stderr"
        for line in ev.lines:
            line = prefix + (line if line.endswith("\n") else line + "\n")
            if stderr:
                if self._held or line.rstrip("\n").endswith(TRACEBACK_START):
                    self._held.append(line)
                else:
                    self.err.write(line)
            else:
                self.release()
                self.out.write(line)

    def release(self) -> None:
        """Print the held-back traceback lines (the job went on after them)."""
        if self._held:
            self.err.write("".join(self._held))
            self._held = []

    def finish(self, failed: bool) -> None:
        """The job ended: a held traceback is the failure's own (shown as the cell's error) or not."""
        if failed:
            self._held = []
        else:
            self.release()
        self.err.flush()

    def event_line(self, ev: Event) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(ev.time))
        return f"[singularity {self.job_id} {stamp}] {describe(ev)}"

    def note(self, text: str) -> None:
        self.out.write(f"[singularity] {text}\n")
        self.out.flush()
