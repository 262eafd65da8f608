"""The live job widget: state badge, placement, progress, timeline, logs and controls.

It draws a ``JobView`` (with its training curve, ``chart.py``) and is fed by an ``EventFollower``
thread, so it keeps updating after the cell that created it has returned. Its buttons run in the
kernel (comm messages): while a cell waits, ``waiting.py`` keeps the kernel handling them. Where widgets cannot render, the text part of its display bundle is a one-line
summary instead of ipywidgets' generic repr.
"""
from __future__ import annotations

import html
import threading
from typing import Any, Optional

import ipywidgets as W

from singularity_sdk import Client
from singularity_sdk.protocol import EventType, JobInfo, JobState

from .actions import perform
from .chart import svg
from .follower import EventFollower
from .view import JobView

STATE_COLORS = {
    JobState.QUEUED: "#6b7280",
    JobState.RUNNING: "#2563eb",
    JobState.PREEMPTING: "#d97706",
    JobState.PREEMPTED: "#b45309",
    JobState.MIGRATING: "#7c3aed",
    JobState.RESIZING: "#7c3aed",
    JobState.SUCCEEDED: "#15803d",
    JobState.FAILED: "#dc2626",
    JobState.CANCELLED: "#4b5563",
}
#: Timeline rows worth a colour of their own.
EVENT_COLORS = {
    EventType.PREEMPTING: "#d97706", EventType.PREEMPTED: "#b45309", EventType.RESUMED: "#15803d",
    EventType.CHECKPOINTED: "#0e7490", EventType.CHECKPOINT_FAILED: "#dc2626", EventType.MIGRATING: "#7c3aed",
    EventType.MIGRATED: "#7c3aed", EventType.RESIZING: "#7c3aed", EventType.RESIZED: "#7c3aed",
    EventType.NODE_LOST: "#dc2626", EventType.RETRYING: "#d97706", EventType.FAILED: "#dc2626",
    EventType.SUCCEEDED: "#15803d", EventType.CANCELLED: "#4b5563",
}
#: When each button makes sense.
ENABLED_IN = {
    "preempt": {JobState.RUNNING},
    "resume": {JobState.PREEMPTED},
    "migrate": {JobState.RUNNING},
    "resize": {JobState.RUNNING, JobState.QUEUED, JobState.PREEMPTED},
    "cancel": {JobState.QUEUED, JobState.RUNNING, JobState.PREEMPTING, JobState.PREEMPTED,
               JobState.MIGRATING, JobState.RESIZING},
}
TIMELINE_ROWS = 60
LOG_ROWS = 200


def badge(state: JobState) -> str:
    color = STATE_COLORS.get(state, "#6b7280")
    return (f'<span class="singularity-badge" style="background:{color};color:white;border-radius:4px;'
            f'padding:1px 8px;font-weight:600">{state.value}</span>')


