"""stalwart's errors: one base, and the few kinds an API answer distinguishes.

`InvalidRequest` (a caller's mistake, HTTP 400), `NotFound` (404) and `Conflict` (409, the request
is valid but the state forbids it now). Anything else raised while handling a request is a bug:
the API answers 500 and logs it, never 400.
"""
from __future__ import annotations


class StalwartError(Exception):
    """Base of every error stalwart raises on purpose."""

    status = 500


class InvalidRequest(StalwartError, ValueError):
    """The request (a job spec, a chaos text, an argument) is wrong; the message says why."""

    status = 400


class NotFound(StalwartError, LookupError):
    """The job, incident or machine named does not exist."""

    status = 404


class Conflict(StalwartError):
    """Valid, but not now (the job is not running, hot update is off for it, ...)."""

    status = 409


class UserError(StalwartError):
    """A mistake of the user's at the command line: printed as one line, exit code 2."""

    status = 400
