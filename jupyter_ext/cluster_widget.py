"""``%singularity cluster``: nodes x devices and which job holds each device, live.

The grid is redrawn whenever one of the user's jobs changes placement (the server's user-events
WebSocket says so at once) and every few seconds regardless, since nodes joining or being lost
are not job events (nor are GPU utilisation and memory, read from NVML where it sees the
device: ``nvml.py``). A daemon thread does this until the widget is closed.
"""
from __future__ import annotations

import hashlib
import html
import json
import logging
import threading
from typing import Optional

import ipywidgets as W
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect as ws_connect

from singularity_sdk import Client
from singularity_sdk.errors import SingularityError
from singularity_sdk.protocol import EventType, NodeInfo
from singularity_sdk.render import table

from .nvml import Load, sample

log = logging.getLogger("jupyter_ext")

#: Job events after which devices may have changed hands.
PLACEMENT_EVENTS = {
    EventType.SCHEDULED, EventType.STARTED, EventType.PREEMPTED, EventType.RESUMED, EventType.MIGRATED,
    EventType.RESIZED, EventType.SUCCEEDED, EventType.FAILED, EventType.CANCELLED, EventType.RETRYING,
    EventType.NODE_LOST, EventType.WORKER_EXITED,
}


def job_color(job_id: str) -> str:
    hue = int(hashlib.sha1(job_id.encode()).hexdigest()[:4], 16) % 360
    return f"hsl({hue},65%,85%)"


def cluster_html(nodes: list[NodeInfo], names: dict[str, str], loads: Optional[dict[str, Load]] = None) -> str:
    if not nodes:
        return "<i>no nodes have registered with the server</i>"
    rows = []
    for n in nodes:
        cells = []
        for d in n.devices:
            job = n.used.get(d.index)
            load = (loads or {}).get(d.uuid or "")
            gauge = f'<br><span class="singularity-load" style="color:#4b5563">{load.text()}</span>' if load else ""
            if job:
                label = html.escape(names.get(job, job))
                cells.append(f'<td class="singularity-device busy" style="background:{job_color(job)};padding:3px 8px;'
                             f'border:1px solid #d1d5db" title="{html.escape(d.name)}">{d.index}: {label}'
                             f' <code>{job}</code>{gauge}</td>')
            else:
                cells.append(f'<td class="singularity-device free" style="padding:3px 8px;border:1px solid #d1d5db;'
                             f'color:#9ca3af" title="{html.escape(d.name)}">{d.index}: free{gauge}</td>')
        state_color = "#15803d" if n.state.value == "ready" else "#dc2626"
        rows.append(f'<tr><th style="text-align:left;padding-right:8px">{html.escape(n.name)} '
                    f'<span style="color:{state_color};font-weight:400">{n.state.value}</span></th>{"".join(cells)}</tr>')
    return '<table class="singularity-grid" style="border-collapse:collapse;font-size:12px">' + "".join(rows) + "</table>"


def cluster_text(nodes: list[NodeInfo], names: dict[str, str]) -> str:
    rows = []
    for n in nodes:
        for d in n.devices:
            job = n.used.get(d.index)
            rows.append([n.name, n.state.value, str(d.index), d.kind, f"{names.get(job, job)} ({job})" if job else "free"])
    return table(["node", "state", "device", "kind", "job"], rows) if rows else "no nodes have registered with the server"


class ClusterWidget(W.VBox):
    def __init__(self, client: Client, poll_s: float = 2.0):
        self.client = client
        self.poll_s = poll_s
        self.grid = W.HTML()
        self.status = W.HTML()
        self._names: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._ws = None
        super().__init__([self.grid, self.status])
        self.add_class("singularity-cluster")
        self.nodes: list[NodeInfo] = []
        self.refresh()

    def refresh(self) -> None:
        try:
            self.nodes = self.client.nodes()
        except SingularityError as exc:
            self.status.value = f'<span style="color:#dc2626">{html.escape(str(exc))}</span>'
            return
        for job in {j for n in self.nodes for j in n.used.values()} - set(self._names):
            try:
                self._names[job] = self.client.get(job).name
            except SingularityError:
                self._names[job] = job  # another user's job: only its id is ours to see
        loads = sample(d.uuid for n in self.nodes for d in n.devices if d.kind == "cuda")
        self.grid.value = cluster_html(self.nodes, self._names, loads)
        self.status.value = ""

    def start(self) -> "ClusterWidget":
        self._thread = threading.Thread(target=self._watch, name="singularity-cluster", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        ws = self._ws
        if ws is not None:  # wakes the thread blocked waiting for events
            try:
                ws.close()
            except Exception:
                pass
        super().close()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                with ws_connect(self.client.ws_url("/events/ws"), additional_headers=self.client.headers,
                                **self.client.ws_kwargs,
                                open_timeout=10, close_timeout=1) as ws:
                    self._ws = ws
                    self.refresh()
                    while not self._stop.is_set():
                        try:
                            raw = ws.recv(timeout=self.poll_s)
                        except TimeoutError:
                            self.refresh()
                            continue
                        if EventType(json.loads(raw).get("type")) in PLACEMENT_EVENTS:
                            self.refresh()
            except InvalidStatus as exc:
                if exc.response.status_code in (401, 403):
                    self.status.value = '<span style="color:#dc2626">the server refused the token</span>'
                    return
            except (OSError, ConnectionClosed, TimeoutError, ValueError):
                pass
            except Exception:
                log.exception("cluster widget update failed")
            finally:
                self._ws = None
            if self._stop.wait(self.poll_s):
                return
            self.refresh()

    def _repr_mimebundle_(self, **kwargs) -> dict:
        bundle = super()._repr_mimebundle_(**kwargs)
        if isinstance(bundle, dict):
            bundle["text/plain"] = cluster_text(self.nodes, self._names)
        return bundle