class JobWidget(W.VBox):
    """One job, live. ``follow(follower)`` wires it to an event stream."""

    def __init__(self, client: Client, info: JobInfo, *, logs_open: bool = False, view: Optional[JobView] = None,
                 printed_metrics: bool = True):
        self.client = client
        self.view = view or JobView(info, printed_metrics=printed_metrics)
        self.follower: Optional[EventFollower] = None
        self._lock = threading.RLock()
        self.header = W.HTML()
        self.placement = W.HTML()
        self.progress = W.HTML()
        self.message = W.HTML()
        self.timeline = W.HTML()
        self.chart = W.HTML()
        self.logs = W.HTML()
        self.buttons = {
            "preempt": W.Button(description="Preempt", icon="pause", tooltip="checkpoint at the next safe point and free the devices"),
            "resume": W.Button(description="Resume", icon="play", tooltip="queue again; continues from the checkpoint"),
            "migrate": W.Button(description="Migrate", icon="exchange", tooltip="move to another node"),
            "resize": W.Button(description="Resize", icon="arrows-h", tooltip="run on this many devices (same world size)"),
            "cancel": W.Button(description="Cancel", icon="stop", button_style="danger", tooltip="stop the job for good"),
        }
        for name, button in self.buttons.items():
            button.layout = W.Layout(width="auto")
            button.add_class(f"singularity-{name}")
            button.on_click(lambda _b, name=name: self.act(name))
        self.migrate_to = W.Dropdown(options=[("any node", "")], value="", layout=W.Layout(width="130px"))
        self.resize_to = W.BoundedIntText(value=self.view.gpus, min=1, max=4096, layout=W.Layout(width="70px"))
        controls = W.HBox([self.buttons["preempt"], self.buttons["resume"], self.buttons["migrate"], self.migrate_to,
                           self.buttons["resize"], self.resize_to, self.buttons["cancel"]],
                          layout=W.Layout(flex_flow="row wrap"))
        self.log_box = W.Accordion(children=[self.logs], titles=("Logs",), selected_index=0 if logs_open else None)
        super().__init__([self.header, self.placement, self.progress, controls, self.message, self.chart,
                          self.timeline, self.log_box], layout=W.Layout(border="1px solid #d1d5db", padding="6px"))
        self.migrate_to.add_class("singularity-migrate-to")
        self.resize_to.add_class("singularity-resize-to")
        self.add_class("singularity-job")
        self.timeline.add_class("singularity-timeline")
        self.chart.add_class("singularity-chart")
        self.logs.add_class("singularity-logs")
        self._load_nodes()
        self.render()

    # ------------------------------------------------------------------ feeding
    def follow(self, follower: EventFollower) -> "JobWidget":
        self.follower = follower
        follower.add_sink(self.on_events)
        follower.add_ticker(self.on_tick)
        follower.add_done(self.on_done)
        return self

    def on_events(self, batch: list) -> None:
        with self._lock:
            if self.view.apply(batch):
                self.render()

    def on_done(self, error: Optional[str]) -> None:
        if error:
            with self._lock:
                self.say(f"stopped following the job: {error}", error=True)

    def on_tick(self) -> None:
        with self._lock:
            if self.view.state.holds_devices:
                self.progress.value = self._progress_html()

    def close(self) -> None:
        if self.follower is not None:
            self.follower.stop()
        super().close()

    # ------------------------------------------------------------------ controls
    def act(self, action: str) -> None:
        """What a button does: ask the server, say what happened; the events show the rest."""
        kwargs: dict[str, Any] = {}
        if action == "migrate":
            kwargs["node"] = self.migrate_to.value or None
        elif action == "resize":
            kwargs["gpus"] = int(self.resize_to.value)
        if action in ("preempt", "cancel", "migrate", "resize"):
            kwargs["reason"] = f"{action} button in the notebook"
        outcome = perform(self.client, self.view.id, action, **kwargs)
        with self._lock:
            if outcome.info is not None and self.view.update_info(outcome.info):
                self.render()
            self.say(outcome.message, error=not outcome.ok)

    def say(self, text: str, error: bool = False) -> None:
        color = "#dc2626" if error else "#374151"
        self.message.value = f'<span class="singularity-message" style="color:{color}">{html.escape(text)}</span>'

    def _load_nodes(self) -> None:
        try:
            names = [n.name for n in self.client.nodes()]
        except Exception:
            return
        self.migrate_to.options = [("any node", "")] + [(n, n) for n in names]

    # ------------------------------------------------------------------ drawing
    def render(self) -> None:
        v = self.view
        self.header.value = (f'<div style="display:flex;gap:10px;align-items:center">{badge(v.state)}'
                             f'<b class="singularity-name">{html.escape(v.name)}</b>'
                             f'<code class="singularity-id">{v.id}</code>'
                             f'<span style="color:#6b7280">sla {v.sla} - {v.gpus} device(s) - attempt {v.attempt}'
                             f'{" - cancelling" if v.cancel_requested and not v.finished else ""}</span></div>')
        self.placement.value = f'<span style="color:#374151">placement: {html.escape(v.placement_text())}</span>'
        self.progress.value = self._progress_html()
        for name, button in self.buttons.items():
            button.disabled = v.state not in ENABLED_IN[name]
        self.migrate_to.disabled = self.buttons["migrate"].disabled
        self.resize_to.disabled = self.buttons["resize"].disabled
        self.timeline.value = self._timeline_html()
        chart = svg(v.metrics)
        if chart != self.chart.value:
            self.chart.value = chart
        lines = list(v.logs)[-LOG_ROWS:]
        more = f"... {v.log_lines - len(lines)} earlier line(s)\n" if v.log_lines > len(lines) else ""
        self.logs.value = ('<pre style="max-height:300px;overflow:auto;margin:0;font-size:12px">'
                           + html.escape(more + "\n".join(lines)) + "</pre>")
        if v.state == JobState.FAILED and v.error:
            self.say(v.error.strip().splitlines()[-1], error=True)

    def _progress_html(self) -> str:
        text = f'<span class="singularity-progress" style="color:#374151">progress: {html.escape(self.view.progress_text())}</span>'
        info = self.view.interruptible
        if info is not None or self.view.exactness_warnings:
            color = "#374151" if info is None or info.get("interruptible") else "#b45309"
            if self.view.exactness_warnings:
                color = "#b45309"
            text += (f'<br><span class="singularity-interruptible" style="color:{color}">'
                     f'{html.escape(self.view.interruptible_text())}</span>')
        return text

    def _timeline_html(self) -> str:
        rows = list(self.view.timeline)[-TIMELINE_ROWS:]
        cells = []
        for e in rows:
            color = EVENT_COLORS.get(e.type, "#374151")
            cells.append(f'<tr><td style="color:#6b7280;padding-right:8px;white-space:nowrap">{e.clock}</td>'
                         f'<td style="color:{color};padding-right:8px;font-weight:600">{e.type.value}</td>'
                         f'<td>{html.escape(e.text)}</td></tr>')
        return ('<table style="font-size:12px;border-collapse:collapse">' + "".join(cells) + "</table>") if cells else ""

    def _repr_mimebundle_(self, **kwargs: Any) -> dict:
        bundle = super()._repr_mimebundle_(**kwargs)
        if isinstance(bundle, dict):
            bundle["text/plain"] = self.view.summary()
        return bundle
