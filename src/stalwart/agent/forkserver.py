"""A machine's fork server: one Python process that imports torch once and forks workers from it.

Every worker of a training job starts with `import torch` (1-2 CPU-seconds, 2-5 s of wall time
on a machine where eight processes import at once), and so does every warm spare and standby
worker, and every restart that finds no warm one. The agent instead keeps one fork server per
machine (started through the machine's exec prefix, so in its network namespace): it imports
torch, torch.distributed, the optimizers and torch._dynamo once, then forks a worker per request
in milliseconds. The child becomes the worker exactly as `python -m MOD ARGS` or
`python SCRIPT ARGS` would (a fresh `__main__`, `sys.argv`, `sys.path` from the worker's cwd and
PYTHONPATH, its environment, its stdout/stderr files, its own session, its niceness, dying with
the server), so a training script cannot tell the difference, except that modules the server
imported are already loaded.

Run by path (`python forkserver.py`): it imports nothing of stalwart but its error type (and, to
bound exec'd children, worker/frhook.py's standard-library `agent_alive`), so the job's own
interpreter can run it whatever it has installed. Protocol: JSON lines on stdin (requests) and
stdout (answers); the server is single-threaded (nothing but its preload's idle library threads
exists when it forks):

* after the preload: ``{"ready": true, "pid": P, "preloaded": [...], "failed": {module: error}}``
* ``{"op": "spawn", "id": N, "argv": [python, ...], "env": {...}, "cwd": D, "stdout": F,
  "stderr": F, "nice": K, "title": T}`` -> ``{"id": N, "pid": P}`` or ``{"id": N, "error": "..."}``
  (`title`: the command line the child shows, default its argv)
* the same with ``"exec": true`` and any program as `argv`: the child `execve`s it (found on the
  request's PATH, relative to its cwd) instead of becoming a Python `__main__`; the answer comes once
  the exec succeeded, else it is an error (``"FileNotFoundError: ..."``) and no child is left
* whenever a child ends: ``{"exit": P, "code": C}`` (C as `subprocess.Popen.returncode`: the exit
  status, or minus the signal number)

``{"op": "quit"}`` (the agent stops) kills every child and ends the server. stdin's end without
it means the agent died: with STALWART_FORK_EXITS set (a directory), the server stays while its
children run, for the agent's successor to adopt them (agent/adopt.py), and writes each one's
exit code to `<that directory>/<pid>`; without it, the children are killed as on `quit`. The
client side is `agent/forkclient.py`.

Exec mode: a worker whose command is not a `python` line this server can become (`bash train.sh`,
a compiled launcher, `python -X ...`, any command while the preloading server is off) still needs
a parent that outlives its agent and notes its exit, or an agent restart costs the job an
incident. Started by the agent itself it would be the agent's child: it must die with the agent
(its exit code would be nobody's to read) or outlive it as an orphan whose end nobody sees. So the
agent runs a second server of this same file per machine (per exec prefix), with an empty preload
(STALWART_FORK_PRELOAD="") and the agent's own interpreter, and sends it ``"exec": true``
requests. Not the torch-preloading one: that one is keyed by the job's interpreter and import
environment, which a `bash` command has none of; it ends when a worker of another key is asked
for; and a `bash` job would pay its torch import (seconds, ~300 MiB) for nothing. The empty one
starts in tens of milliseconds. Its children are set up as a forked worker is (environment, cwd,
log files, own session, niceness, death signal to the server; the signals Python ignores back to
their defaults, as `subprocess` does), and it reports and notes their exits the same way, so a
successor adopts them as it adopts forked ones. A Python worker's start-up hook bounds how long it
outlives its agent (worker/frhook.py); an exec'd program has no such hook, so an orphaned server
does it for them: once the agent named in the work directory's `agent.lock` (the directory of the
child's STALWART_AGENT_SOCK) has been gone for the child's STALWART_RELINK_S seconds, it kills the
child's session and says so in the child's stderr file.
"""
from __future__ import annotations

import io
import json
import os
import selectors
import signal
import sys
import time
import types

