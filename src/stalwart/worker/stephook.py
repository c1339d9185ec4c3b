"""The step hook: a plain training script's steps and snapshots, without a line of its code changed.

A script that does not use the SDK reports no steps, yet its progress line, its ETTR and the hang
timer all want them. Every training loop ends its step with ``optimizer.step()``, so torch's global
optimizer hook (``torch.optim.optimizer.register_optimizer_step_post_hook``) sees each step the moment it ends.
A script's own snapshots are ``torch.save(state, path)`` and ``torch.load(path)``: wrapping both
tells at which step a file was written and that a restarted script read it back, which is what
numbers its steps across restarts (the controller keeps the marks: ``controller/rules/scriptsteps.py``).
A file object open on a file counts as its path; a checkpoint loaded without a mark that names its
own ``global_step`` (Lightning's, written through an in-memory buffer) holds that many steps.

``hookdir/sitecustomize.py`` loads this file at interpreter start-up (beside the flight-recorder
hook) and calls :func:`start`. The hooks are installed as soon as ``torch`` is imported (at once in
a worker forked from a fork server that imported it already; otherwise by an import hook that runs
after ``import torch`` finished), so no step is missed.

A step is counted when the *lead* optimizer steps: the first one that stepped, or the next one once
it is gone. Two optimizers stepping in one iteration (a GAN, an optimizer wrapping another) count
one step; an optimizer made afresh every epoch takes the lead when its predecessor is collected.

The steps a snapshot holds also go on the file itself, as an extended attribute
(``user.stalwart.steps``, where the file system keeps them: ext4, xfs, btrfs, Lustre, tmpfs since
Linux 6.6), so that a restarted script that loads it knows where it stands even when the records of
the save died with a lost machine. A save's records are written before ``torch.save`` returns.

Records (``["s", n, t]`` a step, ``["save", n, t, path]``, ``["load", n, t, path, steps]`` (the
file's mark, or None), ``["move", n, t, path, new_path]`` a saved file renamed (``os.replace``,
``os.rename``: an atomic save); ``n`` is the number of steps this process has completed) are kept in
order in memory and written every ``STALWART_FR_PERIOD`` seconds by a daemon thread to
``STALWART_FR_DIR/<pid>-<seq>.steps`` (atomically); the agent reads and deletes them
(agent/scriptsteps.py). Standard library only; never raises into the training script.
"""
from __future__ import annotations

import atexit
import importlib.abc
import importlib.machinery
import json
import os
import sys
import threading
import time
import weakref
from typing import Any

DIR_ENV = "STALWART_FR_DIR"
PERIOD_ENV = "STALWART_FR_PERIOD"
SUFFIX = ".steps"
XATTR = "user.stalwart.steps"
_replace = os.replace          # (the hook wraps os.replace; its own writes are no renames of a snapshot)


class Steps:
    """What one process did: its step count and the records not yet written."""

    def __init__(self) -> None:
        self.n = 0
        self.records: list[list] = []
        self.lock = threading.Lock()
        self.lead: weakref.ref | None = None
        self.seq = 0
        self.saved: set[str] = set()        # paths this process saved (a rename of one moves its mark)
        self.base: int | None = None        # the job's steps before this process' first (a loaded mark)
        self.unmarked = False               # loaded a file without a mark first: base unknown here
        self.directory: str | None = None   # where the records go (start() sets it)
        self.flushing = threading.Lock()

    def on_step(self, opt: Any) -> None:
        lead = self.lead() if self.lead is not None else None
        if lead is None:
            self.lead, lead = weakref.ref(opt), opt
        if opt is not lead:
            return
        with self.lock:
            self.n += 1
            self.records.append(["s", self.n, time.time()])

    def on_file(self, kind: str, f: Any, obj: Any = None) -> None:
        """`torch.save` wrote or `torch.load` read `f` (`obj`: what the load returned)."""
        path = file_path(f)
        held = None
        if kind == "load":
            held = read_mark(path) if path is not None else None
            if held is None:
                held = checkpoint_step(obj)
        if path is None and held is None:
            return
        with self.lock:
            if kind == "load":
                if self.n == 0 and self.base is None:
                    if held is not None:
                        self.base = held
                    else:
                        self.unmarked = True
                self.records.append([kind, self.n, time.time(), path or "", held])
            elif path is not None:
                if self.base is None and not self.unmarked:
                    self.base = 0           # nothing loaded before: the script starts from scratch
                write_mark(path, None if self.base is None else self.base + self.n)
                self.records.append([kind, self.n, time.time(), path])
                self.saved.add(path)
        if kind == "save" and path is not None and self.directory:
            self.flush(self.directory)      # a snapshot's mark is on disk before torch.save returns

    def on_move(self, src: Any, dst: Any) -> None:
        """A file this process saved was renamed (the write-then-rename of an atomic save)."""
        if not self.saved:
            return
        a, b = file_path(src), file_path(dst)
        if a is None or b is None or a not in self.saved:
            return
        with self.lock:
            self.saved.discard(a)
            self.saved.add(b)
            self.records.append(["move", self.n, time.time(), a, b])

    def take(self) -> list[list]:
        with self.lock:
            out, self.records = self.records, []
        return out

    def flush(self, directory: str) -> str | None:
        """Write the pending records to a new file of `directory`; its path, or None if none."""
        with self.flushing:
            records = self.take()
            if not records:
                return None
            self.seq += 1
            path = os.path.join(directory, f"{os.getpid()}-{self.seq:09d}{SUFFIX}")
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(records, f, separators=(",", ":"))
            _replace(tmp, path)
            return path


