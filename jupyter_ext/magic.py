"""``%%singularity``, ``%singularity`` and ``%singularity_config``.

The cell magic sends the cell (and the notebook variables it reads) to the cluster as a job,
shows a live widget (or plain text), prints the job's output as it happens, and when the job
succeeds puts the variables it set back into the notebook and returns its last expression as
the cell's value. Ctrl-C while waiting detaches (or cancels, or preempts) and never loses work.
"""
from __future__ import annotations

import dataclasses
import queue
import sys
from typing import Any, Optional

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import MagicArgumentParser, argument, magic_arguments
from IPython.display import display

from singularity_sdk import Client, Job
from singularity_sdk.errors import ConfigError, InvalidRequest, JobNotFound, SingularityError
from singularity_sdk.protocol import JobState
from singularity_sdk.render import job_row, table

from singularity_sdk.metrics import Series

from . import options as O
from .actions import perform
from .chart import sparkline
from .follower import End, EventFollower
from .results import outcome, pull, value_of
from .text import TextPrinter
from .variables import analyze, globals_of_own_functions, outputs_for, returnable, select_inputs


class Watch:
    """What a waiting cell drains: the follower's queue, printed by ``printer``."""

    def __init__(self, printer: TextPrinter, follower: EventFollower, q: "queue.Queue", widget: Any,
                 printed_metrics: bool = True):
        self.printer = printer
        self.follower = follower
        self.queue = q
        self.widget = widget
        self.series = Series(rank=0, printed=printed_metrics)

    def show(self, batch: list) -> None:
        self.printer.show(batch)
        if self.widget is None:
            self.series.apply(batch)

    @property
    def curve(self) -> str:
        """The training curve as a sparkline (the plain-text form of the widget's chart)."""
        return sparkline(self.series)


