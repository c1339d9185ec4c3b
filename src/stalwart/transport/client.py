"""A small JSON-over-HTTP client for the controller's API (used by agents and the CLI)."""
from __future__ import annotations

import http.client
import json
import threading
import urllib.parse

from stalwart.security import auth
from stalwart.errors import StalwartError


class ControllerUnreachable(StalwartError, RuntimeError):
    """The controller did not answer (not running, wrong address, network down)."""


class ApiError(StalwartError, RuntimeError):
    """The controller answered with an error."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Client:
    """`token`: the controller's bearer token (None: $STALWART_TOKEN when set; "": none); `ca`:
    the CA file that signed an https controller's certificate (None: the system's authorities);
    `cert`, `key`: this client's certificate for a controller that verifies them (mutual TLS: the
    certificate is the credential of a request without a token), on every request and on an
    agent's channel (`agent.link` connects with `tls`); like `ca`, unused for an http controller."""

    def __init__(self, url: str, timeout: float = 10.0, token: str | None = None, ca: str | None = None,
                 cert: str | None = None, key: str | None = None):
        if "://" not in url:
            url = "http://" + url
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.token = token if token is not None else auth.client_token()
        self.ca, self.cert, self.key = ca, cert, key
        self._tls = auth.client_tls(ca, cert, key) if self.url.startswith("https://") else None
        parts = urllib.parse.urlsplit(self.url)
        self._https, self._host, self._port = parts.scheme == "https", parts.hostname or "", parts.port
        self._base = parts.path
        # one kept-alive connection per thread (an agent's sender, heartbeat and command threads
        # each have theirs): no TCP handshake per event batch, on either side
        self._local = threading.local()

    @property
    def tls(self):
        """The TLS context of an https controller (None for http)."""
        return self._tls

    def with_url(self, url: str) -> "Client":
        """The same credentials for a controller that moved."""
        return Client(url, timeout=self.timeout, token=self.token, ca=self.ca, cert=self.cert, key=self.key)

    def _conn(self, timeout: float) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            if self._https:
                conn = http.client.HTTPSConnection(self._host, self._port, timeout=timeout, context=self._tls)
            else:
                conn = http.client.HTTPConnection(self._host, self._port, timeout=timeout)
            self._local.conn = conn
        conn.timeout = timeout
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        return conn

    def close(self) -> None:
        """Close this thread's connection."""
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            conn.close()

    def request(self, method: str, path: str, body: dict | None = None,
                timeout: float | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        for attempt in (0, 1):
            conn = self._conn(timeout or self.timeout)
            reused = conn.sock is not None
            try:
                conn.request(method, self._base + path, body=data, headers=headers)
                resp = conn.getresponse()
                raw = resp.read()
                if resp.will_close:
                    self.close()
            except (http.client.HTTPException, ConnectionError, TimeoutError, OSError) as e:
                self.close()
                if reused and attempt == 0 and not isinstance(e, TimeoutError):
                    continue        # the server closed a kept-alive connection meanwhile: once more
                # HTTPException: the controller died mid-answer (IncompleteRead, RemoteDisconnected)
                raise ControllerUnreachable(f"controller at {self.url} is not reachable "
                                            f"({type(e).__name__}: {e})") from None
            if resp.status >= 400:
                try:
                    msg = json.loads(raw).get("error", resp.reason)
                except (ValueError, AttributeError):
                    msg = f"HTTP {resp.status} {resp.reason}"
                raise ApiError(resp.status, msg)
            try:
                return json.loads(raw or b"{}")
            except ValueError as e:     # a truncated JSON body: not reachable right now, never a crash
                raise ControllerUnreachable(f"controller at {self.url} is not reachable "
                                            f"(ValueError: {e})") from None
        raise AssertionError("unreachable")

    def get(self, path: str, timeout: float | None = None) -> dict:
        return self.request("GET", path, timeout=timeout)

    def post(self, path: str, body: dict | None = None, timeout: float | None = None) -> dict:
        return self.request("POST", path, body or {}, timeout=timeout)
