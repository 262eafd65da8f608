"""What ``Client`` and ``AsyncClient`` share: building requests and reading responses.

Only the transport differs between the two (httpx.Client vs httpx.AsyncClient, websockets'
sync vs asyncio client), the way httpx itself is built.
"""
from __future__ import annotations

import base64
import inspect
import json
import os
import site
import warnings
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable, Optional, Union

import httpx

from . import tls, unpickle
from .config import REWRITE_MODULES_ENV, resolve
from .errors import APIError, CheckpointFailed, AuthError, Conflict, InvalidRequest, JobCancelled, JobFailed, JobNotFound, ServerUnreachable
from pydantic import TypeAdapter, ValidationError

from .protocol import API_PREFIX, SLA, Event, EventType, JobInfo, JobState, SubmitRequest, describe_validation_error

TERMINAL_EVENTS = {EventType.SUCCEEDED, EventType.FAILED, EventType.CANCELLED}


def events_ws_path(job_id: str, since: int) -> str:
    """A job's event stream after ``since``, in batches: one frame per server commit."""
    return f"/jobs/{job_id}/events/ws?since={since}&batch=1"


_EVENT_LIST = TypeAdapter(list[Event])


def frame_events(raw: Union[str, bytes]) -> list[Event]:
    """The events of one frame of an event stream (a JSON array, or one event), parsed and
    validated in one pass by pydantic (2.3x faster than json.loads then a model per event: a
    follower of a chatty job spends most of its time here)."""
    if raw[:1] in ("[", b"["):
        return _EVENT_LIST.validate_json(raw)
    return [Event.model_validate_json(raw)]
Code = Union[str, Path, Callable[..., Any]]


