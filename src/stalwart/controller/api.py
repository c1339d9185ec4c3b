"""The controller's HTTP/JSON API (agents and the CLI) and a small dashboard page.

Errors: a `StalwartError` is answered with its status (400 invalid request, 404 not found, 409
conflict) and its message; anything else is a bug: 500, logged with its traceback.
"""
from __future__ import annotations

import json
import logging
import ssl
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgspec

from stalwart import __version__, auth, protocol
from stalwart.controller import api_models as models
from stalwart.controller.dashboard import DashboardViews, static_file
from stalwart.controller.metrics import ControllerMetrics
from stalwart.controller.observe import ControllerSource, Raw, newest_status
from stalwart.controller.service import Controller
from stalwart.errors import InvalidRequest, StalwartError
from stalwart.report_html import render as render_html

log = logging.getLogger("stalwart.api")

def _int_query(q: dict, name: str, default: int) -> int:
    try:
        value = int(q.get(name, [str(default)])[0])
    except ValueError:
        raise InvalidRequest(f"{name} must be an integer") from None
    if value < 0:
        raise InvalidRequest(f"{name} must be >= 0")
    return value


class Api:
    """Route handlers: each takes (controller, path args, query, body) and returns JSON or HTML."""

    def __init__(self, ctl: Controller):
        self.ctl = ctl
        source = ControllerSource(ctl)
        self.views = DashboardViews(source)
        self.prom = ControllerMetrics(lambda: newest_status(source), source.machines)
        self._openapi = models.openapi(models.ROUTES, __version__)

    def agent_register(self, m, q, body: protocol.Registration):
        return self.ctl.register(m, body)

    def agent_heartbeat(self, m, q, body: models.Heartbeat):
        return self.ctl.heartbeat(m)

    def agent_events(self, m, q, body: models.AgentEvents):
        self.ctl.agent_events(m, body.events)
        return {"ok": True}

    def agent_commands(self, m, q, body):
        try:
            wait = float(q.get("wait", ["0"])[0])
        except ValueError:
            raise InvalidRequest("wait must be a number of seconds") from None
        return {"commands": self.ctl.commands(m, wait)}

    def job_submit(self, q, body: models.SubmitJob):
        return {"job": self.ctl.submit(body.spec)}

    def job_status(self, job, q, body):
        return self.ctl.status(self.ctl.resolve_job(job))

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
        return {"ok": True}

    def openapi(self, q, body):
        return self._openapi

    # -- the operator's view (controller/dashboard.py, controller/metrics.py): read-only --------
    def dashboard(self, q, body):
        return Raw(*self.views.page())

    def static(self, name, q, body):
        return Raw(*static_file(name))

    def metrics(self, q, body):
        return Raw(*self.prom.exposition())

    def job_dashboard(self, job, q, body):
        return self.views.overview(job)

    def job_series(self, job, q, body):
        return self.views.series(job, _int_query(q, "since", 0), _int_query(q, "points", 120))

    def job_incident(self, job, inc, q, body):
        return self.views.incident(job, int(inc))

    def job_report_html(self, job, q, body):
        return render_html(self.ctl.status(self.ctl.resolve_job(job)), self.views.series(job, 0, 200))


def make_handler(api: Api, token: str | None = None):
    """`token`: the bearer token every non-public route needs (None: no check, for tests that
    serve a synthetic state in-process)."""
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # quiet: agents poll constantly
            log.debug(fmt, *args)

        def _dispatch(self, method: str) -> None:
            self._t0, self._route = time.perf_counter(), "unmatched"   # request latency, by route
            url = urllib.parse.urlparse(self.path)
            if token is not None and not auth.is_public(url.path):
                ok, why = auth.bearer_ok(self.headers.get("Authorization"), token)
                if not ok:      # before the body is read: nothing of the request is looked at
                    log.warning("refused %s %s from %s: %s", method, url.path, self.client_address[0], why)
                    self.close_connection = True
                    return self._reply(401, {"error": f"unauthorized ({why}): give the controller's token "
                                                      f"(--token-file or ${auth.TOKEN_ENV})"},
                                       {"WWW-Authenticate": 'Bearer realm="stalwart"'})
            query = urllib.parse.parse_qs(url.query)
            try:
                n = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                n = -1
            if n < 0 or n > models.MAX_BODY:
                self.close_connection = True
                return self._reply(413 if n > 0 else 400,
                                   {"error": f"request body over {models.MAX_BODY} bytes" if n > 0
                                    else "bad Content-Length"})
            raw = self.rfile.read(n) if n else b""
            for route in models.ROUTES:
                m = route.pattern.match(url.path)
                if m and route.method == method:
                    self._route = route.handler
                    try:
                        body = models.decode(route, raw)
                    except (msgspec.ValidationError, msgspec.DecodeError) as e:
                        return self._reply(400, {"error": f"invalid request body: {e}"})
                    try:
                        out = getattr(api, route.handler)(*m.groups(), query, body)
                    except StalwartError as e:
                        return self._reply(e.status, {"error": str(e).strip("'\"")})
                    except Exception as e:
                        log.exception("%s %s failed", method, url.path)
                        return self._reply(500, {"error": f"internal error: {e}"})
                    return self._reply(200, out)
            self._reply(404, {"error": f"no route {method} {url.path}"})

        def _reply(self, code: int, out, headers: dict[str, str] | None = None) -> None:
            if isinstance(out, Raw):
                data, ctype = out
            elif isinstance(out, str):
                data, ctype = out.encode(), "text/html; charset=utf-8"
            else:
                data, ctype = json.dumps(out).encode(), "application/json"
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            # observed before the body leaves: a client that got its answer finds its request counted
            api.prom.observe_request(self._route, self.command, code, time.perf_counter() - self._t0)
            self.wfile.write(data)

        def do_GET(self):
            self._dispatch("GET")

        def do_POST(self):
            self._dispatch("POST")

    return Handler


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, (ssl.SSLError, ConnectionError, TimeoutError)):
            # a TLS handshake that failed (plain HTTP on the HTTPS port, an untrusted client) or a
            # peer that went away: one line, not a traceback
            log.warning("connection from %s dropped: %s", client_address[0], exc)
            return
        super().handle_error(request, client_address)


class ApiServer:
    """The API on `host:port`; with `token`, every non-public route needs it; with `tls` (a server
    SSLContext), HTTPS (the handshake runs in the request's thread, never in the accept loop)."""

    def __init__(self, ctl: Controller, host: str, port: int, token: str | None = None,
                 tls: ssl.SSLContext | None = None):
        self.ctl = ctl
        self.httpd = _Server((host, port), make_handler(Api(ctl), token))
        if tls is not None:
            self.httpd.socket = tls.wrap_socket(self.httpd.socket, server_side=True,
                                                do_handshake_on_connect=False)
        self.port = self.httpd.server_address[1]
        # a short poll interval: shutdown() waits for the loop to look (0.5 s by default)
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                       name="api", daemon=True)

    def start(self) -> None:
        # the socket listens already (agents' connections wait in its backlog): taken-over jobs
        # start reconciling before the first request is read, so no re-registration reaches a
        # job before it knows it is being taken over
        self.ctl.serving()
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
