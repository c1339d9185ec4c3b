"""The controller's HTTP/JSON API (agents and the CLI) and the dashboard, served by aiohttp.

Errors: a `StalwartError` is answered with its status (400 invalid request, 404 not found, 409
conflict, 503 store unavailable, 500 for the rest, which is logged) and its message; anything else
is a bug: 500, logged with its traceback.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import socket
import ssl
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

import msgspec
from aiohttp import web

from stalwart import __version__, protocol
from stalwart.analyzer.whatif import analyze
from stalwart.controller.api import models
from stalwart.controller.api.channel import Channels, FrontDoor
from stalwart.controller.api.dashboard import DashboardViews, static_file
from stalwart.controller.api.enroll import Enrollment
from stalwart.controller.api.metrics import KEEP_ENDED_S, ControllerMetrics
from stalwart.controller.api.observe import ControllerSource, Raw, current_statuses
from stalwart.controller.cluster.machines import AgentReply
from stalwart.controller.report.html import render as render_html
from stalwart.controller.service import Controller
from stalwart.controller.store.db import StoreUnavailable
from stalwart.errors import Conflict, InvalidRequest, StalwartError
from stalwart.security import auth, identity
from stalwart.security.logtext import loggable
from stalwart.spec import JobSpec

log = logging.getLogger("stalwart.api")
# an agent's beat and batch of events answered over HTTP (the channel answers with protocol.Ack)
BEAT_REPLY = {AgentReply.OK: {"ok": True}, AgentReply.REREGISTER: {"reregister": True},
              AgentReply.UNKNOWN: {"reregister": True}}
EVENTS_REPLY = {AgentReply.OK: {"ok": True}, AgentReply.REREGISTER: {"ok": True, "reregister": True},
                AgentReply.UNKNOWN: {"ok": False, "reregister": True, "taken": False}}

def _int_query(q: dict, name: str) -> int:
    """A query parameter's integer, within its bounds (`api_models.QUERY`)."""
    schema = models.QUERY[name]
    low, high = int(schema["minimum"]), int(schema["maximum"])
    raw = q.get(name, [str(schema["default"])])[0]
    if len(raw) > 20:
        raise InvalidRequest(f"{name} must be an integer from {low} to {high}")
    try:
        value = int(raw)
    except ValueError:
        raise InvalidRequest(f"{name} must be an integer") from None
    if not low <= value <= high:
        raise InvalidRequest(f"{name} must be an integer from {low} to {high}")
    return value


