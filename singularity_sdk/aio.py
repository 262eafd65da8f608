"""The asyncio SDK: ``AsyncClient`` and ``AsyncJob``, the same methods as the sync pair."""
from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any, AsyncIterator, Optional, Union

import httpx
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from ._base import (TERMINAL_EVENTS, BaseClient, Code, JobBase, checkpoint_bound, control_done, events_ws_path,
                    frame_events, reconnect_pauses)
from . import metrics
from .errors import WaitTimeout
from .protocol import SLA, Event, EventType, JobInfo, JobState, NodeInfo



if sys.version_info >= (3, 11):
    async def _recv(ws: Any, timeout: float) -> Any:
        """One frame within ``timeout`` (asyncio.timeout: a third of wait_for's cost, which
        wraps each receive in a task; a follower pays it per frame)."""
        async with asyncio.timeout(timeout):
            return await ws.recv()
else:
    async def _recv(ws: Any, timeout: float) -> Any:
        return await asyncio.wait_for(ws.recv(), timeout)


async def _read_batch(ws: Any, tick_s: float, batch_s: float) -> list[Event]:
    """Wait up to ``tick_s`` for events, then gather what follows within ``batch_s``."""
    try:
        batch = frame_events(await _recv(ws, tick_s))
    except (asyncio.TimeoutError, TimeoutError):
        return []
    deadline = time.monotonic() + batch_s
    while len(batch) < 500 and batch[-1].type not in TERMINAL_EVENTS:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            batch += frame_events(await _recv(ws, left))
        except (asyncio.TimeoutError, TimeoutError):
            break
    return batch