def read_mark(path: str) -> int | None:
    """The steps a snapshot holds, from the extended attribute its save left on it (None where
    the file has none or the file system keeps none)."""
    try:
        return int(os.getxattr(path, XATTR))
    except (OSError, ValueError, AttributeError):
        return None


def write_mark(path: str, steps: int | None) -> None:
    """Tag a saved file with the job's steps it holds (an extended attribute: it travels with the
    file through a rename, and is there when a restarted script loads it, whatever happened to the
    records in between). Where the file system keeps none, the controller's marks still number it."""
    if steps is None:
        return
    try:
        os.setxattr(path, XATTR, str(steps).encode())
    except (OSError, AttributeError):
        pass


def file_path(f: Any) -> str | None:
    """The absolute path `torch.save`/`torch.load` was given: a path, or a file object open on a
    file of the file system (its `name`, or fsspec's local `path`); None for an in-memory buffer."""
    if isinstance(f, (str, bytes)) or hasattr(f, "__fspath__"):
        try:
            p = os.fsdecode(os.fspath(f))
        except TypeError:
            return None
        return os.path.abspath(p)
    for attr in ("name", "path"):
        try:
            name = getattr(f, attr, None)
        except Exception:    # noqa: BLE001 - a file object's property: never into the training script
            continue
        if isinstance(name, str) and name and os.path.isfile(name):
            return os.path.abspath(name)
    return None


def checkpoint_step(obj: Any) -> int | None:
    """The optimizer steps a loaded checkpoint says it holds, for one that carries no mark: its
    `global_step` (Lightning's checkpoints, and scripts that keep the name). Lightning saves through
    an in-memory buffer that it writes to the file, so its files never carry a mark."""
    if not isinstance(obj, dict):
        return None
    step = obj.get("global_step")
    return step if type(step) is int and step >= 0 else None


STATE = Steps()


def install(torch: Any, state: Steps = STATE) -> bool:
    """Hook `torch`'s optimizers, save and load (once per process); False where this torch lacks
    the global optimizer hook."""
    if getattr(torch, "_stalwart_steps", None) is state:
        return True
    try:
        import importlib
        register = getattr(importlib.import_module("torch.optim.optimizer"), "register_optimizer_step_post_hook", None)
    except ImportError:
        return False
    if register is None:
        return False
    register(lambda opt, args, kwargs: state.on_step(opt))
    save, load = torch.save, torch.load

    def saved(obj, f, *a, **kw):
        out = save(obj, f, *a, **kw)
        state.on_file("save", f)
        return out

    def loaded(f, *a, **kw):
        out = load(f, *a, **kw)
        state.on_file("load", f, out)
        return out

    for fn, orig in ((saved, save), (loaded, load)):
        fn.__wrapped__ = orig          # type: ignore[attr-defined]
        fn.__name__, fn.__qualname__, fn.__doc__ = orig.__name__, orig.__qualname__, orig.__doc__
    torch.save, torch.load = saved, loaded
    for name in ("replace", "rename"):
        orig_move = getattr(os, name)

        def moved(src, dst, *a, _orig=orig_move, **kw):
            out = _orig(src, dst, *a, **kw)
            state.on_move(src, dst)
            return out
        moved.__wrapped__ = orig_move        # type: ignore[attr-defined]
        moved.__name__ = moved.__qualname__ = name
        setattr(os, name, moved)
    torch._stalwart_steps = state
    return True


class _AfterTorch(importlib.abc.MetaPathFinder):
    """Runs `install` right after `import torch` completed (the module fully initialised)."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        inner = spec.loader
        exec_module = inner.exec_module

        def run(module):
            exec_module(module)
            try:
                install(module)
            except Exception as e:    # noqa: BLE001 - never into the training script
                sys.stderr.write(f"stalwart: the step hook did not install: {e}\n")
        inner.exec_module = run       # type: ignore[method-assign]
        return spec


def _sdk() -> bool:
    """The SDK reports this process' steps itself."""
    return "stalwart.worker.context" in sys.modules


def _loop(directory: str, period: float) -> None:
    while True:
        time.sleep(period)
        try:
            if _sdk():
                STATE.take()
                continue
            STATE.flush(directory)
        except Exception:       # noqa: BLE001 - a full disk: try again next period
            continue


def start() -> threading.Thread | None:
    """Hook torch (now or when it is imported) and start the writer thread, when the agent asked
    for it (STALWART_FR_DIR set, period > 0)."""
    directory = os.environ.get(DIR_ENV)
    try:
        period = float(os.environ.get(PERIOD_ENV, "1"))
    except ValueError:
        return None
    if not directory or not period > 0:
        return None
    STATE.directory = directory
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "optim"):
        install(torch)
    elif not any(isinstance(f, _AfterTorch) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTorch())

    def at_exit() -> None:
        try:
            if not _sdk():
                STATE.flush(directory)
        except Exception:     # noqa: BLE001
            pass
    atexit.register(at_exit)
    t = threading.Thread(target=_loop, args=(directory, period), name="stalwart-steps", daemon=True)
    t.start()
    return t
