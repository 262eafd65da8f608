"""SLA tier rules of the Singularity policy, in one place so that docs, policy and tests agree.

- premium: never shrunk, never preempted, never migrated for another job; runs at full size.
- standard: may be shrunk (spliced) down to half its devices, rounded up to a divisor of W;
  preempted for premium work, or for standard and basic work with far less attained service
  (``las_across``), each only when shrinking is not enough.
- basic: runs on whatever is spare, at any divisor of W down to ``basic_min_fraction`` (half);
  shrunk, then preempted, before anything else. A basic job that has waited for devices for
  longer than the aging horizon (``now - submitted_at - ran_s >= aging_horizon_s``; with
  ``ran_s`` unknown, None, its time in the system) is treated as standard from then on,
  waiting or running, so it cannot starve (round_state applies this when it reads jobs).
- least attained service: standard and basic waiting jobs go by service class (attained
  device-seconds) in one pool, and a job may take from standard and basic jobs with far more
  service (shrunk, then preempted; premium never). ``las_across=False`` keeps each tier alone.
- quotas (``quotas.py``): a job beyond its user's quota for its tier runs one tier down.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from singularity_sdk.protocol import SLA

#: Priority rank, higher first. Victims are taken from low ranks first.
RANK = {SLA.PREMIUM: 2, SLA.STANDARD: 1, SLA.BASIC: 0}
BY_RANK = {v: k for k, v in RANK.items()}


@dataclass(frozen=True)
class PolicyConfig:
    """Knobs of the Singularity policy; the defaults are the ones measured in docs/scheduling.md."""

    #: a job moved, resized or preempted less than this long ago is left alone (anti-thrash)
    min_move_interval_s: float = 600.0
    #: ... but a job with at least ``long_move_after_s`` of attained service (the top service
    #: class) only this long (None: ``min_move_interval_s``): a burst of new jobs otherwise found
    #: the long jobs it should take from all protected by the burst's own first moves
    long_move_interval_s: Optional[float] = 120.0
    long_move_after_s: float = 36000.0
    #: expected cost of one preemption, migration or resize (the job stalls this long); used to
    #: decide whether a move pays for itself
    overhead_s: float = 30.0
    #: basic jobs that have waited this long are treated as standard (no starvation)
    aging_horizon_s: float = 4 * 3600.0
    standard_min_fraction: float = 0.5
    #: basic jobs shrink to half too: a wide basic job started or squeezed onto one device ran
    #: at 1/W speed for days, which cost basic a third of its device-time share (measured)
    basic_min_fraction: float = 0.5
    #: a waiting standard job may shrink running standard jobs of users who hold more devices
    same_tier_shrink: bool = True
    #: migrate small jobs to free a node for a waiting job that needs one
    defrag: bool = True
    #: a shrunk job that cannot grow for want of room on any node, while no job waits, may have
    #: smaller jobs of its tier or below migrated off its node (or off one more whole node, for
    #: a job on whole nodes) when the gain of growing beats ``defrag_margin`` x the moves' cost
    defrag_grow: bool = True
    #: a migration happens only if the expected gain exceeds margin x its cost
    defrag_margin: float = 2.0
    #: a shrunk job grows back only if the expected gain exceeds margin x the stall
    grow_margin: float = 1.0
    #: least attained service (LAS) within a tier. Attained service = device-seconds a job has
    #: held so far (``JobView.attained_s``); these thresholds (0.25, 1 and 10 device-hours) cut
    #: it into service classes, 0 below the first. Waiting jobs of a tier go lowest class first
    las_thresholds_s: tuple[float, ...] = (900.0, 3600.0, 36000.0)
    #: order waiting jobs of a tier by service class before fair share (False: fair share only)
    las_order: bool = True
    #: a waiting job that fits nowhere else may take devices from running jobs of its own tier
    #: that are at least ``las_take_gap`` service classes above its own (with the defaults: a
    #: job with under 0.25 device-hours from jobs with over 1, one with under 1 from jobs with
    #: over 10): standard ones are only shrunk (to half), basic ones shrunk, then preempted
    las_take: bool = True
    #: standard and basic waiting jobs form one pool ordered by service class (standard first
    #: within a class), and a LAS take may shrink, then preempt, any non-premium job far above
    #: the waiting job in service (False: each tier alone; standard only shrunk for standard)
    las_across: bool = True
    las_take_gap: int = 2
    #: ... and only from a job whose attained service exceeds margin x its devices x
    #: ``overhead_s`` (the stall it pays must be small next to what it has had)
    las_margin: float = 10.0
    #: a waiting job that has waited this long in all (``now - submitted_at - ran_s``) goes
    #: first in its tier, oldest first, and when it does not fit, the free devices of the node
    #: nearest to fitting it are held back for it (no starvation, large jobs included)
    starvation_horizon_s: float = 48 * 3600.0
    #: most waiting jobs placed in one round by taking devices from running jobs (shrinking,
    #: preempting or migrating them); the rest wait for the next round (None: no limit). The
    #: live server applies one round's moves before the next anyway; the bound keeps a round
    #: over 10,000 jobs in front of a full cluster from planning thousands of moves
    max_takes_per_round: Optional[int] = 128
    #: standard work takes devices from basic jobs whatever their service (the tier order);
    #: with 1 or more, only from those of at least this victim class (``RJob.las_victim``), so
    #: that a basic job that has just started, the newest checkpoint and so the first victim,
    #: is left to finish. Measured in docs/scheduling.md section 9: shorter medians, but the
    #: mean and p99 lose where the cluster is smallest, so it is off (0: any basic job)
    tier_take_min_class: int = 0

    def __post_init__(self) -> None:
        if self.las_take_gap < 1:
            raise ValueError("las_take_gap must be at least 1 (a job never takes from its own service class)")
        if list(self.las_thresholds_s) != sorted(self.las_thresholds_s):
            raise ValueError("las_thresholds_s must be increasing")


def min_devices(sla: SLA, gpus: int, config: PolicyConfig) -> int:
    """Fewest devices a job of this (effective) tier may run on: a divisor of W."""
    if sla == SLA.PREMIUM:
        return gpus
    frac = config.standard_min_fraction if sla == SLA.STANDARD else config.basic_min_fraction
    floor = max(1, math.ceil(gpus * frac - 1e-9))
    for p in range(floor, gpus + 1):
        if gpus % p == 0:
            return p
    return gpus
