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

from typing import Iterable, Mapping, Sequence

from stalwart.controller.rules.policy import Mechanism
from stalwart.diag.pairs import edge_of, edge_round, judge_columns, judge_digests, judge_speed, ring_edges

UNEXPLAINED = (Mechanism.REATTEMPT, Mechanism.ROLLBACK, Mechanism.REPLAY)   # rungs that evicted no machine
NUMERIC = ("nan", "loss_spike")
# Thresholds are loose on purpose: a busy host measures healthy machines several times apart, while
# the faults they must catch (a throttled link at kbit/s, a GPU at a quarter speed) are far off.
LINK_MIN_MBPS = 5.0           # an inter-machine pair slower than this is bad
LINK_MIN_RATIO = 0.1          # ... or slower than this fraction of a healthy pair (pairs.judge_pairs)
LINK_MAX_LATENCY_S = 0.5      # ... or slower to answer than this and than LINK_LATENCY_RATIO x a healthy pair
LINK_LATENCY_RATIO = 20.0     # (a shaped link queues small messages too: 0.1 s at 64 kbit/s)
SPEED_MIN_RATIO = 0.25        # a self-test slower than this fraction of the median machine is bad
ROWS_KEPT_MACHINES = 64       # an incident keeps every check row of a job this small (`kept_rows`)


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


def verdict(answers: Mapping[str, Sequence[Mapping]], slots: Sequence[str], ring: Sequence[str] = (),
            missing: Iterable[str] = (), lost: Iterable[str] = ()) -> dict:
    """What the agents' check results say.

    `answers` maps each machine that answered to its rows of `diag_result` as its agent sent
    them (check, ok, detail, measure; an `inter` row names its round and its partner, `peer`).
    `ring` is the pair test's ring (`stalwart.diag.pairs`; the slots, or none without the test):
    a pair's result is its ends' rows that name it, partner and round. Machines in `missing`
    never reported (they timed out): that alone fails them; machines in `lost` fell silent
    during the checks. A machine that reported without a single row while others have rows
    fails too: its check processes died (a machine going down takes them along). When no
    machine finished in time (two or more, none lost) the checks say nothing about any of them:
    a host or a control plane too loaded for the checks' bound, not every machine broken at
    once. The verdict is then inconclusive (`"inconclusive"` says why) and blames nobody, as a
    stack round that flags most machines flags nobody; the ladder goes on without it.
    Returns {"bad": {machine: reason}, "links": [...], "pairs": {...}, "checks": [...]}; "pairs"
    holds every judged pair for a ring of up to ROWS_KEPT_MACHINES machines, the bad ones beyond.

    One pass over the rows, read where they are (a 12,500-machine job's checks are 50,000 rows):
    no copy of a row with its machine and pair, no grouping by check or by pair.
    """
    missing, lost = list(missing), list(lost)
    answered = [m for m, rows in answers.items() if rows]
    if len(slots) >= 2 and not lost and not answered and set(slots) <= set(missing):
        return {"bad": {}, "links": [], "pairs": {}, "checks": [],
                "inconclusive": f"none of the {len(slots)} machines finished its checks in time"}
    bad: dict[str, str] = {m: "lost during the checks (no heartbeat)" for m in lost}
    for m in missing:
        bad.setdefault(m, "did not finish its checks in time")
    if answered:
        heard = set(answered)
        for m in slots:
            if m not in heard:
                bad.setdefault(m, "its checks produced no result (their processes died)")
    n = len(ring)
    position = {m: i for i, m in enumerate(ring)} if n >= 2 else {}
    even = n % 2 == 0
    ends: list[list[Mapping] | None] = [None] * len(ring_edges(n))     # each ring edge's rows
    failed_intra: list[tuple[str, Mapping]] = []
    speed: dict[str, float] = {}
    digests: dict[str, str] = {}
    checks: set[str] = set()
    for m, rows in answers.items():
        i = position.get(m)
        for r in rows:
            c = r["check"]
            checks.add(c)
            if c == "inter":
                if i is None:
                    continue
                peer = r.get("peer")
                j = position.get(peer if type(peer) is str else str(peer))
                if j is None:
                    continue
                # (`edge_of` and `edge_round`, written out: this runs for every pair test's row)
                d = j - i
                if d == 1 or d == -1:
                    e = i if d == 1 else j
                elif n > 2 and (d == n - 1 or d == 1 - n):
                    e = n - 1
                else:
                    continue            # not neighbours on the ring: no pair's result
                if r.get("round") != (e % 2 if even or e < n - 1 else 2):
                    continue            # not the round the ring's schedule gives the pair
                got = ends[e]
                if got is None:
                    ends[e] = [r]
                else:
                    got.append(r)
            elif c == "selftest":
                if not r.get("ok"):
                    bad.setdefault(m, f"selftest failed: {r.get('detail', '')}".strip())
                else:
                    g = (r.get("measure") or {}).get("gflops")
                    if g:
                        speed[m] = min(speed.get(m, g), g)
            elif c == "intra":
                if not r.get("ok"):
                    failed_intra.append((m, r))
            elif c == "align":
                if r.get("ok"):
                    digests[f"{m}/{r.get('local_rank', 0)}"] = (r.get("measure") or {}).get("digest", "")
    for m, r in failed_intra:          # (after every self-test: a machine failing both is named for that)
        bad.setdefault(m, f"intra failed: {r.get('detail', '')}".strip())
    for m in judge_speed(speed, min_ratio=SPEED_MIN_RATIO):
        bad.setdefault(m, f"selftest too slow: {speed[m]:.1f} GFLOP/s")
    links: list[list[str]] = []
    pairs_summary: dict = {}
    if ends:
        edges = ring_edges(n)
        ok: list[bool] = []
        mbps: list[float | None] = []
        latency: list[float | None] = []
        detail: list[str] = []
        for got in ends:
            if got is not None and len(got) == 2 and got[0].get("ok") and got[1].get("ok"):
                # (the usual pair: both ends passed; their worse measures, as `_pair_result` takes)
                ma, mb = got[0].get("measure") or {}, got[1].get("measure") or {}
                x, y, lx, ly = ma.get("mbps"), mb.get("mbps"), ma.get("latency_s"), mb.get("latency_s")
                ok.append(True)
                mbps.append(None if x is None or y is None else min(x, y))
                latency.append(None if lx is None or ly is None else max(lx, ly))
                detail.append("")
            else:
                res = _pair_result(got or [])
                ok.append(res["ok"])
                mbps.append(res["mbps"])
                latency.append(res["latency_s"])
                detail.append(res["detail"])
        judged = judge_columns(edges, ok, mbps, latency, n, min_ratio=LINK_MIN_RATIO, min_mbps=LINK_MIN_MBPS,
                               max_latency_s=LINK_MAX_LATENCY_S, latency_ratio=LINK_LATENCY_RATIO)
        verdicts = judged["verdicts"]
        every = n <= ROWS_KEPT_MACHINES
        for k in sorted(range(len(edges)), key=edges.__getitem__):
            v = verdicts[k]
            if v is None and not every:
                continue
            i, j = edges[k]
            entry = pairs_summary[f"{i}-{j}"] = {"ok": ok[k], "mbps": mbps[k], "latency_s": latency[k],
                                                 "detail": detail[k], "bad": v is not None}
            if v not in (None, "failed"):
                entry["why"] = v
        for i in judged["bad_machines"]:
            how = "; ".join(f"with {ring[peer]}: {why}" for peer, why in _partners(pairs_summary, i))
            bad.setdefault(ring[i], f"inter-machine test failed with every partner ({how})")
        for i, j in judged["bad_links"]:
            links.append([ring[i], ring[j]])
    for digest_key in judge_digests(digests):
        m = digest_key.split("/")[0]
        bad.setdefault(m, "bitwise alignment: its result differs from the other machines'")
    return {"bad": bad, "links": links, "pairs": pairs_summary, "checks": sorted(checks)}


