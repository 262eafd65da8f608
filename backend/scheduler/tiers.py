"""SLA tier rules of the Singularity policy, in one place so that docs, policy and tests agree.

- premium: never shrunk, never preempted, never migrated for another job; runs at full size.
- standard: may be shrunk (spliced) down to half its devices, rounded up to a divisor of W;
  preempted only for premium work, and only when shrinking is not enough.
- basic: runs on whatever is spare, at any divisor of W down to ``basic_min_fraction``;
  shrunk, then preempted, before anything else. A basic job in the system for longer than the
  aging horizon (``now - submitted_at >= aging_horizon_s``) is treated as standard from then
  on, waiting or running, so it cannot starve (round_state applies this when it reads jobs).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from singularity_sdk.protocol import SLA

#: Priority rank, higher first. Victims are taken from low ranks first.
RANK = {SLA.PREMIUM: 2, SLA.STANDARD: 1, SLA.BASIC: 0}
BY_RANK = {v: k for k, v in RANK.items()}


@dataclass(frozen=True)
class PolicyConfig:
    """Knobs of the Singularity policy; the defaults are the ones measured in docs/scheduling.md."""

    #: a job moved, resized or preempted less than this long ago is left alone (anti-thrash)
    min_move_interval_s: float = 600.0
    #: expected cost of one preemption, migration or resize (the job stalls this long); used to
    #: decide whether a move pays for itself
    overhead_s: float = 30.0
    #: basic jobs older than this are treated as standard (no starvation)
    aging_horizon_s: float = 4 * 3600.0
    standard_min_fraction: float = 0.5
    basic_min_fraction: float = 0.0
    #: a waiting standard job may shrink running standard jobs of users who hold more devices
    same_tier_shrink: bool = True
    #: migrate small jobs to free a node for a waiting job that needs one
    defrag: bool = True
    #: a migration happens only if the expected gain exceeds margin x its cost
    defrag_margin: float = 2.0
    #: a shrunk job grows back only if the expected gain exceeds margin x the stall
    grow_margin: float = 1.0


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
