"""The agent's controller session: it registers with what the agent says it runs, takes the
interval the controller asks for, hands each typed command to its executor, reports a command it
cannot read or carry out as `command_failed` and goes on with the next, and delivers what the
agent's parts emit, stamped with the machine."""
from __future__ import annotations

import threading
import time

from stalwart import protocol as p
from stalwart.agent.session import ControllerSession

WAIT_S = 10.0


class FakeLink:
    """The line to a controller that answers at once (agent/link.py's calls)."""
    urls = ["http://127.0.0.1:9"]
    over_channel = True

    def __init__(self, commands: list[dict]):
        self.registered: list[dict] = []
        self.delivered: list[dict] = []
        self._commands = [commands]
        self._lock = threading.Lock()

    def register(self, reg: dict) -> dict:
        self.registered.append(reg)
        return {"heartbeat_s": 0.05, "missed_beats": 4, "role": "active"}

    def beat(self, body: dict, timeout: float) -> dict:
        return {}

    def commands(self, wait: float) -> list[dict]:
        with self._lock:
            if self._commands:
                return self._commands.pop()
        time.sleep(min(wait, 0.05))
        return []

    def events(self, batch: list[dict]) -> dict:
        with self._lock:
            self.delivered.extend(batch)
        return {"taken": True}

    def find_controller(self, path: str | None) -> None:
        pass

    def close(self) -> None:
        pass


class Executor:
    def __init__(self) -> None:
        self.done: list[p.Command] = []
        self.polls = 0

    def execute(self, cmd: p.Command) -> None:
        if isinstance(cmd, p.Trace) and cmd.run == 13:
            raise RuntimeError("no such run")
        self.done.append(cmd)

    def poll_wait(self) -> float:
        return 0.05

    def after_poll(self) -> None:
        self.polls += 1


def wait_for(cond) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_commands_reach_the_executor_typed_and_a_bad_one_is_reported():
    link = FakeLink([{"type": "stop", "run": 3}, {"type": "no-such-command"}, {"type": "trace", "run": 13},
                     {"type": "trace", "run": 4}])
    stop = threading.Event()
    intervals: list[float] = []
    session = ControllerSession(link, "m1", lambda: p.Registration(address="10.0.0.1", gpus=2, running_run=4),
                                lambda: [], lambda: 1, stop, heartbeat_s=1.0, on_heartbeat_s=intervals.append)
    ex = Executor()
    session.start(ex)
    try:
        wait_for(lambda: ex.polls >= 2)
        session.emit(p.Started(run=4, pids=[7]))
        wait_for(lambda: len(link.delivered) >= 3)
    finally:
        stop.set()
    assert link.registered[0]["running_run"] == 4 and link.registered[0]["gpus"] == 2
    assert session.registered.is_set() and intervals == [0.05] and session.heartbeat_s == 0.05
    assert session.relink_s == round(0.05 * 4 + 5.0, 1)
    assert ex.done == [p.Stop(run=3), p.Trace(run=4)]
    failed = [e for e in link.delivered if e["type"] == "command_failed"]
    assert [(e["command"], e["machine"]) for e in failed] == [("no-such-command", "m1"), ("trace", "m1")]
    assert "no such run" in failed[1]["error"]
    started = next(e for e in link.delivered if e["type"] == "started")
    assert started["machine"] == "m1" and started["t"] > 0 and started["pids"] == [7]
