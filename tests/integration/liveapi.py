"""A controller and its HTTP API in this process, on a free loopback port, for tests that talk to
the API itself."""
from __future__ import annotations

import contextlib
import ssl
from typing import Iterator

from stalwart.controller.api.server import ApiServer
from stalwart.controller.service import Controller


@contextlib.contextmanager
def live_api(db_dir, state_dir, token: str, tls: ssl.SSLContext | None = None) -> Iterator[tuple[Controller, str]]:
    """(controller, base URL) of a controller on SQLite in `db_dir` (HTTPS with `tls`); stopped
    at the end."""
    ctl = Controller(f"sqlite:///{db_dir}/stalwart.db", str(state_dir))
    srv = ApiServer(ctl, "127.0.0.1", 0, token=token, tls=tls)
    srv.start()
    try:
        yield ctl, f"{'https' if tls else 'http'}://127.0.0.1:{srv.port}"
    finally:
        srv.stop()
        ctl.close()
