"""Steps of the wall clock during a job: the controller's deadlines do not move.

The controller of a real local job runs with `time.time` moved by an offset the test sets (what
an NTP step or `date -s` does to it, without touching the host's clock): one hour ahead, then two
hours back. Heartbeat and hang deadlines run on the steady clock (`stalwart.controller.clock`) and agents'
reports are judged by when they arrive, so no machine is called lost and no hang is declared."""
import sys
import time

import pytest

from jobrun import gpt_spec, wait_for
from stalwart.backends.local import LocalCluster
from test_controller_restart import finish, status

# the controller's entry point, with time.time() = the real one + the offset in a file
STEPPED = """
import os, sys, threading, time
real, offset, path = time.time, [0.0], os.environ["STALWART_TEST_CLOCK_OFFSET"]
def follow():
    while True:
        try:
            with open(path) as f:
                offset[0] = float(f.read() or 0)
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
threading.Thread(target=follow, daemon=True).start()
time.time = lambda: real() + offset[0]
from stalwart.cli import main
sys.exit(main(sys.argv[1:]))
"""


class SteppedClockCluster(LocalCluster):
    def __init__(self, *a, offset_file: str, **kw):
        super().__init__(*a, **kw)
        self.offset_file = offset_file

    def _spawn(self, argv, log_name):
        if log_name == "controller.log":
            import os
            os.environ["STALWART_TEST_CLOCK_OFFSET"] = self.offset_file
            argv = [sys.executable, "-c", STEPPED] + list(argv[3:])
        return super()._spawn(argv, log_name)


@pytest.mark.timeout(240)
def test_wall_clock_steps_cause_no_loss_and_no_hang(tmp_path, monkeypatch):
    offset = tmp_path / "offset"
    offset.write_text("0")
    monkeypatch.setenv("STALWART_TEST_CLOCK_OFFSET", str(offset))
    spec = gpt_spec(machines=2, gpus=1, dp=2, steps=10**6)   # (it trains until the test cancels it)
    from stalwart.spec import JobSpec
    js = JobSpec.from_dict(spec)
    cluster = SteppedClockCluster(str(tmp_path / "c"), 2, 1, heartbeat_s=js.policy.heartbeat_s,
                                  missed_beats=js.policy.missed_beats, offset_file=str(offset))
    try:
        cluster.start()
        job = cluster.client().post("/api/jobs", {"spec": js.to_dict()})["job"]
        def step() -> int:
            st = status(cluster, job)
            assert st["state"] == "running", (st["state"], st.get("reason"))
            return (st.get("live") or {}).get("step", 0)
        assert wait_for(lambda: step() >= 10, timeout=120)
        offset.write_text("3600")             # one hour ahead
        s = step()
        assert wait_for(lambda: step() >= s + 15, timeout=60)
        time.sleep(3 * js.policy.heartbeat_s * js.policy.missed_beats)
        offset.write_text("-3600")            # two hours back
        s = step()
        assert wait_for(lambda: step() >= s + 15, timeout=60)
        time.sleep(3 * js.policy.heartbeat_s * js.policy.missed_beats)
        assert step() > s
        cluster.client().post(f"/api/jobs/{job}/cancel", {"reason": "the clock test is over"})
        rep = finish(cluster, job, timeout=120)
        assert rep["state"] == "cancelled", rep.get("reason")
        assert rep["incidents"] == [] and len(rep["runs"]) == 1
        assert all(m["state"] != "evicted" for m in rep["machines"])
    finally:
        cluster.stop()
