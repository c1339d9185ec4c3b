"""Jobs take machines in submission order (Controller.free_for): only the oldest waiting job
sees free machines, a running job refills standbys only while nobody waits, and machines another
job has just decided to take are never offered twice."""
import threading
from dataclasses import dataclass, field

import pytest

from stalwart.controller.service import Controller


@dataclass
class FakeRunner:
    job_id: int
    waiting: bool = True
    terminal: bool = False
    mine: set = field(default_factory=set)

    thread = threading.Thread()        # (never started: a runner the controller made but did not run)

    def held(self):
        return set(self.mine)

    def stop(self) -> None:
        self.terminal = True


@pytest.fixture
def ctl(tmp_path):
    c = Controller(f"sqlite:///{tmp_path}/s.db", str(tmp_path))
    for i in range(6):
        c.register(f"m{i}", {"address": "127.0.0.1", "gpus": 1})
    try:
        yield c
    finally:
        c.close()


def test_only_the_oldest_waiting_job_sees_free_machines(ctl):
    a, b = FakeRunner(1), FakeRunner(2)
    ctl.jobs.update({1: a, 2: b})
    assert ctl.free_for(1) == [f"m{i}" for i in range(6)]
    assert ctl.free_for(2) == []                          # B waits behind A
    a.waiting, a.mine = False, {"m0", "m1", "m2"}         # A decided (its assignment not applied yet)
    assert ctl.free_for(2) == ["m3", "m4", "m5"]          # never the machines A holds
    assert ctl.free_for(1) == []                          # A running: B waits, no refill for A
    b.waiting, b.mine = False, {"m3", "m4"}
    assert ctl.free_for(1) == ["m5"] and ctl.free_for(2) == ["m5"]   # nobody waits: refills may use it
    a.terminal = True
    assert ctl.free_for(2) == ["m0", "m1", "m2", "m5"]    # a finished job holds nothing


def test_a_later_job_does_not_jump_the_queue(ctl):
    a, b, c = FakeRunner(1, waiting=False, mine={f"m{i}" for i in range(5)}), FakeRunner(2), FakeRunner(3)
    ctl.jobs.update({1: a, 2: b, 3: c})
    assert ctl.free_for(2) == ["m5"]                      # B is first in line (it needs more: it waits)
    assert ctl.free_for(3) == []                          # C would fit on m5 but comes after B
