"""The wire of the checkpoint peer protocol (`peerxfer`): length-prefixed JSON frames, exact
receives, chunked sends, and the kernel's send/receive timeouts of a blocking socket."""
from __future__ import annotations

import json
import socket
import struct
from typing import Iterator

from stalwart.agent.backups import recv_into_all
from stalwart.errors import StalwartError

CHUNK = 4 << 20
MAX_FRAME = 64 << 20


class PeerError(StalwartError, RuntimeError):
    """The peer refused or failed a transfer (its message says why)."""


# A socket with a Python timeout polls before every send and receive: a dozen poll calls per
# backup, every step. The backups' sockets block instead and the kernel times them out
# (SO_RCVTIMEO / SO_SNDTIMEO), which Python reports as BlockingIOError: a stalled peer.
_STALLED = (TimeoutError, BlockingIOError)


def _kernel_timeouts(sock: socket.socket, timeout_s: float) -> None:
    sec = int(timeout_s)
    tv = struct.pack("ll", sec, int((timeout_s - sec) * 1e6))
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


# ----------------------------------------------------------------------------- framing

def _send_frame(sock: socket.socket, obj: dict) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode()
    sock.sendall(struct.pack(">I", len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into_all(sock, memoryview(buf))
    return bytes(buf)


def _recv_frame(sock: socket.socket, limit: int = MAX_FRAME) -> dict:
    (n,) = struct.unpack(">I", _recv_exact(sock, 4))
    if n > limit:
        raise PeerError(f"frame of {n} bytes exceeds the {limit}-byte limit")
    obj = json.loads(_recv_exact(sock, n))
    if not isinstance(obj, dict):
        raise PeerError("frame is not a JSON object")
    return obj


def _recv_chunks(sock: socket.socket, n: int, chunk: int = CHUNK) -> Iterator[memoryview]:
    """Yield exactly `n` bytes from `sock` as views of one reused buffer (consume each before the next)."""
    buf = memoryview(bytearray(min(chunk, max(n, 1))))
    left = n
    while left:
        want = min(len(buf), left)
        recv_into_all(sock, buf[:want])
        left -= want
        yield buf[:want]


def _send_view(sock: socket.socket, view, chunk: int = CHUNK) -> None:
    mv = memoryview(view).cast("B")
    for i in range(0, len(mv), chunk):
        sock.sendall(mv[i:i + chunk])


def _reply_error(sock: socket.socket, err: BaseException) -> None:
    try:
        _send_frame(sock, {"ok": False, "error": f"{type(err).__name__}: {err}"})
    except OSError:
        pass
