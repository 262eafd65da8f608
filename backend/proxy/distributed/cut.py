"""Consistent cut: every rank of a job checkpoints at the same safe point.

A checkpoint request reaches one rank (the worker that got a preemption, a rank's timer) at an
arbitrary moment; the checkpoint must be taken by all W ranks at the same point of their shared
sequence of collectives, or the restored ranks would disagree about which collectives already
happened.  Agreement rides on the job's own collectives, as in Singularity: every allreduce
through the proxy's backend carries an 8-byte flag word (this rank's pending request bits), and
its result carries the OR over all ranks.  Each rank counts the flagged exchanges it has
*issued*; at a safe point it waits (usually not at all: DDP has already waited for its
allreduces when ``backward()`` returns) until the results of all of them are in.

A set result is not acted on at once: the ranks' safe points differ (a validation pass only
rank 0 runs), and one rank may reach a safe point after that exchange while another issues its
next collective first, so they would checkpoint at different places of the sequence.  Right
after a set result, every rank's collective thread holds one more 8-byte exchange, the
*confirmation*, until its rank either waits at a safe point having issued nothing since (ready)
or issues another collective (not ready).  All ready: every rank checkpoints where it waits.
Otherwise none does, and the request, still pending on its rank, rides the next exchange.

Every ``every``-th collective that carries no flag word (broadcasts, gathers, barriers,
allreduces too large for the plain path's flag) is followed by an explicit 8-byte flag exchange,
a *tick*: a loop without allreduces is still cut, and so is one whose allreduces are always
followed by another collective before some rank's next safe point.  The rule counts
collectives, never safe points: the ranks share their sequence of collectives, while their safe
points differ as soon as one rank runs a loop the others do not.  A phase with no collective at
all cannot be cut: a request waits for the next collective.
"""
from __future__ import annotations

import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

from ..engine.checkpoint_request import CheckpointRequest
from ..engine.controller import Controller

CONTINUE = 1
STOP = 2
#: a rank's request outlived its bound: every rank drops the pending request, none checkpoints
EXPIRED = 4
#: in a confirmation: this rank issued a collective before it reached a safe point
NOT_READY = 8
CUT_EVERY_ENV = "SINGULARITY_CUT_EVERY"
DEFAULT_EVERY = 32


class FlagChannel(Protocol):
    """What the cut needs from the default process group."""

    def confirm(self, word: int) -> int:
        """Run an 8-byte OR exchange now, on the group's collective thread (the caller)."""

    def step_aside(self) -> None:
        """Let the ranks that share this rank's device run (pass the turn without waiting)."""

    def step_back(self) -> None:
        """Wait for this rank's turn again after `step_aside`."""

    def drain(self) -> None:
        """Return once every collective issued so far has completed."""


@dataclass(frozen=True)
class Decision:
    """An agreed checkpoint: the same on every rank."""

    step: int
    then: str  # "continue" or "stop"
    exchanges: int  # flagged exchanges issued when it was decided (equal on every rank)


def _bits(then: str) -> int:
    if then not in ("continue", "stop"):
        raise ValueError("then must be 'continue' or 'stop'")
    return STOP if then == "stop" else CONTINUE


