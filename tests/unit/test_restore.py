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
        assert plan(one, 6, {r: f"m{r}" for r in range(6)}, {f"m{i}" for i in range(8)}) == \
            plan(many, 6, {r: f"m{r}" for r in range(6)}, {f"m{i}" for i in range(8)})


class DictAvailability:
    """The restore availability as plain tables (rank -> tier -> step -> holder), each operation
    spelled out copy by copy: what the arrays of `Availability` must hold after the same calls."""

    def __init__(self, keep=8, memory=None):
        self.keep, self.memory, self.copies = keep, memory or {"own": 2, "backup": 2}, {}

    def add(self, rank, tier, step, holder):
        self.put(rank, tier, [step], holder)

    def put(self, rank, tier, steps, holder):
        table = self.copies.setdefault(rank, {}).setdefault(tier, {})
        for s in steps:
            table[s] = holder
        keep = min(self.keep, self.memory.get(tier, self.keep))
        for old in sorted(table)[:-keep]:
            del table[old]

    def forget(self, machine, tiers):
        for by_tier in self.copies.values():
            for tier in tiers:
                table = by_tier.get(tier, {})
                for s in [s for s, h in table.items() if h == machine]:
                    del table[s]

    def replace_columns(self, tier, machines, ranks, steps):
        for m, rs in zip(machines, ranks):
            self.forget(m, (tier,))
            for r in rs:
                if steps:
                    self.put(r, tier, steps, m)

    def forget_after(self, step):
        for by_tier in self.copies.values():
            for tier in ("own", "backup"):
                table = by_tier.get(tier, {})
                for s in [s for s in table if s > step]:
                    del table[s]

    def plan(self, world, next_machine, alive, bad):
        steps = {s for by_tier in self.copies.values() for t in by_tier.values() for s in t}
        for step in sorted(steps - set(bad), reverse=True):
            cands = {}
            for r in range(world):
                tiers, got = self.copies.get(r, {}), []
                h = tiers.get("own", {}).get(step)
                if h is not None and h == next_machine[r] and h in alive:
                    got.append({"tier": "own", "step": step, "holder": h})
                h = tiers.get("backup", {}).get(step)
                if h is not None and h in alive:
                    got.append({"tier": "backup", "step": step, "holder": h})
                h = tiers.get("durable", {}).get(step)
                if h is not None:
                    got.append({"tier": "durable", "step": step, "location": h})
                if not got:
                    break
                cands[r] = got
            else:
                return step, cands
        return -1, {}

    def held(self):
        return {r: {t: dict(tab) for t, tab in by_tier.items() if tab} for r, by_tier in self.copies.items()
                if any(by_tier.values())}


def test_the_arrays_hold_what_the_tables_copy_by_copy_do():
    """Random sequences of every operation (a rank's copy, a checkpoint's column of ranks, a
    machine's inventory, a stop report's columns with machines listed twice, ranks in two machines'
    lists and copies held by a machine listed later, a restart's forgetting, a lost machine) leave
    the same copies in `Availability` as in plain tables, and the same restore plan, saved form
    included, and the restart's candidates built from the plan's columns."""
    import random
    from stalwart.controller.job.actions import RestoreCopy
    from stalwart.controller.job.actions import RestoreCopies
    from stalwart.controller.job.state import JobState, dumps, loads
    rng = random.Random(11)
    world, machines = 7, [f"m{i}" for i in range(9)]
    for trial in range(80):
        memory = {"own": rng.choice([2, 3]), "backup": 2}
        keep = rng.choice([3, 8])
        arr, ref = Availability(keep=keep, memory=dict(memory)), DictAvailability(keep, dict(memory))
        for op in range(25):
            kind = rng.randrange(7)
            if kind == 0:
                r, tier, s = rng.randrange(world), rng.choice(["own", "backup", "durable"]), rng.randrange(12)
                h = rng.choice(machines) if tier != "durable" else f"/d/{s}"
                arr.add(r, tier, s, h)
                ref.add(r, tier, s, h)
            elif kind == 1:
                tier, s = rng.choice(["own", "durable"]), rng.randrange(12)
                ranks = [rng.randrange(world) for _ in range(rng.randrange(1, 6))]
                holders = [rng.choice(machines) for _ in ranks]
                arr.add_column(tier, ranks, s, holders)
                for r, h in zip(ranks, holders):
                    ref.add(r, tier, s, h)
            elif kind == 2:
                m, tier = rng.choice(machines), rng.choice(["own", "backup"])
                held = {rng.randrange(world): [rng.randrange(12) for _ in range(rng.randrange(0, 3))]
                        for _ in range(rng.randrange(0, 3))}
                arr.replace_held(m, tier, held)
                ref.forget(m, (tier,))
                for r, steps in held.items():
                    if steps:
                        ref.put(r, tier, steps, m)
            elif kind in (3, 4):
                tier = rng.choice(["own", "backup"])
                ms = rng.sample(machines, rng.randrange(1, 6)) if kind == 3 else \
                    [rng.choice(machines) for _ in range(rng.randrange(1, 6))]
                ranks = [rng.sample(range(world), rng.randrange(0, 3)) for _ in ms]
                lo = rng.randrange(0, 12)
                steps = list(range(lo, lo + rng.randrange(0, 4)))
                arr.replace_columns(tier, ms, ranks, steps)
                ref.replace_columns(tier, ms, ranks, steps)
            elif kind == 5:
                s = rng.randrange(12)
                arr.forget_after(s)
                ref.forget_after(s)
            else:
                m = rng.choice(machines)
                arr.drop_machine(m)
                ref.forget(m, ("own", "backup"))
            assert arr.copies == ref.held(), (trial, op)
            nxt = {r: rng.choice(machines) for r in range(world)}
            alive = set(rng.sample(machines, rng.randrange(3, 9)))
            bad = set(rng.sample(range(12), rng.randrange(0, 2)))
            want = ref.plan(world, nxt, alive, bad)
            assert plan(arr, world, nxt, alive, bad) == want, (trial, op)
            step, cols = arr.plan_columns(world, [nxt[r] for r in range(world)], alive, bad)
            assert step == want[0] and RestoreCopies(step, cols) == {   # what a restart's StartRun lists
                r: [RestoreCopy(c["tier"], c["step"], c.get("holder"), c.get("location")) for c in cs]
                for r, cs in want[1].items() if cs}, (trial, op)
        st = JobState(job_id=1, created_at=0.0, avail=arr)
        back = loads(dumps(st))
        assert back.avail.copies == ref.held() and dumps(back) == dumps(st)


