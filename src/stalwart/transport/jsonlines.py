"""Newline-delimited JSON over a stream socket: the local wire between workers and their agent."""
from __future__ import annotations

import json
import socket
import threading


class JsonLineSocket:
    """A stream socket that sends and receives one JSON object per line. Sends are thread-safe."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._wlock = threading.Lock()
        self._rfile = sock.makefile("rb")

    def send(self, obj: dict) -> None:
        self.send_raw((json.dumps(obj, separators=(",", ":")) + "\n").encode())

    def send_raw(self, data: bytes) -> None:
        """Lines already encoded (each one JSON object and a newline), in one write."""
        with self._wlock:
            self.sock.sendall(data)

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
