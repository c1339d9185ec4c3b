"""Text from a request, fit for a log line."""
from __future__ import annotations


def loggable(text: str, limit: int = 200) -> str:
    """`text` with every control and non-ASCII character escaped (a percent-encoded newline in a
    URL must not forge a log line) and cut to `limit` characters."""
    return text[:limit].encode("unicode_escape").decode("ascii").replace('"', '\\"')