class AsyncJob(JobBase):
    _client: "AsyncClient"

    async def refresh(self) -> "AsyncJob":
        self.info = JobInfo.model_validate(await self._client._get(f"/jobs/{self.id}"))
        return self

    async def wait(self, timeout: Optional[float] = None) -> JobState:
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.02
        while not (await self.refresh()).state.is_terminal:
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout(f"job {self.id} still {self.state.value} after {timeout}s")
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 0.25)
        return self.state

    async def result(self, timeout: Optional[float] = None) -> Any:
        await self.wait(timeout)
        return self.decode_result(await self.result_payload())

    async def outputs(self, timeout: Optional[float] = None) -> dict[str, Any]:
        """The final values of the names passed as ``outputs=`` at submit (waits for the end)."""
        await self.wait(timeout)
        return self._outputs(await self.result_payload())

    async def logs(self) -> str:
        return await self._client._get(f"/jobs/{self.id}/logs")

    async def events(self, since: int = 0, follow: bool = True) -> AsyncIterator[Event]:
        if not follow or (await self.refresh()).state.is_terminal:
            for raw in await self._client._get(f"/jobs/{self.id}/events", params={"since": since}):
                yield Event.model_validate(raw)
            return
        url = self._client.ws_url(events_ws_path(self.id, since))
        try:
            async with ws_connect(url, additional_headers=self._client.headers, max_size=None, **self._client.ws_kwargs,
                            max_queue=None, close_timeout=2) as ws:
                async for raw in ws:
                    for ev in frame_events(raw):
                        yield ev
                        if ev.type in TERMINAL_EVENTS:
                            return
        except (OSError, ConnectionClosed) as exc:
            raise self._client.unreachable(exc) from None

    async def follow(self, since: int = 0, *, tick_s: float = 1.0,
                     batch_s: float = 0.05) -> AsyncIterator[list[Event]]:
        """The job's new events, in batches, until it ends, across dropped connections (see
        ``Job.follow``): ``[]`` when nothing came for ``tick_s``."""
        last, backoff = since, 0.2
        while True:
            url = self._client.ws_url(events_ws_path(self.id, last))
            try:
                async with ws_connect(url, additional_headers=self._client.headers, max_size=None,
                                      **self._client.ws_kwargs, open_timeout=10, close_timeout=1) as ws:
                    backoff = 0.2
                    while True:
                        batch = [ev for ev in await _read_batch(ws, tick_s, batch_s) if ev.seq > last]
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
                await asyncio.sleep(pause)
            backoff = min(backoff * 2, 5.0)

    async def metrics(self, *, rank: Optional[int] = 0, printed: bool = True, as_frame: bool = False) -> Any:
        """The job's training curve so far: one dict per report (``step``, ``time``, ``rank``,
        ``source`` -- ``log`` for ``singularity_sdk.log``, ``print`` for a parsed printed line --
        and the values, e.g. ``loss``). Rank 0 by default (``rank=None``: every rank);
        ``printed=False`` ignores printed lines; ``as_frame=True`` gives a pandas DataFrame.
        The grammar of printed metrics is in ``singularity_sdk.metrics``."""
        events = [ev async for ev in self.events(follow=False)]
        return metrics.result(events, rank=rank, printed=printed, frame=as_frame)

    async def result_payload(self) -> dict[str, Any]:
        """The server's record of the job's outcome (see ``Job.result_payload``)."""
        return await self._client._get(f"/jobs/{self.id}/result")

    async def act(self, action: str, reason: str = "", **body: Any) -> "AsyncJob":
        """Ask the server for ``action`` without waiting for the job to react (see ``Job.act``)."""
        if reason:
            body["reason"] = reason
        raw = await self._client._post(f"/jobs/{self.id}/{action}", body)
        self.info = JobInfo.model_validate(raw)
        return self

    async def _await_event(self, since: int, goal: EventType, timeout: Optional[float]) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        async for ev in self.events(since=since):
            if control_done(self.id, goal, ev):
                break
            if deadline is not None and time.monotonic() > deadline:
                raise WaitTimeout(f"job {self.id}: no {goal.value} within {timeout}s")
        await self.refresh()

    async def preempt(self, reason: str = "", wait: bool = True, timeout: Optional[float] = None,
                      checkpoint_timeout: Optional[float] = None) -> "AsyncJob":
        """Checkpoint at the next safe point and stop, freeing the devices.

        With ``wait``, returns once the job is PREEMPTED (or ended first); raises
        ``CheckpointFailed`` naming what could not be saved, or that the job reached no safe
        point within ``checkpoint_timeout`` (default: the server's), in which case it runs on."""
        since = (await self.refresh()).info.last_seq
        await self.act("preempt", reason, **checkpoint_bound(checkpoint_timeout))
        if wait:
            await self._await_event(since, EventType.PREEMPTED, timeout)
        return self

    async def migrate(self, node: Optional[str] = None, reason: str = "", wait: bool = True,
                      timeout: Optional[float] = None, checkpoint_timeout: Optional[float] = None) -> "AsyncJob":
        """Move the running job to ``node`` (or wherever the scheduler finds room): checkpoint
        here, restore there. With ``wait``, returns once it runs again at its destination."""
        since = (await self.refresh()).info.last_seq
        await self.act("migrate", reason, **({"node": node} if node else {}), **checkpoint_bound(checkpoint_timeout))
        if wait:
            await self._await_event(since, EventType.MIGRATED, timeout)
        return self

    async def resize(self, gpus: int, reason: str = "", wait: bool = True,
                     timeout: Optional[float] = None, checkpoint_timeout: Optional[float] = None) -> "AsyncJob":
        """Run on ``gpus`` devices from now on, keeping the job's ranks (several ranks share a
        device when there are fewer devices than ranks); the code does not notice. With ``wait``,
        returns once the job runs again at its new size (a queued job changes size at once)."""
        since = (await self.refresh()).info.last_seq
        await self.act("resize", reason, gpus=gpus, **checkpoint_bound(checkpoint_timeout))
        if wait and self.info.state.holds_devices:
            await self._await_event(since, EventType.RESIZED, timeout)
        return self

    async def resume(self) -> "AsyncJob":
        """Queue a preempted job again; it continues from its newest checkpoint."""
        return await self.act("resume")

    async def checkpoint(self, wait: bool = True, timeout: Optional[float] = None) -> "AsyncJob":
        """Take a checkpoint now (at the next safe point); the job keeps running."""
        since = (await self.refresh()).info.last_seq
        await self.act("checkpoint")
        if wait:
            await self._await_event(since, EventType.CHECKPOINTED, timeout)
        return self

    async def cancel(self, reason: str = "") -> "AsyncJob":
        return await self.act("cancel", reason)


