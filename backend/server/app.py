"""HTTP + WebSocket layer: tornado handlers that translate the protocol into Service calls.

The routes are built relative to a prefix so the same handlers can be mounted inside a
Jupyter server (under ``/singularity``) or served standalone.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from typing import Any, Optional

import tornado.web
from tornado.log import access_log
import tornado.websocket
from pydantic import BaseModel, ValidationError

from singularity_sdk.protocol import (
    API_PREFIX,
    MAX_CODE_BYTES,
    MAX_INPUTS_BYTES,
    PROTOCOL_VERSION,
    Ack,
    AgentEvents,
    AgentHeartbeat,
    AgentLeaving,
    AgentHello,
    CreateUserRequest,
    QuotaRequest,
    JobAction,
    SubmitRequest,
    agent_message_adapter,
    describe_validation_error,
)

from .credentials import NODE_ROLE, node_of
from .edge import load_json_object
from .hub import Batch
from .service import Service, ServiceError

log = logging.getLogger("singularity.server")
#: events per frame of a batched stream's backlog (``?batch=1``)
BACKLOG_FRAME = 1000

#: Request bodies are read up to this size so that an oversize job gets a clear 413 from us
#: rather than a dropped connection from tornado.
MAX_BODY_BYTES = 2 * MAX_INPUTS_BYTES


#: Roles that may use the REST API and the users' sockets (a node credential opens only /agents/ws).
USER_ROLES = ("admin", "user")
#: What a node may be called (as AgentHello.node).
NODE_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
#: Largest integer a query parameter takes (SQLite integers are 64-bit).
MAX_QUERY_INT = 2**62


def _token_from(handler: tornado.web.RequestHandler) -> Optional[str]:
    auth = handler.request.headers.get("Authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return handler.get_query_argument("token", None)


def _dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json")


class ApiHandler(tornado.web.RequestHandler):
    """JSON in, JSON out, token checked before anything else, errors as ``{error, field}``."""

    service: Service
    user: str
    role: str

    def initialize(self, service: Service) -> None:
        self.service = service

    def check_xsrf_cookie(self) -> None:  # token auth, no cookies
        return None

    def prepare(self) -> None:
        try:
            self.user, self.role = self.service.authenticate(_token_from(self))
            if self.role not in USER_ROLES:
                raise ServiceError(403, "a node agent's credential opens only the agent channel; "
                                        "use a user token (SINGULARITY_TOKEN) for the API")
        except ServiceError as exc:
            self._fail(exc)

    def _fail(self, exc: ServiceError) -> None:
        self.set_status(exc.status)
        self.finish({"error": exc.message, "field": exc.field})

    def parse(self, model: type[BaseModel]) -> Any:
        raw = load_json_object(self.request.body or b"{}")
        try:
            return model.model_validate(raw)
        except ValidationError as exc:
            msg, field = describe_validation_error(exc)
            raise ServiceError(422, msg, field) from None

    def send(self, payload: Any, status: int = 200) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        if isinstance(payload, BaseModel):
            payload = _dump(payload)
        elif isinstance(payload, list):
            payload = [_dump(p) if isinstance(p, BaseModel) else p for p in payload]
        self.finish(json.dumps(payload))

    def _handle(self, fn, *args) -> None:
        try:
            fn(*args)
        except ServiceError as exc:
            self._fail(exc)

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        # Never the exception's text: it may name files, tokens or code. The log has it.
        reason = self._reason
        if status_code >= 500:
            reason = "internal error; the server's log has the details"
        self.finish({"error": reason, "field": None})


class HealthHandler(ApiHandler):
    def get(self) -> None:
        self.send({"ok": True, "protocol": PROTOCOL_VERSION, "user": self.user,
                   "nodes": len(self.service.links)})


class JobsHandler(ApiHandler):
    def get(self) -> None:
        states = self.get_query_arguments("state")
        self._handle(lambda: self.send(self.service.jobs(self.user, states or None)))

    def post(self) -> None:
        if len(self.request.body) > MAX_BODY_BYTES:
            return self._fail(ServiceError(
                413, f"request of {len(self.request.body) / 1e6:.1f} MB; the job's code may be at most "
                     f"{MAX_CODE_BYTES / 1e6:.1f} MB. Put data in files the job reads.", "source"))
        self._handle(lambda: self.send(self.service.submit(self.user, self.parse(SubmitRequest)), 201))


class JobHandler(ApiHandler):
    def get(self, job_id: str) -> None:
        self._handle(lambda: self.send(self.service.job(self.user, job_id)))


class JobActionHandler(ApiHandler):
    def post(self, job_id: str, action: str) -> None:
        def run() -> None:
            body = self.parse(JobAction)
            svc, reason, bound = self.service, body.reason or "", body.checkpoint_timeout
            handlers = {
                "cancel": lambda: svc.cancel(self.user, job_id, reason),
                "preempt": lambda: svc.preempt(self.user, job_id, reason, checkpoint_timeout=bound),
                "resume": lambda: svc.resume(self.user, job_id),
                "checkpoint": lambda: svc.checkpoint(self.user, job_id, reason, checkpoint_timeout=bound),
                "migrate": lambda: svc.migrate(self.user, job_id, body.node, reason, checkpoint_timeout=bound),
                "resize": lambda: svc.resize(self.user, job_id, body.gpus, reason, checkpoint_timeout=bound),
            }
            if action not in handlers:
                raise ServiceError(404, f"unknown action '{action}'; valid: {', '.join(handlers)}", "action")
            self.send(handlers[action]())
        self._handle(run)


class EventsHandler(ApiHandler):
    def get(self, job_id: str) -> None:
        def run() -> None:
            since = _int_arg(self, "since", 0)
            self.send(self.service.events(self.user, job_id, since))
        self._handle(run)


class LogsHandler(ApiHandler):
    def get(self, job_id: str) -> None:
        def run() -> None:
            text = self.service.logs(self.user, job_id)
            self.set_header("Content-Type", "text/plain; charset=utf-8")
            self.finish(text)
        self._handle(run)


class ResultHandler(ApiHandler):
    def get(self, job_id: str) -> None:
        def run() -> None:
            self.send(self.service.result(self.user, job_id))
        self._handle(run)


class NodesHandler(ApiHandler):
    def get(self) -> None:
        self.send(self.service.nodes(None if self.role == "admin" else self.user))


class NodeActionHandler(ApiHandler):
    def post(self, node: str, action: str) -> None:
        def run() -> None:
            self.parse(JobAction)
            handlers = {"drain": self.service.drain, "undrain": self.service.undrain}
            if action not in handlers:
                raise ServiceError(404, f"unknown node action '{action}'; valid: {', '.join(handlers)}", "action")
            self.send(handlers[action](self.role, node))
        self._handle(run)


class EnrollHandler(ApiHandler):
    """``POST /nodes/{name}/enroll`` with the join (or admin) token: the node's own credential."""

    def prepare(self) -> None:
        try:
            self.user, self.role = self.service.authenticate(_token_from(self))
        except ServiceError as exc:
            self._fail(exc)

    def post(self, node: str) -> None:
        def run() -> None:
            if not NODE_NAME.match(node):
                raise ServiceError(422, f"node name {node!r}: use letters, digits, '.', '_' and '-' "
                                        f"(at most 64)", "node")
            self.parse(JobAction)
            self.send({"node": node, "token": self.service.enroll(self.role, node)}, 201)
        self._handle(run)


