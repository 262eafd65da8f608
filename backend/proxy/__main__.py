"""Run a script (or a pickled callable) under the device proxy, locally.

    python -m backend.proxy SCRIPT --checkpoint-dir D [--restore]
                            [--stop-at-step N | --stop-after-seconds T] [-- script args]

Exit codes: 0 finished (its checkpoints are cleared), 75 stopped after a checkpoint
(EX_TEMPFAIL: run again with --restore), 1 the script raised, 2 usage or restore error.
Diagnostics go to stderr as ``[proxy] ...`` lines; the script alone writes stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import traceback
import types
from pathlib import Path
from typing import Optional

from backend.contract import ENV_HASH_SEED, EXIT_PREEMPTED, program_exit_code, with_hash_seed

from .launch import say, say_line

def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m backend.proxy", description=__doc__.split("\n\n")[0])
    p.add_argument("script", help="a Python file, or with --callable a cloudpickle of (fn, args, kwargs)")
    p.add_argument("--checkpoint-dir", required=True, type=lambda s: Path(s).resolve(),
                   help="where checkpoints go (relative to where you run this, even if the script changes folder)")
    p.add_argument("--restore", action="store_true", help="continue from the newest valid checkpoint")
    stop = p.add_mutually_exclusive_group()
    stop.add_argument("--stop-at-step", type=int, metavar="N", help="checkpoint and exit at safe point N")
    stop.add_argument("--stop-after-seconds", type=float, metavar="T", help="checkpoint and exit after T s")
    p.add_argument("--checkpoint-every", type=float, metavar="S", help="periodic checkpoints every S seconds")
    p.add_argument("--write-in-line", action="store_true",
                   help="write periodic checkpoints at the safe point instead of behind the loop")
    p.add_argument("--keep", type=int, default=2, help="checkpoints to keep (default 2)")
    p.add_argument("--callable", action="store_true", help="SCRIPT holds cloudpickle.dumps((fn, args, kwargs))")
    p.add_argument("--print-result", action="store_true", help="print repr() of a non-None result to stdout")
    p.add_argument("--keep-checkpoints", action="store_true", help="do not clear checkpoints on success")
    p.add_argument("--trace", type=Path, metavar="FILE", help="write every safe point as a JSON line (slow)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    script_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, script_args = argv[:cut], argv[cut + 1:]
    args = p.parse_args(argv)
    args.script_args = script_args
    return args


def _fix_threads(torch: types.ModuleType, threads: int) -> None:
    """Fixed thread counts: intra-op thread counts change float results, so every run must match."""
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set (e.g. when called twice in one process)
        pass


def main(argv: Optional[list[str]] = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    import cloudpickle

    from . import CheckpointError, CheckpointStore, Preempted, ResumableProgram
    from .engine.lazy import when_imported
    from .rank import RankRun, main_namespace, run_rank

    # when (and only if) the script imports torch: a torch-free script never loads it
    when_imported("torch", lambda torch: _fix_threads(torch, args.threads))

    script = Path(args.script).resolve()
    namespace = main_namespace(str(script))
    sys.argv = [args.script] + list(args.script_args)  # as typed, as `python train.py` gives it
    sys.path.insert(0, str(script.parent))
    try:
        if args.callable:
            fn, fargs, fkwargs = cloudpickle.loads(script.read_bytes())
            program = ResumableProgram.from_callable(fn, fargs, fkwargs)
        else:
            program = ResumableProgram.from_source(script.read_text(), str(script))
    except (OSError, SyntaxError) as e:
        say_line(f"cannot load {script}: {e}")
        return 2

    store = CheckpointStore(args.checkpoint_dir, keep=args.keep)
    run = RankRun(store, restore=args.restore, checkpoint_every=args.checkpoint_every, on_event=say)
    trace_file = open(args.trace, "a") if args.trace else None

    def before(run: RankRun) -> None:
        controller = run.controller
        assert controller is not None
        controller.write_behind = not args.write_in_line
        if args.restore:
            ref = run.restored
            say("restore", {"checkpoint": None, "note": "no valid checkpoint; starting from the beginning"}
                if ref is None else {"checkpoint": str(ref.path), "step": ref.step})
        if args.stop_at_step is not None:
            controller.checkpoint_at_step(args.stop_at_step, "stop")
        if args.stop_after_seconds is not None:
            timer = threading.Timer(args.stop_after_seconds, controller.request_checkpoint,
                                    kwargs={"then": "stop", "reason": "--stop-after-seconds"})
            timer.daemon = True
            timer.start()
        if trace_file is not None:
            def trace(step: int, position: dict) -> None:
                trace_file.write(json.dumps({"step": step, **position}) + "\n")

            controller.trace_safe_points(trace)

    try:
        result = run_rank(program, namespace, run, before)
    except Preempted as p:
        say("stopped", {"step": p.checkpoint.step, "path": str(p.checkpoint.path)})
        if trace_file is not None:
            trace_file.close()
        # as the worker does: the program did not end, so its objects' __del__ (run when the
        # interpreter clears __main__ at exit) must not run in this process
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_PREEMPTED)
    except CheckpointError as e:
        say_line(f"restore failed: {e}")
        return 2
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)  # as the interpreter prints sys.exit("message")
        if code == 0 and not args.keep_checkpoints:
            store.clear()
        if code == EXIT_PREEMPTED:
            say_line(f"the program exited with status {code}, which means a stop at a checkpoint here: exiting 1")
        return program_exit_code(code)
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        if trace_file is not None:
            trace_file.close()
        sys.stdout.flush()
    if args.print_result and result is not None:
        print(repr(result), flush=True)
    say("finished", {"step": run.controller.last_step if run.controller else 0})
    if not args.keep_checkpoints:
        store.clear()
    return 0


if __name__ == "__main__":
    if not os.environ.get(ENV_HASH_SEED):
        # a fixed string-hash salt, so that a restore (a new process) iterates sets as this run does
        os.execve(sys.executable, [sys.executable, "-m", "backend.proxy", *sys.argv[1:]],
                  with_hash_seed(dict(os.environ)))
    sys.exit(main())
