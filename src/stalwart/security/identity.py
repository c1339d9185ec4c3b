"""Who is calling the controller: scoped credentials, one identity per machine.

Four kinds of bearer token, each good for what its holder needs and nothing more:

| scope     | token                                   | may                                                |
| --------- | --------------------------------------- | -------------------------------------------------- |
| operator  | `<state-dir>/token` (random)            | every route                                        |
| reader    | `<state-dir>/reader.token` (``sr1.``)   | GET routes that are not an agent's: status, series, |
|           |                                         | machines, `/metrics` (Prometheus, the dashboard)   |
| agent     | a machine's credential (``sm1.``)       | its own machine's agent routes and channel, only   |
| join      | a join token (``sj1.``)                 | `POST /api/agents/{machine}/enroll`, once          |

A machine enrolls with a join token (made by the operator, `POST /api/join-tokens` or on the
controller's host `stalwart join-token`; bound to one machine id or to any, valid for a while,
usable once) and receives its credential, which names its machine id: the controller refuses a
credential on another machine's routes, so an agent cannot speak for another machine, and a
machine id that enrolled once cannot be enrolled again with another join token. Workers (the
user's training processes) hold none of these: the agent keeps its credential in a 0600 file of
its work directory, never in the environment it gives workers.

A client certificate verified against the controller's `--tls-client-ca` (mutual TLS) is a
credential of the same scopes, named in the certificate (`from_certificate`): a URI SAN
`spiffe://<trust-domain>/machine/<id>` is machine <id>'s agent, `spiffe://<trust-domain>/operator`
an operator, `spiffe://<trust-domain>/reader` a reader; a certificate with no such URI may name
them in its subject CN instead (`stalwart:machine:<id>`, `stalwart:operator`, `stalwart:reader`).
Any other certificate (the controller's own, a host's) proves nothing: its holder needs a token.
A bearer token, when a request carries one, is what is checked; the certificate counts for
requests that carry none (an agent with a certificate sends no token).

Every token but the operator's is derived from the controller's secret (`<state-dir>/secret`,
0600; controllers sharing a database share it): HMAC-SHA256, checked in constant time, nothing to
store but which join tokens were used and which machines enrolled (the store's meta table).
"""
from __future__ import annotations

import base64
import enum
import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass

from stalwart.protocol import MACHINE_ID_RE

READER_FILE = "reader.token"
JOIN_TTL_S = 24 * 3600.0
AGENT_PREFIX = "/api/agents/"


class Scope(enum.Enum):
    OPERATOR = "operator"
    READER = "reader"
    AGENT = "agent"
    JOIN = "join"


@dataclass(frozen=True)
class Identity:
    scope: Scope
    machine: str | None = None        # an agent's machine, or the machine a join token is for
    nonce: str | None = None          # a join token's (each is used once)


def _b64(s: str) -> str:
    return base64.urlsafe_b64encode(s.encode()).decode().rstrip("=")


def _unb64(s: str) -> str:
    return base64.urlsafe_b64decode(s + "=" * (-len(s) % 4)).decode()


def _mac(secret: bytes, *parts: str) -> str:
    return hmac.new(secret, "|".join(parts).encode(), hashlib.sha256).hexdigest()


def reader_token(secret: bytes) -> str:
    return "sr1." + _mac(secret, "reader")


def machine_credential(secret: bytes, machine: str) -> str:
    return f"sm1.{_b64(machine)}.{_mac(secret, 'machine', machine)}"


def join_token(secret: bytes, machine: str | None = None, ttl_s: float = JOIN_TTL_S,
               now: float | None = None) -> str:
    """A one-time join token, for `machine` alone or (None) for any one machine id."""
    expires = int((time.time() if now is None else now) + ttl_s)
    nonce = secrets.token_hex(12)
    target = machine or ""
    return f"sj1.{_b64(target)}.{expires}.{nonce}.{_mac(secret, 'join', target, str(expires), nonce)}"


