"""Stop-time diagnostics: the pair schedule and the pure judges over check results."""

import json
from collections import Counter

import pytest

from stalwart.diag.pairs import (edge_of, edge_round, judge_digests, judge_pairs, judge_speed, pair_rounds,
                                 pairs_of, ring_edges, round_count)
from stalwart.diag.worker import PlanError, load_plan

# -- pair_rounds ----------------------------------------------------------------------------


@pytest.mark.parametrize("n", range(1, 10))
def test_pair_rounds_cover_the_ring_with_disjoint_rounds(n):
    rounds = pair_rounds(n)
    pairs = [p for r in rounds for p in r]
    assert sorted(pairs) == sorted(ring_edges(n))
    assert len(set(pairs)) == len(pairs)
    for r in rounds:                                   # nobody in two pairs of one round
        members = [m for p in r for m in p]
        assert len(members) == len(set(members))
        assert r, "no empty round"
    if n < 2:
        assert rounds == []
    elif n == 2:
        assert rounds == [[(0, 1)]]
    else:
        assert len(rounds) == (2 if n % 2 == 0 else 3)
        count = Counter(m for p in pairs for m in p)
        assert count == {m: 2 for m in range(n)}      # every machine in exactly two pairs
        for m in range(n):                             # ... with two different partners
            partners = {p[0] if p[1] == m else p[1] for p in pairs if m in p}
            assert len(partners) == 2 and m not in partners


def test_one_machine_s_pairs_are_what_the_whole_schedule_gives_it():
    """`pairs_of`, `edge_of`, `edge_round` and `round_count` answer for one machine or one edge
    what scheduling the whole ring (`pair_rounds`) gives, for every ring size up to 60; and the
    checks' action gives each machine its side of its pairs with their rendezvous prefixes."""
    from stalwart.controller.job.actions import RunChecks
    for n in range(0, 61):
        rounds = pair_rounds(n)
        assert round_count(n) == len(rounds)
        want: dict[int, list] = {i: [] for i in range(n)}
        for r, round_pairs in enumerate(rounds):
            for i, j in round_pairs:
                want[i].append((r, j, 0))
                want[j].append((r, i, 1))
        assert [pairs_of(n, i) for i in range(n)] == [want[i] for i in range(n)], n
        edges = ring_edges(n)
        for e, (i, j) in enumerate(edges):
            assert edge_of(n, i, j) == edge_of(n, j, i) == e and (i, j) in rounds[edge_round(n, e)]
        assert sum(edge_of(n, i, j) is not None for i in range(n) for j in range(n)) == 2 * len(edges)
    ring = [f"m{i}" for i in range(5)]
    act = RunChecks(name="d", checks=["inter"], machines=ring, ring=ring)
    assert [(x.round, x.peer, x.rank, x.prefix) for x in act.inter_of("m0")] == [
        (0, "m1", 0, "d/r0/m0-m1/"), (2, "m4", 0, "d/r2/m0-m4/")]
    assert [(x.round, x.peer, x.rank) for x in act.inter_of("m4")] == [(1, "m3", 1), (2, "m0", 1)]
    assert act.pairs_of("elsewhere") == [] and RunChecks(name="d", checks=[], machines=ring).inter_of("m0") == []


def test_pair_rounds_even_split_by_parity():
    assert pair_rounds(4) == [[(0, 1), (2, 3)], [(1, 2), (0, 3)]]


# -- judge_pairs ----------------------------------------------------------------------------


def ok(mbps=1000.0):
    return {"ok": True, "mbps": mbps, "detail": "ok"}


def failed(detail="timeout"):
    return {"ok": False, "mbps": None, "detail": detail}


def test_judge_pairs_all_good():
    v = judge_pairs({p: ok(1000 + 10 * p[0]) for p in ring_edges(6)}, 6)
    assert v["bad_machines"] == [] and v["bad_links"] == []
    assert set(v["pairs"]) == {"0-1", "1-2", "2-3", "3-4", "4-5", "0-5"}
    assert not any(p["bad"] for p in v["pairs"].values())


