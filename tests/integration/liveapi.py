"""A controller and its HTTP API in this process, on a free loopback port, for tests that talk to
the API itself."""
from __future__ import annotations

import contextlib
from typing import Iterator

from stalwart.controller.api.server import ApiServer
from stalwart.controller.service import Controller


@contextlib.contextmanager
def live_api(db_dir, state_dir, token: str) -> Iterator[tuple[Controller, str]]:
    """(controller, base URL) of a controller on SQLite in `db_dir`; stopped at the end."""
    ctl = Controller(f"sqlite:///{db_dir}/stalwart.db", str(state_dir))
    srv = ApiServer(ctl, "127.0.0.1", 0, token=token)
    srv.start()
    try:
        yield ctl, f"http://127.0.0.1:{srv.port}"
    finally:
        srv.stop()
        ctl.close()
