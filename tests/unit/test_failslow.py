"""Fail-slow rounds, throughput drop and slow-rank detection."""

import pytest

from stalwart.analyzer.failslow import (FailSlowRounds, compute_outliers, domains, flag_round,
                                        healthy_pace, slow_ranks, steady_outliers, throughput_drop,
                                        trimmed_mean)
from stalwart.topology import Topology

TOPO = Topology(machines=16, gpus_per_machine=2, tp=2, pp=4, dp=4)


def ranks_on(*machines):
    return [r for m in machines for r in TOPO.ranks_of_machine(m)]


def test_domains_merge_groups_on_the_same_machines():
    ds = domains(TOPO)
    assert ("pp", (3, 7, 11, 15)) in ds and ("dp", (12, 13, 14, 15)) in ds and ("tp", (15,)) in ds
    assert len(ds) == len(set(ds)) == 16 + 4 + 4  # tp per machine, pp per replica, dp per stage


def test_flag_round_picks_group_with_most_outliers_then_smallest():
    assert flag_round(ranks_on(3, 7, 11, 15), TOPO) == ("pp", (3, 7, 11, 15))
    assert flag_round(ranks_on(15), TOPO) == ("tp", (15,))      # tie 2/2/2: fewest machines
    assert flag_round([30], TOPO) == ("tp", (15,))
    assert flag_round(ranks_on(12, 14), TOPO) == ("dp", (12, 13, 14, 15))
    assert flag_round([], TOPO) is None
    # kind order breaks a tie between equally small groups: pp before dp
    t = Topology(machines=4, gpus_per_machine=1, pp=2, dp=2)
    assert flag_round([0], t) == ("pp", (0, 2))


def test_five_noisy_rounds_find_the_degrader():
    """Machine 11 is slow; rounds also catch its pipeline neighbour 7 or a noise rank."""
    rounds = FailSlowRounds()
    seen = [ranks_on(11), ranks_on(11, 7), ranks_on(11) + [0], ranks_on(11, 7), ranks_on(11)]
    for i, outliers in enumerate(seen):
        assert rounds.add_round(outliers, TOPO, now=10.0 * i) is not None
        if i < 4:
            assert rounds.verdict() is None
    assert rounds.flags() == {("tp", (11,)): 3, ("pp", (3, 7, 11, 15)): 2}
    assert rounds.verdict() == ("tp", [11])


def test_pipeline_that_keeps_lagging_together_is_over_evicted():
    rounds = FailSlowRounds()
    for i, outliers in enumerate([ranks_on(11, 7), ranks_on(11), ranks_on(3, 11), ranks_on(7, 15),
                                  ranks_on(15)]):
        rounds.add_round(outliers, TOPO, now=10.0 * i)
    assert rounds.verdict() == ("pp", [3, 7, 11, 15])


def test_verdict_counts_cumulative_flags_and_slides():
    r = FailSlowRounds(rounds=3)
    r.add_round(ranks_on(3, 7, 11, 15), TOPO, 0)
    r.add_round(ranks_on(5), TOPO, 10)
    r.add_round(ranks_on(3, 7), TOPO, 20)
    assert r.flags()[("pp", (3, 7, 11, 15))] == 2
    assert r.verdict() == ("pp", [3, 7, 11, 15])
    r.add_round(ranks_on(5), TOPO, 30)
    r.add_round([], TOPO, 40)  # a clean round flags nothing
    assert r.verdict() == ("tp", [5])  # window now: [3,7], [5], []: tie 1-1 -> smaller domain


def test_rounds_without_outliers_give_no_verdict():
    r = FailSlowRounds()
    for i in range(5):
        assert r.add_round([], TOPO, i) is None
    assert r.ready and r.verdict() is None


