"""The stop-time verdict as it was written before its loops were tightened (`ladder.verdict`,
`pairs.judge_pairs`): the unit tests hold the current ones to these on random check results.
The plain verdict reads flat rows, each with its machine and an `inter` row with its pair as the
schedule names it (`plain_result_rows` makes them from a machine's answer)."""
from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Mapping, Sequence

from stalwart.controller.rules.ladder import (LINK_LATENCY_RATIO, LINK_MAX_LATENCY_S, LINK_MIN_MBPS, LINK_MIN_RATIO,
                                              SPEED_MIN_RATIO, _partners)
from stalwart.diag.pairs import Pair, _reference, judge_digests, judge_speed, ring_edges


def plain_result_rows(machine: str, rows: Sequence[Mapping], pair_keys) -> list[dict]:
    """A machine's check results as flat rows: each with its machine, and a pair test's result
    with its pair in the order the checks named it (`pair_keys`: the scheduled (round, a, b))."""
    out = []
    for raw in rows:
        r = dict(raw, machine=machine)
        if r.get("check") == "inter":
            a, b = machine, str(r.get("peer"))
            if (r.get("round"), b, a) in pair_keys:
                a, b = b, a
            r["pair"] = [r.get("round"), a, b]
        out.append(r)
    return out


def plain_judge_pairs(results: dict[tuple[int, int], dict], n: int, min_ratio: float = 0.25,
                min_mbps: float = 50.0, max_latency_s: float = 0.1, latency_ratio: float = 10.0) -> dict:
    """Which machines and links the pair results accuse.

    ``results[(i, j)] = {"ok": bool, "mbps": float | None, "latency_s": float | None, "detail": str}``;
    a ring pair with no result counts as failed ("missing"). Each pair is judged against the
    others: it is bad when it failed, or its bandwidth is below ``min_mbps`` or below
    ``min_ratio`` x the reference bandwidth, or its latency is above both ``max_latency_s`` and
    ``latency_ratio`` x the reference latency (references: `_reference`, over the pairs that
    passed). A machine is bad when it is in >= 2 pairs and all of them are bad; a link is bad when
    it is bad while both of its machines passed some other pair (or, n == 2, when the single pair
    is bad: two machines cannot tell which end is at fault).
    """
    merged: dict[Pair, dict] = {e: {"ok": False, "mbps": None, "detail": "missing"}
                                for e in ring_edges(n)}
    for (i, j), res in results.items():
        merged[(i, j) if i <= j else (j, i)] = res     # (read only: `pairs` below are new dicts)
    passed_pairs = {p: r for p, r in merged.items() if r.get("ok")}
    speed = _reference({p: r["mbps"] for p, r in passed_pairs.items() if r.get("mbps") is not None}, max)
    latency = _reference({p: r["latency_s"] for p, r in passed_pairs.items()
                          if r.get("latency_s") is not None}, min)

    def why_bad(r: dict) -> str | None:
        if not r.get("ok"):
            return "failed"
        mbps, lat = r.get("mbps"), r.get("latency_s")
        if mbps is not None and mbps < min_mbps:
            return f"{mbps:.2f} Mbit/s is below {min_mbps:g}"
        if mbps is not None and speed is not None and mbps < min_ratio * speed:
            return f"{mbps:.2f} Mbit/s is below {min_ratio:g} x the others' {speed:.1f}"
        if lat is not None and lat > max_latency_s and (latency is None or lat > latency_ratio * latency):
            return f"latency {lat * 1e3:.1f} ms is above {latency_ratio:g} x the others' " \
                   f"{(latency or 0) * 1e3:.2f} ms"
        return None

    verdicts = {p: why_bad(r) for p, r in merged.items()}
    bad = {p: v is not None for p, v in verdicts.items()}
    member: dict[int, int] = {}         # machine -> its pairs, and how many of them are bad
    failed: dict[int, int] = {}
    for p, b in bad.items():
        for m in p:
            member[m] = member.get(m, 0) + 1
            failed[m] = failed.get(m, 0) + b
    bad_machines = sorted(m for m, k in member.items() if k >= 2 and failed[m] == k)
    passed = {m for m, k in member.items() if failed[m] < k}
    if n == 2:
        bad_links = sorted(p for p in merged if bad[p])
    else:
        bad_links = sorted(p for p in merged if bad[p] and p[0] in passed and p[1] in passed)
    pairs = {}
    for i, j in sorted(merged):
        pairs[f"{i}-{j}"] = {**merged[(i, j)], "bad": bad[(i, j)]}
        if verdicts[(i, j)] not in (None, "failed"):
            pairs[f"{i}-{j}"]["why"] = verdicts[(i, j)]
    return {
        "bad_machines": bad_machines,
        "bad_links": bad_links,
        "pairs": pairs,
        "reference_mbps": speed,
        "reference_latency_s": latency,
    }


def plain_verdict(results: Iterable[Mapping], slots: Sequence[str], pair_index: Mapping[tuple, tuple],
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
    answered: set[str] = set()
    for r in results:
        by_check[r["check"]].append(r)
        answered.add(r["machine"])
    if results:
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
        pair_res: dict[tuple[int, int], dict] = {}
        by_pair: dict[tuple, list[Mapping]] = defaultdict(list)
        for r in by_check.get("inter", []):
            by_pair[tuple(r.get("pair", ()))].append(r)
        none: list[Mapping] = []
        for key, (i, j) in pair_index.items():
            rows = by_pair.get(key, none)
            if rows and all(r.get("ok") for r in rows):    # (no row failed: no detail to tell)
                measures = [r.get("measure") or {} for r in rows]
                mbps = [m.get("mbps") for m in measures]        # the worse of both ends' measures
                latency = [m.get("latency_s") for m in measures]      # (None unless both measured)
                pair_res[(i, j)] = {"ok": True, "mbps": None if None in mbps else min(mbps),  # type: ignore[type-var]
                                    "latency_s": None if None in latency else max(latency),  # type: ignore[type-var]
                                    "detail": ""}
            else:
                pair_res[(i, j)] = {"ok": False, "mbps": None, "latency_s": None,
                                    "detail": "; ".join(r.get("detail", "") for r in rows if not r.get("ok"))
                                    or ("no result" if not rows else "")}
        judged = plain_judge_pairs(pair_res, len(slots), min_ratio=LINK_MIN_RATIO, min_mbps=LINK_MIN_MBPS,
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