class AsyncClient(BaseClient):
    def __init__(self, url: Optional[str] = None, token: Optional[str] = None, *, home: Optional[Path] = None,
                 timeout: float = 30.0, ca: Optional[str] = None):
        super().__init__(url, token, home=home, timeout=timeout, ca=ca)
        self._http = httpx.AsyncClient(headers=self.headers, timeout=timeout, verify=self.verify)

    async def _request(self, method: str, path: str, **kw: Any) -> Any:
        try:
            response = await self._http.request(method, self.api(path), **kw)
        except httpx.TransportError as exc:
            raise self.unreachable(exc) from None
        return self.check(response)

    async def _get(self, path: str, **kw: Any) -> Any:
        return await self._request("GET", path, **kw)

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        return await self._request("POST", path, json=body)

    async def submit(self, code: Code, *fn_args: Any, gpus: int = 1, sla: Union[str, SLA] = "standard",
                     name: Optional[str] = None, ranks: Optional[int] = None,
                     checkpoint_every: Optional[float] = None, env: Optional[dict[str, str]] = None,
                     filename: Optional[str] = None, kwargs: Optional[dict[str, Any]] = None,
                     inputs: Optional[dict[str, Any]] = None, outputs: Optional[list[str]] = None,
                     args: Optional[list[str]] = None, workdir: Union[str, Path, None] = None,
                     sync_workdir: bool = False, rewrite_modules: Optional[list[str]] = None) -> AsyncJob:
        body = self.submit_body(code, fn_args, kwargs, gpus=gpus, sla=sla, name=name, ranks=ranks,
                                checkpoint_every=checkpoint_every, env=env, filename=filename,
                                inputs=inputs, outputs=outputs, argv=args, workdir=workdir,
                                sync_workdir=sync_workdir, rewrite_modules=rewrite_modules)
        return AsyncJob(self, JobInfo.model_validate(await self._post("/jobs", body)))

    async def get(self, job_id: str) -> AsyncJob:
        return AsyncJob(self, JobInfo.model_validate(await self._get(f"/jobs/{job_id}")))

    async def jobs(self, state: Optional[Union[str, JobState, list]] = None) -> list[AsyncJob]:
        states = [state] if isinstance(state, (str, JobState)) else (state or [])
        raw = await self._get("/jobs", params=[("state", str(s)) for s in states])
        return [AsyncJob(self, JobInfo.model_validate(j)) for j in raw]

    async def drain(self, node: str) -> NodeInfo:
        """Admin: move every job off ``node``; it takes no new work until ``undrain``."""
        return NodeInfo.model_validate(await self._post(f"/nodes/{node}/drain", {}))

    async def undrain(self, node: str) -> NodeInfo:
        return NodeInfo.model_validate(await self._post(f"/nodes/{node}/undrain", {}))

    async def nodes(self) -> list[NodeInfo]:
        return [NodeInfo.model_validate(n) for n in await self._get("/nodes")]

    async def health(self) -> dict[str, Any]:
        return await self._get("/health")

    async def create_user(self, user: str) -> str:
        return (await self._post("/users", {"user": user}))["token"]

    async def usage(self) -> list[dict[str, Any]]:
        return await self._get("/usage")

    async def set_quota(self, user: str, tier: str, devices: Optional[int]) -> dict[str, Any]:
        return await self._post("/quotas", {"user": user, "tier": str(tier), "devices": devices})

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()
