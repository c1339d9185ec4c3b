"""A throwaway PostgreSQL server for tests (Debian's postgresql package), removed afterwards."""
from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time


def pg_bin() -> str | None:
    for cand in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if os.path.exists(os.path.join(cand, "pg_ctl")):
            return cand
    return None


def unavailable_reason() -> str | None:
    if pg_bin() is None:
        return "PostgreSQL server binaries not installed (apt-get install postgresql)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no 'postgres' user to run the server as"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PgServer:
    def __init__(self):
        self.bin = pg_bin()
        self.dir = tempfile.mkdtemp(prefix="stalwart-pg-")
        self.port = _free_port()
        self.as_user = []
        if os.geteuid() == 0:  # postgres refuses to run as root
            pw = pwd.getpwnam("postgres")
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
            self.as_user = ["runuser", "-u", "postgres", "--"]

    def _run(self, *argv: str) -> None:
        subprocess.run(self.as_user + list(argv), check=True, capture_output=True, timeout=60)

    def start(self) -> str:
        data = os.path.join(self.dir, "data")
        self._run(f"{self.bin}/initdb", "-A", "trust", "-U", "postgres", "-D", data)
        self._run(f"{self.bin}/pg_ctl", "-D", data, "-w", "-t", "30", "-l", os.path.join(self.dir, "log"),
                  "-o", f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.dir}", "start")
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def pause(self) -> None:
        """Stop the server (fast shutdown: clients' connections are cut), keeping its data."""
        self._run(f"{self.bin}/pg_ctl", "-D", os.path.join(self.dir, "data"), "-m", "fast", "-w", "stop")

    def resume(self) -> None:
        """Start the stopped server again on the same port and data."""
        self._run(f"{self.bin}/pg_ctl", "-D", os.path.join(self.dir, "data"), "-w", "-t", "30", "-l",
                  os.path.join(self.dir, "log"), "-o", f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.dir}",
                  "start")

    def stop(self) -> None:
        data = os.path.join(self.dir, "data")
        if os.path.exists(os.path.join(data, "postmaster.pid")):
            subprocess.run(self.as_user + [f"{self.bin}/pg_ctl", "-D", data, "-m", "immediate", "-w",
                                           "stop"], capture_output=True, timeout=60)
        shutil.rmtree(self.dir, ignore_errors=True)
