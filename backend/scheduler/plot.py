"""Pictures of simulations: the JCT CDF of each policy, and each policy's occupancy per tier.

People compare schedulers by these curves: the CDF shows where a policy wins (short jobs at the
left, the tail at the right, log scale), the occupancy shows who held the devices when (a
policy that protects premium work shows a steady premium band under the others).
matplotlib is imported here only, so the simulator runs without it.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .metrics import Finished

Run = tuple[str, Sequence[Finished], Sequence[tuple[float, int, int, int]], int]  # name, jobs, occupancy, devices
TIER_COLOURS = (("premium", "#b2182b"), ("standard", "#2166ac"), ("basic", "#8c8c8c"))


def plot_runs(runs: Sequence[Run], path: str, title: str = "") -> None:
    """Write a PNG: the JCT CDFs on top, one occupancy panel per policy below."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # an optional dependency: say how to get it
        raise SystemExit("--plot needs matplotlib: pip install 'singularity-notebooks[plot]'") from exc

    fig, axes = plt.subplots(1 + len(runs), 1, figsize=(9, 3.2 * (1 + len(runs))), squeeze=False)
    cdf = axes[0][0]
    for name, finished, _, _ in runs:
        jct = np.sort([(f.finish - f.submit) / 3600.0 for f in finished])
        cdf.plot(jct, np.arange(1, len(jct) + 1) / max(1, len(jct)), label=f"{name} (mean {jct.mean():.2f} h)")
    cdf.set_xscale("log")
    cdf.set_xlabel("job completion time (h, log scale)")
    cdf.set_ylabel("fraction of jobs")
    cdf.set_title(f"JCT CDF{': ' + title if title else ''}")
    cdf.grid(True, which="both", alpha=0.3)
    cdf.legend(loc="lower right")
    for ax, (name, finished, occupancy, devices) in zip((a[0] for a in axes[1:]), runs):
        occ = np.asarray(occupancy, dtype=float).reshape(-1, 4)
        t0 = min(f.submit for f in finished) if finished else 0.0
        hours = (occ[:, 0] - t0) / 3600.0
        ax.stackplot(hours, occ[:, 1], occ[:, 2], occ[:, 3], step="post",
                     labels=[t for t, _ in TIER_COLOURS], colors=[c for _, c in TIER_COLOURS])
        ax.axhline(devices, color="black", lw=0.8, ls="--")
        ax.set_xlim(0, hours.max() if len(hours) else 1)
        ax.set_ylim(0, devices * 1.05)
        ax.set_ylabel("devices held")
        ax.set_title(f"{name}: occupancy per tier")
        ax.legend(loc="upper right", fontsize="small")
    axes[-1][0].set_xlabel("hours since the first submission")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
