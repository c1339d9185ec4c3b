"""The stop-time ladder (pure): which checks, what their results mean, which rung comes next."""
from stalwart.controller.rules import ladder
SLOTS = ["m0", "m1", "m2", "m3"]
# ring pairs of 4 machines: round 0 (0,1),(2,3); round 1 (1,2),(3,0)
PAIRS = {(0, "m0", "m1"): (0, 1), (0, "m2", "m3"): (2, 3), (1, "m1", "m2"): (1, 2), (1, "m3", "m0"): (3, 0)}


def answers(rows):
    """Flat rows (each with its machine; an `inter` row with its pair) as the agents answer."""
    out = {}
    for r in rows:
        row = {k: v for k, v in r.items() if k not in ("machine", "pair")}
        if r["check"] == "inter":
            rnd, a, b = r["pair"]
            row.update(round=rnd, peer=b if r["machine"] == a else a)
        out.setdefault(r["machine"], []).append(row)
    return out


def verdict(rows, slots, ring, missing=(), lost=()):
    return ladder.verdict(answers(rows), slots, ring, missing, lost)


def inter(key, ok=True, mbps=2000.0):
    r, a, b = key
    return [{"check": "inter", "machine": m, "pair": list(key), "ok": ok,
             "measure": {"mbps": mbps} if ok else {}, "detail": "" if ok else "timed out"} for m in (a, b)]


def base(results=()):
    rows = []
    for m in SLOTS:
        for lr in (0, 1):
            rows.append({"check": "selftest", "machine": m, "local_rank": lr, "ok": True,
                         "measure": {"gflops": 20.0}})
            rows.append({"check": "intra", "machine": m, "local_rank": lr, "ok": True, "measure": {}})
    return rows + list(results)


def test_checks_for_each_kind_of_failure():
    assert ladder.checks_for("worker_crash", "explicit", 4, True, True) == ["selftest", "intra", "inter"]
    assert ladder.checks_for("worker_crash", "explicit", 1, True, True) == ["selftest", "intra"]
    assert ladder.checks_for("nan", "implicit", 4, True, True) == ["align"]
    assert ladder.checks_for("nan", "implicit", 4, True, False) == []
    assert ladder.checks_for("nan", "implicit", 2, True, True) == []        # no majority with 2
    assert ladder.checks_for("worker_crash", "explicit", 4, False, True) == []
    assert ladder.checks_for("user_code_exception", "user_code", 4, True, True) == []


def test_all_pass_means_nothing_to_evict():
    rows = base([x for k in PAIRS for x in inter(k)])
    v = verdict(rows, SLOTS, SLOTS)
    assert v["bad"] == {} and v["links"] == []
    assert ladder.evictions(v, 1) == ([], "")


def test_slow_machine_fails_with_both_partners():
    rows = base([x for k in PAIRS for x in inter(k, mbps=0.06 if "m1" in k else 2000.0)])
    v = verdict(rows, SLOTS, SLOTS)
    assert list(v["bad"]) == ["m1"]
    assert v["bad"]["m1"] == ("inter-machine test failed with every partner (with m0: 0.06 Mbit/s is below 5; "
                              "with m2: 0.06 Mbit/s is below 5)")
    assert ladder.evictions(v, 1)[0] == ["m1"]


def test_partitioned_link_evicts_both_ends_only_with_two_standbys():
    rows = base([x for k in PAIRS for x in inter(k, ok=k != (1, "m1", "m2"))])
    v = verdict(rows, SLOTS, SLOTS)
    assert v["bad"] == {} and v["links"] == [["m1", "m2"]]
    assert ladder.evictions(v, 2)[0] == ["m1", "m2"]
    evict, why = ladder.evictions(v, 1)
    assert evict == ["m1"] and "link m1<->m2" in why


def test_pair_measures_reach_the_verdict_per_pair():
    rows = base([x for k in PAIRS for x in inter(k, mbps=0.9 if "m2" in k else 3000.0)])
    for r in rows:
        if r["check"] == "inter":
            r["measure"]["latency_s"] = 0.0004
    v = verdict(rows, SLOTS, SLOTS)
    assert list(v["bad"]) == ["m2"] and "with m1: 0.90 Mbit/s is below 5" in v["bad"]["m2"]
    assert {k: (p["mbps"], p["bad"]) for k, p in v["pairs"].items()} == {
        "0-1": (3000.0, False), "1-2": (0.9, True), "2-3": (0.9, True), "0-3": (3000.0, False)}
    assert v["pairs"]["1-2"]["latency_s"] == 0.0004 and "below 5" in v["pairs"]["1-2"]["why"]


