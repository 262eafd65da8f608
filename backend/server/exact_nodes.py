"""Where a job's checkpoint resumes exactly: the nodes whose fingerprint matches it.

A checkpoint records what its result depends on (``backend/proxy/checkpoint/fingerprint.py``); agents
report their node's fingerprint when they connect. A job is placed, migrated or resized only
onto matching nodes. When no node of the cluster matches at all, placement is not restricted
and the restoring worker refuses the checkpoint with the difference named, so the user hears
why instead of the job waiting forever.
"""
from __future__ import annotations

import json
from typing import Any, Iterable, Optional

from backend.proxy.checkpoint.fingerprint import COMPARED, differences, matches
from singularity_sdk.protocol import NodeInfo, NodeState

#: nodes in these states may come back; a checkpoint that matches one of them waits for it
_GONE = (NodeState.LOST, NodeState.DOWN)


def recorded(row: Any) -> Optional[dict[str, Any]]:
    """The fingerprint of a job's newest checkpoint (None: no checkpoint, or one without it)."""
    fp = json.loads(row["last_checkpoint_json"] or "{}").get("fingerprint")
    return fp if isinstance(fp, dict) and fp else None


def moving(row: Any, placement: Iterable[str], fingerprints: dict[str, dict[str, Any]]) -> Optional[dict[str, Any]]:
    """What the checkpoint a move is about to take will record: the fingerprint of the node the
    job runs on, keeping the newest checkpoint's knowledge of which libraries it does not use."""
    here = next((fingerprints[n] for n in placement if n in fingerprints), None)
    if here is None:
        return recorded(row)
    last = recorded(row) or {}
    return {k: (None if k in last and last[k] is None else here.get(k)) for k in COMPARED}


def allowed(fp: Optional[dict[str, Any]], nodes: list[NodeInfo],
            fingerprints: dict[str, dict[str, Any]]) -> Optional[frozenset[str]]:
    """The nodes where ``fp`` resumes exactly; None when unrestricted (no fingerprint, or no
    node that may come back matches: the restore itself then refuses, naming the difference)."""
    if not fp:
        return None
    ok = frozenset(n.name for n in nodes if n.state not in _GONE and matches(fp, fingerprints.get(n.name)))
    return ok or None


def why_not(fp: Optional[dict[str, Any]], node: str, fingerprints: dict[str, dict[str, Any]]) -> str:
    """Why ``node`` cannot resume ``fp`` exactly ("" when it can)."""
    if not fp:
        return ""
    theirs = fingerprints.get(node)
    if theirs is None:
        return f"{node} has not reported what it runs (python, torch, numpy, device)"
    diff = differences(fp, theirs)
    return "; ".join(d.replace("(here)", f"({node})") for d in diff)