def test_rounds_refuse_bad_input():
    with pytest.raises(ValueError, match="positive"):
        FailSlowRounds(rounds=0)
    r = FailSlowRounds()
    r.add_round([1], TOPO, 10)
    with pytest.raises(ValueError, match="forward"):
        r.add_round([1], TOPO, 5)
    with pytest.raises(ValueError, match="same topology"):
        r.add_round([1], Topology(machines=4, gpus_per_machine=2, tp=2, pp=2, dp=2), 20)


def test_throughput_drop():
    steady = [1.0 + 0.02 * (i % 3) for i in range(25)]
    assert not throughput_drop(steady)
    assert throughput_drop(steady[:20] + [1.6] * 5)           # 1/1.6 = 62% of the baseline
    assert not throughput_drop(steady[:20] + [1.3] * 5)       # 77%: within 30%
    assert not throughput_drop(steady[:20] + [1.0, 5.0, 1.0, 1.0, 1.0])  # one slow step
    assert not throughput_drop([1.0] * 10 + [3.0] * 5)        # not enough history
    assert throughput_drop([1.0] * 10 + [3.0] * 5, baseline_n=10)
    with pytest.raises(ValueError, match="fraction"):
        throughput_drop(steady, drop=1.5)
    with pytest.raises(ValueError, match="positive"):
        throughput_drop([1.0, 0.0])


def test_slow_ranks_high_compute_low_wait():
    step = {r: 2.0 for r in range(8)}
    wait = {r: 0.8 + 0.05 * r for r in range(8)}
    wait[5] = 0.02  # rank 5 computes 1.98 s while the others wait ~0.9 s on it
    assert slow_ranks(step, wait) == [5]


def test_slow_ranks_nothing_when_healthy_or_nobody_waits():
    step = {r: 1.0 for r in range(8)}
    assert slow_ranks(step, {r: 0.3 for r in range(8)}) == []
    assert slow_ranks(step, {r: 0.0 for r in range(8)}) == []   # no one waits: no straggler
    wait = {r: 0.3 for r in range(8)}
    wait[3] = 0.6                                               # waits more: a victim, not slow
    assert slow_ranks(step, wait) == []
    assert slow_ranks({0: 1.0, 1: 1.0}, {0: 0.0, 1: 0.5}) == []


def test_slow_ranks_refuses_bad_input():
    with pytest.raises(ValueError, match="same ranks"):
        slow_ranks({0: 1.0}, {1: 0.5})
    with pytest.raises(ValueError, match="wait <= step"):
        slow_ranks({0: 1.0, 1: 1.0, 2: 1.0}, {0: 2.0, 1: 0.0, 2: 0.0})


# per-rank compute seconds of a dp=4 job, one row per fail-slow round, measured on a 2-core host
# with rank 2's machine held to 10% of a CPU (tests/integration/test_implicit_faults.py): rank 2 is
# never 3x the job's median, but slower than its peers in every round (others now and then)
THROTTLED = [{0: 0.0319, 1: 0.0625, 2: 0.0765, 3: 0.0489}, {0: 0.0197, 1: 0.0323, 2: 0.0802, 3: 0.0205},
             {0: 0.0582, 1: 0.0304, 2: 0.0761, 3: 0.0216}, {0: 0.034, 1: 0.0292, 2: 0.0575, 3: 0.0219},
             {0: 0.0257, 1: 0.0276, 2: 0.0483, 3: 0.0171}]
DP4 = {r: [0, 1, 2, 3] for r in range(4)}


