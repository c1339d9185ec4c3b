"""Fixtures the integration tests share."""
import pytest

from pgserver import PgServer, unavailable_reason


@pytest.fixture
def pg_url():
    """A real PostgreSQL server for the test (skipped, with the reason, where its binaries are
    missing); stopped at the end."""
    why = unavailable_reason()
    if why:
        pytest.skip(why)
    srv = PgServer()
    try:
        yield srv.start()
    finally:
        srv.stop()
