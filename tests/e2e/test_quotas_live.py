"""Tier quotas live: premium work beyond its user's quota runs as standard until the admin
lifts the quota; ``usage`` reports device-hours per user and tier."""
from __future__ import annotations

import time

from exactness import wait_for_lines
from singularity_sdk import Client, JobState, LocalCluster
from singularity_sdk.cli import main as cli_main

LONG = "import time\nfor i in range(600):\n    print(i, flush=True)\n    time.sleep(0.1)\n'long'"


def test_premium_over_quota_waits_as_standard_until_the_quota_is_lifted(tmp_path, capsys):
    with LocalCluster(nodes=1, devices_per_node=1, home=tmp_path / "h", min_move_interval=1) as cluster, \
            cluster.client() as admin:
        bob = Client(cluster.url, admin.create_user("bob"))
        assert admin.set_quota("bob", "premium", 0)["devices"] == 0
        holder = admin.submit(LONG, sla="standard", name="holder")
        wait_for_lines(holder, 3)
        urgent = bob.submit("'urgent'", sla="premium", name="urgent")
        time.sleep(3)
        # as standard work it may not take the device from a standard job
        assert urgent.refresh().state == JobState.QUEUED
        admin.set_quota("bob", "premium", None)
        assert urgent.result(timeout=120) == "urgent"
        rows = {(r["user"], r["tier"]): r for r in admin.usage()}
        assert rows[("bob", "premium")]["jobs"] == 1 and rows[("bob", "premium")]["quota"] is None
        assert rows[("bob", "premium")]["device_hours"] > 0
        assert {r["user"] for r in bob.usage()} == {"bob"}
        holder.cancel()
        assert cli_main(["usage", "--url", cluster.url, "--token", cluster.token]) == 0
        out = capsys.readouterr().out
        assert "bob" in out and "premium" in out and "DEVICE-HOURS" in out
        bob.close()