class Api:
    """Route handlers: each takes (controller, path args, query, body) and returns JSON or HTML."""

    def __init__(self, ctl: Controller):
        self.ctl = ctl
        source = ControllerSource(ctl)
        self.views = DashboardViews(source)
        self.prom = ControllerMetrics(lambda: current_statuses(source, KEEP_ENDED_S), source.machines, source.ping)
        self._openapi = models.openapi(models.ROUTES, __version__)
        self.enrollment = Enrollment(ctl.store, ctl.secret)
        self._submit_lock = threading.Lock()

    def agent_enroll(self, m, q, body, ident: identity.Identity | None = None):
        if ident is None:
            raise InvalidRequest("enrolling takes a join token (this controller checks no credentials)")
        return self.enrollment.enroll(m, ident)

    def join_token(self, q, body: models.MakeJoinToken):
        return {"token": identity.join_token(self.ctl.secret, body.machine, body.ttl_s),
                "machine": body.machine, "ttl_s": body.ttl_s}

    def agent_register(self, m, q, body: protocol.Registration):
        return self.ctl.register(m, body)

    def agent_heartbeat(self, m, q, body: models.Heartbeat):
        return dict(BEAT_REPLY[self.ctl.heartbeat(m)])

    def agent_events(self, m, q, body: models.AgentEvents):
        return dict(EVENTS_REPLY[self.ctl.agent_events(m, body.events)])

    async def agent_commands(self, m, q, body):
        try:
            wait = float(q.get("wait", ["0"])[0][:32])
        except ValueError:
            raise InvalidRequest("wait must be a number of seconds") from None
        if not (math.isfinite(wait) and 0 <= wait <= models.MAX_WAIT_S):
            raise InvalidRequest(f"wait must be a number of seconds from 0 to {models.MAX_WAIT_S:g}")
        return {"commands": await self.ctl.commands(m, wait)}

    def agent_channel(self, m, q, body):
        # (an upgrade request is served by ApiServer._handle before it gets here)
        raise InvalidRequest("an agent's channel is a WebSocket: send the upgrade request "
                             "(Upgrade: websocket, Connection: Upgrade, Sec-WebSocket-Key, -Version: 13)")

    def job_submit(self, q, body: models.SubmitJob):
        if body.idempotency_key is None:
            return {"job": self.ctl.submit(body.spec)}
        key = f"submit:{body.idempotency_key}"
        with self._submit_lock:           # (the same key twice at once: one job)
            made = self.ctl.store.get_meta(key)
            if made is not None:
                return {"job": int(made), "repeated": True}
            job = self.ctl.submit(body.spec)
            self.ctl.store.set_meta(key, str(job))
        return {"job": job}

    def job_status(self, job, q, body):
        return self.ctl.status(self.ctl.resolve_job(job))

    def job_live(self, job, q, body):
        return self.ctl.live_status(self.ctl.resolve_job(job))

    def job_inject(self, job, q, body: models.InjectChaos):
        return self.ctl.inject(self.ctl.resolve_job(job, acting=True), body.chaos)

    def job_cancel(self, job, q, body: models.CancelJob):
        self.ctl.cancel(self.ctl.resolve_job(job, acting=True), body.reason)
        return {"ok": True}

    def job_update(self, job, q, body: models.UpdateCode):
        return self.ctl.register_version(self.ctl.resolve_job(job, acting=True), body.code, body.mode, body.window_s)

    def job_versions(self, job, q, body):
        return {"versions": self.ctl.list_versions(self.ctl.resolve_job(job))}

    def machines(self, q, body):
        return {"machines": self.ctl.machines()}

    def health(self, q, body):
        # 503 while writes to the store fail or hang (a liveness probe sees the outage); a read
        # that succeeds meanwhile does not clear it
        why = self.ctl.store.unavailable()
        if why is not None:
            raise StoreUnavailable(why)
        return {"ok": True}

    def openapi(self, q, body):
        return self._openapi

    # -- the operator's view (controller/api/dashboard.py, controller/api/metrics.py): read-only --------
    def dashboard(self, q, body):
        return Raw(*self.views.page())

    def static(self, name, q, body):
        return Raw(*static_file(name))

    def metrics(self, q, body):
        return Raw(*self.prom.exposition())

    def job_dashboard(self, job, q, body):
        return self.views.overview(job)

    def job_series(self, job, q, body):
        return self.views.series(job, _int_query(q, "since"), _int_query(q, "points"))

    def job_incident(self, job, inc, q, body):
        try:
            inc_id = int(inc)
        except ValueError:
            raise InvalidRequest("an incident id is a number") from None
        return self.views.incident(job, inc_id)

    def job_whatif(self, job, q, body):
        job_id = self.ctl.resolve_job(job)
        microbatches = _int_query(q, "microbatches")
        row = self.ctl.store.job(job_id)
        assert row is not None              # (resolve_job found it)
        records = [e["data"] for e in self.ctl.store.events(job_id, kinds=["rank_times"])]
        try:
            return {"job_id": job_id, **analyze(records, JobSpec.from_dict(row["spec"]).topology(), microbatches)}
        except ValueError as e:         # no step with every rank's compute time (yet)
            raise Conflict(str(e)) from None

    def job_report_html(self, job, q, body):
        return render_html(self.ctl.status(self.ctl.resolve_job(job)), self.views.series(job, 0, 200))


# Handlers cheap enough to run on the event loop itself: the controller's lock and a queue post,
# no I/O (heartbeats and event batches are 9 in 10 of all requests at scale). Everything else
# (store reads and writes, reports) runs on a bounded thread pool, off the loop.
ON_LOOP = frozenset({"agent_heartbeat", "agent_events", "health"})
API_THREADS = 16
LISTEN_BACKLOG = 4096       # a burst of agents (a new cluster, a restarted controller) must not
                            # overflow it: a dropped SYN is retried after 1, 3, 7 s


