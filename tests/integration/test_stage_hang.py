"""ByteRobust Fig. 7 on a real local cluster: one pipeline stage hangs inside its send to the
neighbour stage (`stage-hang` chaos; the process stays alive and runnable, so only its stack tells
it apart). The hang is detected with its time recorded, the stacks single out the hung stage's
pipeline, the culprit machine is inside the evicted set, the evicted set is no larger than the
culprit's parallel group, and the job completes."""
import pytest

from jobrun import gpt_spec, run_job
from stalwart.analyzer.stacks import aggregate
from stalwart.controller.rules.hangstacks import to_process_stacks
from stalwart.controller.job.flows.implicit import ABNORMAL_STATES
from stalwart.controller.store.db import Store
from stalwart.topology import Topology

# 4 machines x 1 worker, tp=1, pp=2, dp=2: rank = dp + 2*pp, machine mN holds rank N.
# m1 = rank 1 = stage 0 of replica 1; its PP group is m1+m3, its DP group m0+m1.
TOPO = Topology(4, 1, tp=1, pp=2, dp=2)
CULPRIT = 1


def machines_of_group(kind: str, rank: int) -> set[str]:
    [ranks] = [g for g in TOPO.groups(kind) if rank in g]
    return {f"m{TOPO.machine_of(r)}" for r in ranks}


def worker_frames(records: list[dict], rank: int) -> list[str]:
    [rec] = [r for r in records if r.get("role") == "worker" and r.get("rank") == rank]
    # py-spy names methods with their class ("Context.maybe_hang"): keep the function's own name
    return [f["name"].rsplit(".", 1)[-1] for t in rec.get("threads") or []
            for f in t.get("frames") or []]


@pytest.mark.timeout(240)
def test_hung_pipeline_stage_is_over_evicted_with_its_pipeline(tmp_path):
    # two standbys: the culprit's whole PP group (2 machines) may be over-evicted
    spec = gpt_spec(machines=4, gpus=1, steps=50, tp=1, pp=2, dp=2, standby=2,
                    chaos=[f"stage-hang@step=20,machine={CULPRIT}"],
                    policy={"heartbeat_s": 0.5, "missed_beats": 4, "hang_timeout_floor_s": 3.0})
    rep = run_job(tmp_path, spec, timeout=200)
    assert rep["state"] == "succeeded", rep.get("reason")
    assert rep["steps_completed"] == 50
    assert len(rep["incidents"]) == 1, [(i["symptom"], i["cause"]) for i in rep["incidents"]]
    [inc] = rep["incidents"]
    assert inc["symptom"] == "hang" and inc["category"] == "implicit", inc
    assert inc["detection_s"] is not None and inc["detection_s"] < 15.0, inc
    evicted = set(inc["machines_evicted"])
    assert f"m{CULPRIT}" in evicted, inc
    # over-eviction never goes beyond the culprit's parallel group
    assert evicted <= machines_of_group("pp", CULPRIT) or \
        evicted <= machines_of_group("dp", CULPRIT), inc

    store = Store(f"sqlite:///{tmp_path}/stalwart.db")
    try:
        data = store.incidents(1)[0]["data"]
    finally:
        store.close()
    stacks = data["stacks"]
    assert set(stacks) == {"m0", "m1", "m2", "m3"}
    # the hung rank is alive and runnable (not stopped), blocked in the pipeline's send
    hung = [r for r in stacks[f"m{CULPRIT}"] if r.get("role") == "worker"]
    assert all(r.get("status") not in ABNORMAL_STATES for r in hung), hung
    names = worker_frames(stacks[f"m{CULPRIT}"], CULPRIT)
    assert {"gpipe_step", "stage_send", "maybe_hang"} <= set(names), names
    agg = aggregate(to_process_stacks(stacks, TOPO, ["m0", "m1", "m2", "m3"])[0])
    print(f"\nstage-hang: detection {inc['detection_s']:.2f}s, evicted {sorted(evicted)}, "
          f"analysis: {data.get('analysis')}")
    for key, ranks in agg.groups:
        print(f"  ranks {ranks}:\n    " + key.replace("\n", "\n    "))
    assert CULPRIT in agg.outliers
    # the flight recorder (an SDK job's too) names the hung pipeline: its ranks never entered their
    # data-parallel all-reduce, in which their peers wait (gloo records no send/recv, so the hung
    # stage and the stage blocked in recv from it look alike)
    fr = data["flight_recorder"]
    assert CULPRIT in fr["laggards"] and set(fr["laggards"]) <= set(TOPO.group("pp", CULPRIT)), fr
    assert all(g["op"] == "gloo:all_reduce" and g["group"].startswith("dp group") for g in fr["groups"]), fr
