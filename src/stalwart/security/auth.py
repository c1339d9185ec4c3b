"""Who may use the controller's API: the operator's bearer token, the controller's secret that
the other credentials derive from (`identity`: reader, machine, join tokens), and optional TLS.

Anyone who can call the API runs code on every machine (a job is a command), so every route that
reads or changes a job needs the token. `stalwart controller` creates it on first start (random,
in `<state-dir>/token`, mode 0600) unless given `--token-file`; agents and the CLI read it from
`--token-file`, the environment (`STALWART_TOKEN`) or, on the controller's host, the state dir.
With `--tls-client-ca` a client certificate signed by that CA is a credential too (mutual TLS,
`identity.from_certificate`). What stays open: `/api/health` (a liveness probe),
`/api/openapi.json` and the dashboard's page and static files (they hold no data; the page asks
the API with the token it was given in the URL's fragment).
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import ssl
import stat

from stalwart.errors import StalwartError

TOKEN_FILE = "token"
SECRET_FILE = "secret"     # the controller's secret: checkpoint keys and scoped tokens derive from it
TOKEN_ENV = "STALWART_TOKEN"
PUBLIC_PATHS = ("/", "/api/health", "/api/openapi.json")
PUBLIC_PREFIXES = ("/static/",)

log = logging.getLogger(__name__)


class AuthConfigError(StalwartError, ValueError):
    """A token or certificate file that cannot be used (the message says which and why)."""


def read_token_file(path: str) -> str:
    try:
        with open(path) as f:
            token = f.read().strip()
    except OSError as e:
        raise AuthConfigError(f"cannot read the token file {path}: {e.strerror or e}") from None
    if not token:
        raise AuthConfigError(f"the token file {path} is empty")
    if any(c.isspace() for c in token):
        raise AuthConfigError(f"the token file {path} holds more than one word")
    return token


def create_token_file(path: str) -> str:
    """The token in `path`, made (random, mode 0600) when the file does not exist yet. Creating is
    atomic (O_EXCL): two processes starting at once agree on one token."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return read_token_file(path)
    token = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def controller_token(state_dir: str, token_file: str | None = None) -> str:
    """The token a controller checks: `token_file` when given (it must exist), else the state
    dir's own (made on first start)."""
    if token_file:
        return read_token_file(token_file)
    return create_token_file(os.path.join(state_dir, TOKEN_FILE))


def controller_secret(state_dir: str, secret_file: str | None = None) -> bytes:
    """The controller's secret (`secret_file` when given, else `<state-dir>/secret`, random,
    0600, made on first start like the token): the jobs' checkpoint keys and the scoped tokens
    (`identity`) derive from it. Controllers that share a database share this file too."""
    if secret_file:
        return read_token_file(secret_file).encode()
    return create_token_file(os.path.join(state_dir, SECRET_FILE)).encode()


def checkpoint_key(secret: bytes, job_id: int) -> str:
    """A job's checkpoint key (hex of 32 bytes): what its agents authenticate peer connections
    and MAC shards with. Derived (HMAC-SHA256), so that it is the same after a restart and
    differs between jobs: a machine of one job cannot read or forge another job's shards."""
    return hmac.new(secret, b"stalwart-ckpt-key|%d" % job_id, hashlib.sha256).hexdigest()


def loose_permissions(path: str) -> bool:
    """Whether others than the owner may read the file (worth a warning, not a refusal)."""
    try:
        return bool(os.stat(path).st_mode & (stat.S_IRWXG | stat.S_IRWXO))
    except OSError:
        return False


def client_token(token_file: str | None = None, state_dir: str | None = None) -> str | None:
    """The token a client sends: `--token-file`, else $STALWART_TOKEN, else the state dir's
    token file when this host has it (the local cluster, the controller's own host)."""
    if token_file:
        return read_token_file(token_file)
    env = os.environ.get(TOKEN_ENV, "").strip()
    if env:
        return env
    if state_dir:
        path = os.path.join(state_dir, TOKEN_FILE)
        if os.path.exists(path):
            return read_token_file(path)
    return None


def is_public(path: str) -> bool:
    return path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES)


def bearer_ok(header: str | None, token: str) -> tuple[bool, str]:
    """Whether an Authorization header carries the token, and if not, why (for the log)."""
    if not header:
        return False, "no token"
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return False, "not a bearer token"
    if not hmac.compare_digest(value.strip().encode(), token.encode()):
        return False, "wrong token"
    return True, ""