def identify(token: str, operator: str | None, secret: bytes, now: float | None = None) -> tuple[Identity | None, str]:
    """The identity a bearer token proves, or (None, why not)."""
    if operator is not None and hmac.compare_digest(token.encode(), operator.encode()):
        return Identity(Scope.OPERATOR), ""
    parts = token.split(".")
    try:
        if parts[0] == "sr1" and len(parts) == 2:
            if hmac.compare_digest(token.encode(), reader_token(secret).encode()):
                return Identity(Scope.READER), ""
        elif parts[0] == "sm1" and len(parts) == 3:
            machine = _unb64(parts[1])
            if hmac.compare_digest(parts[2].encode(), _mac(secret, "machine", machine).encode()):
                return Identity(Scope.AGENT, machine), ""
        elif parts[0] == "sj1" and len(parts) == 5:
            target, expires, nonce = _unb64(parts[1]), parts[2], parts[3]
            if hmac.compare_digest(parts[4].encode(), _mac(secret, "join", target, expires, nonce).encode()):
                if int(expires) < (time.time() if now is None else now):
                    return None, "expired join token"
                return Identity(Scope.JOIN, target or None, nonce), ""
    except (ValueError, UnicodeDecodeError):
        pass
    return None, "wrong token"


def from_header(header: str | None, operator: str | None, secret: bytes) -> tuple[Identity | None, str]:
    """The identity an Authorization header proves, or (None, why not)."""
    if not header:
        return None, "no token"
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None, "not a bearer token"
    return identify(value.strip(), operator, secret)


SPIFFE = "spiffe://"
CN_PREFIX = "stalwart:"


def _named(name: str) -> Identity | None:
    """The identity a stalwart name (`machine/<id>`, `operator`, `reader`) stands for."""
    if name == "operator":
        return Identity(Scope.OPERATOR)
    if name == "reader":
        return Identity(Scope.READER)
    kind, _, machine = name.partition("/")
    if kind == "machine" and MACHINE_ID_RE.match(machine):
        return Identity(Scope.AGENT, machine)
    return None


def from_certificate(peercert: dict | None) -> tuple[Identity | None, str]:
    """The identity a verified client certificate (`SSLSocket.getpeercert()`'s dict: the TLS
    layer checked it against the client CA already) names, or (None, why not)."""
    if not peercert:
        return None, "no client certificate"
    found: set[Identity] = set()
    for kind, value in peercert.get("subjectAltName", ()):
        if kind == "URI" and value.startswith(SPIFFE):
            _trust, slash, path = value[len(SPIFFE):].partition("/")
            ident = _named(path) if slash else None
            if ident is not None:
                found.add(ident)
    if not found:
        for rdn in peercert.get("subject", ()):
            for key, value in rdn:
                if key == "commonName" and value.startswith(CN_PREFIX):
                    ident = _named(value[len(CN_PREFIX):].replace(":", "/", 1))
                    if ident is not None:
                        found.add(ident)
    if len(found) > 1:
        return None, "the client certificate names more than one identity"
    if not found:
        return None, "the client certificate names no stalwart identity"
    return found.pop(), ""


def from_request(header: str | None, peercert: dict | None, operator: str | None,
                 secret: bytes) -> tuple[Identity | None, str]:
    """The identity a request proves: its bearer token when it carries an Authorization header,
    else its verified client certificate (None when the connection presented none)."""
    if header or not peercert:
        return from_header(header, operator, secret)
    ident, why = from_certificate(peercert)
    return (ident, "") if ident is not None else (None, f"no token, and {why}")


def agent_machine(path: str) -> str | None:
    """The machine id an agent route names (`/api/agents/{machine}/...`), as it appears in the path."""
    if not path.startswith(AGENT_PREFIX):
        return None
    rest = path[len(AGENT_PREFIX):]
    machine, slash, _ = rest.partition("/")
    return machine if slash and machine else None


def permits(ident: Identity, method: str, path: str, machine: str | None) -> str | None:
    """None when `ident` may call `method path` (`machine`: the decoded machine id of an agent
    route, else None), else why not."""
    if ident.scope is Scope.OPERATOR:
        return None
    if ident.scope is Scope.READER:
        if method in ("GET", "HEAD") and machine is None:
            return None
        return "a reader token may only read (GET) status, metrics and the dashboard"
    if ident.scope is Scope.AGENT:
        if machine is None:
            return "a machine's credential is good for its own agent routes only"
        if machine != ident.machine:
            return f"this credential is machine {ident.machine!r}'s, not {machine!r}'s"
        if path.endswith("/enroll"):
            return "a machine enrolls with a join token"
        return None
    if machine is None or method != "POST" or not path.endswith("/enroll"):
        return "a join token is good for enrolling a machine only"
    if ident.machine is not None and ident.machine != machine:
        return f"this join token is for machine {ident.machine!r}, not {machine!r}"
    return None
