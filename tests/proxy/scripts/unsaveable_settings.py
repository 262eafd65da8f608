"""A logging handler that cannot be saved (it writes to a socket), made inside a function so no
variable of the program holds the socket: each checkpoint leaves the handler out, warns once,
and saves everything else.

STEP_SECONDS sets the pause per step: a periodic run makes it long enough for several
checkpoints, whatever one takes to write on a busy machine."""
import logging
import os
import socket
import time

import torch


def attach_remote_log() -> None:
    ours, theirs = socket.socketpair()
    handler = logging.StreamHandler(ours.makefile("w"))
    handler.peer = theirs  # kept open while the program runs
    logging.getLogger("remote").addHandler(handler)


attach_remote_log()
logging.getLogger("train").addHandler(logging.NullHandler())  # saves: kept
torch.manual_seed(0)
total = 0.0
for i in range(8):
    total += torch.rand(1).item()
    print(i, total)
    time.sleep(float(os.environ.get("STEP_SECONDS", "0.02")))
