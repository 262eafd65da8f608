"""The synchronous SDK: ``Client`` and the ``Job`` handles it returns."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import httpx
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect as ws_connect

from ._base import (TERMINAL_EVENTS, BaseClient, Code, JobBase, checkpoint_bound, control_done, events_ws_path,
                    frame_events, reconnect_pauses)
from . import metrics
from .errors import WaitTimeout
from .protocol import SLA, Event, EventType, JobInfo, JobState, NodeInfo



def _read_batch(ws: Any, tick_s: float, batch_s: float) -> list[Event]:
    """Wait up to ``tick_s`` for events, then gather what follows within ``batch_s``."""
    try:
        batch = frame_events(ws.recv(timeout=tick_s))
    except TimeoutError:
        return []
    deadline = time.monotonic() + batch_s
    while len(batch) < 500 and batch[-1].type not in TERMINAL_EVENTS:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            batch += frame_events(ws.recv(timeout=left))
        except TimeoutError:
            break
    return batch

class Job(JobBase):
    _client: "Client"

    def refresh(self) -> "Job":
        self.info = JobInfo.model_validate(self._client._get(f"/jobs/{self.id}"))
        return self

    def wait(self, timeout: Optional[float] = None) -> JobState:
        """Block until the job ends; returns its final state."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.02
        while not self.refresh().state.is_terminal:
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout(f"job {self.id} still {self.state.value} after {timeout}s")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.25)
        return self.state

    def result(self, timeout: Optional[float] = None) -> Any:
        """The value of the job's last expression (or the callable's return value).

        Waits for the job to end; raises ``JobFailed`` with the remote traceback if it failed."""
        self.wait(timeout)
        return self.decode_result(self.result_payload())

    def result_payload(self) -> dict[str, Any]:
        """The server's record of the job's outcome, as sent (``pickle_b64``, ``repr``, ``error``,
        ``outputs_b64``, ``outputs_skipped``); ``decode_result`` turns it into the value."""
        return self._client._get(f"/jobs/{self.id}/result")

    def outputs(self, timeout: Optional[float] = None) -> dict[str, Any]:
        """The final values of the names passed as ``outputs=`` at submit (waits for the end)."""
        self.wait(timeout)
        return self._outputs(self.result_payload())

    def logs(self) -> str:
        return self._client._get(f"/jobs/{self.id}/logs")

    def events(self, since: int = 0, follow: bool = True) -> Iterator[Event]:
        """The job's events after ``since``; with ``follow`` keeps going until the job ends."""
        if not follow or self.refresh().state.is_terminal:
            for raw in self._client._get(f"/jobs/{self.id}/events", params={"since": since}):
                yield Event.model_validate(raw)
            return
        url = self._client.ws_url(events_ws_path(self.id, since))
        try:
            with ws_connect(url, additional_headers=self._client.headers, max_size=None, **self._client.ws_kwargs,
                            max_queue=None, close_timeout=2) as ws:
                for raw in ws:
                    for ev in frame_events(raw):
                        yield ev
                        if ev.type in TERMINAL_EVENTS:
                            return
        except (OSError, ConnectionClosed) as exc:
            raise self._client.unreachable(exc) from None

    def follow(self, since: int = 0, *, tick_s: float = 1.0, batch_s: float = 0.05) -> Iterator[list[Event]]:
        """The job's new events, in batches, until it ends, across dropped connections (a server
        restart, a network blip): each reconnect asks for the events after the last one seen,
        so none is missed or repeated. Yields ``[]`` when nothing came for ``tick_s`` (a chance
        to update a clock, or to stop by leaving the loop); what follows an event within
        ``batch_s`` comes with it, so a chatty job means one redraw per batch, not per line.
        Raises JobNotFound or AuthError when the server refuses the job."""
        last, backoff = since, 0.2
        while True:
            url = self._client.ws_url(events_ws_path(self.id, last))
            try:
                with ws_connect(url, additional_headers=self._client.headers, max_size=None, **self._client.ws_kwargs,
                                open_timeout=10, close_timeout=1) as ws:
                    backoff = 0.2
                    while True:
                        batch = [ev for ev in _read_batch(ws, tick_s, batch_s) if ev.seq > last]
                        if batch:
                            last = batch[-1].seq
                        yield batch
                        if any(ev.type in TERMINAL_EVENTS for ev in batch):
                            return
            except InvalidStatus as exc:
                self._client.raise_if_refused(exc.response.status_code, exc.response.body)
            except (OSError, ConnectionClosed, TimeoutError):
                pass
            for pause in reconnect_pauses(backoff, tick_s):
                yield []
                time.sleep(pause)
            backoff = min(backoff * 2, 5.0)

    def metrics(self, *, rank: Optional[int] = 0, printed: bool = True, as_frame: bool = False) -> Any:
        """The job's training curve so far: one dict per report (``step``, ``time``, ``rank``,
        ``source`` -- ``log`` for ``singularity_sdk.log``, ``print`` for a parsed printed line --
        and the values, e.g. ``loss``). Rank 0 by default (``rank=None``: every rank);
        ``printed=False`` ignores printed lines; ``as_frame=True`` gives a pandas DataFrame.
        The grammar of printed metrics is in ``singularity_sdk.metrics``."""
        return metrics.result(self.events(follow=False), rank=rank, printed=printed, frame=as_frame)

    def act(self, action: str, reason: str = "", **body: Any) -> "Job":
        """Ask the server for ``action`` (preempt, resume, migrate, resize, cancel, checkpoint)
        with ``body``'s fields, without waiting for the job to react; ``APIError`` says why not."""
        if reason:
            body["reason"] = reason
        raw = self._client._post(f"/jobs/{self.id}/{action}", body)
        self.info = JobInfo.model_validate(raw)
        return self

    def _await_event(self, since: int, goal: EventType, timeout: Optional[float]) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        for ev in self.events(since=since):
            if control_done(self.id, goal, ev):
                break
            if deadline is not None and time.monotonic() > deadline:
                raise WaitTimeout(f"job {self.id}: no {goal.value} within {timeout}s")
        self.refresh()

    def preempt(self, reason: str = "", wait: bool = True, timeout: Optional[float] = None,
                checkpoint_timeout: Optional[float] = None) -> "Job":
        """Checkpoint at the next safe point and stop, freeing the devices.

        With ``wait``, returns once the job is PREEMPTED (or ended first); raises
        ``CheckpointFailed`` naming what could not be saved, or where the job is when it reached
        no safe point within ``checkpoint_timeout`` (default: the server's), in which case the
        job runs on."""
        since = (self.refresh()).info.last_seq
        self.act("preempt", reason, **checkpoint_bound(checkpoint_timeout))
        if wait:
            self._await_event(since, EventType.PREEMPTED, timeout)
        return self

    def migrate(self, node: Optional[str] = None, reason: str = "", wait: bool = True,
                timeout: Optional[float] = None, checkpoint_timeout: Optional[float] = None) -> "Job":
        """Move the running job to ``node`` (or wherever the scheduler finds room): checkpoint
        here, restore there. With ``wait``, returns once it runs again at its destination."""
        since = (self.refresh()).info.last_seq
        self.act("migrate", reason, **({"node": node} if node else {}), **checkpoint_bound(checkpoint_timeout))
        if wait:
            self._await_event(since, EventType.MIGRATED, timeout)
        return self

    def resize(self, gpus: int, reason: str = "", wait: bool = True,
               timeout: Optional[float] = None, checkpoint_timeout: Optional[float] = None) -> "Job":
        """Run on ``gpus`` devices from now on, keeping the job's ranks (several ranks share a
        device when there are fewer devices than ranks); the code does not notice. With ``wait``,
        returns once the job runs again at its new size (a queued job changes size at once)."""
        since = (self.refresh()).info.last_seq
        self.act("resize", reason, gpus=gpus, **checkpoint_bound(checkpoint_timeout))
        if wait and self.info.state.holds_devices:
            self._await_event(since, EventType.RESIZED, timeout)
        return self

    def resume(self) -> "Job":
        """Queue a preempted job again; it continues from its newest checkpoint."""
        return self.act("resume")

    def checkpoint(self, wait: bool = True, timeout: Optional[float] = None) -> "Job":
        """Take a checkpoint now (at the next safe point); the job keeps running."""
        since = (self.refresh()).info.last_seq
        self.act("checkpoint")
        if wait:
            self._await_event(since, EventType.CHECKPOINTED, timeout)
        return self

    def cancel(self, reason: str = "") -> "Job":
        return self.act("cancel", reason)


