"""Newline-delimited JSON over a stream socket: the local wire between workers and their agent."""
from __future__ import annotations

import fcntl
import json
import socket
import struct
import termios
import threading


class JsonLineSocket:
    """A stream socket that sends and receives one JSON object per line. Sends are thread-safe."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._wlock = threading.Lock()
        self._sndbuf: int | None = None
        self._rfile = sock.makefile("rb")

    def send(self, obj: dict) -> None:
        data = (json.dumps(obj, separators=(",", ":")) + "\n").encode()
        with self._wlock:
            self.sock.sendall(data)

    def send_nowait(self, obj: dict) -> bool:
        """Send `obj` only if that cannot block: another sender holds the socket, or its buffer
        has little room: False, nothing sent (the caller queues it)."""
        data = (json.dumps(obj, separators=(",", ":")) + "\n").encode()
        if not self._wlock.acquire(blocking=False):
            return False
        try:
            if self._room() < 4 * len(data):
                return False
            try:
                sent = self.sock.send(data, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return False
            if sent < len(data):                    # (not with that much room; never torn)
                self.sock.sendall(data[sent:])
            return True
        finally:
            self._wlock.release()

    def _room(self) -> int:
        """Bytes the send buffer can still take: its size less what the peer has not read."""
        if self._sndbuf is None:
            self._sndbuf = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        queued = struct.unpack("i", fcntl.ioctl(self.sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
        return self._sndbuf - queued

    def recv(self) -> dict | None:
        """The next object, or None when the peer closed the connection."""
        line = self._rfile.readline()
        if not line:
            return None
        return json.loads(line)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
