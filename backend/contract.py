"""The agent <-> worker contract, in one place: exit codes, environment, the rank folder's files.

The agent starts a worker as ``python -m backend.worker SPEC_JSON RANK_DIR`` with the
environment below; the worker (and the proxy inside it) reads that environment, reports on the
control pipe, and leaves its outcome in the rank folder for the agent to read after it exits
(so the outcome survives a lost connection). Both sides, and the proxy's own launchers, take
the names from here. This module imports nothing of the project but the SDK's `report` (which
owns the job's end of the control pipe, and imports only the standard library): the worker
imports it before anything else, on every start.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from singularity_sdk.report import CONTROL_FD_ENV

# ---------------------------------------------------------------------------- exit codes
#: the rank stopped at a committed checkpoint (preempt, migrate, resize): resume it later
EXIT_PREEMPTED = 75
#: the rank ended at the agent's ``exit`` request (cancel, or the job failed on another rank)
EXIT_STOPPED = 143
#: a collective failed (a peer died) and could not be reported softly: the attempt crashed
EXIT_COLLECTIVE_FAILED = 70
#: what a program's own ``sys.exit(EXIT_PREEMPTED)`` exits with instead
EXIT_PROGRAM_USED_PREEMPTED = 1


def program_exit_code(code: int) -> int:
    """The status a rank exits with when the program itself exits with ``code``. Left as it was,
    a ``sys.exit(75)`` (EX_TEMPFAIL) read as "stopped at a checkpoint": the job was queued and
    resumed from its last checkpoint, again and again."""
    return EXIT_PROGRAM_USED_PREEMPTED if code == EXIT_PREEMPTED else code

# ---------------------------------------------------------------------------- environment
# Set by the agent for every rank (besides RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
# MASTER_ADDR, MASTER_PORT and CUDA_VISIBLE_DEVICES, which mean what torch.distributed says).
ENV_JOB_ID = "SINGULARITY_JOB_ID"
#: "addr:port" of this attempt's rendezvous, as MASTER_ADDR/MASTER_PORT give it, where a script
#: cannot change it (the DDP tutorial sets MASTER_PORT=12355 itself; distributed/collectives.py)
ENV_RENDEZVOUS = "SINGULARITY_RENDEZVOUS"
ENV_ATTEMPT = "SINGULARITY_ATTEMPT"
#: the write end of the control pipe (backend/worker/main.py: ControlChannel)
ENV_CONTROL_FD = CONTROL_FD_ENV
#: JSON list of the rank's devices (singularity_sdk.protocol.DeviceInfo)
ENV_DEVICES = "SINGULARITY_DEVICES"
#: the level of the service's own logs (server, agent): DEBUG, INFO, WARNING...
ENV_LOG_LEVEL = "SINGULARITY_LOG_LEVEL"
#: the folder of the job's checkpoints on this node (backend/proxy/checkpoint/store.py)
ENV_CHECKPOINT_DIR = "SINGULARITY_CHECKPOINT_DIR"
#: threads for the rank (also OMP_NUM_THREADS/MKL_NUM_THREADS): results must not depend on the node
ENV_THREADS = "SINGULARITY_THREADS"
#: the cores of the rank's CPU slot ("0,1"); pinned by backend/proxy/launch.py: pin_to_slot
ENV_CPUS = "SINGULARITY_CPUS"
#: ranks grouped by the device they share ("0,1|2,3"; backend/proxy/distributed/layout.py)
ENV_PLACEMENT = "SINGULARITY_PLACEMENT"
#: where synced copies of jobs' folders live on this node (backend/worker/workdir.py)
ENV_WORKDIR_ROOT = "SINGULARITY_WORKDIR_ROOT"
#: "1" inside the sandbox (backend/agent/sandbox.py): pid 1 there is the sandbox's init
ENV_SANDBOXED = "SINGULARITY_SANDBOXED"
#: seconds without a word from the agent on stdin after which a worker ends itself (a frozen or
#: cut-off agent cannot stop it, and the job runs elsewhere by then)
ENV_AGENT_LEASE = "SINGULARITY_AGENT_LEASE"
#: a job's env: "1" writes periodic checkpoints at the safe point instead of behind the loop (the
#: way to compare the two, or to rule the background writer out when a checkpoint misbehaves)
ENV_WRITE_IN_LINE = "SINGULARITY_WRITE_IN_LINE"
#: the agent writes this request to every worker's stdin each AGENT_PING_S seconds
#: The order of a set (or frozenset) of strings follows their hashes, and CPython salts those
#: at random per interpreter unless this is set: a job restored in a new process would then
#: iterate its sets in another order. Every process the engine starts gets the same salt.
ENV_HASH_SEED = "PYTHONHASHSEED"
HASH_SEED = "0"


def with_hash_seed(env: dict[str, str]) -> dict[str, str]:
    """``env`` with a fixed ``PYTHONHASHSEED`` where it names none (a job's own choice stays;
    an empty value, which python reads as unset, is replaced)."""
    return {**env, ENV_HASH_SEED: env.get(ENV_HASH_SEED) or HASH_SEED}


OP_ALIVE = "alive"
AGENT_PING_S = 1.0

# ---------------------------------------------------------------------------- rank folder
SPEC_FILE = "spec.json"  # in the attempt's folder, beside rank-N/
RESULT_PICKLE = "result.pkl"  # rank 0's value, cloudpickled (written to .tmp, then renamed)
RESULT_REPR = "result.repr"  # its repr, cut to RESULT_REPR_LIMIT characters
RESULT_ERROR = "result.error"  # why the value could not be pickled
OUTPUTS_PICKLE = "outputs.pkl"  # the names the job asked for, cloudpickled
OUTPUTS_SKIPPED = "outputs.skipped"  # JSON {name: why it was not sent back}
ERROR_FILE = "error.txt"  # why the rank failed (the user's traceback, or sys.exit)
RESULT_REPR_LIMIT = 20_000


def rank_dir(run_dir: Path, rank: int) -> Path:
    return run_dir / f"rank-{rank}"


@dataclass
class WorkerSpec:
    """What a worker reads from ``spec.json`` (the agent's StartJob, as plain JSON: parsing it
    with the SDK's pydantic model would add ~100 ms to every start)."""

    job_id: str = ""
    attempt: int = 1
    filename: str = "<cell>"
    source: Optional[str] = None
    callable_b64: Optional[str] = None
    inputs_b64: Optional[str] = None
    outputs: list[str] = field(default_factory=list)
    args: list[str] = field(default_factory=list)
    workdir: Optional[str] = None
    workdir_b64: Optional[str] = None
    #: resume from the newest usable checkpoint in the job's checkpoint folder (a flag: which
    #: checkpoint is the store's answer, so a torn newest one falls back to the one before)
    restore: bool = False
    checkpoint_every: Optional[float] = None

    @classmethod
    def read(cls, path: Path) -> "WorkerSpec":
        raw: dict[str, Any] = json.loads(Path(path).read_text())
        known = {f for f in cls.__dataclass_fields__}
        spec = cls(**{k: v for k, v in raw.items() if k in known})
        spec.restore = bool(raw.get("restore"))
        return spec