class UsageHandler(ApiHandler):
    """``GET /usage``: device-hours per user and tier (the admin sees every user)."""

    def get(self) -> None:
        self._handle(lambda: self.send(self.service.usage(None if self.role == "admin" else self.user)))


class QuotasHandler(ApiHandler):
    """``POST /quotas`` (admin): ``{"user", "tier", "devices"}``; devices null lifts the limit."""

    def post(self) -> None:
        def run() -> None:
            req = self.parse(QuotaRequest)
            self.send(self.service.set_quota(self.role, req.user, req.tier.value, req.devices))
        self._handle(run)


class UsersHandler(ApiHandler):
    def post(self) -> None:
        def run() -> None:
            req = self.parse(CreateUserRequest)
            self.send({"user": req.user, "token": self.service.create_user(self.role, req.user)}, 201)
        self._handle(run)


def _int_arg(handler: tornado.web.RequestHandler, name: str, default: int) -> int:
    raw = handler.get_query_argument(name, None)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ServiceError(422, f"query parameter '{name}' must be an integer, not {raw!r}", name) from None
    if not 0 <= value <= MAX_QUERY_INT:
        raise ServiceError(422, f"query parameter '{name}' must be between 0 and {MAX_QUERY_INT}", name)
    return value


class AuthedSocket(tornado.websocket.WebSocketHandler):
    """WebSocket with the same token check as the REST handlers (done before the upgrade)."""

    service: Service
    user: str
    role: str

    def initialize(self, service: Service) -> None:
        self.service = service

    def check_origin(self, origin: str) -> bool:
        return True  # every socket needs a token; origin adds nothing

    async def get(self, *args: Any, **kwargs: Any) -> None:
        try:
            self.user, self.role = self.service.authenticate(_token_from(self))
            self.authorize(*args)
        except ServiceError as exc:
            self.set_status(exc.status)
            self.finish({"error": exc.message, "field": exc.field})
            return
        await super().get(*args, **kwargs)

    def authorize(self, *args: Any) -> None:
        """Raise ServiceError before the upgrade when the caller may not open this socket."""
        if self.role not in USER_ROLES:
            raise ServiceError(403, "a node agent's credential opens only the agent channel")

    def open(self, *args: Any) -> None:
        # Tornado leaves Nagle's algorithm on: a small frame written while the one before is
        # unacknowledged waits for the peer's delayed ACK (~40 ms; bench/latency.py's p99).
        self.set_nodelay(True)

    def send_json(self, payload: Any) -> None:
        self.send_text(json.dumps(payload))

    def send_batch(self, batch: Batch) -> None:
        """Events: one frame each, or, for a client that asked ``?batch=1``, one JSON array per
        batch (a chatty job's lines cost one frame per commit, not one per line)."""
        if self.get_query_argument("batch", "0") == "1":
            self.send_text(batch.array)
        else:
            for text in batch.texts:
                self.send_text(text)

    def send_text(self, text: str) -> None:
        if self.ws_connection is None or self.ws_connection.is_closing():
            return
        self.write_message(text)


