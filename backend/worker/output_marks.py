"""Output marks: where a control message falls in the rank's stdout and stderr.

A rank's output and its control messages travel on different pipes, so the agent cannot tell
from arrival order alone whether a line was printed before or after a checkpoint's state was
taken; under load either pipe may be read first. Exactly-once logs (backend/server/log_replay.py)
need that order. So, when the state is taken, the worker writes a mark line on both streams
and sends the mark's number with the control message; the agent passes on the lines before
the mark, then the message, then the lines after it, and never shows the mark itself.

Both sides import this module, which is why it imports nothing of the project.
"""
from __future__ import annotations

import os
import re
import sys
from typing import Optional

PREFIX = b"\x1esingularity-mark:"
SUFFIX = b"\x1e\n"
_MARK = re.compile(re.escape(PREFIX) + rb"(\d+)" + re.escape(SUFFIX) + rb"$")
#: the control messages that carry a mark: the ones whose place among the lines matters
MARKED = frozenset({"checkpoint_started"})


def write(number: int) -> list[str]:
    """Flush Python's buffers, then put mark ``number`` on fds 1 and 2; returns the streams
    that took it (a stream the program closed or redirected goes unmarked)."""
    for stream in {id(s): s for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__) if s}.values():
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    line = PREFIX + str(number).encode() + SUFFIX
    marked = []
    for fd, name in ((1, "stdout"), (2, "stderr")):
        try:
            os.write(fd, line)
            marked.append(name)
        except OSError:
            pass
    return marked


def split(line: bytes) -> tuple[bytes, Optional[int]]:
    """``(text, number)`` for a line that ends in a mark (``text`` is a partial line printed
    before it, usually empty), else ``(line, None)``."""
    if not line.endswith(SUFFIX):
        return line, None
    found = _MARK.search(line)
    if found is None:
        return line, None
    return line[:found.start()], int(found.group(1))
