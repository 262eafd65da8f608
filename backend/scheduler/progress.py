"""A one-line progress bar on stderr for long simulations (no dependency: it is one line).

It redraws at most every ``every_s`` seconds and only after ``after_s`` (short runs print
nothing), so that it costs nothing next to a scheduling round.
"""
from __future__ import annotations

import sys
import time
from typing import Optional, TextIO


class ProgressBar:
    """``bar(done, total)`` after each round; ``bar.close()`` ends the line."""

    def __init__(self, label: str, stream: Optional[TextIO] = None, after_s: float = 1.0, every_s: float = 0.2,
                 width: int = 30):
        self.label = label
        self.stream = sys.stderr if stream is None else stream  # the current one, not import time's
        self.after_s = after_s
        self.every_s = every_s
        self.width = width
        self.t0 = time.monotonic()
        self.last = 0.0
        self.shown = False
        self.done = self.total = 0

    def __call__(self, done: int, total: int) -> None:
        self.done, self.total = done, total
        now = time.monotonic()
        if now - self.t0 < self.after_s or now - self.last < self.every_s:
            return
        self.last = now
        self._draw(now)

    def _draw(self, now: float) -> None:
        frac = self.done / self.total if self.total else 1.0
        full = int(frac * self.width)
        elapsed = now - self.t0
        eta = f", ~{elapsed / frac - elapsed:.0f} s left" if 0 < frac < 1 else ""
        self.stream.write(f"\r{self.label} [{'#' * full}{'.' * (self.width - full)}] {frac:4.0%} "
                          f"{self.done}/{self.total} jobs done, {elapsed:.0f} s{eta}   ")
        self.stream.flush()
        self.shown = True

    def close(self) -> None:
        if self.shown:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()
