"""Restore planning: the newest step every rank can restore, and each rank's tiers in order."""
from stalwart.controller.rules.restore import Availability, plan


def av_with(world, steps, own_holder, backup_holder, durable=()):
    av = Availability()
    for r in range(world):
        for s in steps:
            av.add(r, "own", s, own_holder[r])
            av.add(r, "backup", s, backup_holder[r])
        for s in durable:
            av.add(r, "durable", s, f"/d/rank{r}.step{s}")
    return av


def test_same_machines_restore_from_own_memory_newest_step():
    av = av_with(2, [8, 9], {0: "m0", 1: "m1"}, {0: "m1", 1: "m0"}, durable=[4])
    step, c = plan(av, 2, {0: "m0", 1: "m1"}, {"m0", "m1"})
    assert step == 9
    assert [x["tier"] for x in c[0]] == ["own", "backup"]


def test_replaced_machine_restores_from_backup_peer():
    av = av_with(2, [8, 9], {0: "m0", 1: "m1"}, {0: "m1", 1: "m0"})
    av.drop_machine("m1")
    step, c = plan(av, 2, {0: "m0", 1: "m2"}, {"m0", "m2"})
    assert step == 9
    assert c[1] == [{"tier": "backup", "step": 9, "holder": "m0"}]
    assert c[0][0]["tier"] == "own"


def test_machine_and_backup_lost_falls_back_to_common_durable_step():
    av = av_with(2, [8, 9], {0: "m0", 1: "m1"}, {0: "m1", 1: "m0"}, durable=[4])
    for m in ("m0", "m1"):
        av.drop_machine(m)
    step, c = plan(av, 2, {0: "m2", 1: "m3"}, {"m2", "m3"})
    assert step == 4 and all(x[0]["tier"] == "durable" for x in c.values())


def test_bad_step_is_skipped_and_nothing_means_fresh_start():
    av = av_with(1, [8, 9], {0: "m0"}, {0: "m1"})
    assert plan(av, 1, {0: "m0"}, {"m0", "m1"}, bad_steps={9})[0] == 8
    assert plan(Availability(), 2, {0: "m0", 1: "m1"}, {"m0", "m1"}) == (-1, {})


def test_keeps_only_recent_steps():
    av = Availability(keep=2)
    for s in range(5):
        av.add(0, "own", s, "m0")
    assert sorted(av.copies[0]["own"]) == [3, 4]


def test_a_whole_job_column_of_inventories_leaves_what_each_machine_alone_does():
    """`replace_columns` (a stop report's tier for many machines at once) leaves the same copies as
    `replace_ranks` machine by machine: holders that change, ranks backed up by several machines,
    trimming to the tier's newest steps, machines that hold nothing, an empty inventory."""
    import random
    rng = random.Random(7)
    for trial in range(40):
        one, many = Availability(memory={"own": 2, "backup": 2}), Availability(memory={"own": 2, "backup": 2})
        for av in (one, many):
            for r in range(6):
                av.add(r, "own", 1, f"m{r}")
                av.add(r, "durable", 0, "/d/0")
        for _ in range(4):
            tier = rng.choice(["own", "backup"])
            machines = [f"m{rng.randrange(8)}" for _ in range(rng.randrange(1, 7))]
            ranks = [tuple(rng.sample(range(6), rng.randrange(0, 3))) for _ in machines]
            lo = rng.randrange(0, 5)
            steps = list(range(lo, lo + rng.randrange(0, 4)))
            for m, rs in zip(machines, ranks):
                one.replace_ranks(m, tier, rs, steps)
            many.replace_columns(tier, machines, ranks, steps)
            assert one.copies == many.copies, trial
            assert {k: v for k, v in one._holders.items() if v} == {k: v for k, v in many._holders.items() if v}
        assert plan(one, 6, {r: f"m{r}" for r in range(6)}, {f"m{i}" for i in range(8)}) == \
            plan(many, 6, {r: f"m{r}" for r in range(6)}, {f"m{i}" for i in range(8)})
