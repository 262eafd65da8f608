"""The Ray actor that runs one node's agent.

The actor is a thin parent: it starts ``python -m backend.agent`` as its own child (the agent
already handles signals, reconnection and its workers) and the child dies with it
(``PR_SET_PDEATHSIG``), so when Ray kills the actor or loses the node, the agent and, through
theirs, every worker go too: no process of a lost attempt survives its node.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from backend.agent.credential import CREDENTIAL_FILE
from backend.agent.credential import TOKEN_ENV as AGENT_TOKEN_ENV
from backend.agent.credential import save as save_credential
from backend.forkserver import die_with_parent
from singularity_sdk.config import default_home


class NodeAgent:
    """One node's agent, started once the server hands over the node's credential."""

    def __init__(self, server: str, name: str, address: str, store: Optional[str] = None,
                 ca: Optional[str] = None, orphan_timeout: float = 60.0):
        # No credential here: actor arguments are kept in Ray's control store for the actor's
        # life; the credential comes in a method call (``start``) and goes to a 0600 file.
        self.server, self.name, self.address = server, name, address
        self.store, self.ca, self.orphan_timeout = store, ca, orphan_timeout
        self.proc: Optional[subprocess.Popen] = None

    def devices(self) -> int:
        """How many devices Ray assigned to this actor (all of the node's GPUs)."""
        import ray

        return len(ray.get_gpu_ids())

    def start(self, credential: str) -> int:
        """Start the agent with ``credential`` and the GPUs Ray assigned; returns its pid."""
        base = default_home()
        home = agent_home(self.name)
        save_credential(home / CREDENTIAL_FILE, credential)
        ckpt = home / "checkpoint-cache" if self.store else base / "checkpoints"
        # Ray sets CUDA_VISIBLE_DEVICES to the assigned GPUs; NVML still sees every GPU, so the
        # agent is limited to as many as Ray gave (all of the node's, as placed). Where the
        # node declares GPUs it has not got, NVML finds none and they become CPU slots.
        cmd = [sys.executable, "-m", "backend.agent", "--server", self.server, "--name", self.name,
               "--home", str(home), "--checkpoint-root", str(ckpt), "--devices", str(self.devices()),
               "--address", self.address, "--orphan-timeout", str(self.orphan_timeout)]
        if self.store:
            cmd += ["--store", self.store]
        if self.ca:
            cmd += ["--ca", self.ca]
        env = {k: v for k, v in os.environ.items() if not k.startswith(AGENT_TOKEN_ENV)}
        log = open(home / "agent.log", "ab")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     cwd=str(home), preexec_fn=die_with_parent)
        log.close()
        return self.proc.pid

    def pid(self) -> Optional[int]:
        """The agent's pid while it runs, else None."""
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop the agent (it stops its workers) before the actor goes."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def agent_home(name: str) -> Path:
    """Where the agent of ``name`` keeps its files on its node."""
    return default_home() / "agents" / name
