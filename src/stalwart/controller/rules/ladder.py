"""The stop-time ladder (pure): which checks to run after a failure without a certain culprit, what
their results mean, and which rung comes next (papers.md §1.5.2-1.5.3).

    crash, no culprit  -> stop-time checks -> evict the machines that fail them -> restart
                                          \\-> all pass: reattempt
    fails again        -> roll back to the last stable code version (versions.rollback_reason)
    still fails        -> dual-phase replay -> evict the machine both phases point at
    NaN, no culprit    -> bitwise alignment test (when enabled), then the same ladder

Everything here works on plain data (incident dicts as the store returns them, check results as the
agents report them); the job core's `job/flows/diagnosis.py` does the talking.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Mapping, Sequence

from stalwart.controller.rules.policy import Mechanism
from stalwart.diag.pairs import judge_digests, judge_pairs, judge_speed

UNEXPLAINED = (Mechanism.REATTEMPT, Mechanism.ROLLBACK, Mechanism.REPLAY)   # rungs that evicted no machine
NUMERIC = ("nan", "loss_spike")
# Thresholds are loose on purpose: a busy host measures healthy machines several times apart, while
# the faults they must catch (a throttled link at kbit/s, a GPU at a quarter speed) are far off.
LINK_MIN_MBPS = 5.0           # an inter-machine pair slower than this is bad
LINK_MIN_RATIO = 0.1          # ... or slower than this fraction of a healthy pair (pairs.judge_pairs)
LINK_MAX_LATENCY_S = 0.5      # ... or slower to answer than this and than LINK_LATENCY_RATIO x a healthy pair
LINK_LATENCY_RATIO = 20.0     # (a shaped link queues small messages too: 0.1 s at 64 kbit/s)
SPEED_MIN_RATIO = 0.25        # a self-test slower than this fraction of the median machine is bad


def checks_for(symptom: str, category: str, machines: int, stop_time_checks: bool,
               alignment_test: bool) -> list[str]:
    """The stop-time checks for a failure that `policy.resolve` could not pin on a machine."""
    if category == "user_code" or not stop_time_checks:
        return []
    if symptom in NUMERIC:
        # A wrong number is not a broken machine in the usual sense: only a bit-for-bit comparison
        # of the same computation on every machine sees a silently corrupting one.
        return ["align"] if alignment_test and machines >= 3 else []
    checks = ["selftest", "intra"]
    if machines >= 2:
        checks.append("inter")
    return checks


def streak(incidents: Sequence[Mapping], window_s: float, now: float | None = None) -> list[str]:
    """Mechanisms of the failures just before the current one (detected at `now`) that no eviction
    explained, newest first; the run of them ends at an eviction, a planned stop, or a gap longer
    than `window_s` (between two of them, and between the newest and `now`: a failure hours after
    the last one is not that one coming back)."""
    out: list[str] = []
    past = [i for i in incidents if i.get("mechanism")]
    past.sort(key=lambda i: i["detected_at"])
    later = now
    for inc in reversed(past):
        if inc["mechanism"] not in UNEXPLAINED or inc.get("evicted"):
            break
        if later is not None and later - inc["detected_at"] > window_s:
            break
        out.append(inc["mechanism"])
        later = inc["detected_at"]
    return out


def next_rung(previous: Sequence[str], replay_possible: bool) -> str:
    """After checks found nothing: reattempt first; replay once reattempts (and any rollback the
    version history allows) have not helped; never two replays in one run of failures."""
    if not previous or "replay" in previous:
        return "reattempt"
    return "replay" if replay_possible else "reattempt"


def verdict(results: Iterable[Mapping], slots: Sequence[str], pair_index: Mapping[tuple, tuple],
            missing: Iterable[str] = (), lost: Iterable[str] = ()) -> dict:
    """What the agents' check results say.

    `results` are the rows of every machine's `diag_result` (check, ok, machine, measure, and for
    `inter` the pair key). `pair_index` maps a pair key (round, machine_a, machine_b) to slot indices.
    Machines in `missing` never reported (they timed out): that alone fails them; machines in
    `lost` fell silent during the checks. A machine that reported without a single row while
    others have rows fails too: its check processes died (a machine going down takes them along).
    When no machine finished in time (two or more, none lost) the checks say nothing about any
    of them: a host or a control plane too loaded for the checks' bound, not every machine
    broken at once. The verdict is then inconclusive (`"inconclusive"` says why) and blames nobody,
    as a stack round that flags most machines flags nobody; the ladder goes on without it.
    Returns {"bad": {machine: reason}, "links": [...], "pairs": {...}, "checks": [...]}.
    """
    results = list(results)
    missing, lost = list(missing), list(lost)
    if len(slots) >= 2 and not lost and not results and set(slots) <= set(missing):
        return {"bad": {}, "links": [], "pairs": {}, "checks": [],
                "inconclusive": f"none of the {len(slots)} machines finished its checks in time"}
    bad: dict[str, str] = {m: "lost during the checks (no heartbeat)" for m in lost}
    for m in missing:
        bad.setdefault(m, "did not finish its checks in time")
    by_check: dict[str, list[Mapping]] = defaultdict(list)
    for r in results:
        by_check[r["check"]].append(r)
    if results:
        answered = {r["machine"] for r in results}
        for m in slots:
            if m not in answered:
                bad.setdefault(m, "its checks produced no result (their processes died)")
    for r in by_check.get("selftest", []) + by_check.get("intra", []):
        if not r.get("ok"):
            bad.setdefault(r["machine"], f"{r['check']} failed: {r.get('detail', '')}".strip())
    speed: dict[str, float] = {}
    for r in by_check.get("selftest", []):
        g = (r.get("measure") or {}).get("gflops")
        if r.get("ok") and g:
            speed[r["machine"]] = min(speed.get(r["machine"], g), g)
    for m in judge_speed(speed, min_ratio=SPEED_MIN_RATIO):
        bad.setdefault(m, f"selftest too slow: {speed[m]:.1f} GFLOP/s")
    links: list[list[str]] = []
    pairs_summary: dict = {}
    if pair_index:
        by_pair: dict[tuple, list[Mapping]] = {}
        for r in by_check.get("inter", []):
            key = tuple(r.get("pair", ()))
            got = by_pair.get(key)
            if got is None:
                by_pair[key] = [r]
            else:
                got.append(r)
        pair_res = {}
        for key, (i, j) in pair_index.items():
            rows = by_pair.get(key)
            if rows is not None and len(rows) == 2 and rows[0].get("ok") and rows[1].get("ok"):
                # (the usual pair: both ends passed; their worse measures, as `_pair_result` takes)
                ma, mb = rows[0].get("measure") or {}, rows[1].get("measure") or {}
                x, y, lx, ly = ma.get("mbps"), mb.get("mbps"), ma.get("latency_s"), mb.get("latency_s")
                pair_res[(i, j)] = {"ok": True, "mbps": None if x is None or y is None else min(x, y),
                                    "latency_s": None if lx is None or ly is None else max(lx, ly), "detail": ""}
            else:
                pair_res[(i, j)] = _pair_result(rows or [])
        judged = judge_pairs(pair_res, len(slots), min_ratio=LINK_MIN_RATIO, min_mbps=LINK_MIN_MBPS,
                             max_latency_s=LINK_MAX_LATENCY_S, latency_ratio=LINK_LATENCY_RATIO)
        pairs_summary = judged["pairs"]
        for i in judged["bad_machines"]:
            how = "; ".join(f"with {slots[peer]}: {why}" for peer, why in _partners(pairs_summary, i))
            bad.setdefault(slots[i], f"inter-machine test failed with every partner ({how})")
        for i, j in judged["bad_links"]:
            links.append([slots[i], slots[j]])
    digests = {f"{r['machine']}/{r.get('local_rank', 0)}": (r.get("measure") or {}).get("digest", "")
               for r in by_check.get("align", []) if r.get("ok")}
    for digest_key in judge_digests(digests):
        m = digest_key.split("/")[0]
        bad.setdefault(m, "bitwise alignment: its result differs from the other machines'")
    return {"bad": bad, "links": links, "pairs": pairs_summary,
            "checks": sorted(by_check)}


def _pair_result(rows: Sequence[Mapping]) -> dict:
    """A pair's result from its ends' `inter` rows: passed when some row came and none failed, with
    the worse of the ends' measures (None unless every end measured it); else failed, with what
    the failed rows said (or "no result")."""
    if rows and all(r.get("ok") for r in rows):    # (no row failed: no detail to tell)
        measures = [r.get("measure") or {} for r in rows]
        mbps = [m.get("mbps") for m in measures]
        latency = [m.get("latency_s") for m in measures]
        return {"ok": True, "mbps": None if None in mbps else min(mbps),  # type: ignore[type-var]
                "latency_s": None if None in latency else max(latency), "detail": ""}  # type: ignore[type-var]
    detail = "; ".join(r.get("detail", "") for r in rows if not r.get("ok"))
    return {"ok": False, "mbps": None, "latency_s": None, "detail": detail or ("no result" if not rows else "")}


def _partners(pairs: Mapping[str, Mapping], i: int) -> list[tuple[int, str]]:
    """Machine `i`'s partners in the judged pairs ("i-j" keys) and what was wrong with each pair."""
    out = []
    for key, v in pairs.items():
        a, b = (int(x) for x in key.split("-"))
        if i in (a, b):
            out.append((b if a == i else a, str(v.get("why") or v.get("detail") or "failed")))
    return sorted(out)


def evictions(v: Mapping, standby_ready: int) -> tuple[list[str], str]:
    """Machines to evict for a verdict, and why. A bad link whose ends both passed with other
    partners is cut by evicting both ends when standbys allow, else its first end (either end
    cuts it). The single pair of a two-machine job cannot tell a bad machine from a bad link:
    both ends go when standbys allow, else none (the reason says why)."""
    evict = sorted(v["bad"])
    reasons = [f"{m}: {v['bad'][m]}" for m in evict]
    alone = len(v.get("pairs") or {}) == 1
    for a, b in v["links"]:
        if a in evict or b in evict:
            continue
        room = standby_ready - len(evict)
        if alone and room < 2:
            reasons.append(f"link {a}<->{b} failed the inter-machine test, but with two machines the "
                           f"checks cannot tell which end is at fault and {room} standby(s) cannot "
                           f"replace both: evicting neither")
            continue
        ends = [a, b] if room >= 2 else [a]
        evict.extend(ends)
        reasons.append(f"link {a}<->{b} failed the inter-machine test; evicting {', '.join(ends)}")
    return evict, "; ".join(reasons)
