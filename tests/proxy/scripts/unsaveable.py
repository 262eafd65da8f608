"""State that cannot be pickled.

Phase 1 iterates a generator created before its loop (hidden state) and opens a socket inside
the loop (so no single earlier statement can rebuild it): a checkpoint there must fail naming
both, and the program carries on.  Phase 2 holds a thread pool (no progress of its own, and not
picklable) created by one top-level statement that nothing reassigns: it is rebuilt on restore
by re-running that statement.
"""
import concurrent.futures
import socket

import torch

torch.manual_seed(0)
sock = None
numbers = (i * 3 for i in range(6))
for n in numbers:
    if sock is None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    print("phase1", n, torch.rand(1).item())
sock.close()
del sock, numbers

pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
total = 0
for i in range(6):
    total += pool.submit(abs, -i).result()
    print("phase2", i, total, torch.rand(1).item())
print("pool", type(pool).__name__)
pool.shutdown()
