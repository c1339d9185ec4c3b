"""The agent's side of its machine's fork servers (`agent/forkserver.py`): start them, ask them
for workers, learn when they end.

A worker whose command line the server can become (`python [-u] -m MOD ...`, `python SCRIPT ...`,
`python -c CODE ...` with the server's own interpreter) is forked from it: no `import torch` of
its own. A server is kept per *key*: the interpreter, the exec prefix (the machine's network
namespace) and the environment variables that a library reads once, at import (everything but the
per-run and per-rank ones below): a worker whose key differs gets a new server, so a forked worker
is the same process a started one would have been. A server ends once no worker of its own is
left and another key was asked for (ending a server ends the workers it forked).

Anything the preloading server cannot do (another program, an unknown interpreter option, a
server that failed to start or died, all of it with STALWART_FORK_SERVER=0) goes to the machine's
exec server: the same server file with nothing preloaded, run by the agent's interpreter, one per
exec prefix and kept for the agent's life, which forks and execs the command (see forkserver.py's
"Exec mode": why, and how such a worker is bounded once its agent is gone). Its workers outlive
the agent and are adopted just as forked ones. Only when no server can start at all (or with
STALWART_EXEC_SERVER=0) does `spawn` return None: the caller then starts the worker as its own
child, which dies with it.

`ForkedProcess` stands in for `subprocess.Popen` where the agent watches a worker: `pid`,
`returncode`, `poll()`, `wait(timeout)`, and `exited()` (ended, reaped or not).
"""
from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from typing import Callable

from stalwart.protocol import WARM_TITLE_MARK, Env
from stalwart.protocol.events import WORKER_START_S

log = logging.getLogger("stalwart.agent")
SERVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "forkserver.py")
READY_TIMEOUT_S = WORKER_START_S      # the server's preload (import torch) on a loaded machine
SPAWN_TIMEOUT_S = 30.0       # a fork, once the server is ready
DISABLE_ENV = "STALWART_FORK_SERVER"      # "0": no preloading server (workers are exec'd, see EXEC_DISABLE_ENV)
EXEC_DISABLE_ENV = "STALWART_EXEC_SERVER"  # "0": no exec server (what is not forked is the agent's own child)
PRELOAD_ENV = "STALWART_FORK_PRELOAD"     # the modules a server imports (forkserver.PRELOAD_ENV)
EXITS_ENV = "STALWART_FORK_EXITS"         # where a server outliving its agent notes exits (forkserver.EXITS_ENV)


# Read by the worker at run time, not by a library at import: they may differ between a server
# and the workers it forks.
RUNTIME_PREFIXES = ("STALWART_", "TORCHELASTIC_", "NCCL_", "GLOO_", "MASTER_", "TORCH_NCCL_", "TORCH_FR_")
RUNTIME_KEYS = frozenset({
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "CUDA_VISIBLE_DEVICES", "PYTHONPATH",
    "PYTHONUNBUFFERED", "PYTHONSAFEPATH", "OLDPWD", "PWD", "_",
})
# (PYTHONSAFEPATH: the server applies it to each forked worker's sys.path, forkserver.become. As
# an import key it gave the stop-time checks, which run without it, a server of their own: a
# second preload of torch, 2.2 s of every incident's checks.)


def runtime_key(name: str) -> bool:
    return name in RUNTIME_KEYS or name.startswith(RUNTIME_PREFIXES)


