"""The controller's HTTP/JSON API (agents and the CLI) and a small dashboard page."""
from __future__ import annotations

import json
import logging
import re
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from stalwart.chaos.catalogue import ChaosError
from stalwart.controller.report import render_html
from stalwart.controller.service import Controller

log = logging.getLogger("stalwart.api")

ROUTES: list[tuple[str, re.Pattern, str]] = [
    ("POST", re.compile(r"^/api/agents/([^/]+)/register$"), "agent_register"),
    ("POST", re.compile(r"^/api/agents/([^/]+)/heartbeat$"), "agent_heartbeat"),
    ("POST", re.compile(r"^/api/agents/([^/]+)/events$"), "agent_events"),
    ("GET", re.compile(r"^/api/agents/([^/]+)/commands$"), "agent_commands"),
    ("POST", re.compile(r"^/api/jobs$"), "job_submit"),
    ("GET", re.compile(r"^/api/jobs/([^/]+)$"), "job_status"),
    ("GET", re.compile(r"^/api/jobs/([^/]+)/report$"), "job_status"),
    ("POST", re.compile(r"^/api/jobs/([^/]+)/inject$"), "job_inject"),
    ("POST", re.compile(r"^/api/jobs/([^/]+)/cancel$"), "job_cancel"),
    ("POST", re.compile(r"^/api/jobs/([^/]+)/versions$"), "job_update"),
    ("GET", re.compile(r"^/api/jobs/([^/]+)/versions$"), "job_versions"),
    ("GET", re.compile(r"^/api/machines$"), "machines"),
    ("GET", re.compile(r"^/api/health$"), "health"),
    ("GET", re.compile(r"^/$"), "dashboard"),
]


class Api:
    """Route handlers: each takes (controller, path args, query, body) and returns JSON or HTML."""

    def __init__(self, ctl: Controller):
        self.ctl = ctl

    def agent_register(self, m, q, body):
        return self.ctl.register(m, body)

    def agent_heartbeat(self, m, q, body):
        return self.ctl.heartbeat(m, body)

    def agent_events(self, m, q, body):
        self.ctl.agent_events(m, body.get("events", []))
        return {"ok": True}

    def agent_commands(self, m, q, body):
        return {"commands": self.ctl.commands(m, float(q.get("wait", ["0"])[0]))}

    def job_submit(self, q, body):
        return {"job": self.ctl.submit(body.get("spec", body))}

    def job_status(self, job, q, body):
        return self.ctl.status(self.ctl.resolve_job(job))

    def job_inject(self, job, q, body):
        return self.ctl.inject(self.ctl.resolve_job(job), body["chaos"])

    def job_cancel(self, job, q, body):
        self.ctl.cancel(self.ctl.resolve_job(job), body.get("reason", "cancelled by the user"))
        return {"ok": True}

    def job_update(self, job, q, body):
        return self.ctl.register_version(self.ctl.resolve_job(job), body["code"], body.get("mode", "lazy"),
                                         body.get("window_s"))

    def job_versions(self, job, q, body):
        return {"versions": self.ctl.versions(self.ctl.resolve_job(job))}

    def machines(self, q, body):
        return {"machines": self.ctl.machines()}

    def health(self, q, body):
        return {"ok": True}

    def dashboard(self, q, body):
        try:
            return render_html(self.ctl.status(self.ctl.resolve_job("latest")))
        except LookupError:
            return "<html><body><h1>stalwart</h1><p>no job yet</p></body></html>"


def make_handler(api: Api):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # quiet: agents poll constantly
            log.debug(fmt, *args)

        def _dispatch(self, method: str) -> None:
            url = urllib.parse.urlparse(self.path)
            query = urllib.parse.parse_qs(url.query)
            body = {}
            n = int(self.headers.get("Content-Length") or 0)
            if n:
                try:
                    body = json.loads(self.rfile.read(n))
                except ValueError:
                    return self._reply(400, {"error": "request body is not JSON"})
            for meth, pat, name in ROUTES:
                m = pat.match(url.path)
                if m and meth == method:
                    try:
                        out = getattr(api, name)(*m.groups(), query, body)
                    except LookupError as e:
                        return self._reply(404, {"error": str(e).strip("'\"")})
                    except (ValueError, ChaosError, KeyError, TypeError) as e:
                        return self._reply(400, {"error": str(e).strip("'\"")})
                    except Exception as e:
                        log.exception("%s %s failed", method, url.path)
                        return self._reply(500, {"error": f"internal error: {e}"})
                    return self._reply(200, out)
            self._reply(404, {"error": f"no route {method} {url.path}"})

        def _reply(self, code: int, out) -> None:
            if isinstance(out, str):
                data, ctype = out.encode(), "text/html; charset=utf-8"
            else:
                data, ctype = json.dumps(out).encode(), "application/json"
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._dispatch("GET")

        def do_POST(self):
            self._dispatch("POST")

    return Handler


class ApiServer:
    def __init__(self, ctl: Controller, host: str, port: int):
        self.httpd = ThreadingHTTPServer((host, port), make_handler(Api(ctl)))
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        # a short poll interval: shutdown() waits for the loop to look (0.5 s by default)
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                       name="api", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
