"""Tier quotas and usage: how many devices of each tier a user may hold, and what each has used.

Tiers are a shared resource: the admin sets a user's quota per tier (``POST /quotas``), the
scheduler reads the quotas with every snapshot (a job beyond its user's quota runs one tier
down, ``backend/scheduler/quotas.py``), and ``GET /usage`` (``singularityctl usage``) shows
device-hours per user and tier, so that a quota can be set from what people actually use.
The quotas live in their own table of the same SQLite file.
"""
from __future__ import annotations

import time
from typing import Any, Optional

from singularity_sdk.protocol import SLA

from .core import Core, ServiceError
from .store import attained

SCHEMA = """
CREATE TABLE IF NOT EXISTS quotas (
    user TEXT NOT NULL,
    tier TEXT NOT NULL,
    devices INTEGER NOT NULL,       -- most devices the user's jobs of this tier hold at this tier
    PRIMARY KEY (user, tier)
) WITHOUT ROWID;
"""
TIERS = tuple(t.value for t in SLA)


class Usage:
    """Quotas per user and tier, and device-hours used."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self.store = core.store

    def _quota_table(self) -> None:
        if not getattr(self, "_quotas_ready", False):
            self.store.db.executescript(SCHEMA)
            self._quotas_ready = True

    def quotas(self) -> dict[tuple[str, str], int]:
        """(user, tier) -> devices, what the scheduler's snapshot carries."""
        self._quota_table()
        return {(u, t): n for u, t, n in self.store.db.execute("SELECT user, tier, devices FROM quotas")}

    def set_quota(self, caller_role: str, user: str, tier: str, devices: Optional[int]) -> dict[str, Any]:
        """Admin: at most ``devices`` of ``tier`` for ``user``; None removes the limit."""
        if caller_role != "admin":
            raise ServiceError(403, "only the admin token (written to server.json by 'serve') can set quotas")
        if tier not in TIERS:
            raise ServiceError(422, f"unknown tier {tier!r}; valid: {', '.join(TIERS)}", "tier")
        if not self.store.user_exists(user):
            raise ServiceError(404, f"no user '{user}'", "user")
        self._quota_table()
        if devices is None:
            self.store.db.execute("DELETE FROM quotas WHERE user=? AND tier=?", (user, tier))
        else:
            self.store.db.execute("INSERT OR REPLACE INTO quotas (user, tier, devices) VALUES (?, ?, ?)",
                                  (user, tier, devices))
        self.core.schedule()  # jobs may change tier: a round sees it at once
        return {"user": user, "tier": tier, "devices": devices}

    def usage(self, user: Optional[str]) -> list[dict[str, Any]]:
        """Per user and tier: device-hours used (every job, finished ones too), devices held now
        and the quota; ``user`` None (the admin) sees everyone."""
        now = time.time()
        rows = self.store.db.execute(
            "SELECT user, sla, state, placement_json, attained_s, held_s, held_since, started_at FROM jobs"
            + ("" if user is None else " WHERE user=?"), () if user is None else (user,))
        out: dict[tuple[str, str], dict[str, Any]] = {}
        for row in rows:
            key = (row[0], row[1])
            r = out.setdefault(key, {"user": key[0], "tier": key[1], "device_hours": 0.0, "holding": 0, "jobs": 0})
            ds, _ = attained(_Row(row), now)
            r["device_hours"] += ds / 3600.0
            r["jobs"] += 1
            if row[6] is not None:
                r["holding"] += sum(len(p["devices"]) for p in _placement(row[3]))
        quotas = self.quotas()
        for (u, t), n in quotas.items():
            if user is None or u == user:
                out.setdefault((u, t), {"user": u, "tier": t, "device_hours": 0.0, "holding": 0, "jobs": 0})
        for (u, t), r in out.items():
            r["quota"] = quotas.get((u, t))
        return sorted(out.values(), key=lambda r: (r["user"], TIERS.index(r["tier"]) if r["tier"] in TIERS else 9))


class _Row(dict):
    """A usage row read by name, as ``store.attained`` reads job rows."""

    def __init__(self, row: tuple) -> None:
        super().__init__(placement_json=row[3], attained_s=row[4], held_s=row[5], held_since=row[6],
                         started_at=row[7])


def _placement(placement_json: str) -> list[dict[str, Any]]:
    import json

    return json.loads(placement_json or "[]")