class BaseClient:
    def __init__(self, url: Optional[str] = None, token: Optional[str] = None, *, home: Optional[Path] = None,
                 timeout: float = 30.0, ca: Optional[str] = None):
        conn = resolve(url, token, home)
        self.url = conn.url
        self.token = conn.token
        self.timeout = timeout
        #: trusts the private CA of a TLS server (ca=, SINGULARITY_CA or server.json); None: defaults
        self.ssl = tls.context(ca or conn.ca)
        #: what the HTTP client verifies with (a shared context: making one per client is slow)
        self.verify = self.ssl or tls.default_context()

    @property
    def ws_kwargs(self) -> dict[str, Any]:
        return tls.websocket_kwargs(self.ws_url(""), self.ssl)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def api(self, path: str) -> str:
        return f"{self.url}{API_PREFIX}{path}"

    def ws_url(self, path: str) -> str:
        return self.api(path).replace("http://", "ws://", 1).replace("https://", "wss://", 1)

    def unreachable(self, exc: Exception) -> ServerUnreachable:
        return ServerUnreachable(
            f"cannot reach the Singularity server at {self.url} ({type(exc).__name__}: {exc}). "
            "Is it running? Start one with 'singularityctl serve --nodes 2 --devices-per-node 2', "
            "or point SINGULARITY_URL at a running server."
        )

    def raise_if_refused(self, status: int, body: Optional[bytes]) -> None:
        """A WebSocket handshake refused for good (401, 403, 404) raises what the same HTTP call
        would; any other status is transient (the caller reconnects)."""
        if status in (401, 403, 404):
            self.check(httpx.Response(status, content=body or b"", headers={"content-type": "application/json"}))

    @staticmethod
    def check(response: httpx.Response) -> Any:
        if response.status_code < 400:
            if response.headers.get("content-type", "").startswith("application/json"):
                return response.json()
            return response.text
        try:
            body = response.json()
            message, field = body.get("error", response.text), body.get("field")
        except ValueError:
            message, field = response.text or response.reason_phrase, None
        cls = {401: AuthError, 403: AuthError, 404: JobNotFound, 409: Conflict}.get(response.status_code)
        if cls is None:
            cls = InvalidRequest if response.status_code < 500 else APIError
        raise cls(response.status_code, message, field)

    @staticmethod
    def submit_body(code: Code, args: tuple, kwargs: Optional[dict], *, gpus: int, sla: Union[str, SLA],
                    name: Optional[str], ranks: Optional[int], checkpoint_every: Optional[float],
                    env: Optional[dict[str, str]], filename: Optional[str],
                    inputs: Optional[dict[str, Any]] = None, outputs: Optional[list[str]] = None,
                    argv: Optional[list[str]] = None, workdir: Union[str, Path, None] = None,
                    sync_workdir: bool = False, rewrite_modules: Optional[list[str]] = None) -> dict[str, Any]:
        """Build a validated submit request from a source string, a script path or a callable.

        ``argv`` becomes the job's ``sys.argv[1:]``; ``workdir`` (default: the current directory)
        is where it runs, as ``python script.py ARGS`` run from there would. ``sync_workdir``
        sends a copy of it for nodes that do not see it (size-capped)."""
        folder = os.path.abspath(workdir if workdir is not None else os.getcwd())
        fields: dict[str, Any] = dict(gpus=gpus, sla=sla, name=name, ranks=ranks, workdir=folder,
                                      checkpoint_every=checkpoint_every, env=env or {}, outputs=list(outputs or []))
        if rewrite_modules:  # library modules whose loops get safe points (docs/checkpoint-format.md)
            fields["env"] = {**fields["env"], REWRITE_MODULES_ENV: ",".join(rewrite_modules)}
        if argv is not None:
            fields["args"] = argv
        if sync_workdir:
            fields["workdir_b64"] = base64.b64encode(pack_workdir(folder)).decode()
        if inputs:
            fields["inputs_b64"] = base64.b64encode(pickle_inputs(inputs)).decode()
        if isinstance(code, Path):
            fields.update(source=code.read_text(), filename=filename or script_name(code, folder), name=name or code.stem)
        elif isinstance(code, str):
            fields.update(source=code, filename=filename or "<cell>")
        elif callable(code):
            blob = pickle_callable(code, args, kwargs)
            fields.update(callable_b64=base64.b64encode(blob).decode(),
                          filename=filename or _callable_file(code),
                          name=name or getattr(code, "__name__", None))
        else:
            raise TypeError(f"submit() takes source code (str), a script path (pathlib.Path) or a callable, "
                            f"not {type(code).__name__}")
        if args and not callable(code):
            raise TypeError("positional arguments are only for submitting a callable")
        try:
            request = SubmitRequest(**fields)
        except ValidationError as exc:  # caught here, before a round trip, with the server's wording
            message, field = describe_validation_error(exc)
            raise InvalidRequest(422, message, field) from None
        return request.model_dump(mode="json", exclude_none=True)


def pack_workdir(folder: str) -> bytes:
    """The job's folder as the synced copy, or InvalidRequest naming the cap before any upload."""
    from .folders import WorkdirTooLarge, pack

    try:
        return pack(folder)
    except WorkdirTooLarge as exc:
        raise InvalidRequest(413, str(exc), "workdir_b64") from None


def script_name(path: Path, folder: str) -> str:
    """The script as ``sys.argv[0]``: relative to the job's folder when inside it, else absolute."""
    full = os.path.abspath(path)
    rel = os.path.relpath(full, folder)
    return full if rel.startswith(os.pardir + os.sep) or rel == os.pardir else rel


def _is_users_own_module(module: Any) -> bool:
    """A module the workers may not be able to import: not stdlib, not an installed package."""
    path = getattr(module, "__file__", None)
    if not path or module.__name__ == "__main__":
        return False
    installed = {sys.prefix, sys.base_prefix, *site.getsitepackages()}
    return not any(os.path.abspath(path).startswith(os.path.abspath(p) + os.sep) for p in installed)


def pickle_callable(fn: Callable[..., Any], args: tuple, kwargs: Optional[dict]) -> bytes:
    """cloudpickle ``(fn, args, kwargs)``, carrying the user's own modules by value so a
    function defined in a local helper file runs on a worker that lacks that file."""
    import cloudpickle

    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    by_value = module is not None and _is_users_own_module(module)
    if by_value:
        cloudpickle.register_pickle_by_value(module)
    try:
        return cloudpickle.dumps((fn, tuple(args), dict(kwargs or {}), _function_source(fn)))
    finally:
        if by_value:
            cloudpickle.unregister_pickle_by_value(module)