class ConsistentCut:
    """Per-process agreement state; the default process group attaches itself as its channel."""

    def __init__(self, every: Optional[int] = None) -> None:
        if every is None:
            every = int(os.environ.get(CUT_EVERY_ENV, DEFAULT_EVERY) or DEFAULT_EVERY)
        if every < 1:
            raise ValueError("every must be at least 1 collective")
        self.every = every
        self._cond = threading.Condition()
        self._channel: Optional[FlagChannel] = None
        self._local = 0  # this rank's pending request bits
        self._requested_at: Optional[float] = None
        self._reason = ""
        self._issued = 0
        self._resolved = 0
        self._agreed = 0  # OR of resolved results not yet acted on
        self._unflagged = 0  # collectives without the flag word issued since the last tick
        self._seq = 0  # collectives issued on the group (its sequence, shared by all ranks)
        self._flag_seqs: deque[int] = deque()  # place in the sequence of each unresolved exchange
        self._parked = False  # the rank waits in `poll`, at a safe point
        self._confirming = False
        self._leaving = False
        self._go = 0  # bits every rank confirmed: acted on where the rank waits
        #: confirmations that found a rank not at a safe point (the request rode on)
        self.refused = 0
        #: explicit flag exchanges issued (the steady state of a DDP loop has none)
        self.ticks = 0
        self.decisions: list[Decision] = []

    # ------------------------------------------------------------------ public
    def request(self, then: str = "continue", reason: str = "") -> None:
        """Ask for a checkpoint at the next agreed safe point (thread-safe, any rank, any time)."""
        bits = _bits(then)
        with self._cond:
            self._local |= bits
            if self._requested_at is None:
                self._requested_at = time.monotonic()
                self._reason = reason

    def expire(self, requested_at: float) -> bool:
        """Withdraw this rank's request made at ``requested_at`` (its bound passed); True if it
        was still pending. The withdrawal travels in the flag word like a request, so every rank
        drops the request at the same safe point and none checkpoints alone."""
        with self._cond:
            if not self._local & (CONTINUE | STOP) or self._requested_at is None \
                    or self._requested_at > requested_at:
                return False
            self._local = EXPIRED
            self._requested_at = None
            return True

    @property
    def attached(self) -> bool:
        return self._channel is not None

    @property
    def pending_request(self) -> Optional[tuple[str, str, float]]:
        """This rank's unsatisfied request: (then, reason, monotonic time), or None."""
        with self._cond:
            if not self._local:
                return None
            then = "stop" if self._local & STOP else "continue"
            return then, self._reason, float(self._requested_at or time.monotonic())

    def poll(self, step: int) -> Optional[Decision]:
        """Called by every rank at every safe point; returns the same answer on all of them.

        Without a process group (before ``init_process_group`` or after its destruction) ranks
        cannot agree, so requests wait.  On a positive answer every collective issued so far has
        completed (none straddles the checkpoint) and this rank's request counts as satisfied.
        """
        channel = self._channel
        if channel is None:
            return None
        aside = False
        with self._cond:
            self._parked = True
            self._cond.notify_all()  # a confirmation may be waiting for this safe point
            try:
                while self._resolved < self._issued or self._confirming:
                    if self._confirming and not aside:
                        # ranks sharing this rank's device must reach theirs too: let them run
                        aside = True
                        self._cond.release()
                        try:
                            channel.step_aside()
                        finally:
                            self._cond.acquire()
                        continue
                    self._cond.wait()
            finally:
                self._parked = False
            bits, self._go = self._go, 0
            decision = None
            if bits & EXPIRED:  # some rank's bound passed: drop the request everywhere
                self._local = 0
                self._requested_at = None
            elif bits:
                self._local = 0
                self._requested_at = None
                decision = Decision(step, "stop" if bits & STOP else "continue", self._issued)
        if aside:
            channel.step_back()
        if decision is None:
            return None
        channel.drain()
        self.decisions.append(decision)
        return decision

    def should_checkpoint(self, step: int) -> bool:
        """`poll` as a yes/no (the decision's ``then`` is in `decisions`)."""
        return self.poll(step) is not None

    # ------------------------------------------------------------------ used by the process group
    def attach(self, channel: FlagChannel) -> None:
        with self._cond:
            self._channel = channel
            self._issued = self._resolved = 0
            self._agreed = self._go = 0
            self._unflagged = self._seq = 0
            self._flag_seqs.clear()
            self._confirming = self._leaving = False

    def leave(self) -> None:
        """The group is shutting down: a confirmation waiting for this rank answers not ready."""
        with self._cond:
            self._leaving = True
            self._cond.notify_all()

    def detach(self, channel: FlagChannel) -> None:
        with self._cond:
            if self._channel is channel:
                self._channel = None
                self._resolved = self._issued
                self._cond.notify_all()

    def _outgoing(self) -> int:
        """Bits for the flagged exchange being issued now (callers serialise issues)."""
        with self._cond:
            self._issued += 1
            self._seq += 1
            self._flag_seqs.append(self._seq)
            self._cond.notify_all()  # a confirmation may be waiting for this rank's next move
            return self._local

    def _tick_due(self) -> bool:
        """Called after issuing a collective without the flag word (callers serialise issues):
        whether an explicit flag exchange must follow it now. Every rank issues the same
        collectives in the same order, so every rank ticks after the same one. (A DDP loop issues
        only flagged allreduces: it never ticks.)"""
        with self._cond:
            self._seq += 1
            self._cond.notify_all()
            self._unflagged += 1
            if self._unflagged < self.every:
                return False
            self._unflagged = 0
            self.ticks += 1
            return True

    def _resolve(self, bits: int) -> None:
        """Result of the oldest unresolved exchange (results arrive in issue order), on the
        collective thread, after the exchange's future completed. A set result is confirmed
        before anyone acts on it (module docstring)."""
        with self._cond:
            self._resolved += 1
            at = self._flag_seqs.popleft()  # where this exchange stands in the sequence
            self._agreed |= bits
            channel = self._channel
            if not self._agreed or channel is None:
                self._cond.notify_all()
                return
            self._confirming = True
            self._cond.notify_all()  # a rank waiting in `poll` steps aside for its device's others
            while not (self._parked or self._seq > at or self._leaving):
                self._cond.wait()
            ready = self._parked and self._seq == at and not self._leaving
        try:
            word = channel.confirm(0 if ready else NOT_READY)
        except Exception:  # a peer is gone: the collectives after this one fail and say so
            word = NOT_READY
        with self._cond:
            self._confirming = False
            if word & NOT_READY:
                self.refused += 1
            else:
                self._go |= self._agreed
            self._agreed = 0
            self._cond.notify_all()


_CUT: Optional[ConsistentCut] = None
_CUT_LOCK = threading.Lock()


