"""``singularityctl``: the command line. Every listing command takes ``--json``."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from ._base import script_name
from .client import Client, Job
from .errors import SingularityError
from .protocol import SLA, EventType, JobState
from .render import describe, format_event, job_row, table

SLA_CHOICES = [s.value for s in SLA]


def _client(args: argparse.Namespace) -> Client:
    return Client(args.url, args.token, home=args.home)


def _print_json(payload: Any) -> None:
    print(json.dumps(payload, indent=2, default=str))


def cmd_submit(args: argparse.Namespace) -> int:
    if args.file == "-":
        source, filename = sys.stdin.read(), "<stdin>"
    else:
        path = Path(args.file)
        if not path.is_file():
            raise SingularityError(f"no such file: {args.file}")
        source, filename = path.read_text(), script_name(path, os.getcwd())
    env = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SingularityError(f"--env takes KEY=VALUE, not {item!r}")
        env[key] = value
    with _client(args) as c:
        job = c.submit(source, gpus=args.gpus, sla=args.sla, name=args.name or Path(filename).stem,
                       ranks=args.ranks, checkpoint_every=args.checkpoint_every, filename=filename, env=env,
                       args=args.script_args, sync_workdir=args.sync_workdir, rewrite_modules=args.rewrite_module)
        if args.wait:
            for ev in job.events():
                if not args.json:
                    _print_live(ev)
            job.refresh()
        if args.json:
            _print_json(job.info.model_dump(mode="json"))
        else:
            if not args.wait:
                print(job.id)
        return 0 if not args.wait or job.state == JobState.SUCCEEDED else 1


def _print_live(ev) -> None:
    if ev.type == EventType.LOG:
        stream = sys.stdout if ev.data.get("stream") == "stdout" else sys.stderr
        stream.write(ev.data.get("line", ""))
        stream.flush()
    else:
        print(format_event(ev), file=sys.stderr, flush=True)


def cmd_jobs(args: argparse.Namespace) -> int:
    with _client(args) as c:
        jobs = c.jobs(state=args.state)
    if args.json:
        _print_json([j.info.model_dump(mode="json") for j in jobs])
        return 0
    now = time.time()
    print(table(["id", "name", "state", "sla", "devices", "node", "age"], [job_row(j.info, now) for j in jobs]))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    with _client(args) as c:
        job = c.get(args.job)
        notes = [] if args.json else _before_moving(job)
    if args.json:
        _print_json(job.info.model_dump(mode="json"))
        return 0
    info = job.info
    print(f"{info.id}  {info.name}  [{info.state.value}]  sla={info.sla.value}  gpus={info.gpus}  ranks={info.ranks}")
    for p in info.placement:
        print(f"  placement: {p.node} devices {p.devices} ranks {p.ranks}")
    print(f"  attempt {info.attempt}, created {time.ctime(info.created_at)}, events {info.last_seq}")
    if info.error:
        print("  error:\n" + "\n".join("    " + line for line in info.error.splitlines()))
    for line in notes:
        print(f"  {line}")
    return 0


def _before_moving(job: Any) -> list[str]:
    """What the job said at start about being moved: where it can be interrupted, and what an
    exact resume depends on (the latest report of each)."""
    from .render import exactness_text

    latest: dict[EventType, Any] = {}
    for ev in job.events(follow=False):
        if ev.type in (EventType.INTERRUPTIBLE, EventType.EXACTNESS):
            latest[ev.type] = ev
    out = []
    if EventType.INTERRUPTIBLE in latest:
        out.append(f"interruptible: {latest[EventType.INTERRUPTIBLE].data.get('message', '')}")
    if EventType.EXACTNESS in latest:
        out.append(f"exactness: {exactness_text(latest[EventType.EXACTNESS].data)}")
    return out


def cmd_logs(args: argparse.Namespace) -> int:
    with _client(args) as c:
        job = c.get(args.job)
        if not args.follow:
            sys.stdout.write(job.logs())
            return 0
        for ev in job.events():
            if ev.type == EventType.LOG:
                prefix = f"[rank {ev.data.get('rank', 0)}] " if job.info.ranks > 1 else ""
                sys.stdout.write("".join(prefix + line for line in ev.lines))
                sys.stdout.flush()
    return 0


def cmd_events(args: argparse.Namespace) -> int:
    with _client(args) as c:
        job = c.get(args.job)
        for ev in job.events(since=args.since, follow=args.follow):
            if args.json:
                print(ev.model_dump_json(), flush=True)
            else:
                print(format_event(ev), flush=True)
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    with _client(args) as c:
        job = c.get(args.job).cancel(args.reason or "")
        if not args.no_wait:
            job.wait(timeout=30)  # stopping takes at most the grace period plus a kill
    print(f"{job.id}: {job.state.value}")
    return 0


def cmd_preempt(args: argparse.Namespace) -> int:
    with _client(args) as c:  # the job's events are read through this client: print before it closes
        job = c.get(args.job).preempt(args.reason or "", wait=not args.no_wait,
                                      checkpoint_timeout=args.checkpoint_timeout)
        last = _last_event(job, EventType.PREEMPTED)
        print(f"{job.id}: {job.state.value}" + (f" ({describe(last)})" if last else ""))
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    with _client(args) as c:
        job = c.get(args.job).resume()
    print(f"{job.id}: {job.state.value}")
    return 0


def cmd_checkpoint(args: argparse.Namespace) -> int:
    with _client(args) as c:
        job = c.get(args.job).checkpoint(wait=not args.no_wait)
        last = _last_event(job, EventType.CHECKPOINTED)
        print(f"{job.id}: " + (describe(last) if last and not args.no_wait else "checkpoint requested"))
    return 0


def _last_event(job: Job, etype: EventType):
    found = None
    for ev in job.events(follow=False):
        if ev.type == etype:
            found = ev
    return found


def cmd_migrate(args: argparse.Namespace) -> int:
    return _move(args, EventType.MIGRATED, lambda job, wait: job.migrate(args.to, args.reason or "", wait=wait,
                                                                    checkpoint_timeout=args.checkpoint_timeout))


def cmd_resize(args: argparse.Namespace) -> int:
    return _move(args, EventType.RESIZED, lambda job, wait: job.resize(args.gpus, args.reason or "", wait=wait,
                                                                   checkpoint_timeout=args.checkpoint_timeout))


def _move(args: argparse.Namespace, done: EventType, request: Callable[[Job, bool], Job]) -> int:
    """Request a move, wait for it unless --no-wait, and say where the job stands."""
    with _client(args) as c:
        job = request(c.get(args.job), not args.no_wait)
        last = _last_event(job, done) if not args.no_wait else None
    print(f"{job.id}: {job.state.value}" + (f" ({describe(last)})" if last else ""))
    return 0


def cmd_drain(args: argparse.Namespace) -> int:
    with _client(args) as c:
        node = c.undrain(args.node) if args.command == "undrain" else c.drain(args.node)
    print(f"{node.name}: {node.state.value}")
    return 0


def cmd_nodes(args: argparse.Namespace) -> int:
    with _client(args) as c:
        nodes = c.nodes()
    if args.json:
        _print_json([n.model_dump(mode="json") for n in nodes])
        return 0
    rows = []
    for n in nodes:
        devs = " ".join(f"{d.index}:{n.used.get(d.index, '-')}" for d in n.devices)
        kinds = ",".join(sorted({d.kind for d in n.devices}))
        rows.append([n.name, n.state.value, f"{len(n.devices)} {kinds}", n.address or "-", devs])
        if any(m.ray_node_id for m in nodes):  # agents placed on a Ray cluster (serve --ray)
            rows[-1].insert(4, n.ray_node_id or "-")
    ray = ["ray node id"] if any(n.ray_node_id for n in nodes) else []
    print(table(["node", "state", "devices", "address", *ray, "in use (device:job)"], rows))
    return 0


def cmd_user(args: argparse.Namespace) -> int:
    with _client(args) as c:
        token = c.create_user(args.name)
    if args.json:
        _print_json({"user": args.name, "token": token})
    else:
        print(token)
    return 0


def cmd_usage(args: argparse.Namespace) -> int:
    with _client(args) as c:
        rows = c.usage()
    if args.json:
        _print_json(rows)
        return 0
    print(table(["user", "tier", "device-hours", "holding now", "quota", "jobs"],
                [[r["user"], r["tier"], f"{r['device_hours']:.2f}", str(r["holding"]),
                  "-" if r["quota"] is None else str(r["quota"]), str(r["jobs"])] for r in rows]))
    return 0


def cmd_quota(args: argparse.Namespace) -> int:
    with _client(args) as c:
        row = c.set_quota(args.user, args.tier, None if args.devices < 0 else args.devices)
    if args.json:
        _print_json(row)
    else:
        limit = "no limit" if row["devices"] is None else f"at most {row['devices']} devices"
        print(f"{row['user']} {row['tier']}: {limit}")
    return 0


#: the entry-point group through which installed packages add commands (the service adds serve,
#: agent, simulate and demo: backend/commands.py), so that this client imports none of them
COMMANDS_GROUP = "singularityctl.commands"
Register = Callable[[Callable[..., argparse.ArgumentParser]], Optional[dict[str, Callable[[list[str]], int]]]]


def _installed_commands() -> list[Register]:
    from importlib.metadata import entry_points

    found = []
    for ep in entry_points(group=COMMANDS_GROUP):
        try:
            found.append(ep.load())
        except Exception as exc:  # a broken plug-in must not take the client's commands with it
            print(f"singularityctl: the commands of {ep.value} are unavailable: {exc}", file=sys.stderr)
    return found


def build_parser(extra: Sequence[Register] = ()) -> argparse.ArgumentParser:
    """The parser; ``parser.passthrough`` maps commands that parse their own arguments to them."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=None, help="server URL (default: SINGULARITY_URL or server.json)")
    common.add_argument("--token", default=None, help="API token (default: SINGULARITY_TOKEN or server.json)")
    common.add_argument("--home", type=Path, default=None, help="SINGULARITY_HOME (default ~/.singularity)")
    p = argparse.ArgumentParser(prog="singularityctl", description="Preemptible, migratable, resizable DL jobs.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help: str, add_help: bool = True) -> argparse.ArgumentParser:
        """A subcommand that also takes --url/--token/--home (after its name)."""
        return sub.add_parser(name, help=help, add_help=add_help, parents=[common] if add_help else [])

    s = add("submit", help="submit a script (or - for stdin); 'submit FILE [options] -- ARGS...' passes "
                           "ARGS as its sys.argv[1:]; it runs in the current directory")
    s.add_argument("file")
    s.add_argument("--gpus", type=int, default=1)
    s.add_argument("--ranks", type=int, default=None, help="processes (default: one per device)")
    s.add_argument("--sla", choices=SLA_CHOICES, default="standard")
    s.add_argument("--name", default=None)
    s.add_argument("--checkpoint-every", type=float, default=None, metavar="SECONDS")
    s.add_argument("--rewrite-module", action="append", default=[], metavar="MODULE",
                   help="also give safe points to the loops of this library module (repeatable)")
    s.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="an environment variable for the job's processes (repeatable)")
    s.add_argument("--sync-workdir", action="store_true",
                   help="send a copy of the current directory (at most 32 MiB) for nodes that do not see it")
    s.add_argument("--wait", action="store_true", help="stream the job's output and wait for it to end")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_submit)

    s = add("jobs", help="list your jobs")
    s.add_argument("--state", action="append", choices=[st.value for st in JobState])
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_jobs)

    for name, fn, helptext in (("show", cmd_show, "one job in detail"),):
        s = add(name, help=helptext)
        s.add_argument("job")
        s.add_argument("--json", action="store_true")
        s.set_defaults(fn=fn)

    s = add("logs", help="a job's output")
    s.add_argument("job")
    s.add_argument("-f", "--follow", action="store_true")
    s.set_defaults(fn=cmd_logs)

    s = add("events", help="a job's event log")
    s.add_argument("job")
    s.add_argument("-f", "--follow", action="store_true")
    s.add_argument("--since", type=int, default=0)
    s.add_argument("--json", action="store_true", help="one JSON object per line")
    s.set_defaults(fn=cmd_events)

    s = add("cancel", help="cancel a job")
    s.add_argument("job")
    s.add_argument("--reason", default=None)
    s.add_argument("--no-wait", action="store_true", help="return once the request is accepted")
    s.set_defaults(fn=cmd_cancel)

    s = add("preempt", help="checkpoint a running job and stop it, freeing its devices")
    s.add_argument("job")
    s.add_argument("--reason", default=None)
    s.add_argument("--no-wait", action="store_true")
    s.add_argument("--checkpoint-timeout", type=float, default=None, metavar="SECONDS",
                   help="answer checkpoint_failed if no safe point is reached this soon (default: the server's)")
    s.set_defaults(fn=cmd_preempt)

    s = add("resume", help="queue a preempted job again; it continues where it stopped")
    s.add_argument("job")
    s.set_defaults(fn=cmd_resume)

    s = add("checkpoint", help="take a checkpoint now; the job keeps running")
    s.add_argument("job")
    s.add_argument("--no-wait", action="store_true")
    s.set_defaults(fn=cmd_checkpoint)

    s = add("migrate", help="move a running job to another node (checkpoint, transfer, restore)")
    s.add_argument("job")
    s.add_argument("--to", default=None, metavar="NODE", help="destination (default: the scheduler picks)")
    s.add_argument("--reason", default=None)
    s.add_argument("--no-wait", action="store_true")
    s.add_argument("--checkpoint-timeout", type=float, default=None, metavar="SECONDS",
                   help="answer checkpoint_failed if no safe point is reached this soon (default: the server's)")
    s.set_defaults(fn=cmd_migrate)

    s = add("resize", help="run a job on more or fewer devices, keeping its ranks (exact: the code cannot tell)")
    s.add_argument("job")
    s.add_argument("--gpus", type=int, required=True, help="devices from now on (a divisor of the job's ranks)")
    s.add_argument("--reason", default=None)
    s.add_argument("--no-wait", action="store_true")
    s.add_argument("--checkpoint-timeout", type=float, default=None, metavar="SECONDS",
                   help="answer checkpoint_failed if no safe point is reached this soon (default: the server's)")
    s.set_defaults(fn=cmd_resize)

    for name, helptext in (("drain", "admin: move every job off a node; it takes no new work"),
                           ("undrain", "admin: let a drained node take work again")):
        s = add(name, help=helptext)
        s.add_argument("node")
        s.set_defaults(fn=cmd_drain)

    s = add("nodes", help="list nodes and their devices")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_nodes)

    s = add("user", help="admin: create a user and print their token")
    s.add_argument("name")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_user)

    s = add("usage", help="device-hours per user and tier, devices held now and quotas")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_usage)

    s = add("quota", help="admin: the most devices of a tier a user may hold (beyond it: one tier down)")
    s.add_argument("user")
    s.add_argument("--tier", choices=["premium", "standard", "basic"], default="premium")
    s.add_argument("--gpus", dest="devices", type=int, required=True, help="devices; -1 lifts the limit")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_quota)

    passthrough: dict[str, Callable[[list[str]], int]] = {}
    for register in dict.fromkeys([*extra, *_installed_commands()]):
        passthrough.update(register(add) or {})
    p.passthrough = passthrough  # type: ignore[attr-defined]
    return p


def main(argv: Optional[list[str]] = None, extra: Sequence[Register] = ()) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(extra)
    # e.g. 'agent', whose parser is shared with 'python -m backend.agent': hand it the rest.
    if argv and argv[0] in parser.passthrough:  # type: ignore[attr-defined]
        return parser.passthrough[argv[0]](argv[1:])  # type: ignore[attr-defined]
    # 'submit FILE [options] -- ARGS...': everything after the first '--' is the script's own argv.
    script_args: list[str] = []
    if argv[:1] == ["submit"] and "--" in argv:
        cut = argv.index("--")
        argv, script_args = argv[:cut], argv[cut + 1:]
    args = parser.parse_args(argv)
    args.script_args = script_args
    try:
        return args.fn(args)
    except SingularityError as exc:
        print(f"singularityctl: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def entry() -> None:
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:  # the reader left (`singularityctl show j-1 | head -3`): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        code = 0
    sys.exit(code)


if __name__ == "__main__":
    entry()
