"""The jupyter-server extension: a backend for the kernels, and its API behind Jupyter's auth.

On start it connects to a configured server, or adopts / starts an embedded one (see
``embedded.py``), and exports ``SINGULARITY_HOME`` (or ``SINGULARITY_URL``/``_TOKEN``) so
kernels started by this Jupyter find it with no setup. It serves the backend's REST API and
its event WebSockets under ``/singularity/api/v1/`` to anyone Jupyter has authenticated, by
forwarding with the backend's token (the browser never sees that token). The node agents'
channel is not forwarded. On shutdown it stops the backend it started.

Configure with ``c.SingularityApp.<trait>`` or ``--SingularityApp.<trait>=...``.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, Optional

from jupyter_server.auth.decorator import authorized, ws_authenticated
from jupyter_server.base.handlers import APIHandler, JupyterHandler
from jupyter_server.base.websocket import WebSocketMixin
from jupyter_server.extension.application import ExtensionApp
from tornado import httpclient, web, websocket
from tornado.ioloop import PeriodicCallback
from traitlets import Bool, Float, Int, Unicode

from singularity_sdk.protocol import API_PREFIX

from .embedded import BackendManager

PREFIX = "/singularity"
#: Paths under /api/v1 that are never forwarded: the agents' channel needs the agent token.
BLOCKED = ("agents",)
HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "content-encoding", "server", "date"}


class SingularityApp(ExtensionApp):
    """Runs (or finds) the Singularity backend for this Jupyter server."""

    name = "jupyter_ext"
    load_other_extensions = True

    url = Unicode("", config=True, help="Use this Singularity server instead of starting one (with `token`).")
    token = Unicode("", config=True, help="Token for `url` (default: SINGULARITY_TOKEN).")
    home = Unicode("", config=True, help="SINGULARITY_HOME of the embedded backend (default: ~/.singularity).")
    nodes = Int(1, config=True, help="Local node agents the embedded backend starts.")
    devices_per_node = Int(0, config=True, help="CPU slots per local node where there is no GPU (0: the agent's default).")
    ray = Unicode("", config=True, help="Run the embedded backend's node agents on this Ray cluster ('auto' or "
                  "HOST:PORT, as `singularityctl serve --ray`) instead of local ones; needs the ray extra.")
    store = Unicode("", config=True, help="Checkpoint store URL (fsspec) for nodes that share no filesystem.")
    start_timeout = Float(60.0, config=True, help="Seconds to wait for the embedded backend to come up.")
    watch_interval = Float(5.0, config=True, help="Seconds between checks that the embedded backend is alive (0: never).")
    stop_backend = Bool(True, config=True, help="Stop the backend this server started when it shuts down.")

    manager: Optional[BackendManager] = None
    _watcher: Optional[PeriodicCallback] = None

    def initialize_settings(self) -> None:
        self.manager = BackendManager(url=self.url, token=self.token, home=self.home, nodes=self.nodes,
                                      devices_per_node=self.devices_per_node, start_timeout=self.start_timeout,
                                      log=self.log, ray=self.ray, store=self.store)
        self.manager.start()
        self.manager.export_env()
        self.settings["singularity_manager"] = self.manager

    def initialize_handlers(self) -> None:
        kw = {"manager": self.manager}
        self.handlers.extend([
            (rf"{PREFIX}/status", StatusHandler, kw),
            (rf"{PREFIX}{API_PREFIX}/((?:jobs/[\w-]+/)?events/ws)", EventsSocketProxy, kw),
            (rf"{PREFIX}{API_PREFIX}/(.*)", ApiProxyHandler, kw),
        ])

    async def _start_jupyter_server_extension(self, serverapp: Any) -> None:
        if self.watch_interval > 0 and self.manager is not None and self.manager.info.owned:
            self._watcher = PeriodicCallback(self._watch, self.watch_interval * 1000)
            self._watcher.start()

    async def _watch(self) -> None:
        if self.manager is not None:
            done = await asyncio.to_thread(self.manager.check)
            if done:
                self.log.info("Singularity backend: %s", done)

    async def stop_extension(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
        if self.manager is not None and self.stop_backend:
            await asyncio.to_thread(self.manager.stop)


class _Base(APIHandler):
    auth_resource = "singularity"

    def initialize(self, manager: BackendManager) -> None:
        self.manager = manager

    def unavailable(self) -> bool:
        info = self.manager.info
        if info.ready:
            return False
        self.set_status(503)
        self.finish(json.dumps({"error": info.error or "the Singularity backend is not running", "field": None}))
        return True


class StatusHandler(_Base):
    @web.authenticated
    @authorized
    def get(self) -> None:
        self.finish(json.dumps(self.manager.info.public()))


class ApiProxyHandler(_Base):
    """Forward one REST call to the backend with its token; answer exactly what it answered."""

    @web.authenticated
    @authorized
    async def get(self, path: str) -> None:
        await self._forward(path)

    @web.authenticated
    @authorized
    async def post(self, path: str) -> None:
        await self._forward(path)

    @web.authenticated
    @authorized
    async def delete(self, path: str) -> None:
        await self._forward(path)

    async def _forward(self, path: str) -> None:
        if path.split("/", 1)[0] in BLOCKED:
            self.set_status(404)
            self.finish(json.dumps({"error": "the node agents' channel is not served through Jupyter", "field": None}))
            return
        if self.unavailable():
            return
        info = self.manager.info
        url = f"{info.url}{API_PREFIX}/{path}" + (f"?{self.request.query}" if self.request.query else "")
        headers = {"Authorization": f"Bearer {info.token}"}
        if self.request.headers.get("Content-Type"):
            headers["Content-Type"] = self.request.headers["Content-Type"]
        body = self.request.body if self.request.method in ("POST", "PUT", "PATCH") else None
        request = httpclient.HTTPRequest(url, method=self.request.method, headers=headers, body=body,
                                         request_timeout=120, allow_nonstandard_methods=True)
        try:
            response = await httpclient.AsyncHTTPClient().fetch(request, raise_error=False)
        except OSError as exc:
            self.set_status(502)
            self.finish(json.dumps({"error": f"the Singularity backend at {info.url} does not answer: {exc}",
                                    "field": None}))
            return
        if response.code == 599:  # tornado's "no HTTP response" (connection refused, timeout)
            self.set_status(502)
            self.finish(json.dumps({"error": f"the Singularity backend at {info.url} does not answer: "
                                             f"{response.error}", "field": None}))
            return
        self.set_status(response.code)
        for name, value in response.headers.get_all():
            if name.lower() not in HOP_HEADERS and name.lower() != "content-type":
                self.set_header(name, value)
        self.finish(response.body or b"",
                    set_content_type=response.headers.get("Content-Type", "application/json"))


class EventsSocketProxy(WebSocketMixin, websocket.WebSocketHandler, JupyterHandler):
    """Relay the backend's job / user event stream to an authenticated Jupyter user."""

    auth_resource = "singularity"
    upstream: Optional[websocket.WebSocketClientConnection] = None

    def initialize(self, manager: BackendManager) -> None:
        self.manager = manager

    @ws_authenticated
    async def get(self, path: str, *args: Any, **kwargs: Any) -> None:
        info = self.manager.info
        if not info.ready:
            self.set_status(503)
            self.finish({"error": info.error or "the Singularity backend is not running", "field": None})
            return
        base = info.url.replace("http://", "ws://", 1).replace("https://", "wss://", 1)
        url = f"{base}{API_PREFIX}/{path}" + (f"?{self.request.query}" if self.request.query else "")
        request = httpclient.HTTPRequest(url, headers={"Authorization": f"Bearer {info.token}"})
        try:
            self.upstream = await websocket.websocket_connect(request, max_message_size=64 * 1024 * 1024)
        except httpclient.HTTPClientError as exc:
            self.set_status(exc.code)
            body = exc.response.body if exc.response is not None and exc.response.body else None
            self.finish(body or {"error": str(exc), "field": None})
            return
        except OSError as exc:
            self.set_status(502)
            self.finish({"error": f"the Singularity backend at {info.url} does not answer: {exc}", "field": None})
            return
        await super().get(path, *args, **kwargs)

    def open(self, *args: Any, **kwargs: Any) -> None:
        self.set_nodelay(True)  # as the backend's sockets: no ~40 ms wait for a delayed ACK
        asyncio.ensure_future(self._relay())

    async def _relay(self) -> None:
        upstream = self.upstream
        while upstream is not None:
            message = await upstream.read_message()
            if message is None:
                self.close()
                return
            try:
                await self.write_message(message)
            except websocket.WebSocketClosedError:
                upstream.close()
                return

    def on_message(self, message: Any) -> None:
        pass  # the event streams are one-way

    def on_close(self) -> None:
        if self.upstream is not None:
            self.upstream.close()
            self.upstream = None
