"""A small JSON-over-HTTP client for the controller's API (used by agents and the CLI)."""
from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request

from stalwart import auth


class ControllerUnreachable(RuntimeError):
    """The controller did not answer (not running, wrong address, network down)."""


class ApiError(RuntimeError):
    """The controller answered with an error."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Client:
    """`token`: the controller's bearer token (None: $STALWART_TOKEN when set); `ca`: the CA file
    that signed an https controller's certificate (None: the system's authorities)."""

    def __init__(self, url: str, timeout: float = 10.0, token: str | None = None, ca: str | None = None):
        if "://" not in url:
            url = "http://" + url
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.token = token if token is not None else auth.client_token()
        self.ca = ca
        self._tls = auth.client_tls(ca) if self.url.startswith("https://") else None

    def with_url(self, url: str) -> "Client":
        """The same credentials for a controller that moved."""
        return Client(url, timeout=self.timeout, token=self.token, ca=self.ca)

    def request(self, method: str, path: str, body: dict | None = None,
                timeout: float | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout, context=self._tls) as resp:
                return json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as e:
            try:
                msg = json.loads(e.read()).get("error", str(e))
            except ValueError:
                msg = str(e)
            raise ApiError(e.code, msg) from None
        except (urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError, OSError,
                ValueError) as e:
            # HTTPException: the controller died mid-answer (IncompleteRead, RemoteDisconnected);
            # ValueError: a truncated JSON body. Both mean "not reachable right now", never a crash.
            reason = getattr(e, "reason", None) or f"{type(e).__name__}: {e}"
            raise ControllerUnreachable(f"controller at {self.url} is not reachable ({reason})") from None

    def get(self, path: str, timeout: float | None = None) -> dict:
        return self.request("GET", path, timeout=timeout)

    def post(self, path: str, body: dict | None = None, timeout: float | None = None) -> dict:
        return self.request("POST", path, body or {}, timeout=timeout)