class Client(BaseClient):
    """Talks to a Singularity server. Arguments win over ``SINGULARITY_URL``/``SINGULARITY_TOKEN``,
    which win over ``$SINGULARITY_HOME/server.json``."""

    def __init__(self, url: Optional[str] = None, token: Optional[str] = None, *, home: Optional[Path] = None,
                 timeout: float = 30.0, ca: Optional[str] = None):
        super().__init__(url, token, home=home, timeout=timeout, ca=ca)
        self._http = httpx.Client(headers=self.headers, timeout=timeout, verify=self.verify)

    # -- transport
    def _request(self, method: str, path: str, **kw: Any) -> Any:
        try:
            response = self._http.request(method, self.api(path), **kw)
        except httpx.TransportError as exc:
            raise self.unreachable(exc) from None
        return self.check(response)

    def _get(self, path: str, **kw: Any) -> Any:
        return self._request("GET", path, **kw)

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        return self._request("POST", path, json=body)

    # -- API
    def submit(self, code: Code, *fn_args: Any, gpus: int = 1, sla: Union[str, SLA] = "standard",
               name: Optional[str] = None, ranks: Optional[int] = None, checkpoint_every: Optional[float] = None,
               env: Optional[dict[str, str]] = None, filename: Optional[str] = None,
               kwargs: Optional[dict[str, Any]] = None,
               inputs: Optional[dict[str, Any]] = None, outputs: Optional[list[str]] = None,
               args: Optional[list[str]] = None, workdir: Union[str, Path, None] = None,
               sync_workdir: bool = False, rewrite_modules: Optional[list[str]] = None) -> Job:
        """Submit source code (str), a script (pathlib.Path) or a callable with ``*fn_args``/``kwargs``.

        ``args`` is the job's ``sys.argv[1:]``; it runs in ``workdir`` (default: the current
        directory), so relative paths mean what they mean to ``python script.py ARGS`` run here;
        ``sync_workdir=True`` also sends a copy of that folder (at most 32 MiB of files) for nodes
        that do not see it: the job then runs in the copy, whose files travel with its checkpoints.
        ``rewrite_modules`` names library modules whose loops also become safe points (transformers'
        Trainer loop is one by default; docs/checkpoint-format.md)."""
        body = self.submit_body(code, fn_args, kwargs, gpus=gpus, sla=sla, name=name, ranks=ranks,
                                checkpoint_every=checkpoint_every, env=env, filename=filename,
                                inputs=inputs, outputs=outputs, argv=args, workdir=workdir,
                                sync_workdir=sync_workdir, rewrite_modules=rewrite_modules)
        return Job(self, JobInfo.model_validate(self._post("/jobs", body)))

    def get(self, job_id: str) -> Job:
        return Job(self, JobInfo.model_validate(self._get(f"/jobs/{job_id}")))

    def jobs(self, state: Optional[Union[str, JobState, list]] = None) -> list[Job]:
        states = [state] if isinstance(state, (str, JobState)) else (state or [])
        raw = self._get("/jobs", params=[("state", str(s)) for s in states])
        return [Job(self, JobInfo.model_validate(j)) for j in raw]

    def drain(self, node: str) -> NodeInfo:
        """Admin: move every job off ``node``; it takes no new work until ``undrain``."""
        return NodeInfo.model_validate(self._post(f"/nodes/{node}/drain", {}))

    def undrain(self, node: str) -> NodeInfo:
        return NodeInfo.model_validate(self._post(f"/nodes/{node}/undrain", {}))

    def nodes(self) -> list[NodeInfo]:
        return [NodeInfo.model_validate(n) for n in self._get("/nodes")]

    def health(self) -> dict[str, Any]:
        return self._get("/health")

    def create_user(self, user: str) -> str:
        """Admin only: create a user and return their token."""
        return self._post("/users", {"user": user})["token"]

    def usage(self) -> list[dict[str, Any]]:
        """Device-hours per user and tier, devices held now and quotas (the admin sees everyone)."""
        return self._get("/usage")

    def set_quota(self, user: str, tier: str, devices: Optional[int]) -> dict[str, Any]:
        """Admin only: ``user`` may hold at most ``devices`` of ``tier`` (None: no limit); beyond
        it their jobs of that tier run one tier down."""
        return self._post("/quotas", {"user": user, "tier": str(tier), "devices": devices})

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