def test_judge_pairs_slow_machine_is_bad_in_both_pairs():
    results = {p: ok(40_000.0) for p in ring_edges(6)}
    results[(2, 3)] = ok(2000.0)                   # machine 3's NIC is slow: both pairs slow
    results[(3, 4)] = ok(1800.0)
    v = judge_pairs(results, 6)
    assert v["bad_machines"] == [3]
    assert v["bad_links"] == []
    assert v["pairs"]["2-3"]["bad"] and v["pairs"]["3-4"]["bad"]
    assert v["pairs"]["2-3"]["mbps"] == 2000.0


def timed(nbytes, seconds, latency_s=0.0004):
    """A pair's result as the check reports it, from a synthetic transfer time."""
    return {"ok": True, "mbps": nbytes * 8 / 1e6 / seconds, "latency_s": latency_s, "detail": "ok"}


@pytest.mark.parametrize("n", [3, 4, 5, 8])
def test_a_slow_machine_fails_only_its_own_pairs_against_the_others(n):
    """Synthetic timings: 2 MiB in ~2 ms on healthy pairs (with noise), the pairs through machine 1
    throttled 50x. Only machine 1 is bad, with n = 3 too, where two of the three pairs are slow
    (the median pair would be a slow one: the reference is each machine's best pair)."""
    noise = [1.0, 1.7, 0.8, 2.5, 1.2, 0.9, 3.0, 1.1]
    results = {}
    for k, (i, j) in enumerate(ring_edges(n)):
        seconds = 0.002 * noise[k % len(noise)]
        results[(i, j)] = timed(2 << 20, seconds * 50 if 1 in (i, j) else seconds)
    v = judge_pairs(results, n, min_ratio=0.1, min_mbps=5.0)
    assert v["bad_machines"] == [1] and v["bad_links"] == []
    slow = {k for k, p in v["pairs"].items() if p["bad"]}
    assert slow == {f"{i}-{j}" for i, j in ring_edges(n) if 1 in (i, j)}
    assert all("x the others'" in v["pairs"][k]["why"] for k in slow)
    assert v["reference_mbps"] > 2000


def test_a_busy_host_is_not_a_slow_link():
    """Healthy pairs measured several times apart (a busy host) and one pair 8x slower than the
    best: within the ratio, nobody is bad."""
    results = {p: timed(2 << 20, 0.002 * f) for p, f in zip(ring_edges(6), [1, 3, 8, 2, 5, 1.5])}
    v = judge_pairs(results, 6, min_ratio=0.1, min_mbps=5.0)
    assert v["bad_machines"] == [] and v["bad_links"] == [] and not any(p["bad"] for p in v["pairs"].values())


def test_latency_far_above_the_others_fails_a_pair_but_noise_does_not():
    results = {p: timed(2 << 20, 0.002, latency_s=0.0005) for p in ring_edges(4)}
    results[(0, 1)] = timed(2 << 20, 0.002, latency_s=0.03)       # 60x, but only 30 ms: noise
    assert judge_pairs(results, 4, min_ratio=0.1, min_mbps=5.0)["bad_links"] == []
    results[(0, 1)] = timed(2 << 20, 0.002, latency_s=0.4)        # 400 ms: a delayed link
    v = judge_pairs(results, 4, min_ratio=0.1, min_mbps=5.0)
    assert v["bad_links"] == [(0, 1)] and "latency 400.0 ms" in v["pairs"]["0-1"]["why"]
    for m in (1, 2):                                             # machine 2 answers slowly to everyone
        results = {p: timed(2 << 20, 0.002, latency_s=0.5 if m in p else 0.0005) for p in ring_edges(4)}
        assert judge_pairs(results, 4, min_ratio=0.1, min_mbps=5.0)["bad_machines"] == [m]


def test_judge_pairs_below_absolute_floor():
    results = {p: ok(30.0) for p in ring_edges(3)}   # all slow alike: the floor catches it
    assert judge_pairs(results, 3)["bad_machines"] == [0, 1, 2]


