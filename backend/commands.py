"""The service's commands of ``singularityctl``: ``serve``, ``agent``, ``simulate`` and ``demo``.

The SDK is a client library: it must not import the server, the agents or the scheduler, which
import it. So these commands live here and join ``singularityctl`` through the
``singularityctl.commands`` entry point (see pyproject.toml); ``python -m backend COMMAND`` runs
them without an installed entry point (``LocalCluster`` and the Jupyter extension use that).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Optional

AddCommand = Callable[..., argparse.ArgumentParser]
Passthrough = Callable[[list[str]], int]


def cmd_serve(args: argparse.Namespace) -> int:
    from backend.server.main import run
    from backend.server.run_as import RunAsTableError
    from backend.server.store import StoreTooNew
    from singularity_sdk.errors import SingularityError

    try:
        run(args.home, args.host, args.port, args.nodes, args.devices_per_node, args.store, args.checkpoint_every,
            args.node_timeout, args.policy, args.min_move_interval, args.move_cost,
            checkpoint_timeout=args.checkpoint_timeout, tls_cert=args.tls_cert, tls_key=args.tls_key, ca=args.ca,
            ray_address=args.ray, stop_timeout=args.stop_timeout, run_as=args.run_as)
    except (StoreTooNew, RunAsTableError) as exc:
        raise SingularityError(str(exc)) from None
    return 0


def cmd_agent(rest: list[str]) -> int:
    from backend.agent.agent import main

    main(rest)
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from backend.scheduler.simulator import run_args

    return run_args(args) or 0


def cmd_demo(args: argparse.Namespace) -> int:
    from backend.demo import run_demo

    return run_demo(nodes=args.nodes, devices_per_node=args.devices_per_node)


def register(add: AddCommand) -> dict[str, Passthrough]:
    """Add the service's subcommands with ``add(name, help=..., add_help=...)``; returns the
    commands that parse their own arguments (``agent``: its parser is the agent's)."""
    s = add("serve", help="run the server (and local node agents)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=0, help="0 picks a free port (see server.json)")
    s.add_argument("--nodes", type=int, default=0, help="local node agents to start beside the server")
    s.add_argument("--devices-per-node", type=int, default=None, help="CPU slots per local node (where no GPU)")
    s.add_argument("--store", default=None, metavar="URL",
                   help="checkpoint store for nodes that share no filesystem (fsspec URL); local agents "
                        "then keep separate caches")
    s.add_argument("--checkpoint-every", type=float, default=None, metavar="SECONDS",
                   help="cluster default for periodic checkpoints (default 600; 0 turns them off)")
    s.add_argument("--checkpoint-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="a preempt, migrate or resize that finds no safe point this long is answered "
                        "checkpoint_failed (saying where the job is) and the job runs on")
    s.add_argument("--stop-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM, how long running jobs have to checkpoint before they are ended; they "
                        "are queued again and resume when the service is back (default 30)")
    s.add_argument("--node-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="a node whose agent is silent this long is lost; its jobs resume elsewhere")
    s.add_argument("--policy", choices=["singularity", "fifo"], default="singularity",
                   help="scheduling policy (docs/scheduling.md)")
    s.add_argument("--min-move-interval", type=float, default=60.0, metavar="SECONDS",
                   help="a job preempted or moved by the scheduler is left alone this long")
    s.add_argument("--move-cost", type=float, default=5.0, metavar="SECONDS",
                   help="what the policy assumes a preemption or migration costs (defragmentation weighs it)")
    s.add_argument("--tls-cert", default=None, metavar="PEM", help="serve HTTPS with this certificate (with --tls-key)")
    s.add_argument("--tls-key", default=None, metavar="PEM", help="the certificate's private key")
    s.add_argument("--ca", default=None, metavar="PEM",
                   help="the CA that signed --tls-cert, for clients and local agents (default: the certificate "
                        "itself, as for a self-signed one); written to server.json")
    s.add_argument("--ray", default=None, metavar="ADDRESS",
                   help="run one node agent per Ray node with GPUs ('auto', or HOST:PORT as for ray.init); "
                        "needs the ray extra: pip install 'singularity-notebooks[ray]'")
    s.add_argument("--run-as", default=None, type=Path, metavar="TABLE",
                   help="run each user's jobs as their own OS account: a file of 'USER ACCOUNT' lines (agents "
                        "run as root, jobs in the sandbox; docs/security.md)")
    s.set_defaults(fn=cmd_serve)

    add("agent", help="run a node agent (see 'singularityctl agent --help')", add_help=False)

    s = add("simulate", help="replay a job trace through the scheduling policies (simulated clock)")
    from backend.scheduler.simulator import add_arguments

    add_arguments(s)
    s.set_defaults(fn=cmd_simulate)

    s = add("demo", help="start a local cluster and run the demo training job")
    s.add_argument("--nodes", type=int, default=2)
    s.add_argument("--devices-per-node", type=int, default=2)
    s.set_defaults(fn=cmd_demo)
    return {"agent": cmd_agent}


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m backend COMMAND ...``: singularityctl, with these commands whether or not the
    entry point is installed."""
    from singularity_sdk.cli import main as ctl_main

    return ctl_main(sys.argv[1:] if argv is None else argv, extra=[register])