class JobEventsSocket(AuthedSocket):
    """A job's events from ``since``, then live. No gap: the backlog is read and the
    subscription made in the same event-loop turn, so nothing can commit in between."""

    unsubscribe = None

    def authorize(self, job_id: str) -> None:
        super().authorize()
        self.service.job(self.user, job_id)
        self.since = _int_arg(self, "since", 0)

    def open(self, job_id: str) -> None:
        super().open(job_id)
        try:
            backlog = self.service.store.events(job_id, self.since)
        except Exception:
            log.exception("could not read the events of %s", job_id)
            self.close(1011, "internal error; the server's log has the details")
            return
        self.last = self.since
        for start in range(0, len(backlog), BACKLOG_FRAME):  # a long job's history: bounded frames
            self.send_batch(Batch(backlog[start:start + BACKLOG_FRAME]))

        def push(batch: Batch) -> None:
            if batch.events and batch.events[0].seq <= self.last:  # (not after the backlog read)
                batch = Batch([ev for ev in batch.events if ev.seq > self.last])
            self.send_batch(batch)

        self.unsubscribe = self.service.hub.subscribe_job(job_id, push)

    def send_batch(self, batch: Batch) -> None:
        if not batch.events:
            return
        self.last = batch.events[-1].seq
        super().send_batch(batch)

    def on_message(self, message: Any) -> None:
        pass  # the stream is one-way; pings are handled by the protocol layer

    def on_close(self) -> None:
        if self.unsubscribe:
            self.unsubscribe()


class UserEventsSocket(AuthedSocket):
    """Live events of all of the caller's jobs (the widget's and ``jobs -f``'s feed)."""

    unsubscribe = None

    def open(self) -> None:
        super().open()
        self.unsubscribe = self.service.hub.subscribe_user(self.user, self.send_batch)

    def on_message(self, message: Any) -> None:
        pass

    def on_close(self) -> None:
        if self.unsubscribe:
            self.unsubscribe()