def test_judge_pairs_dead_machine_and_missing_result():
    results = {p: ok() for p in ring_edges(5)}
    del results[(1, 2)]                               # no result at all counts as failed
    results[(0, 1)] = failed("peer never joined")
    v = judge_pairs(results, 5)
    assert v["bad_machines"] == [1]
    assert v["pairs"]["1-2"]["detail"] == "missing"
    assert v["bad_links"] == []


def test_judge_pairs_partitioned_link():
    results = {p: ok() for p in ring_edges(6)}
    results[(4, 5)] = failed("all-gather data mismatch")
    v = judge_pairs(results, 6)
    assert v["bad_machines"] == []
    assert v["bad_links"] == [(4, 5)]               # 4 and 5 both passed their other pair


def test_judge_pairs_accepts_either_orientation():
    results = {p: ok() for p in ring_edges(4)}
    del results[(0, 3)]
    results[(3, 0)] = failed()
    assert judge_pairs(results, 4)["bad_links"] == [(0, 3)]


def test_judge_pairs_two_machines():
    assert judge_pairs({(0, 1): failed()}, 2) == {
        "bad_machines": [], "bad_links": [(0, 1)], "reference_mbps": None, "reference_latency_s": None,
        "pairs": {"0-1": {**failed(), "bad": True}}}
    assert judge_pairs({(0, 1): ok()}, 2)["bad_links"] == []
    assert judge_pairs({}, 1)["pairs"] == {}


# -- judge_speed / judge_digests -----------------------------------------------------------


def test_judge_speed():
    assert judge_speed({"m0": 100.0, "m1": 95.0, "m2": 30.0, "m3": 105.0}) == ["m2"]
    assert judge_speed({"m0": 100.0, "m1": 90.0, "m2": 60.0}) == []
    assert judge_speed({"m0": 100.0, "m1": 1.0}) == []          # two machines: no verdict
    assert judge_speed({"a": 9.0, "b": 100.0, "c": 100.0}, min_ratio=0.05) == []


def test_judge_digests():
    assert judge_digests({"a": "x", "b": "x", "c": "y"}) == ["c"]
    assert judge_digests({"a": "x", "b": "x", "c": "y", "d": "z", "e": "x"}) == ["c", "d"]
    assert judge_digests({"a": "x", "b": "x", "c": "y", "d": "y"}) == []   # tie: inconclusive
    assert judge_digests({"a": "x", "b": "y", "c": "z"}) == []             # all different
    assert judge_digests({"a": "x", "b": "y"}) == []
    assert judge_digests({"a": "x", "b": "x", "c": "x"}) == []
    assert judge_digests({}) == []


# -- plan validation ------------------------------------------------------------------------


def write(tmp_path, plan):
    p = tmp_path / "plan.json"
    p.write_text(json.dumps(plan))
    return str(p)


GOOD = {"machine": "m0", "local_rank": 0, "local_world": 1, "device": 0, "simgpu": None,
        "checks": ["selftest", "intra", "inter", "align"], "store_host": "127.0.0.1",
        "intra": {"port": 1, "prefix": "p"},
        "inter": [{"round": 0, "peer": "m1", "rank": 0, "port": 1, "prefix": "q"}]}


def test_load_plan_fills_defaults(tmp_path):
    plan = load_plan(write(tmp_path, GOOD))
    assert plan["timeout_s"] == 10.0 and plan["inter_bytes"] == 1 << 21


@pytest.mark.parametrize("change, message", [
    ({"checks": ["selftest", "burn"]}, "unknown checks"),
    ({"local_rank": 1}, "not in a machine of 1"),
    ({"machine": 3}, "'machine'"),
    ({"intra": {"port": "x", "prefix": "p"}}, "intra: 'port'"),
    ({"inter": [{"round": 0, "peer": "m1", "rank": 2, "port": 1, "prefix": "q"}]}, "rank"),
    ({"timeout_s": 0}, "timeout_s"),
    ({"store_host": None}, "store_host"),
])
def test_load_plan_rejects(tmp_path, change, message):
    with pytest.raises(PlanError, match=message):
        load_plan(write(tmp_path, {**GOOD, **change}))