def test_compute_outliers_single_out_the_starved_rank_against_its_peers():
    flagged = [compute_outliers(row, DP4) for row in THROTTLED]
    assert all(2 in f for f in flagged) and sum(f != [2] for f in flagged) == 2
    assert steady_outliers([{f"m{r}" for r in f} for f in flagged], 5) == (["m2"], 5)
    healthy = {0: 0.031, 1: 0.0338, 2: 0.0401, 3: 0.0392}        # the same job before the fault
    assert compute_outliers(healthy, DP4) == []
    # slower by the ratio but by less than the noise floor: not slow
    assert compute_outliers({0: 0.002, 1: 0.002, 2: 0.005}, {r: [0, 1, 2] for r in range(3)}) == []
    # peers are the ranks doing the same work: a pipeline stage twice as slow as another is not slow
    two_stages = {0: 0.1, 1: 0.1, 2: 0.2, 3: 0.2}
    assert compute_outliers(two_stages, {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}) == []
    assert compute_outliers({0: 0.1, 1: 0.3}, {0: [0, 1], 1: [0, 1]}) == [1]  # two peers: the slower
    assert compute_outliers({0: 0.1}, {0: [0]}) == []                         # nobody to compare with
    with pytest.raises(ValueError, match="ratio"):
        compute_outliers({}, {}, ratio=1.0)


def test_steady_outliers_need_four_of_five_rounds():
    rounds = [{"m2"}, {"m2", "m0"}, {"m2"}, set(), {"m2"}]
    assert steady_outliers(rounds, 5) == (["m2"], 4)
    assert steady_outliers(rounds[:4], 5) == ([], 3)
    assert steady_outliers([{"m0"}, {"m1"}, {"m0", "m1"}, {"m0", "m1"}, {"m0", "m1"}], 5) == (["m0", "m1"], 4)
    assert steady_outliers([{"m9"}] * 3 + rounds, 5) == (["m2"], 4)   # only the last n rounds count
    assert steady_outliers([], 5) == ([], 0)
    with pytest.raises(ValueError):
        steady_outliers(rounds, 0)


def test_a_slowdown_during_a_quiet_period_is_caught_against_the_healthy_pace():
    fast, slow = [0.10] * 30, [0.20] * 30
    times = fast + slow
    # the steps before the recent ones are already slow: the plain window sees no drop ...
    assert not throughput_drop(times, baseline_n=20, recent_n=5)
    # ... the fastest pace seen while nobody looked does
    ref = None
    for i in range(1, len(fast) + 1):
        ref = healthy_pace(ref, times[:i], baseline_n=20)
    assert ref == pytest.approx(0.10)
    for i in range(len(fast) + 1, len(times) + 1):
        ref = healthy_pace(ref, times[:i], baseline_n=20)
    assert ref == pytest.approx(0.10)                     # slow windows never raise it
    assert throughput_drop(times, baseline_n=20, recent_n=5, reference_s=ref)
    assert healthy_pace(None, [0.1] * 19, baseline_n=20) is None
    with pytest.raises(ValueError, match="reference_s"):
        throughput_drop(times, reference_s=0.0)


def test_trimmed_mean_follows_a_rank_slow_every_other_step_and_ignores_a_lone_pause():
    from statistics import median
    throttled = [0.006, 0.085] * 5 + [0.006]          # more lucky steps than slow ones
    assert median(throttled) == 0.006                 # the median sees nothing
    assert trimmed_mean(throttled) > 0.04
    healthy = [0.012] * 9 + [1.5]                      # one GC pause
    assert trimmed_mean(healthy) == pytest.approx(0.012)
    assert trimmed_mean([0.1, 0.3]) == pytest.approx(0.2)   # too few values to trim
    with pytest.raises(ValueError):
        trimmed_mean([])


def test_a_verdict_can_ask_for_a_steady_group():
    """The most-flagged group flagged in 2 of 5 rounds is noise when 4 are asked for."""
    r = FailSlowRounds()
    for i, outliers in enumerate([ranks_on(5), ranks_on(3), ranks_on(5), [], ranks_on(9)]):
        r.add_round(outliers, TOPO, i)
    assert r.verdict() == ("tp", [5]) and r.verdict(min_flags=4) is None
    for i in range(5, 9):
        r.add_round(ranks_on(5), TOPO, i)
    assert r.verdict(min_flags=4) == ("tp", [5])          # the last 5 rounds: 9, then 5 four times