def _function_source(fn: Callable[..., Any]) -> Optional[str]:
    """The source of a ``def`` (the worker rewrites its loops into safe points, and has no copy
    of the user's file to read it from). None for lambdas, builtins and the like."""
    code = getattr(fn, "__code__", None)
    if code is None or code.co_name == "<lambda>":
        return None
    try:
        return textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return None


def pickle_inputs(inputs: dict[str, Any]) -> bytes:
    """cloudpickle the variables a job starts with; name every one that cannot be sent."""
    import cloudpickle

    bad = []
    for name, value in inputs.items():
        try:
            cloudpickle.dumps(value)
        except Exception as exc:
            bad.append(f"{name} ({type(value).__name__}: {exc})")
    if bad:
        raise InvalidRequest(422, "these variables cannot be sent with the job: " + "; ".join(bad)
                             + ". Re-create them inside the job instead.", "inputs")
    return cloudpickle.dumps(dict(inputs))


def _callable_file(fn: Callable[..., Any]) -> str:
    try:
        return os.path.basename(inspect.getsourcefile(fn) or "<callable>")
    except TypeError:
        return "<callable>"


class JobBase:
    """A job's last known state; ``refresh()`` (or ``await refresh()``) updates it."""

    def __init__(self, client: Any, info: JobInfo):
        self._client = client
        self.info = info

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def state(self) -> JobState:
        return self.info.state

    @property
    def placement(self):
        return self.info.placement

    def __repr__(self) -> str:
        where = ", ".join(f"{p.node}{p.devices}" for p in self.info.placement)
        return f"<Job {self.id} {self.name!r} {self.state.value}{' on ' + where if where else ''}>"

    def decode_result(self, payload: dict[str, Any]) -> Any:
        """Turn a finished job's result payload into its value (or the right exception)."""
        if self.state == JobState.FAILED:
            raise JobFailed(self.id, self.info.error or "(no traceback recorded)")
        if self.state == JobState.CANCELLED:
            raise JobCancelled(f"job {self.id} was cancelled; it has no result")
        if payload.get("error"):
            raise APIError(200, f"job {self.id} succeeded but its result could not be kept: {payload['error']}")
        blob = payload.get("pickle_b64")
        if blob is None:
            return None
        return unpickle.loads(base64.b64decode(blob))

    def _outputs(self, payload: dict[str, Any]) -> dict[str, Any]:
        if self.state != JobState.SUCCEEDED:
            self.decode_result(payload)  # raises the right error
        skipped = payload.get("outputs_skipped") or {}
        if skipped:
            warnings.warn("not returned from job " + self.id + ": "
                          + "; ".join(f"{k}: {v}" for k, v in skipped.items()), stacklevel=3)
        blob = payload.get("outputs_b64")
        if blob is None:
            return {}
        return unpickle.loads(base64.b64decode(blob))


def reconnect_pauses(backoff: float, tick_s: float) -> list[float]:
    """The sleeps before a follower reconnects: ``backoff`` in all, in steps of at most
    ``tick_s`` (between which it yields an empty batch, so its caller can stop)."""
    steps = []
    while backoff > 1e-9:
        steps.append(min(tick_s, backoff))
        backoff -= steps[-1]
    return steps


def control_done(job_id: str, goal: EventType, ev: "Event") -> bool:
    """Whether ``ev`` settles a preempt/checkpoint request waiting for ``goal``; raises
    ``CheckpointFailed`` when the job answered with an error instead."""
    if ev.type == EventType.CHECKPOINT_FAILED:
        raise CheckpointFailed(job_id, str(ev.data.get("error")), ev.data.get("variables"))
    return ev.type == goal or ev.type in TERMINAL_EVENTS


def checkpoint_bound(checkpoint_timeout: Optional[float]) -> dict[str, float]:
    """The request body's bound on reaching a safe point, when the caller set one."""
    return {} if checkpoint_timeout is None else {"checkpoint_timeout": float(checkpoint_timeout)}