# Answers to agents' beats and batches are a handful of small constant bodies: encoded once.
_CONSTANT_REPLIES: dict[tuple, bytes] = {}


def _encode(out) -> tuple[bytes, str]:
    if isinstance(out, Raw):
        return out
    if isinstance(out, str):
        return out.encode(), "text/html; charset=utf-8"
    if type(out) is dict and len(out) <= 2 and all(type(v) is bool for v in out.values()):
        key = tuple(out.items())
        data = _CONSTANT_REPLIES.get(key)
        if data is None:
            data = _CONSTANT_REPLIES[key] = json.dumps(out).encode()
        return data, "application/json"
    return json.dumps(out).encode(), "application/json"


def new_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop where it is installed (Linux, macOS: about half the CPU of asyncio's
    own per request, which decides how many agents one controller core holds), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


CERT_HINT = " or a client certificate the controller's --tls-client-ca signed"


class ApiServer:
    """The API on aiohttp: one event loop in its own thread holds every connection (agents' long
    polls included) with no thread per connection; HTTP/1.1 keep-alive; optional TLS.

    `token`: the bearer token every non-public route needs (None: no check, for tests that serve
    a synthetic state in-process). `tls`: serve HTTPS; when it verifies client certificates
    (`auth.server_tls(client_ca=...)`), a request without a token is identified by its
    connection's certificate (`identity.from_request`)."""

    def __init__(self, ctl: Controller, host: str, port: int, token: str | None = None,
                 tls: ssl.SSLContext | None = None):
        self.ctl, self.token, self.tls = ctl, token, tls
        self.mtls = tls is not None and tls.verify_mode != ssl.CERT_NONE      # (client certificates)
        ctl.verify_identities = token is not None
        self.api = Api(ctl)
        self._handlers = {r.handler: (getattr(self.api, r.handler),
                                      asyncio.iscoroutinefunction(getattr(self.api, r.handler)))
                          for r in models.ROUTES}
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)
        self.port = self.sock.getsockname()[1]
        self.pool = ThreadPoolExecutor(max_workers=API_THREADS, thread_name_prefix="api")
        self.channels = Channels(ctl, self.pool, token, models.MAX_BODY, self.api.prom.observe_request)
        self.loop = new_loop()
        self.thread = threading.Thread(target=self._serve, name="api", daemon=True)
        self._ready = threading.Event()
        self._failed: BaseException | None = None

    def _identify(self, header: str | None, peercert: dict | None) -> tuple[identity.Identity | None, str]:
        return identity.from_request(header, peercert, self.token, self.ctl.secret)

    def start(self) -> None:
        # the socket listens already (agents' connections wait in its backlog): taken-over jobs
        # start reconciling before the first request is read, so no re-registration reaches a
        # job before it knows it is being taken over
        self.ctl.serving()
        self.thread.start()
        self._ready.wait(30)
        if self._failed is not None or not self._ready.is_set():
            raise RuntimeError(f"the API did not start: {self._failed or 'timeout'}")

    def stop(self) -> None:
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.sock.close()

    # -- the loop ---------------------------------------------------------------------------------
    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.set_exception_handler(self._loop_error)
        async def server() -> web.Server:      # (made on its running loop)
            # aiohttp's low-level server: every request goes to one handler that routes it itself
            # (models.ROUTES), without an Application's router, URL objects and middleware chain
            return web.Server(self._handle, request_factory=self._make_request, access_log=None)

        try:
            # at stop, requests in flight (agents' long polls) get a second, not aiohttp's 60
            runner = web.ServerRunner(self.loop.run_until_complete(server()), handle_signals=False,
                                      shutdown_timeout=1.0)
            self.loop.run_until_complete(runner.setup())
            http = runner.server
            assert http is not None
            # every connection starts at the front door: agents' channels are served there
            # (controller/api/channel.py), any other request goes on to aiohttp
            listening = self.loop.run_until_complete(self.loop.create_server(
                lambda: FrontDoor(http, self.channels), sock=self.sock, ssl=self.tls, backlog=LISTEN_BACKLOG))
        except BaseException as e:       # (reported by start)
            self._failed = e
            self._ready.set()
            return
        self._ready.set()
        try:
            self.loop.run_forever()
        finally:
            listening.close()
            self.channels.close_all()
            self.loop.run_until_complete(runner.cleanup())
            self.loop.close()

    def _make_request(self, message, payload, protocol, writer, task) -> web.BaseRequest:
        return web.BaseRequest(message, payload, protocol, writer, task, self.loop,
                               client_max_size=models.MAX_BODY)

    @staticmethod
    def _loop_error(loop, context) -> None:
        exc = context.get("exception")
        if isinstance(exc, (ssl.SSLError, ConnectionError, TimeoutError)):
            # a TLS handshake that failed (plain HTTP on the HTTPS port, an untrusted client) or a
            # peer that went away: one line, not a traceback
            log.warning("connection dropped: %s", exc)
            return
        loop.default_exception_handler(context)

    # -- one request ------------------------------------------------------------------------------
    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        t0, method, path = time.perf_counter(), request.method, request.path
        route_name = "unmatched"

        def reply(code: int, out, headers: dict[str, str] | None = None, close: bool = False) -> web.Response:
            data, ctype = _encode(out)
            resp = web.Response(status=code, body=data, headers={"Content-Type": ctype, **(headers or {})})
            if close:
                resp.force_close()
            # observed before the body leaves: a client that got its answer finds its request counted
            self.api.prom.observe_request(route_name, method, code, time.perf_counter() - t0)
            return resp

        ident = None
        if self.token is not None and not auth.is_public(path):
            ident, why = self._identify(request.headers.get("Authorization"),
                                        request.get_extra_info("peercert") if self.mtls else None)
            if ident is None:      # before the body is read: nothing of the request is looked at
                log.warning("refused %s %s from %s: %s", method, loggable(path), request.remote, why)
                return reply(401, {"error": f"unauthorized ({why}): give the controller's token "
                                            f"(--token-file or ${auth.TOKEN_ENV}){CERT_HINT if self.mtls else ''}"},
                             {"WWW-Authenticate": 'Bearer realm="stalwart"'}, close=True)
            machine = identity.agent_machine(path)        # (request.path is decoded already)
            denied = identity.permits(ident, method, path, machine)
            if denied is not None:
                log.warning("refused %s %s from %s: %s", method, loggable(path), request.remote, denied)
                return reply(403, {"error": f"forbidden: {denied}"}, close=True)
            if ident.scope is identity.Scope.AGENT and machine is not None:
                self.ctl.verified.add(machine)
        if (request.content_length or 0) > models.MAX_BODY:
            return reply(413, {"error": f"request body over {models.MAX_BODY} bytes"}, close=True)
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:          # a chunked body that grew too big
            return reply(413, {"error": f"request body over {models.MAX_BODY} bytes"}, close=True)
        qs = request.query_string
        query = urllib.parse.parse_qs(qs) if qs else {}
        for route in models.ROUTES:
            m = route.pattern.match(path)
            if not (m and route.method == method):
                continue
            route_name = route.handler
            try:
                body = models.decode(route, raw)
            except (msgspec.ValidationError, msgspec.DecodeError) as e:
                return reply(400, {"error": f"invalid request body: {e}"})
            fn, is_async = self._handlers[route.handler]
            args = (*m.groups(), query, body) if route.handler != "agent_enroll" else \
                (m.group(1), query, body, ident)
            try:
                if is_async:
                    out = await fn(*args)
                elif route.handler in ON_LOOP:
                    out = fn(*args)
                else:
                    out = await asyncio.get_running_loop().run_in_executor(self.pool, lambda: fn(*args))
            except StalwartError as e:
                if e.status == 500:     # (a lease lost, a schema mismatch; 503, the store away, the probe says)
                    log.error("%s %s failed: %s: %s", method, loggable(path), type(e).__name__, e)
                return reply(e.status, {"error": str(e).strip("'\"")})
            except Exception as e:
                log.exception("%s %s failed", method, loggable(path))
                return reply(500, {"error": f"internal error: {e}"})
            return reply(200, out)
        if identity.agent_machine(path) is not None and \
                not models.MACHINE_ID_RE.match(identity.agent_machine(path) or ""):
            return reply(400, {"error": protocol.MACHINE_ID_RULE})
        return reply(404, {"error": f"no route {method} {loggable(path, 100)}"})
