"""Replica splicing: S co-located ranks take turns on their shared device (or CPU slot).

Exactly one rank of a slot computes at any moment.  A rank gives its turn away when it issues a
collective (after queueing its contribution) and gets it back, in round-robin order over the
slot's ranks, before its collective call returns.  Because every rank issues the same sequence
of collectives, the round-robin has an invariant that keeps it deadlock-free: when a rank holds
the turn after issuing its k-th collective, every other rank of its slot has issued its k-th
too, so anything the holder waits for has all of its local contributions.  A rank therefore never
needs to give the turn away while it blocks inside a collective's ``wait()`` (which happens in
C++, where Python cannot intervene): it only ever blocks there on work that completes without
its neighbours.

Steps that need every rank at once without being collectives of the group (creating a
subgroup: its rendezvous) are bracketed by `suspend` (pass the turn on, do not wait) and
`resume` (wait for the next turn).  The turn travels through the job's c10d store (a ``PrefixStore`` per slot): passing it to
neighbour k is ``add("count/k")`` then ``set("to/k/<n>")``, and k waits on that key.  A rank
that exits marks ``left/<i>`` and passes the turn on for good.
"""
from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any, Optional


class TurnRing:
    """Round-robin turns among the ``size`` ranks of one slot (``index`` is this rank's place)."""

    def __init__(self, store: Any, index: int, size: int, timeout: Optional[timedelta] = None) -> None:
        if not 0 <= index < size:
            raise ValueError(f"index {index} outside a slot of {size}")
        self._store = store
        self.index = index
        self.size = size
        self._timeout = timeout
        self._received = 0
        self._lock = threading.Lock()
        self.holding = False
        self.left = False
        self._suspended = False
        #: seconds this rank spent waiting for its turn (splicing's cost, for benchmarks)
        self.waited_s = 0.0
        self.turns = 0

    def start(self) -> None:
        """Rank 0 of the slot begins with the turn; the others wait for their first one."""
        if self.index == 0 or self.size == 1:
            self.holding = True
        else:
            self._wait()

    def yield_turn(self) -> None:
        """Give the turn to the next rank and block until it comes back (called at each collective)."""
        with self._lock:
            if self.size == 1 or self.left or not self.holding:
                return
            if not self._pass():
                return  # every neighbour has left: keep going alone
            self.holding = False
        self._wait()

    def suspend(self) -> None:
        """Pass the turn on without waiting for it: what follows needs every rank at once.

        Creating a subgroup is such a step (its rendezvous needs all ranks inside it); every
        rank calls it at the same point of the program, then `resume` puts the ring back.
        """
        with self._lock:
            if self.size == 1 or self.left or not self.holding:
                return
            self._suspended = self._pass()
            self.holding = not self._suspended  # alone in the slot: keep the turn

    def resume(self) -> None:
        """Wait for this rank's next turn after `suspend`."""
        with self._lock:
            suspended, self._suspended = self._suspended, False
        if suspended:
            self._wait()

    def leave(self) -> None:
        """This rank is done (process exit or group destroyed): never wait for it again.

        The store lives in rank 0's process, which may already have exited when the last ranks
        leave; then nobody is left to wait for a turn, so a store error here is ignored.
        """
        with self._lock:
            if self.left or self.size == 1:
                self.left = True
                return
            self.left = True
            try:
                self._store.set(f"left/{self.index}", b"1")
                if self.holding:
                    self.holding = False
                    self._pass()
            except (RuntimeError, OSError):  # DistNetworkError / DistStoreError are RuntimeErrors
                pass

    # ------------------------------------------------------------------ internals
    def _pass(self) -> bool:
        for step in range(1, self.size):
            k = (self.index + step) % self.size
            if not self._store.check([f"left/{k}"]):
                n = self._store.add(f"count/{k}", 1)
                self._store.set(f"to/{k}/{n}", b"1")
                return True
        return False

    def _wait(self) -> None:
        self._received += 1
        key = f"to/{self.index}/{self._received}"
        t0 = time.monotonic()
        if self._timeout is None:
            self._store.wait([key])
        else:
            self._store.wait([key], self._timeout)
        self.waited_s += time.monotonic() - t0
        self.turns += 1
        self.holding = True