from stalwart.errors import StalwartError

DEFAULT_PRELOAD = ("torch", "torch.distributed", "torch.nn", "torch.optim", "torch._dynamo")
PRELOAD_ENV = "STALWART_FORK_PRELOAD"     # comma list of modules (replaces the default)
PR_SET_PDEATHSIG = 1
EXITS_ENV = "STALWART_FORK_EXITS"         # where an orphaned server notes its children's exits


class Unsupported(StalwartError, ValueError):
    """A command line this server cannot become (the client starts that worker the usual way)."""


def parse_argv(argv: list[str]) -> tuple[str, str, list[str], bool]:
    """(kind, target, program argv, unbuffered) of `python [-u] [-B] (-m MOD | -c CODE | SCRIPT) ARGS`,
    kind being "module", "code" or "script". Anything else raises Unsupported."""
    rest, unbuffered = list(argv[1:]), False
    while rest and rest[0].startswith("-") and rest[0] not in ("-m", "-c", "-"):
        opt = rest.pop(0)
        if opt == "-u":
            unbuffered = True
        elif opt != "-B":
            raise Unsupported(f"interpreter option {opt!r} is not supported by the fork server")
    if not rest or rest[0] == "-":
        raise Unsupported("no module, code or script to run")
    if rest[0] in ("-m", "-c"):
        if len(rest) < 2:
            raise Unsupported(f"{rest[0]} without an argument")
        kind = "module" if rest[0] == "-m" else "code"
        return kind, rest[1], [rest[1] if kind == "module" else "-c"] + rest[2:], unbuffered
    return "script", rest[0], rest, unbuffered


def _out(msg: dict) -> None:
    data = (json.dumps(msg, separators=(",", ":")) + "\n").encode()
    while data:
        data = data[os.write(1, data):]


def _preload(names: list[str]) -> tuple[list[str], dict[str, str]]:
    done, failed = [], {}
    for name in names:
        try:
            __import__(name)
            done.append(name)
        except Exception as e:           # noqa: BLE001 - the child imports it itself, or fails there
            failed[name] = f"{type(e).__name__}: {e}"
    return done, failed


def overdue(bounded: dict[int, tuple[str, float, str]], alive: dict[str, bool], gone_since: dict[str, float],
            now: float) -> list[int]:
    """The exec'd children to stop now: those whose agent (`bounded`: child -> its agent's lock
    file, bound, stderr file; `alive`: lock file -> is its agent alive now) has been gone for at
    least their bound. `gone_since` (lock file -> when its agent was first seen gone) is brought
    up to date: an agent seen alive again starts the count over."""
    for lock, up in alive.items():
        if up:
            gone_since.pop(lock, None)
        else:
            gone_since.setdefault(lock, now)
    return sorted(pid for pid, (lock, limit, _) in bounded.items()
                  if lock in gone_since and now - gone_since[lock] >= limit)


def _die_with_parent() -> None:
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def _detach() -> None:
    """In a forked child: a session of its own, dying with the server (gone already: exit 70)."""
    server_pid = os.getppid()
    os.setsid()
    _die_with_parent()
    if os.getppid() != server_pid:        # the server died before the line above
        os._exit(70)