def test_slowdown_exceeds_answers_as_the_full_slowdown_does():
    """The controller's per-step question, without a median of every stretch when none can be
    fast enough: the same answer on random paces, slow tails, baselines, odd and even stretches."""
    import random

    from stalwart.analyzer.failslow import slowdown, slowdown_exceeds
    rng = random.Random(16)
    for _ in range(3000):
        n = rng.randint(0, 60)
        pace = rng.uniform(0.05, 2.0)
        times = [pace * rng.uniform(0.5, 1.5) for _ in range(n)]
        if n and rng.random() < 0.5:                       # a slow tail
            k = rng.randint(1, n)
            times[-k:] = [t * rng.uniform(1.0, 12.0) for t in times[-k:]]
        if n and rng.random() < 0.1:                       # a few very fast steps before
            for i in rng.sample(range(n), min(n, rng.randint(1, 4))):
                times[i] = pace * rng.uniform(0.01, 0.2)
        recent_n = rng.choice([2, 3, 4, 5, 6])
        base = rng.choice([None, pace * rng.uniform(0.05, 1.5)])
        factor = rng.choice([1.0, 1.5, 2.0, 5.0, 10.0, 100.0])
        assert slowdown_exceeds(times, factor, recent_n, base) == (slowdown(times, recent_n, base) >= factor), \
            (times, factor, recent_n, base)


def test_slowdown_exceeds_takes_the_quick_answers_on_a_healthy_job(monkeypatch):
    from stalwart.analyzer import failslow
    calls = []
    real = failslow.slowdown
    monkeypatch.setattr(failslow, "slowdown", lambda *a, **k: calls.append(a) or real(*a, **k))
    healthy = [0.1 + 0.001 * (i % 7) for i in range(200)]
    assert not failslow.slowdown_exceeds(healthy, 5.0, 5, 0.1)
    slow = healthy[:-5] + [0.9] * 5
    assert failslow.slowdown_exceeds(slow, 5.0, 5, 0.1)         # against the baseline alone
    assert not calls                                             # no stretch's median was taken
    assert failslow.slowdown_exceeds(slow, 5.0, 5, None) and calls   # (no baseline: the stretches)


def test_compute_outliers_from_a_groups_sorted_times_are_those_of_each_ranks_list():
    """`compute_outliers` reads each rank's median of its peers from its group's sorted times
    (ranks given one peers object); on random jobs (groups shared or one list per rank, ranks
    outside their own group or missing times, equal times, a group listing a rank twice, a NaN)
    it names the ranks a list of each rank's peers' times names."""
    import math
    import random
    from statistics import median

    def plain(compute, peers, ratio, floor_s):
        slow = []
        for r, c in compute.items():
            others = [compute[p] for p in peers.get(r, ()) if p != r and p in compute]
            if others:
                med = median(others)
                if c >= ratio * med and c - med > floor_s:
                    slow.append(r)
        return sorted(slow)

    rng = random.Random(23)
    for trial in range(500):
        world = rng.randrange(1, 30)
        size = rng.choice([1, 2, 3, 4, world])
        compute = {r: rng.choice([0.1, 0.1, 0.2, 0.3, 1.0, 0.0, 2]) for r in range(world) if rng.random() < 0.95}
        if rng.random() < 0.05 and compute:
            compute[rng.choice(list(compute))] = math.nan
        groups = [tuple(range(lo, min(world, lo + size))) for lo in range(0, world, size)]
        if rng.random() < 0.1:
            groups[0] = groups[0] + groups[0][:1]           # a rank listed twice
        shared = rng.random() < 0.7
        peers = {r: (g if shared else list(g)) for g in groups for r in g if rng.random() < 0.95}
        if rng.random() < 0.2 and world > 1:
            peers[0] = groups[-1]                           # a rank outside its own group
        ratio, floor_s = rng.choice([1.25, 1.5, 3.0]), rng.choice([0.0, 0.01])
        assert compute_outliers(compute, peers, ratio, floor_s) == plain(compute, peers, ratio, floor_s), trial
