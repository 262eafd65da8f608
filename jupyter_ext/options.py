"""Options of ``%%singularity`` and the session defaults set with ``%singularity_config``.

Parsing is IPython's ``magic_arguments`` (so ``%%singularity?`` shows the usage); this module
turns the parsed namespace plus the session defaults into one validated ``CellOptions``, and
makes every mistake a ``UsageError`` that names the valid choices.
"""
from __future__ import annotations

import argparse
import keyword
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Optional

from IPython.core.error import UsageError
from IPython.core.magic_arguments import parse_argstring

from singularity_sdk.protocol import SLA

SLA_CHOICES = tuple(s.value for s in SLA)
INTERRUPT_CHOICES = ("detach", "cancel", "preempt")
WIDGET_CHOICES = ("auto", "on", "off")
ON_OFF = ("on", "off")
#: Default cap on the pickled size of the variables pulled back into the notebook.
DEFAULT_PULL_LIMIT_MB = 256.0


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, not {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, not {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, not {text}")
    return value


def variable_name(text: str) -> str:
    if not text.isidentifier() or keyword.iskeyword(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a valid Python variable name")
    return text


@dataclass
class SessionConfig:
    """Defaults for every ``%%singularity`` cell of this session, and where the server is."""

    gpus: int = 1
    ranks: Optional[int] = None
    sla: str = "standard"
    checkpoint_every: Optional[float] = None
    on_interrupt: str = "detach"
    pull_limit_mb: float = DEFAULT_PULL_LIMIT_MB
    widgets: str = "auto"
    #: chart the loss-like values the job prints (singularity_sdk.metrics has the grammar)
    print_metrics: str = "on"
    url: Optional[str] = None
    token: Optional[str] = field(default=None, repr=False)
    home: Optional[str] = None

    def describe(self) -> str:
        lines = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "token" and value:
                value = value[:4] + "..."
            lines.append(f"  {f.name.replace('_', '-'):<17} {value if value is not None else '(default)'}")
        return "singularity session defaults:\n" + "\n".join(lines)

    def connection(self) -> dict[str, Any]:
        return {"url": self.url, "token": self.token, "home": Path(self.home) if self.home else None}


@dataclass(frozen=True)
class CellOptions:
    """Everything one ``%%singularity`` cell was asked to do."""

    gpus: int
    ranks: Optional[int]
    sla: str
    name: Optional[str]
    checkpoint_every: Optional[float]
    wait: bool
    store_as: Optional[str]
    on_interrupt: str
    pull: bool


def parse(magic_func: Callable[..., Any], line: str) -> argparse.Namespace:
    """``parse_argstring`` whose errors list the valid options when one is unknown."""
    try:
        return parse_argstring(magic_func, line)
    except UsageError as exc:
        message = str(exc)
        if "unrecognized arguments" in message:
            valid = sorted({o for a in magic_func.parser._actions for o in a.option_strings if o.startswith("--")})
            message += f"; valid options: {', '.join(valid)}"
        raise UsageError(message) from None


def cell_options(args: argparse.Namespace, config: SessionConfig) -> CellOptions:
    """Merge the cell's options over the session defaults."""
    def pick(name: str) -> Any:
        value = getattr(args, name, None)
        return getattr(config, name) if value is None else value

    return CellOptions(  # how ranks must fit gpus is the server's rule: its 422 is shown as is
        gpus=pick("gpus"), ranks=pick("ranks"), sla=pick("sla"), name=args.name, checkpoint_every=pick("checkpoint_every"),
        wait=not args.no_wait, store_as=args.o, on_interrupt=pick("on_interrupt"), pull=not args.no_pull,
    )


def updated_config(args: argparse.Namespace, config: SessionConfig) -> SessionConfig:
    """A new SessionConfig with the options given to ``%singularity_config`` applied."""
    if getattr(args, "reset", False):
        return SessionConfig()
    changes = {f.name: getattr(args, f.name) for f in fields(SessionConfig)
               if getattr(args, f.name, None) is not None}
    return replace(config, **changes)


def noninteractive() -> bool:
    """``SINGULARITY_NONINTERACTIVE=1`` (CI, logs): plain text instead of widgets."""
    return os.environ.get("SINGULARITY_NONINTERACTIVE", "").strip().lower() in ("1", "true", "yes", "on")