def test_two_machines_cannot_tell_which_end_of_a_bad_pair():
    rows = [{"check": "inter", "machine": m, "pair": [0, "m0", "m1"], "ok": True,
             "measure": {"mbps": 0.5, "latency_s": 0.001}} for m in ("m0", "m1")]
    v = verdict(rows, ["m0", "m1"], ["m0", "m1"])
    assert v["bad"] == {} and v["links"] == [["m0", "m1"]]
    evict, why = ladder.evictions(v, 1)
    assert evict == [] and "cannot tell which end" in why
    assert ladder.evictions(v, 2)[0] == ["m0", "m1"]


def test_selftest_failure_and_missing_machine_are_bad():
    rows = base()
    rows[0] = dict(rows[0], ok=False, detail="max relative error 3e-3")
    v = verdict([r for r in rows if r["machine"] != "m3"], SLOTS, [], missing=["m3"])
    assert set(v["bad"]) == {"m0", "m3"} and "selftest failed" in v["bad"]["m0"]


def test_checks_that_no_machine_finished_in_time_blame_nobody():
    v = verdict([], SLOTS, [], missing=SLOTS)
    assert v["bad"] == {} and v["inconclusive"] == f"none of the {len(SLOTS)} machines finished its checks in time"
    assert ladder.evictions(v, 4) == ([], "")
    # but one machine of several silent, one lost, or a job of one machine: those are evidence
    assert set(verdict([], SLOTS, [], missing=SLOTS[1:], lost=SLOTS[:1])["bad"]) == set(SLOTS)
    assert verdict([], ["m0"], [], missing=["m0"])["bad"] == {"m0": "did not finish its checks in time"}
    assert "inconclusive" not in verdict(base(), SLOTS, [])


def test_slow_selftest_is_bad_against_the_median():
    rows = base()
    for r in rows:
        if r["machine"] == "m2" and r["check"] == "selftest":
            r["measure"] = {"gflops": 2.0}
    assert set(verdict(rows, SLOTS, [])["bad"]) == {"m2"}


def test_alignment_names_the_odd_machine_and_a_tie_names_none():
    rows = [{"check": "align", "machine": m, "local_rank": lr, "ok": True,
             "measure": {"digest": "bad" if m == "m2" else "good"}} for m in SLOTS for lr in (0, 1)]
    assert set(verdict(rows, SLOTS, [])["bad"]) == {"m2"}
    tie = [dict(r, measure={"digest": "x" if r["machine"] in ("m0", "m1") else "y"}) for r in rows]
    assert verdict(tie, SLOTS, [])["bad"] == {}


def inc(i, mech, t, evicted=()):
    return {"id": i, "mechanism": mech, "detected_at": t, "evicted": list(evicted)}


def test_streak_stops_at_evictions_gaps_and_planned_stops():
    hist = [inc(1, "reattempt", 10), inc(2, "evict_restart", 20, ["m1"]), inc(3, "reattempt", 30),
            inc(4, "rollback", 40)]
    assert ladder.streak(hist, 3600) == ["rollback", "reattempt"]
    assert ladder.streak(hist, 5) == ["rollback"]
    assert ladder.streak(hist + [inc(5, "hot_update", 50)], 3600) == []
    assert ladder.streak([], 3600) == []
    # the current failure, detected long after the newest past one, starts a new run
    assert ladder.streak(hist, 5, now=44) == ["rollback"]
    assert ladder.streak(hist, 5, now=46) == []


def test_next_rung_reattempt_then_replay_once():
    assert ladder.next_rung([], True) == "reattempt"
    assert ladder.next_rung(["reattempt"], True) == "replay"
    assert ladder.next_rung(["reattempt"], False) == "reattempt"
    assert ladder.next_rung(["rollback", "reattempt"], True) == "replay"
    assert ladder.next_rung(["reattempt", "replay", "reattempt"], True) == "reattempt"