def _server_context(cert: str, key: str, client_ca: str | None, require_client_cert: bool,
                    crl: str | None) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise AuthConfigError(f"cannot load the TLS certificate {cert} / key {key}: {e}") from None
    if client_ca:
        try:
            ctx.load_verify_locations(cafile=client_ca)
        except (OSError, ssl.SSLError) as e:
            raise AuthConfigError(f"cannot load the client CA file {client_ca}: {e}") from None
        ctx.verify_mode = ssl.CERT_REQUIRED if require_client_cert else ssl.CERT_OPTIONAL
    elif require_client_cert:
        raise AuthConfigError("requiring client certificates needs the CA that signs them (--tls-client-ca)")
    if crl:
        if not client_ca:
            raise AuthConfigError("a revocation list (--tls-crl) is for client certificates: give --tls-client-ca")
        try:
            ctx.load_verify_locations(cafile=crl)
        except (OSError, ssl.SSLError) as e:
            raise AuthConfigError(f"cannot load the revocation list {crl}: {e}") from None
        ctx.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
    return ctx


class ServerTls:
    """The controller's TLS files, read again when one of them changes: a renewed certificate, a
    new client CA bundle or a revocation list with one more certificate in it applies to the next
    handshake, without a restart. Every handshake stats the files (a few microseconds each) and
    takes the newest context that loaded; a file caught half-written, or wrong, keeps the previous
    context (logged once per change) rather than refusing everyone."""

    def __init__(self, cert: str, key: str, client_ca: str | None = None, require_client_cert: bool = False,
                 crl: str | None = None):
        self.args = (cert, key, client_ca, require_client_cert, crl)
        self.paths = [p for p in (cert, key, client_ca, crl) if p]
        self.stamp = self._stamp()
        self.context = _server_context(*self.args)      # the one the server holds: it hands over
        self.context.sni_callback = self._handshake       # (called for every ClientHello, SNI or not)
        self.current = self.context
        self.reloads = 0
        self.failed: str | None = None

    def _stamp(self) -> tuple:
        out = []
        for p in self.paths:
            try:
                st = os.stat(p)
                out.append((st.st_mtime_ns, st.st_size, st.st_ino))
            except OSError:
                out.append(None)
        return tuple(out)

    def fresh(self) -> ssl.SSLContext:
        """The context for a new handshake: reloaded first when a file changed since the last."""
        stamp = self._stamp()
        if stamp != self.stamp:
            self.stamp = stamp
            try:
                self.current = _server_context(*self.args)
                self.reloads += 1
                self.failed = None
                log.info("TLS files changed: reloaded (%s)", ", ".join(self.paths))
            except AuthConfigError as e:
                self.failed = str(e)
                log.warning("TLS files changed but do not load, keeping the previous ones: %s", e)
        return self.current

    def _handshake(self, conn, server_name, ctx) -> None:
        conn.context = self.fresh()


def server_tls(cert: str, key: str, client_ca: str | None = None, require_client_cert: bool = False,
               crl: str | None = None) -> ssl.SSLContext:
    """The controller's TLS context. `client_ca`: ask every client for a certificate and verify
    one it presents against this CA (a certificate from another CA fails the handshake); a
    verified certificate is a credential (`identity.from_certificate`). A client without one
    still connects and shows a bearer token, unless `require_client_cert`. `crl`: the CA's
    revocation list (PEM); a revoked client certificate fails the handshake. The files are read
    again when they change (`ServerTls`)."""
    return ServerTls(cert, key, client_ca, require_client_cert, crl).context


def client_tls(ca: str | None, cert: str | None = None, key: str | None = None) -> ssl.SSLContext:
    """Verify the controller's certificate against `ca` (else the system's authorities); present
    `cert` (with its `key`) when the controller asks for a client certificate."""
    try:
        ctx = ssl.create_default_context(cafile=ca) if ca else ssl.create_default_context()
    except (OSError, ssl.SSLError) as e:
        raise AuthConfigError(f"cannot load the CA file {ca}: {e}") from None
    if bool(cert) != bool(key):
        raise AuthConfigError("a client certificate and its key go together (--tls-cert and --tls-key)")
    if cert:
        try:
            ctx.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as e:
            raise AuthConfigError(f"cannot load the client certificate {cert} / key {key}: {e}") from None
    return ctx
