"""policy.over_evict: a hang's outlier stacks evict their shared parallel group (ByteRobust's
over-eviction), or, switched off, only inform while stop-time checks look for the culprit."""
import pytest

from corekit import Harness, of
from stalwart import protocol as p
from stalwart.controller.job import actions as a
from stalwart.controller.job.state import JobPhase


def stack(rank: int, fn: str) -> dict:
    return {"rank": rank, "role": "worker", "status": "sleeping", "pid": 100 + rank,
            "threads": [{"thread_name": "MainThread", "frames": [{"name": fn, "module": "train"}]}]}


@pytest.mark.parametrize("over_evict", [True, False])
def test_a_hung_pipeline_is_over_evicted_or_left_to_the_checks(over_evict):
    # 8 machines x 1, pp=2 dp=4: pipelines {m0,m4}, {m1,m5}, ...; m1 hangs in a collective and its
    # pipeline peer m5 waits in recv; everyone else reached the optimizer
    h = Harness(machines=8, gpus=1, standby=2, pp=2, policy={"hang_timeout_floor_s": 2.0, "over_evict": over_evict})
    h.tick()
    h.steps(10)
    traced = of(h.advance(3.0), a.TraceStacks)
    assert traced and h.st.phase == JobPhase.TRACING
    for i, m in enumerate(h.st.slots):
        fn = {1: "all_gather", 5: "recv"}.get(i, "optimizer_step")
        h.agent(m, p.Stacks(run=1, records=[stack(i, fn)]))
    assert h.st.incident.implicit_evict == (["m1", "m5"] if over_evict else [])
    acts = h.stopped() + h.advance(2.0)
    if over_evict:
        assert [(x.machine, x.state) for x in of(acts, a.AssignMachine)] == [
            ("m1", "evicted"), ("m8", "active"), ("m5", "evicted"), ("m9", "active")]
    else:
        assert of(acts, a.RunChecks) and not of(acts, a.AssignMachine)
        assert "policy.over_evict is off" in h.st.incident.reason