def kept_rows(answers: Mapping[str, Sequence[Mapping]], ring: Sequence[str], bad: Iterable[str],
              every_row_up_to: int = ROWS_KEPT_MACHINES) -> tuple[list[dict], int]:
    """The check results an incident keeps: every row for a job of up to `every_row_up_to`
    machines, else the rows that failed and every row of a machine named `bad` (a
    12,500-machine job's checks are 50,000 rows, most of them a pass); each with its machine,
    and a pair test's with its pair as the ring names it ([round, lower end, higher end]).
    Returns the rows and how many passed rows were left out."""
    every = len(answers) <= every_row_up_to
    named = set(bad)
    n = len(ring)
    position = {m: i for i, m in enumerate(ring)}
    kept, left = [], 0
    for m, rows in answers.items():
        whole = every or m in named
        for r in rows:
            if not (whole or not r.get("ok")):
                left += 1
                continue
            row = dict(r, machine=m)
            if r.get("check") == "inter":
                peer = str(r.get("peer"))
                i, j = position.get(m), position.get(peer)
                e = None if i is None or j is None else edge_of(n, i, j)
                ring_pair = e is not None and r.get("round") == edge_round(n, e)
                row["pair"] = [r.get("round"), *((peer, m) if ring_pair and j < i else (m, peer))]  # type: ignore[operator]
            kept.append(row)
    return kept, left


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