def test_the_verdict_is_the_one_its_plain_loops_give():
    """`verdict` and `judge_pairs` give, key by key and in the same order, what their plain loops
    (`plainladder`) give, on random check results: failed, slow, missing, repeated and one-ended
    pairs, rows naming another round or a partner off the ring, latencies, self-tests, alignment
    digests, machines missing, lost or answering without a row; and the rows an incident keeps
    are the plain rows it keeps."""
    import json
    import random

    from plainladder import plain_judge_pairs, plain_result_rows, plain_verdict

    from stalwart.diag.pairs import judge_pairs, pair_rounds
    rng = random.Random(17)

    def measure():
        m = {}
        if rng.random() < 0.9:
            m["mbps"] = rng.choice([0.5, 3.0, 40.0, 100.0, 100.0, 100.0, 2000.0, float("nan")])
        if rng.random() < 0.3:
            m["latency_s"] = rng.choice([0.001, 0.01, 0.6, 2.0])
        return m if rng.random() < 0.95 else None

    for trial in range(400):
        n = rng.randrange(1, 8)
        slots = [f"m{i}" for i in range(n)]
        ring = slots if n >= 2 and rng.random() < 0.9 else []
        index = {}
        for r, round_pairs in enumerate(pair_rounds(len(ring))):
            for i, j in round_pairs:
                index[(r, slots[i], slots[j])] = (i, j)
        got_rows: dict = {m: [] for m in rng.sample(slots, n)}
        for m in slots:
            if rng.random() < 0.9:
                got_rows[m].append({"check": "selftest", "ok": rng.random() < 0.9,
                                    "measure": {"gflops": rng.choice([0.0, 5.0, 100.0, 100.0])}, "detail": "x"})
                got_rows[m].append({"check": "intra", "ok": rng.random() < 0.9, "measure": {}})
            if rng.random() < 0.2:
                got_rows[m].append({"check": "align", "ok": True, "local_rank": 0,
                                    "measure": {"digest": rng.choice(["a", "a", "b"])}})
        for (r, a, b) in index:
            for end, peer in ((a, b), (b, a)):
                for _ in range(rng.choice([0, 1, 1, 1, 1, 2])):
                    got_rows[end].append({"check": "inter", "ok": rng.random() < 0.9, "detail": "timeout",
                                          "round": r, "peer": peer, "measure": measure()})
        for m in slots:             # rows of no scheduled pair: another round, a partner off the ring
            if rng.random() < 0.1:
                got_rows[m].append({"check": "inter", "ok": True, "round": rng.randrange(4), "detail": "",
                                    "peer": rng.choice(slots + ["elsewhere", None]), "measure": measure()})
        for m in slots:
            rng.shuffle(got_rows[m]) if rng.random() < 0.3 else None
        for m in list(got_rows):
            if not got_rows[m] and rng.random() < 0.5:
                del got_rows[m]         # (else it answered with no row: its check processes died)
        missing = rng.sample(slots, rng.randrange(0, min(3, n) + 1)) if rng.random() < 0.3 else []
        lost = rng.sample(slots, 1) if rng.random() < 0.1 else []
        if rng.random() < 0.05:
            got_rows = {}
        rows = [x for m, mine in got_rows.items() for x in plain_result_rows(m, mine, set(index))]
        got = ladder.verdict(got_rows, slots, ring, missing, lost)
        want = plain_verdict(rows, slots, index, missing, lost)
        assert json.dumps(got) == json.dumps(want), trial
        kept, left = ladder.kept_rows(got_rows, ring, got["bad"], every_row_up_to=3)
        whole = len(got_rows) <= 3
        assert kept == [r for r in rows if whole or not r.get("ok") or r["machine"] in got["bad"]], trial
        assert left == len(rows) - len(kept), trial
        results = {}
        for _ in range(rng.randrange(0, 2 * n + 2)):
            i, j = rng.randrange(n), rng.randrange(n)
            results[(i, j)] = {"ok": rng.random() < 0.85, "detail": "d", **(measure() or {})}
            results[(i, j)].setdefault("mbps", None)
        kw = dict(min_ratio=0.25, min_mbps=rng.choice([5.0, 50.0, float("nan")]), max_latency_s=0.5, latency_ratio=20.0)
        assert json.dumps(judge_pairs(results, n, **kw)) == json.dumps(plain_judge_pairs(results, n, **kw)), trial