def import_env(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The part of an environment that must be the same in a server and the workers it forks."""
    return tuple(sorted((k, v) for k, v in env.items() if not runtime_key(k)))


class ForkedProcess:
    """A worker forked (or exec'd) by a fork server (the server is its parent and reports its end)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None
        self._ended = threading.Event()

    def _set(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def exited(self) -> bool:
        """Has it ended (its server may not have reported it yet)?"""
        if self.returncode is not None:
            return True
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except (OSError, IndexError):
            return True


class _Server:
    """One running fork server and the workers it forked."""

    def __init__(self, key: tuple, argv: list[str], env: dict[str, str], cwd: str, log_path: str,
                 preexec: Callable[[], None] | None):
        self.key = key
        self.lock = threading.Lock()
        self.ready = threading.Event()
        self.dead = threading.Event()
        self.info: dict = {}
        self.pending: dict[int, list] = {}            # request id -> [event, answer]
        self.procs: dict[int, ForkedProcess] = {}     # pid -> process
        self.early: dict[int, int] = {}               # exits heard before the pid's answer
        self.next_id = 0
        with open(log_path, "ab") as logf:
            self.proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=logf, start_new_session=True, preexec_fn=preexec)
        threading.Thread(target=self._read, name="forkserver", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if msg.get("ready"):
                self.info = msg
                self.ready.set()
            elif "exit" in msg:
                with self.lock:
                    proc = self.procs.pop(msg["exit"], None)
                    if proc is None:
                        self.early[msg["exit"]] = msg["code"]
                if proc is not None:
                    proc._set(int(msg["code"]))
            elif "id" in msg:
                with self.lock:
                    slot = self.pending.pop(msg["id"], None)
                if slot is not None:
                    slot[1] = msg
                    slot[0].set()
        # the server is gone, and with it (by their death signal) every worker it forked
        self.dead.set()
        self.ready.set()
        with self.lock:
            procs, self.procs = list(self.procs.values()), {}
            pending, self.pending = list(self.pending.values()), {}
        for proc in procs:
            proc._set(-9)
        for slot in pending:
            slot[0].set()

    def spawn(self, req: dict, timeout: float) -> ForkedProcess | None:
        if not self.ready.wait(READY_TIMEOUT_S) or self.dead.is_set():
            return None
        done = threading.Event()
        slot: list = [done, None]
        with self.lock:
            self.next_id += 1
            rid = self.next_id
            self.pending[rid] = slot
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write((json.dumps(dict(req, op="spawn", id=rid)) + "\n").encode())
            self.proc.stdin.flush()
        except (OSError, ValueError):
            return None
        if not done.wait(timeout) or not slot[1] or "pid" not in slot[1]:
            if slot[1] and slot[1].get("error"):
                log.info("%s: %s", "exec server" if self.key[0] == "exec" else "fork server", slot[1]["error"])
            return None
        proc = ForkedProcess(int(slot[1]["pid"]))
        with self.lock:
            code = self.early.pop(proc.pid, None)
            if code is None:
                self.procs[proc.pid] = proc
        if code is not None:
            proc._set(code)
        return proc

    def live(self) -> bool:
        """Does a worker it forked still run?"""
        with self.lock:
            return any(p.returncode is None for p in self.procs.values())

    def close(self) -> None:
        """End the server; it kills every worker it forked (`quit`: a bare end of its input would
        leave them to a successor, see forkserver.py)."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.write(b'{"op":"quit"}\n')
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class ForkServers:
    """The machine's fork server(s): one per key, the newest kept, and an exec server per exec
    prefix (see the module's doc)."""

    def __init__(self, log_dir: str, preexec: Callable[[], None] | None = None, enabled: bool | None = None,
                 hide_paths: tuple[str, ...] = (), exits_dir: str | None = None, exec_enabled: bool | None = None):
        """`enabled`: the preloading servers (default: unless STALWART_FORK_SERVER=0);
        `exec_enabled`: the exec servers (default: unless STALWART_EXEC_SERVER=0);
        `preexec`: run in the server's process before exec (its death signal, say); `exits_dir`:
        the servers outlive this process while workers they forked run, noting their exits there
        (forkserver.py, for a successor that adopts them);
        `hide_paths`: PYTHONPATH entries the server itself must not have (a start-up hook that is
        the workers', such as the flight-recorder hook's directory)."""
        self.log_dir = log_dir
        self.preexec = preexec
        self.exits_dir = exits_dir
        self.hide_paths = {os.path.abspath(p) for p in hide_paths}
        self.enabled = os.environ.get(DISABLE_ENV, "1") != "0" if enabled is None else enabled
        self.exec_enabled = os.environ.get(EXEC_DISABLE_ENV, "1") != "0" if exec_enabled is None else exec_enabled
        self._lock = threading.Lock()
        self._servers: dict[tuple, _Server] = {}
        self._execs: dict[tuple, _Server] = {}         # exec prefix -> its exec server
        self._starts: queue.Queue = queue.Queue()
        self._starter: threading.Thread | None = None
        self._starter_lock = threading.Lock()
        self.preload_wait_s = 0.0       # time spawns waited for a server's preload, in all (see Started)

    def key_of(self, command: list[str], env: dict[str, str], prefix: list[str] | None) -> tuple | None:
        """The server a command needs, or None when it cannot be forked."""
        if not self.enabled or not command:
            return None
        exe = command[0]
        if os.sep not in exe:
            exe = shutil.which(exe, path=env.get("PATH")) or ""
        if not exe or not os.path.basename(exe).startswith("python"):
            return None
        try:
            from stalwart.agent.forkserver import Unsupported, parse_argv
            parse_argv(command)
        except Unsupported:
            return None
        return (os.path.realpath(exe), tuple(prefix or ()), import_env(env), self._preload(env))

    @staticmethod
    def _preload(env: dict[str, str]) -> str | None:
        """The modules the server preloads (STALWART_FORK_PRELOAD of the worker, else of the agent;
        None: the server's default)."""
        return env.get(PRELOAD_ENV, os.environ.get(PRELOAD_ENV))

    def _server_for(self, command, env, prefix, cwd) -> _Server | None:
        key = self.key_of(command, env, prefix)
        if key is None:
            return None
        with self._lock:
            srv = self._servers.get(key)
            if srv is not None and srv.dead.is_set():
                srv = None
            # servers of other keys go once no worker of theirs is left (ending a server ends its
            # workers: never while one trains)
            idle = [s for k, s in self._servers.items() if k != key and (s.dead.is_set() or not s.live())]
            self._servers = {k: s for k, s in self._servers.items() if s not in idle and (k != key or srv)}
            if srv is None:
                srv = self._start(key, command, env, prefix, cwd)
                if srv is not None:
                    self._servers[key] = srv
        for old in idle:
            threading.Thread(target=old.close, daemon=True, name="forkserver-close").start()
        return srv

    def _start(self, key: tuple, command: list[str], env: dict[str, str], prefix: list[str] | None,
               cwd: str | None) -> _Server | None:
        os.makedirs(self.log_dir, exist_ok=True)
        server_env = self._server_env({k: v for k, v in env.items() if not runtime_key(k)}, key[3])
        argv = list(prefix or []) + [command[0], SERVER]
        try:
            return self._in_starter(lambda: _Server(key, argv, server_env, cwd or os.getcwd(),
                                                    os.path.join(self.log_dir, "forkserver.log"), self.preexec))
        except OSError as e:
            log.warning("fork server did not start (%s): workers start the usual way", e)
            return None

    def _server_env(self, base: dict[str, str], preload: str | None, extra_path: str | None = None) -> dict[str, str]:
        """A server's environment: `base`, unbuffered, its preload (None: the server's default),
        where it notes exits, and PYTHONPATH without the hidden entries (plus `extra_path`)."""
        server_env = dict(base, PYTHONUNBUFFERED="1")
        if preload is not None:
            server_env[PRELOAD_ENV] = preload
        if self.exits_dir:
            server_env[EXITS_ENV] = self.exits_dir
        path = [p for p in base.get("PYTHONPATH", "").split(os.pathsep)
                if p and os.path.abspath(p) not in self.hide_paths]
        if extra_path:
            path.append(extra_path)
        if path:                  # (stalwart itself may be there)
            server_env["PYTHONPATH"] = os.pathsep.join(path)
        return server_env

    def _in_starter(self, make: Callable[[], _Server]) -> _Server:
        """Run `make` on this object's own thread, which lives as long as the object: a server
        started with a death signal (`preexec`) dies with the thread that started it, and callers
        may be short-lived threads (the stop-time checks run on one per command)."""
        with self._starter_lock:
            if self._starter is None:
                self._starter = threading.Thread(target=self._start_loop, name="forkserver-starter", daemon=True)
                self._starter.start()
        done: list = []
        ev = threading.Event()
        self._starts.put((make, done, ev))
        ev.wait()
        if isinstance(done[0], BaseException):
            raise done[0]
        return done[0]

    def _start_loop(self) -> None:
        while True:
            make, done, ev = self._starts.get()
            try:
                done.append(make())
            except BaseException as e:     # noqa: BLE001 - handed to the caller
                done.append(e)
            ev.set()

    def spawn(self, command: list[str], env: dict[str, str], cwd: str | None, stdout: str, stderr: str,
              prefix: list[str] | None = None, nice: int = 0) -> ForkedProcess | None:
        """Fork a worker, else exec it from the exec server; None when no server could start it
        (the caller starts it as its own child)."""
        proc = self._fork(command, env, cwd, stdout, stderr, prefix, nice)
        if proc is None:
            proc = self._exec(command, env, cwd, stdout, stderr, prefix, nice)
        return proc

    def _fork(self, command: list[str], env: dict[str, str], cwd: str | None, stdout: str, stderr: str,
              prefix: list[str] | None, nice: int) -> ForkedProcess | None:
        srv = self._server_for(command, env, prefix, cwd)
        if srv is None:
            return None
        t0 = time.time()
        if not srv.ready.is_set():
            srv.ready.wait(READY_TIMEOUT_S)
            self.preload_wait_s += time.time() - t0
        title = " ".join(command) + (WARM_TITLE_MARK if env.get(Env.STANDBY) == "1" else "")
        proc = srv.spawn({"argv": list(command), "env": env, "cwd": cwd or os.getcwd(), "stdout": stdout,
                          "stderr": stderr, "nice": nice, "title": title}, SPAWN_TIMEOUT_S)
        if proc is None:
            log.info("fork server could not fork %s: it is exec'd instead", command[:3])
        elif time.time() - t0 > 1.0:
            log.info("fork server: first worker after %.1fs (preload %.1fs)", time.time() - t0,
                     srv.info.get("preload_s", -1))
        return proc

    def _exec(self, command: list[str], env: dict[str, str], cwd: str | None, stdout: str, stderr: str,
              prefix: list[str] | None, nice: int) -> ForkedProcess | None:
        if not self.exec_enabled or not command:
            return None
        key = tuple(prefix or ())
        with self._lock:
            srv = self._execs.get(key)
            if srv is None or srv.dead.is_set():
                srv = self._start_exec(key, prefix)
                if srv is None:
                    self._execs.pop(key, None)
                else:
                    self._execs[key] = srv
        if srv is None:
            return None
        proc = srv.spawn({"exec": True, "argv": list(command), "env": env, "cwd": cwd or os.getcwd(),
                          "stdout": stdout, "stderr": stderr, "nice": nice}, SPAWN_TIMEOUT_S)
        if proc is None:
            log.info("exec server could not start %s", command[:3])
        return proc

    def _start_exec(self, key: tuple, prefix: list[str] | None) -> _Server | None:
        """The machine's exec server: this file's server with nothing preloaded, run by the agent's
        own interpreter (which has stalwart: the server imports its errors) behind `prefix`."""
        os.makedirs(self.log_dir, exist_ok=True)
        server_env = self._server_env(dict(os.environ), "",
                                      extra_path=os.path.dirname(os.path.dirname(os.path.dirname(SERVER))))
        argv = list(prefix or []) + [sys.executable, SERVER]
        try:
            return self._in_starter(lambda: _Server(("exec",) + key, argv, server_env, self.log_dir,
                                                    os.path.join(self.log_dir, "execserver.log"), self.preexec))
        except OSError as e:
            log.warning("exec server did not start (%s): workers start as the agent's own children", e)
            return None

    def server_pids(self) -> list[int]:
        with self._lock:
            return [s.proc.pid for s in list(self._servers.values()) + list(self._execs.values())
                    if not s.dead.is_set()]

    def close(self) -> None:
        """End every server (and so every worker they forked)."""
        with self._lock:
            servers = list(self._servers.values()) + list(self._execs.values())
            self._servers, self._execs = {}, {}
        for srv in servers:
            srv.close()

