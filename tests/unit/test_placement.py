"""Topology-aware standby choice: the pure rule, and the job core using it through the cluster's
labels (the controller's registry, or the simulator's machines)."""
from corekit import Harness, of, records
from stalwart.controller.cluster import placement
from stalwart.controller.job import actions as a
from stalwart.controller.job.events import MachineLost

SW = lambda s, p: {"switch": s, "pod": p}  # noqa: E731


def test_distance_counts_switch_then_pod():
    group = [SW("s1", "p0"), SW("s2", "p0")]
    assert placement.distance(SW("s2", "p0"), group) == 0
    assert placement.distance(SW("s9", "p0"), group) == 1
    assert placement.distance(SW("s9", "p5"), group) == 2
    assert placement.distance({}, group) == 2 and placement.distance(SW("s1", "p0"), []) == 2


def test_the_nearest_standby_replaces_each_evicted_machine_in_slot_order():
    labels = {"x": SW("s7", "p1"), "y": SW("s3", "p0"), "z": SW("s1", "p0")}
    groups = {"m1": [SW("s0", "p0"), SW("s1", "p0")], "m2": [SW("s3", "p0")]}
    plan = placement.replacement_plan(["m0", "m1", "m2"], ["m2", "m1"], ["x", "y", "z"], groups, labels)
    assert plan == {"m1": "z", "m2": "y"}
    # a tie at the same distance goes to the standby sharing the label with more of the group
    labels = {"x": SW("s0", "p0"), "y": SW("s1", "p0")}
    groups = {"m1": [SW("s0", "p0"), SW("s1", "p0"), SW("s1", "p0")]}
    assert placement.replacement_plan(["m1"], ["m1"], ["x", "y"], groups, labels) == {"m1": "y"}
    # nobody near: falling back by distance (same pod first), then the pool's order
    labels = {"x": SW("s8", "p3"), "y": SW("s9", "p0"), "w": SW("s5", "p3")}
    assert placement.replacement_plan(["m1"], ["m1"], ["x", "w", "y"], {"m1": [SW("s0", "p0")]},
                                      labels) == {"m1": "y"}
    assert placement.replacement_plan(["m1"], ["m1"], ["x", "w"], {"m1": [SW("s0", "p0")]}, labels) == {"m1": "x"}


def test_without_labels_the_pool_order_decides_as_before():
    assert placement.replacement_plan(("m0", "m1", "m2", "m3"), ["m3", "m1"], ("m4", "m5")) == \
        {"m1": "m4", "m3": "m5"}


def test_the_job_core_puts_a_lost_machine_s_standby_under_its_pipeline_s_switch():
    """4 machines, pp=2 dp=2: m0,m2 and m1,m3 are pipelines. Two standbys: m4 in another pod, m5
    under the switch of m1's pipeline. m1 is lost: m5 takes its ranks although m4 comes first."""
    h = Harness(machines=4, gpus=1, standby=2, pp=2)
    h.cluster.tags = {"m0": SW("s0", "p0"), "m1": SW("s1", "p0"), "m2": SW("s0", "p0"), "m3": SW("s1", "p0"),
                      "m4": SW("s9", "p9"), "m5": SW("s1", "p0")}
    h.tick()
    assert h.st.pool.standby == ["m4", "m5"]
    h.steps(3)
    h.cluster.dead.add("m1")
    h.event(MachineLost(machine="m1"))
    acts = h.stopped(["m0", "m2", "m3"])
    assert [(x.machine, x.state) for x in of(acts, a.AssignMachine)] == [("m1", "evicted"), ("m5", "active")]
    assert records(acts, "standby_placed") == [{"machine": "m5", "replaces": "m1", "incident": 1,
                                                "near": "switch"}]
    assert of(acts, a.StartRun)[0].slots == ["m0", "m5", "m2", "m3"]