@magics_class
class SingularityMagics(Magics):
    def __init__(self, shell: Any):
        super().__init__(shell)
        self.session = O.SessionConfig()
        self._client: Optional[Client] = None
        self.last_job: Optional[Job] = None
        #: job id -> follower of every widget shown in this session (stopped on unload)
        self.followers: dict[str, list[EventFollower]] = {}
        #: job id -> the newest widget showing it
        self.widgets: dict[str, Any] = {}
        self.cluster_widgets: list[Any] = []

    # ------------------------------------------------------------------ plumbing
    def client(self) -> Client:
        if self._client is None:
            try:
                self._client = Client(**self.session.connection())
            except ConfigError as exc:
                raise UsageError(f"{exc} In JupyterLab the jupyter_ext server extension sets this up; "
                                 f"elsewhere use %singularity_config --url URL --token TOKEN.") from None
        return self._client

    def use_widgets(self) -> bool:
        if O.noninteractive() or self.session.widgets == "off":
            return False
        if self.session.widgets == "on":
            return True
        return getattr(self.shell, "kernel", None) is not None  # a frontend that can draw widgets

    def close(self) -> None:
        """Stop every background thread this session started (extension unload)."""
        for followers in self.followers.values():
            for f in followers:
                f.stop()
        for w in [*self.widgets.values(), *self.cluster_widgets]:
            w.close()
        self.widgets.clear()
        self.cluster_widgets.clear()
        if self._client is not None:
            self._client.close()
            self._client = None

    # ------------------------------------------------------------------ %%singularity
    @magic_arguments("%singularity")
    @argument("--gpus", type=O.positive_int, default=None, help="devices (the job's world size); default 1")
    @argument("--ranks", type=O.positive_int, default=None, help="processes; default one per device")
    @argument("--sla", choices=O.SLA_CHOICES, default=None, help="tier: how much it may be shrunk or preempted")
    @argument("--name", default=None, help="job name; default cell-N")
    @argument("--checkpoint-every", type=O.positive_float, default=None, metavar="SECONDS",
              help="periodic checkpoints (what a lost node resumes from)")
    @argument("--no-wait", action="store_true", help="return the Job at once; the widget keeps following it")
    @argument("-o", type=O.variable_name, default=None, metavar="VAR", help="store the Job in VAR")
    @argument("--on-interrupt", choices=O.INTERRUPT_CHOICES, default=None,
              help="what Ctrl-C does while waiting; default detach (the job keeps running)")
    @argument("--no-pull", action="store_true", help="do not bring the cell's variables back")
    @cell_magic("singularity")
    def singularity_cell(self, line: str, cell: str) -> Any:
        """Run this cell on the Singularity cluster: preemptible, migratable, resizable.

        Notebook variables the cell reads are sent with it; when the job succeeds, the variables
        it sets (and inputs it may have changed in place, like a model it trained) come back, and
        its last expression is the cell's value. Remote output appears as it happens.
        Session defaults: %singularity_config. Other commands: %singularity?
        """
        job, opts = self._start_cell(line, cell)
        return self._follow(job, wait=opts.wait, pull_vars=opts.pull, on_interrupt=opts.on_interrupt,
                            logs_open=not opts.wait)

    async def cell_async(self, line: str, cell: str) -> Any:
        """The cell magic as the kernel runs it where it can (``waiting.py``): the same job and
        value, but the kernel handles the widget's buttons while the cell waits."""
        job, opts = self._start_cell(line, cell)
        return await self.follow_async(job, wait=opts.wait, pull_vars=opts.pull, on_interrupt=opts.on_interrupt,
                                       logs_open=not opts.wait)

    def _start_cell(self, line: str, cell: str) -> tuple[Job, O.CellOptions]:
        args = O.parse(self.singularity_cell, line)
        opts = O.cell_options(args, self.session)
        job = self._submit(cell, opts)
        self.last_job = job
        if opts.store_as:
            self.shell.user_ns[opts.store_as] = job
        return job, opts

    def _submit(self, cell: str, opts: O.CellOptions) -> Job:
        try:
            names = analyze(cell)
        except SyntaxError as exc:
            raise UsageError(f"the cell is not plain Python, so it cannot run on the cluster: {exc.msg} "
                             f"(line {exc.lineno}: {(exc.text or '').strip()!r}). IPython syntax such as !cmd "
                             f"or %magic works only in the notebook itself.") from None
        ns = self.shell.user_ns
        inputs = select_inputs(names.reads, ns, self.shell.user_ns_hidden)
        used = globals_of_own_functions(inputs, ns, self.shell.user_ns_hidden)
        if used:  # what the notebook's functions use travels too, and may change like the cell's own
            inputs.update((n, v) for n, v in used.items() if n not in inputs)
            names = dataclasses.replace(names, mutated=names.mutated | frozenset(used))
        too_big = _too_big_to_return({n: v for n, v in inputs.items() if n in names.mutated},
                                     self.session.pull_limit_mb)
        outputs = outputs_for(names, inputs, too_big)
        name = opts.name or f"cell-{self.shell.execution_count}"
        client = self.client()
        try:
            # A blank first line stands for the %%singularity line: remote tracebacks then give
            # the line numbers the notebook shows for the cell.
            return client.submit("\n" + cell, gpus=opts.gpus, sla=opts.sla, name=name, ranks=opts.ranks,
                                 checkpoint_every=opts.checkpoint_every, filename="<cell>",
                                 inputs=inputs or None, outputs=outputs)
        except InvalidRequest as exc:
            raise UsageError(exc.message) from None
        except SingularityError as exc:
            raise UsageError(str(exc)) from None

    def _follow(self, job: Job, *, wait: bool, pull_vars: bool, on_interrupt: str, logs_open: bool,
                since: int = 0) -> Any:
        """Show the job (widget or text); with ``wait``, print its output until it ends."""
        watch = self._show(job, wait=wait, logs_open=logs_open, since=since)
        if watch is None:
            return job
        return self._finish(job, watch, self._drain(job, watch, on_interrupt), pull_vars)

    async def follow_async(self, job: Job, *, wait: bool, pull_vars: bool, on_interrupt: str, logs_open: bool,
                           since: int = 0) -> Any:
        """``_follow`` for a cell the kernel runs as a coroutine (``waiting.py``): while it waits
        the kernel's event loop runs, so the widget's buttons act during the cell."""
        watch = self._show(job, wait=wait, logs_open=logs_open, since=since)
        if watch is None:
            return job
        return self._finish(job, watch, await self._drain_async(job, watch, on_interrupt), pull_vars)

    def _show(self, job: Job, *, wait: bool, logs_open: bool, since: int) -> Optional[Watch]:
        """Display the widget (or say how to follow the job); for ``wait``, what to drain."""
        client = self.client()
        widgets = self.use_widgets()
        printer = TextPrinter(job.id, job.info.ranks, events=not widgets)
        follower = EventFollower(client, job.id, since=since)
        widget = None
        if widgets:
            from .widgets import JobWidget

            widget = JobWidget(client, job.info, logs_open=logs_open,
                               printed_metrics=self.session.print_metrics == "on").follow(follower)
            self.followers.setdefault(job.id, []).append(follower)
            self.widgets[job.id] = widget
        elif not wait:
            printer.note(f"job {job.id} ({job.name}): {job.state.value}. Follow it with "
                         f"%singularity attach {job.id} --wait")
        if not wait:
            if widget is not None:
                follower.start()
                display(widget)
            return None
        q = follower.subscribe()
        follower.start()
        if widget is not None:
            display(widget)
        return Watch(printer, follower, q, widget, printed_metrics=self.session.print_metrics == "on")

    def _finish(self, job: Job, watch: Watch, end: Optional[End], pull_vars: bool) -> Any:
        """The job ended (or the cell detached: ``end`` None): its value, variables, or error."""
        printer, follower, widget = watch.printer, watch.follower, watch.widget
        if end is None:  # detached
            return None
        follower.unsubscribe(watch.queue)
        if end.error and not follower.finished:
            printer.finish(failed=False)
            raise UsageError(f"lost track of job {job.id}: {end.error}")
        printer.finish(failed=job.refresh().state == JobState.FAILED)
        if widget is None and watch.curve:
            printer.note(f"job {job.id}: {watch.curve}")
        payload = outcome(job)  # raises with the remote traceback on failure
        notes: list[str] = []
        if pull_vars:
            pulled = pull(payload, self.shell.user_ns, self.session.pull_limit_mb)
            notes += pulled.notes
            if widget is not None and pulled.names:
                widget.say("variables brought back: " + ", ".join(pulled.names))
        value, more = value_of(job, payload)
        for note in notes + more:
            print(f"[singularity] {note}", file=sys.stderr)
        return value

    def _drain(self, job: Job, watch: Watch, on_interrupt: str) -> Optional[End]:
        """Print batches until the follower ends; on Ctrl-C apply ``on_interrupt``, return None."""
        try:
            while True:
                try:
                    item = watch.queue.get(timeout=0.25)
                except queue.Empty:
                    continue
                if isinstance(item, End):
                    return item
                watch.show(item)
        except KeyboardInterrupt:
            self._detach(job, watch, on_interrupt)
            return None

    async def _drain_async(self, job: Job, watch: Watch, on_interrupt: str) -> Optional[End]:
        """``_drain`` that yields to the kernel's loop between batches; the kernel turns Ctrl-C
        into cancelling the cell's task, which ends up here as ``CancelledError``."""
        import asyncio

        try:
            while True:
                try:
                    item = watch.queue.get_nowait()
                except queue.Empty:
                    await asyncio.sleep(0.05)
                    continue
                if isinstance(item, End):
                    return item
                watch.show(item)
        except (asyncio.CancelledError, KeyboardInterrupt):
            task = asyncio.current_task()
            if task is not None and hasattr(task, "uncancel"):
                task.uncancel()  # handled: the cell ends normally, as after Ctrl-C in a plain cell
            self._detach(job, watch, on_interrupt)
            return None

    def _detach(self, job: Job, watch: Watch, on_interrupt: str) -> None:
        watch.follower.unsubscribe(watch.queue)
        if watch.widget is None:
            watch.follower.stop()
        watch.printer.finish(failed=False)
        self._interrupted(job, on_interrupt, watch.printer)

    def _interrupted(self, job: Job, on_interrupt: str, printer: TextPrinter) -> None:
        if on_interrupt == "detach":
            printer.note(f"detached (Ctrl-C): job {job.id} keeps running. Follow it again with "
                         f"%singularity attach {job.id} --wait, or get its value with job.result().")
            return
        result = perform(self.client(), job.id, on_interrupt, reason="Ctrl-C in the notebook")
        printer.note(f"Ctrl-C: {result.message}" + (f". %singularity resume {job.id} continues it."
                                                   if on_interrupt == "preempt" and result.ok else ""))

    # ------------------------------------------------------------------ %singularity
    @line_magic("singularity")
    def singularity_line(self, line: str) -> Any:
        """Singularity commands:

          %singularity jobs [--state S]          your jobs
          %singularity attach [JOB] [--wait] [--no-pull] [-o VAR]
                                                 a live widget for a job (after a kernel restart too);
                                                 --wait follows it here and brings its variables back
          %singularity cluster                   nodes x devices and the jobs holding them, live
          %singularity logs [JOB]                a job's output so far
          %singularity preempt|resume|cancel|checkpoint [JOB]
          %singularity migrate [JOB] [--to NODE]
          %singularity resize [JOB] --gpus N

        JOB is a job id or a variable holding a Job; by default the last job of this session.
        Run a cell on the cluster with %%singularity (see %%singularity?).
        """
        if not line.strip():
            raise UsageError("say what to do: " + ", ".join(LINE_COMMANDS) + " (see %singularity?)")
        args = _line_parser().parse_argstring(line)
        return getattr(self, f"_cmd_{args.command}")(args)

    def _job(self, ref: Optional[str]) -> Job:
        if ref is None:
            if self.last_job is None:
                raise UsageError("no job yet in this session: name one (an id, or a variable holding a Job)")
            return self.last_job.refresh()
        value = self.shell.user_ns.get(ref)
        if isinstance(value, Job):
            return value.refresh()
        try:
            return self.client().get(ref)
        except JobNotFound:
            raise UsageError(f"no job {ref!r}: not a job id of yours, nor a variable holding a Job") from None
        except SingularityError as exc:
            raise UsageError(str(exc)) from None

    def _cmd_jobs(self, args: Any) -> None:
        import time

        try:
            jobs = self.client().jobs(args.state or None)
        except SingularityError as exc:
            raise UsageError(str(exc)) from None
        if not jobs:
            print("no jobs")
            return
        now = time.time()
        print(table(["id", "name", "state", "sla", "devices", "node", "age"], [job_row(j.info, now) for j in jobs]))

    def _cmd_attach(self, args: Any) -> Any:
        job = self._job(args.job)
        self.last_job = job
        if args.o:
            self.shell.user_ns[args.o] = job
        return self._follow(job, wait=args.wait, pull_vars=not args.no_pull, on_interrupt=self.session.on_interrupt,
                            logs_open=not args.wait)

    def _cmd_cluster(self, args: Any) -> None:
        client = self.client()
        if self.use_widgets():
            from .cluster_widget import ClusterWidget

            widget = ClusterWidget(client).start()
            self.cluster_widgets.append(widget)
            display(widget)
        else:
            from .cluster_widget import cluster_text

            names = {j.id: j.name for j in client.jobs()}
            print(cluster_text(client.nodes(), names))

    def _cmd_logs(self, args: Any) -> None:
        sys.stdout.write(self._job(args.job).logs())

    def _control(self, action: str, args: Any, **kwargs: Any) -> None:
        job = self._job(args.job)
        result = perform(self.client(), job.id, action, **kwargs)
        if not result.ok:
            raise UsageError(result.message)
        print(f"[singularity] job {job.id}: {result.message}")

    def _cmd_preempt(self, args: Any) -> None:
        self._control("preempt", args, reason="preempted from the notebook")

    def _cmd_resume(self, args: Any) -> None:
        self._control("resume", args)

    def _cmd_cancel(self, args: Any) -> None:
        self._control("cancel", args, reason="cancelled from the notebook")

    def _cmd_checkpoint(self, args: Any) -> None:
        self._control("checkpoint", args)

    def _cmd_migrate(self, args: Any) -> None:
        self._control("migrate", args, node=args.to, reason="migrated from the notebook")

    def _cmd_resize(self, args: Any) -> None:
        self._control("resize", args, gpus=args.gpus, reason="resized from the notebook")

    # ------------------------------------------------------------------ %singularity_config
    @magic_arguments("singularity_config")
    @argument("--gpus", type=O.positive_int, default=None)
    @argument("--ranks", type=O.positive_int, default=None)
    @argument("--sla", choices=O.SLA_CHOICES, default=None)
    @argument("--checkpoint-every", type=O.positive_float, default=None, metavar="SECONDS")
    @argument("--on-interrupt", choices=O.INTERRUPT_CHOICES, default=None)
    @argument("--pull-limit-mb", type=O.positive_float, default=None,
              help=f"largest pickled size of the variables brought back (default {O.DEFAULT_PULL_LIMIT_MB:g})")
    @argument("--widgets", choices=O.WIDGET_CHOICES, default=None, help="auto: widgets in a kernel, text elsewhere")
    @argument("--print-metrics", choices=O.ON_OFF, default=None,
              help="chart loss-like values the job prints (name=value, name: value); default on")
    @argument("--url", default=None, help="server URL (default: SINGULARITY_URL, else $SINGULARITY_HOME/server.json)")
    @argument("--token", default=None)
    @argument("--home", default=None, help="a SINGULARITY_HOME whose server.json to use")
    @argument("--reset", action="store_true", help="back to the defaults")
    @line_magic("singularity_config")
    def singularity_config(self, line: str) -> None:
        """Defaults for the %%singularity cells of this session, and which server to use.

        With no options, shows the current settings."""
        args = O.parse(self.singularity_config, line)
        new = O.updated_config(args, self.session)
        if new.connection() != self.session.connection() and self._client is not None:
            self._client.close()
            self._client = None
        self.session = new
        print(self.session.describe())