class AgentSocket(AuthedSocket):
    """The node agents' channel: hello, batched events (acked after commit), heartbeats.

    The socket is opened with a node credential, which names the one node it may speak for;
    a bad message gets an error reply and is skipped, and the connection stays."""

    node: Optional[str] = None

    def authorize(self) -> None:
        if self.role != NODE_ROLE:
            raise ServiceError(403, "this socket is for node agents: connect with the node's credential "
                                    "(an agent enrolls with the join token, agent_token in server.json)")

    def send(self, message: BaseModel) -> None:  # AgentLink
        self.send_json(_dump(message))

    def on_message(self, message: Any) -> None:
        try:
            self._on_message(message)
        except ServiceError as exc:
            log.warning("bad message from agent %s: %s", self.node or self.user, exc.message)
            self.send_json({"type": "error", "error": exc.message})
        except Exception:
            log.exception("message from agent %s not applied", self.node or self.user)
            self.send_json({"type": "error", "error": "the message could not be applied; the server's log "
                                                      "has the details"})

    def _on_message(self, message: Any) -> None:
        try:  # parsed and validated in one pass (a chatty node's batches: a third of this server's CPU)
            msg = agent_message_adapter.validate_json(message)
        except ValidationError:  # say why as the REST edge does: the depth, the JSON, the field
            msg = None
        if msg is None or not isinstance(msg, AgentEvents) or any(
                isinstance(v, (dict, list)) for ev in msg.events for v in ev.data.values()):
            # the depth limit, walked only where something nests (a log line's data does not)
            raw = load_json_object(message, "the message", nul=True)
            try:
                msg = agent_message_adapter.validate_python(raw) if msg is None else msg
            except ValidationError as exc:
                raise ServiceError(422, describe_validation_error(exc)[0]) from None
        if isinstance(msg, AgentHello):
            if msg.protocol != PROTOCOL_VERSION:
                self.send_json({"type": "error", "error": f"protocol {msg.protocol} not supported; "
                                                          f"this server speaks {PROTOCOL_VERSION}"})
                self.close(4400, "protocol version")
                return
            if msg.node != node_of(self.user):
                log.warning("credential of %s said hello as node %r: refused", self.user, msg.node)
                raise ServiceError(403, f"this credential belongs to node '{node_of(self.user)}', not "
                                        f"'{msg.node}'; the hello is ignored")
            self.node = msg.node
            welcome = self.service.agent_hello(self, msg)
            self.send(welcome)
        elif self.node is None:
            self.send_json({"type": "error", "error": "send 'hello' first"})
        elif isinstance(msg, AgentEvents):
            acked = self.service.agent_events(self.node, msg.events, self.reject)
            self.send(Ack(agent_seq=acked))
        elif isinstance(msg, AgentHeartbeat):
            self.service.agent_heartbeat(self.node, msg)
        elif isinstance(msg, AgentLeaving):
            self.service.agent_leaving(self.node, msg.reason)

    def reject(self, agent_seq: int, why: str) -> None:
        """Tell the agent one of its events was skipped (it is acked all the same)."""
        self.send_json({"type": "error", "error": f"event {agent_seq} skipped: {why}"})

    def on_close(self) -> None:
        if self.node is not None:  # no close frame: the agent's process (or its machine) died
            self.service.agent_disconnected(self, dropped=self.close_code is None)


def routes(service: Service, prefix: str = "") -> list[tuple[str, type, dict]]:
    p = prefix.rstrip("/") + API_PREFIX
    kw = {"service": service}
    return [
        (rf"{p}/health", HealthHandler, kw),
        (rf"{p}/jobs", JobsHandler, kw),
        (rf"{p}/jobs/([\w-]+)", JobHandler, kw),
        (rf"{p}/jobs/([\w-]+)/events", EventsHandler, kw),
        (rf"{p}/jobs/([\w-]+)/events/ws", JobEventsSocket, kw),
        (rf"{p}/jobs/([\w-]+)/logs", LogsHandler, kw),
        (rf"{p}/jobs/([\w-]+)/result", ResultHandler, kw),
        (rf"{p}/jobs/([\w-]+)/(\w+)", JobActionHandler, kw),
        (rf"{p}/events/ws", UserEventsSocket, kw),
        (rf"{p}/nodes", NodesHandler, kw),
        (rf"{p}/nodes/([\w.-]+)/enroll", EnrollHandler, kw),
        (rf"{p}/nodes/([\w.-]+)/(\w+)", NodeActionHandler, kw),
        (rf"{p}/users", UsersHandler, kw),
        (rf"{p}/usage", UsageHandler, kw),
        (rf"{p}/quotas", QuotasHandler, kw),
        (rf"{p}/agents/ws", AgentSocket, kw),
    ]


class NotFound(tornado.web.RequestHandler):
    def prepare(self) -> None:
        self.set_status(404)
        self.finish({"error": f"no such endpoint: {self.request.method} {self.request.path}; "
                              f"the API lives under {API_PREFIX}/", "field": None})


def log_request(handler: tornado.web.RequestHandler) -> None:
    """The access log, with the path but never the query string: ``?token=`` must not reach it."""
    status = handler.get_status()
    level = access_log.info if status < 400 else access_log.warning if status < 500 else access_log.error
    level("%d %s %s (%s) %.1fms", status, handler.request.method, handler.request.path,
          handler.request.remote_ip, 1000.0 * handler.request.request_time())


def make_app(service: Service) -> tornado.web.Application:
    return tornado.web.Application(routes(service), default_handler_class=NotFound,
                                   websocket_max_message_size=64 * 1024 * 1024, log_function=log_request)


def install_schedule_coalescing(service: Service) -> None:
    """Many triggers in one event-loop turn -> one scheduling round."""
    loop = asyncio.get_running_loop()
    pending = False

    def run() -> None:
        nonlocal pending
        pending = False
        try:
            service.schedule_now()
        except Exception:
            log.exception("scheduling round failed")

    def hook() -> None:
        nonlocal pending
        if not pending:
            pending = True
            loop.call_soon(run)

    def wake_at(when: float) -> None:
        loop.call_later(max(0.0, when - time.time()) + 0.01, hook)

    service.set_schedule_hook(hook, wake_at)
