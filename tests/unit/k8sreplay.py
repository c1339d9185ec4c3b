"""Replays recorded Kubernetes API exchanges on a local HTTP server: each request the client makes
must be the next one recorded (method, path, query, content type, body), and gets the recorded
answer. The official client talks to it over real HTTP, through its own REST layer.

The exchanges (`k8s_api/*.json`) follow the Kubernetes API reference (v1 Node, Pod, Status
objects); they were not captured from a live cluster, none can run where these tests run."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

HERE = Path(__file__).parent / "k8s_api"


def load(name: str) -> list[dict]:
    return json.loads((HERE / name).read_text())


def contains(have, want) -> bool:
    """`want` is `have` or, for mappings, a part of it (recursively; lists item by item)."""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(k in have and contains(have[k], v) for k, v in want.items())
    if isinstance(want, list):
        return isinstance(have, list) and len(have) == len(want) and all(map(contains, have, want))
    return have == want


class ReplayServer:
    def __init__(self, exchanges: list[dict]):
        self.expected = list(exchanges)
        self.seen: list[dict] = []
        self.errors: list[str] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def _any(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n) if n else b""
                owner._answer(self, raw)

            do_GET = do_POST = do_PATCH = do_DELETE = do_PUT = _any

            def log_message(self, *a) -> None:
                pass

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}"
        self._lock = threading.Lock()

    def _answer(self, h: BaseHTTPRequestHandler, raw: bytes) -> None:
        parts = urlsplit(h.path)
        got = {"method": h.command, "path": parts.path, "query": dict(parse_qsl(parts.query)),
               "content_type": h.headers.get("Content-Type"), "body": json.loads(raw) if raw else None}
        with self._lock:
            self.seen.append(got)
            want = self.expected.pop(0) if self.expected else None
        status, body = 500, {"kind": "Status", "status": "Failure", "message": "unexpected request"}
        if want is None:
            self.errors.append(f"unexpected request {got['method']} {got['path']}")
        else:
            req = want["request"]
            problems = [k for k in ("method", "path", "query", "content_type")
                        if k in req and req[k] != got[k]]
            if "body" in req and not contains(got["body"], req["body"]):
                problems.append("body")
            if problems:
                self.errors.append(f"request {len(self.seen)}: {', '.join(problems)} differ: got {got}, "
                                   f"recorded {req}")
            else:
                status, body = want["response"]["status"], want["response"]["body"]
        data = json.dumps(body).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def api_client(self):
        from kubernetes import client
        return client.ApiClient(client.Configuration(host=self.url))

    def __enter__(self) -> "ReplayServer":
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.srv.shutdown()
        self.srv.server_close()

    def check(self) -> None:
        assert not self.errors, self.errors
        assert not self.expected, f"recorded requests never made: {self.expected}"