def test_a_long_jobs_durable_locations_do_not_pile_up_and_the_copies_stay():
    """Every durable copy has a location of its own: after thousands of them the names the
    availability keeps are about the ones its copies still refer to, and the copies, the plan
    and the saved form are those of plain tables fed the same reports."""
    from stalwart.controller.job.state import JobState, dumps, loads
    from stalwart.controller.rules import restore
    world, memory = 4, {"own": 2, "backup": 2}
    arr, ref = Availability(keep=3, memory=dict(memory)), DictAvailability(3, dict(memory))
    steps = 10 * (3 * restore.COMPACT_NAMES // world)     # three times the names kept before a compaction
    for step in range(steps):
        ranks = list(range(world))
        arr.add_column("own", ranks, step, [f"m{r // 2}" for r in ranks])
        for r in ranks:
            ref.add(r, "own", step, f"m{r // 2}")
        if step % 10 == 0:
            urls = [f"/durable/rank{r}.step{step}" for r in ranks]
            arr.add_column("durable", ranks, step, urls)
            for r, u in zip(ranks, urls):
                ref.add(r, "durable", step, u)
    assert len(arr._names) <= restore.COMPACT_NAMES + world
    assert arr.copies == ref.held()
    nxt = {r: f"m{r // 2}" for r in range(world)}
    for alive, bad in (({"m0", "m1"}, set()), ({"m0"}, set()), ({"m0"}, {steps - 10})):
        assert plan(arr, world, nxt, alive, bad) == ref.plan(world, nxt, alive, bad)
    st = JobState(job_id=1, created_at=0.0, avail=arr)
    assert loads(dumps(st)).avail.copies == ref.held()


def test_a_restarts_candidates_from_the_plans_columns_are_the_plans_lists():
    """`RestoreCopies` (the StartRun's candidates, from `plan_columns`) lists for every rank the
    copies `plan` lists, in its order (own, backup, durable), with equal copies one object, on
    random availabilities where every rank holds some copy of the newest steps."""
    import random
    from stalwart.controller.job.actions import RestoreCopy
    from stalwart.controller.job.actions import RestoreCopies
    rng = random.Random(3)
    machines = [f"m{i}" for i in range(6)]
    for trial in range(200):
        world = rng.randrange(0, 6)
        av = Availability(keep=4, memory={"own": 2, "backup": 2})
        for r in range(world):
            for s in (4, 5):
                if rng.random() < 0.6:
                    av.add(r, "own", s, rng.choice(machines))
                if rng.random() < 0.6:
                    av.add(r, "backup", s, rng.choice(machines))
                if rng.random() < 0.7:
                    av.add(r, "durable", s, rng.choice(["/d/shared", f"/d/{r}/{s}"]))
        nxt = [rng.choice(machines) for _ in range(world)]
        alive = set(rng.sample(machines, rng.randrange(2, 7)))
        step, lists = av.plan(world, nxt, alive, set())
        got_step, cols = av.plan_columns(world, nxt, alive, set())
        got = RestoreCopies(got_step, cols)
        want = {r: [RestoreCopy(c["tier"], c["step"], c.get("holder"), c.get("location")) for c in cs]
                for r, cs in lists.items() if cs}
        assert got_step == step and got == want and len(got) == len(want), trial
        assert got.best_tiers() == {cs[0].tier for cs in want.values()}, trial
        assert all(got.get(r) is None for r in (-1, world, "0")), trial
        shared = [c for cs in got.values() for c in cs if c.location == "/d/shared"]
        assert all(c is shared[0] for c in shared), trial


def test_a_copy_added_when_the_names_are_compacted_is_kept():
    """Every durable copy has a location of its own, so the names are compacted now and then
    (`Availability._compact`); the copy whose name triggers it is kept like any other."""
    av = Availability(keep=2)
    for i in range(2100):
        av.add(0, "durable", i, f"/d/{i}")
        assert av.copies[0]["durable"] == ({i - 1: f"/d/{i - 1}"} if i else {}) | {i: f"/d/{i}"}, i
    av.replace_columns("own", ["m0", "m1"], [[0, 1], [2]], [7])
    assert {r: av.copies[r]["own"] for r in range(3)} == {0: {7: "m0"}, 1: {7: "m0"}, 2: {7: "m1"}}