def default_cut() -> ConsistentCut:
    """The process's cut: the default process group of the proxy's backend attaches to it."""
    global _CUT
    with _CUT_LOCK:
        if _CUT is None:
            _CUT = ConsistentCut()
        return _CUT


class DistributedController(Controller):
    """A `Controller` for one rank of W: checkpoints happen only where the ranks agree.

    Local requests (`request_checkpoint`, `checkpoint_at_step`, the periodic timer, which only
    rank 0 runs) become cut requests; every safe point takes the slow path and asks the cut.
    The runtime needs no change: it calls ``poll`` whenever ``flag`` is set, and it always is.
    """

    def __init__(self, store: Any, rank: int, world_size: int, cut: Optional[ConsistentCut] = None,
                 checkpoint_every: Optional[float] = None,
                 on_event: Callable[[str, dict], None] = lambda type, data: None) -> None:
        super().__init__(store, rank, world_size, checkpoint_every if rank == 0 else None, on_event)
        self.cut = cut if cut is not None else default_cut()
        self.flag = True
        self._in_cut: Optional[CheckpointRequest] = None
        self._in_cut_at = 0.0
        #: this rank answered a request as timed out since the last agreement
        self._withdrawn = False

    def _expire(self) -> None:
        """As for one rank; a request already handed to the cut is withdrawn through it."""
        super()._expire()
        request, self._in_cut = self._in_cut, None
        if request is None or request.deadline is None:
            return
        now = time.monotonic()
        if request.deadline > now:
            self._in_cut = request
            self._arm_expiry(request.deadline - now)
        elif self.cut.expire(self._in_cut_at):
            self._report_timeout(request, now, "agreement")

    def _wants_slow_path(self) -> bool:
        return True

    def poll(self, rt: Any) -> tuple[Optional[CheckpointRequest], bool]:
        request, progress = super().poll(rt)
        if request is not None:
            self.cut.request(request.then, request.reason)
            if request.deadline is not None:
                # its bound is enforced through the cut from now on
                self._in_cut, self._in_cut_at = request, time.monotonic()
        mine = self.cut.pending_request
        decision = self.cut.poll(rt.step)
        if decision is None:
            return None, progress
        reason = mine[1] if mine is not None else "consistent cut (requested by another rank)"
        requested_at = mine[2] if mine is not None else time.monotonic()
        label, withdrawn = _agree_on_label(rt.step, self._withdrawn)
        self._withdrawn = False
        if withdrawn:
            # A rank already answered this request as timed out (its bits had spread before the
            # withdrawal could): the ranks agree, in the same collective, to take no checkpoint.
            return None, progress
        return CheckpointRequest(decision.then, reason or "consistent cut", requested_at, label), progress

    def request_checkpoint(self, then: str = "continue", reason: str = "", timeout_s: Optional[float] = None) -> None:
        self._withdrawn = False  # a new request: the timed-out one was answered and is done
        super().request_checkpoint(then, reason, timeout_s)  # type: ignore[arg-type]

    def _report_timeout(self, request: CheckpointRequest, now: float, stage: str = "safe point") -> None:
        self._withdrawn = True  # whatever agreement is reached next for it must not be acted on
        super()._report_timeout(request, now, stage)

    def all_written(self, mine: bool) -> bool:
        """Agree on the outcome: if any rank could not write its part, no rank stops (the set will
        never be complete) and the job runs on, as a one-rank job does after a failed checkpoint.
        The same holds when the parts went to places that never meet (`store.meeting_point`):
        ranks on nodes that share neither a checkpoint folder nor a store."""
        import torch
        import torch.distributed as dist

        from ..checkpoint.store import meeting_point

        here = 0
        if mine:
            try:
                here = meeting_point(self.store.root)
            except OSError as exc:
                self.emit("checkpoint_failed", {"error": f"cannot read where the parts meet: {exc}", "variables": []})
                mine = False
        t = torch.tensor([1 if mine else 0, here, -here], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        if not t[0].item():
            return False
        if t[1].item() != -t[2].item():  # the ranks' parts are in folders that are not one
            if self.rank == 0:
                self.emit("checkpoint_failed", {"error": (
                    "the ranks' parts of this checkpoint were written on nodes that share no checkpoint "
                    "folder, so no rank can commit them: serve with --store URL (its agents then bring the "
                    "parts together), or give every node the same checkpoint folder (--checkpoint-root on "
                    "a shared filesystem)"), "variables": []})
            return False
        return True


def _agree_on_label(step: int, withdrawn: bool = False) -> tuple[int, bool]:
    """The checkpoint's number, the same on every rank: the largest of their step counts; and
    whether any rank withdrew the request (its bound passed), so that none acts on it.

    Ranks decide at the same point of their collective sequence, not necessarily after the same
    number of safe points (a validation loop only rank 0 runs adds some), while the parts of one
    checkpoint must share a folder. Each rank's count only grows, so the maximum does too, and
    checkpoints stay ordered. One 16-byte allreduce per checkpoint, none in the steady state."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([step, int(withdrawn)], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t[0].item()), bool(t[1].item())