LINE_COMMANDS = ("jobs", "attach", "cluster", "logs", "preempt", "resume", "cancel", "checkpoint", "migrate", "resize")


def _line_parser() -> MagicArgumentParser:
    p = MagicArgumentParser(prog="%singularity", add_help=False)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    s = sub.add_parser("jobs", add_help=False)
    s.add_argument("--state", action="append", choices=[st.value for st in JobState])
    s = sub.add_parser("attach", add_help=False)
    s.add_argument("job", nargs="?")
    s.add_argument("--wait", action="store_true")
    s.add_argument("--no-pull", action="store_true")
    s.add_argument("-o", type=O.variable_name, default=None, metavar="VAR")
    sub.add_parser("cluster", add_help=False)
    for name in ("logs", "preempt", "resume", "cancel", "checkpoint"):
        sub.add_parser(name, add_help=False).add_argument("job", nargs="?")
    s = sub.add_parser("migrate", add_help=False)
    s.add_argument("job", nargs="?")
    s.add_argument("--to", default=None, metavar="NODE")
    s = sub.add_parser("resize", add_help=False)
    s.add_argument("job", nargs="?")
    s.add_argument("--gpus", type=O.positive_int, required=True)
    return p


def _too_big_to_return(inputs: dict[str, Any], limit_mb: float) -> list[str]:
    """Inputs whose pickled size alone is over the pull limit: read-only data (a dataset) that
    must not crowd the cell's real results out of the pull."""
    import cloudpickle

    big = []
    for name, value in inputs.items():
        if not returnable(value):
            continue
        try:
            if len(cloudpickle.dumps(value)) > limit_mb * 1e6:
                big.append(name)
        except Exception:
            pass  # the submit reports it, naming the variable
    return big