def _settle(req: dict, out: int, err: int) -> None:
    """In a forked child: the request's niceness (and the idle class with it), stdin from
    /dev/null, stdout and stderr to its files."""
    nice = int(req.get("nice") or 0)
    if nice:
        os.nice(nice)
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except (OSError, AttributeError):
            pass
    devnull = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((devnull, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
        os.close(fd)


class Server:
    def __init__(self) -> None:
        self.children: set[int] = set()
        self.sel = selectors.DefaultSelector()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        os.set_blocking(self.wake_r, False)
        self.buf = b""
        self.bounded: dict[int, tuple[str, float, str]] = {}    # exec'd child -> (agent.lock, bound, stderr file)
        self.gone_since: dict[str, float] = {}                  # agent.lock -> when its agent was first seen gone
        # the workers' path is theirs (their cwd or script directory, their PYTHONPATH) plus the
        # interpreter's own entries: the server's PYTHONPATH entries are not passed on
        own = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        self.base_path = [p for p in sys.path if p not in own]

    def serve(self) -> dict | None:
        """Answer requests until stdin ends (None: the server exits) or a fork happened in the
        child (the request it must become)."""
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(self.wake_w)
        self.sel.register(0, selectors.EVENT_READ, "req")
        self.sel.register(self.wake_r, selectors.EVENT_READ, "chld")
        while True:
            for key, _ in self.sel.select(timeout=1.0):
                if key.data == "chld":
                    try:
                        while os.read(self.wake_r, 512):
                            pass
                    except BlockingIOError:
                        pass
                else:
                    data = os.read(0, 1 << 16)
                    if not data:
                        if os.environ.get(EXITS_ENV) and self.children:
                            self.orphaned(os.environ[EXITS_ENV])
                        self.shutdown()
                        return None
                    self.buf += data
                    while b"\n" in self.buf:
                        line, self.buf = self.buf.split(b"\n", 1)
                        if line.strip() == b'{"op":"quit"}':
                            self.shutdown()
                            return None
                        child = self.request(line)
                        if child is not None:
                            return child
            self.reap()

    def shutdown(self) -> None:
        """The agent is gone: every child's session goes with it (they would die with the server
        anyway, by their death signal; this is the orderly way)."""
        for pid in list(self.children):
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
            try:                # (a child forked a moment ago may not have its own session yet)
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        deadline = time.time() + 5.0
        while self.children and time.time() < deadline:
            self.reap()
            time.sleep(0.01)

    def reap(self, exits: str | None = None) -> None:
        """Reap the children that ended and report each exit (to the agent, or with `exits` to
        a file of that directory)."""
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.children.discard(pid)
            self.bounded.pop(pid, None)
            code = os.waitstatus_to_exitcode(status)
            if exits is None:
                _out({"exit": pid, "code": code})
                continue
            tmp = os.path.join(exits, f".{pid}.tmp")
            try:
                with open(tmp, "w") as f:
                    f.write(str(code))
                os.replace(tmp, os.path.join(exits, str(pid)))
            except OSError:
                pass

    def orphaned(self, exits: str) -> None:
        """The agent died: keep the children (a restarted agent adopts them) until every one has
        ended, noting their exits in `exits`; an exec'd one whose agent stays gone past its bound
        is stopped (`bound`)."""
        os.makedirs(exits, exist_ok=True)
        self.sel.unregister(0)
        while True:
            self.reap(exits)
            if not self.children:
                return
            if self.bounded:
                self.bound(time.monotonic())
            for key, _ in self.sel.select(timeout=1.0):
                try:
                    while os.read(self.wake_r, 512):
                        pass
                except BlockingIOError:
                    pass

    def bound(self, now: float) -> None:
        """Kill each exec'd child whose agent has been gone for its bound (see the module's doc)."""
        from stalwart.worker.frhook import agent_alive
        alive = {lock: agent_alive(lock) for lock in {b[0] for b in self.bounded.values()}}
        for pid in overdue(self.bounded, alive, self.gone_since, now):
            _, limit, err_path = self.bounded.pop(pid)
            try:
                with open(err_path, "a") as f:
                    f.write(f"stalwart: the agent has been gone for {limit:.0f}s: this worker stops\n")
            except OSError:
                pass
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass

    def request(self, line: bytes) -> dict | None:
        try:
            req = json.loads(line)
        except ValueError:
            _out({"error": "a request that is not JSON"})
            return None
        rid = req.get("id")
        if req.get("op") != "spawn":
            _out({"id": rid, "error": f"unknown op {req.get('op')!r}"})
            return None
        try:
            if req.get("exec"):
                if not req["argv"] or not all(isinstance(a, str) for a in req["argv"]):
                    raise Unsupported("exec needs an argv of strings")
            else:
                parse_argv(list(req["argv"]))
            for k in ("env", "cwd", "stdout", "stderr"):
                if k not in req:
                    raise Unsupported(f"spawn without {k!r}")
            # the files open here, so a bad path is an error answer, not a dead child
            out = os.open(req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            err = os.open(req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except (Unsupported, OSError, KeyError, TypeError) as e:
            _out({"id": rid, "error": f"{type(e).__name__}: {e}"})
            return None
        if req.get("exec"):
            self.execute(req, rid, out, err)
            return None
        pid = os.fork()
        if pid == 0:
            try:
                self.into_child(req, out, err)
            except BaseException as e:       # noqa: BLE001 - a child that cannot start says why
                os.write(err, f"stalwart fork server: the worker could not start: {e!r}\n".encode())
                os._exit(70)
            return req
        os.close(out)
        os.close(err)
        self.children.add(pid)
        _out({"id": rid, "pid": pid})
        return None

    def execute(self, req: dict, rid: object, out: int, err: int) -> None:
        """Fork a child that execs the request's program; answer once the exec succeeded (the
        report pipe is close-on-exec: its end without a word is the success)."""
        report_r, report_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(report_r)
            try:
                self.exec_child(req, out, err)
            except BaseException as e:       # noqa: BLE001 - told to the server, which answers it
                what = f"{e.filename}: {e.strerror}" if isinstance(e, OSError) and e.strerror else str(e)
                os.write(report_w, f"{type(e).__name__}: {what}".encode(errors="replace")[:4000])
            os._exit(127)
        os.close(report_w)
        os.close(out)
        os.close(err)
        why = b""
        while chunk := os.read(report_r, 4096):
            why += chunk
        os.close(report_r)
        if why:
            os.waitpid(pid, 0)
            _out({"id": rid, "error": why.decode(errors="replace")})
            return
        self.children.add(pid)
        env = req["env"]
        sock, limit = env.get("STALWART_AGENT_SOCK"), env.get("STALWART_RELINK_S")
        try:
            if sock and limit and float(limit) > 0:
                self.bounded[pid] = (os.path.join(os.path.dirname(sock), "agent.lock"), float(limit), req["stderr"])
        except ValueError:
            pass
        _out({"id": rid, "pid": pid})

    def exec_child(self, req: dict, out: int, err: int) -> None:
        """In the forked child: become the request's program (returns only by raising)."""
        _detach()
        # handlers end at exec; what Python ignores would stay ignored (as subprocess restores them)
        for sig in (signal.SIGCHLD, signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(sig, signal.SIG_DFL)
        _settle(req, out, err)
        if req["cwd"]:
            os.chdir(req["cwd"])
        env = {str(k): str(v) for k, v in req["env"].items()}
        argv = [str(a) for a in req["argv"]]
        try:
            os.execvpe(argv[0], argv, env)
        except OSError as e:                 # (named as given, not as the last PATH entry tried)
            raise type(e)(e.errno, e.strerror, argv[0]) from None

    def into_child(self, req: dict, out: int, err: int) -> None:
        """In the forked child: leave the server behind and set up the process the worker's
        command line would have made."""
        _detach()
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        self.sel.close()
        os.close(self.wake_r)
        os.close(self.wake_w)
        _settle(req, out, err)
        os.chdir(req["cwd"] or os.getcwd())
        env = {str(k): str(v) for k, v in req["env"].items()}
        os.environ.clear()
        os.environ.update(env)
        retitle(str(req.get("title") or " ".join(req["argv"])))


def retitle(title: str) -> None:
    """Show `title` as the process' command line (`ps`, /proc/PID/cmdline: a forked worker would
    show the server's), where the `setproctitle` package is installed."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(title)


def _std_streams(unbuffered: bool) -> None:
    """New sys.stdin/stdout/stderr on fds 0-2 (the server's were a pipe): block-buffered stdout
    unless -u or PYTHONUNBUFFERED, line-buffered stderr, as the interpreter makes them."""
    enc = sys.stdout.encoding if sys.stdout else "utf-8"

    def text(fd: int, line: bool, raw_unbuffered: bool, errors: str) -> io.TextIOWrapper:
        raw = io.FileIO(fd, "w", closefd=False)
        binary = raw if raw_unbuffered else io.BufferedWriter(raw)
        return io.TextIOWrapper(binary, encoding=enc, errors=errors, line_buffering=line,  # type: ignore[arg-type]
                                write_through=raw_unbuffered)
    sys.stdout = sys.__stdout__ = text(1, False, unbuffered, "strict")
    sys.stderr = sys.__stderr__ = text(2, True, unbuffered, "backslashreplace")
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)),
                                                 encoding=enc)


def _reseed() -> None:
    """A fresh interpreter seeds `random` (and numpy's global generator) from the OS; forked ones
    would all share the server's state. (torch's default generator starts from a fixed seed in
    every process anyway.)"""
    import random
    random.seed()
    np = sys.modules.get("numpy")
    if np is not None:
        try:
            np.random.seed()
        except Exception:      # noqa: BLE001 - an odd numpy: leave it
            pass


def _sitecustomize(extra: list[str]) -> None:
    """Run a `sitecustomize` found on the worker's PYTHONPATH, as start-up would have (the agent's
    flight-recorder hook is one); the server started without the worker's PYTHONPATH."""
    if not extra:
        return
    import importlib
    import importlib.util
    saved = sys.modules.pop("sitecustomize", None)
    spec = importlib.util.find_spec("sitecustomize")
    dirs = {os.path.abspath(p) for p in extra}
    if spec is not None and spec.origin and os.path.dirname(os.path.abspath(spec.origin)) in dirs:
        importlib.import_module("sitecustomize")
    elif saved is not None:
        sys.modules["sitecustomize"] = saved


def become(req: dict, base_path: list[str]) -> None:
    """Run the worker's program in this (forked) process, as the interpreter would have: returns
    when it returns; its exceptions and SystemExit propagate as from `python -m`."""
    kind, target, argv, unbuffered = parse_argv(list(req["argv"]))
    unbuffered = unbuffered or bool(os.environ.get("PYTHONUNBUFFERED"))
    _std_streams(unbuffered)
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if kind == "script":
        first = os.path.dirname(os.path.abspath(target))
    else:
        first = os.getcwd() if kind == "module" else ""
    safe = bool(os.environ.get("PYTHONSAFEPATH"))      # as `python -P`: no first entry
    sys.path[:] = ([] if safe else [first]) + extra + [p for p in base_path if p not in extra]
    _reseed()
    _sitecustomize(extra)
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    sys.argv[:] = argv
    if kind == "module":
        import runpy
        runpy._run_module_as_main(target, alter_argv=True)  # type: ignore[attr-defined]
    elif kind == "code":
        exec(compile(target, "<string>", "exec"), main.__dict__)
    else:
        path = os.path.abspath(target)      # (as __file__ of a script is since Python 3.9)
        main.__dict__["__file__"] = path
        with open(path, "rb") as f:
            source = f.read()
        exec(compile(source, path, "exec"), main.__dict__)


def run() -> None:
    if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
        sys.path.pop(0)                  # (run by path: this directory is not the workers' path)
    if not os.environ.get(EXITS_ENV):    # (else it outlives its agent while its children run)
        _die_with_parent()
    # (set up before any environment change: setproctitle finds the memory it rewrites through
    # the environment as the interpreter started with it)
    retitle(f"stalwart fork server ({sys.executable})")
    t0 = time.time()
    names = os.environ.get(PRELOAD_ENV)
    done, failed = _preload([n for n in names.split(",") if n] if names is not None else list(DEFAULT_PRELOAD))
    server = Server()
    _out({"ready": True, "pid": os.getpid(), "preloaded": done, "failed": failed,
          "preload_s": round(time.time() - t0, 3)})
    child = server.serve()
    if child is None:
        os._exit(0)      # (nothing to clean up; tearing down an interpreter that imported torch takes a second)
    become(child, server.base_path)


if __name__ == "__main__":
    run()
