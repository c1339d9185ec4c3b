"""Pure verdicts of the stop-time diagnostics: the inter-machine pair schedule and the judges.

The inter-machine test pairs machines along a ring, so every machine (of n >= 3) is tested
twice, with two different partners: a bad machine fails both of its pairs, a good one passes
at least one unless both of its neighbours are bad. Each pair measures its bandwidth and
latency, and is judged against the other pairs (a slow link fails only the pairs through it).
Machines are numbered 0..n-1 here; the caller maps them to machine ids. No torch import: the
controller uses this module.
"""
from __future__ import annotations

import statistics
from collections import Counter

Pair = tuple[int, int]


def ring_edges(n: int) -> list[Pair]:
    """The ring's edges (i, i+1 mod n) as (low, high) tuples; one edge for n == 2, none below."""
    if n < 2:
        return []
    if n == 2:
        return [(0, 1)]
    return [(i, i + 1) for i in range(n - 1)] + [(0, n - 1)]      # (the closing edge (n-1, 0) as (0, n-1))


def pair_rounds(n: int) -> list[list[Pair]]:
    """The ring's edges scheduled into rounds in which no machine is in two pairs.

    Even n: two rounds (edges starting at an even machine, then at an odd one). Odd n: three
    rounds (greedy in ring order; only the closing edge needs the third). Pairs are (low, high).
    """
    edges = ring_edges(n)
    if len(edges) < 2:
        return [edges] if edges else []
    if n % 2 == 0:
        return [[e for i, e in enumerate(edges) if i % 2 == parity] for parity in (0, 1)]
    rounds: list[list[Pair]] = []
    busy: list[set[int]] = []
    for e in edges:
        for r, used in enumerate(busy):
            if e[0] not in used and e[1] not in used:
                rounds[r].append(e)
                used.update(e)
                break
        else:
            rounds.append([e])
            busy.append(set(e))
    return rounds


def _key(pair: tuple[int, int]) -> Pair:
    i, j = pair
    return (min(i, j), max(i, j))


def _reference(values: dict[Pair, float], best) -> float | None:
    """The pace a healthy pair shows: the median over machines of each machine's best pair (its
    fastest, or lowest latency). A slow machine drags both of its pairs, so in a ring of three
    two pairs of three are slow and their median would call the slow pace normal; every other
    machine still has one good pair."""
    per_machine: dict[int, float] = {}
    for (i, j), v in values.items():
        for m in (i, j):
            per_machine[m] = best(per_machine[m], v) if m in per_machine else v
    return statistics.median(per_machine.values()) if per_machine else None


def judge_pairs(results: dict[tuple[int, int], dict], n: int, min_ratio: float = 0.25,
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
    given: dict[Pair, dict] = {}
    for (i, j), res in results.items():
        given[(i, j) if i <= j else (j, i)] = res     # (read only: `pairs` below are new dicts)
    missing = {"ok": False, "mbps": None, "detail": "missing"}
    merged: dict[Pair, dict] = {e: given.get(e, missing) for e in ring_edges(n)}
    for p, res in given.items():
        if p not in merged:
            merged[p] = res
    passed_pairs = {p: r for p, r in merged.items() if r.get("ok")}
    speed = _reference({p: r["mbps"] for p, r in passed_pairs.items() if r.get("mbps") is not None}, max)
    latency = _reference({p: r["latency_s"] for p, r in passed_pairs.items()
                          if r.get("latency_s") is not None}, min)
    fast = min_mbps if speed is None else max(min_mbps, min_ratio * speed)

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

    verdicts: dict[Pair, str | None] = {}
    member: dict[int, int] = {}         # machine -> its pairs, and how many of them are bad
    failed: dict[int, int] = {}
    for p, r in merged.items():
        mbps = r.get("mbps")
        # (the usual pair: passed, fast enough, no latency measured; else `why_bad` says)
        v = None if r.get("ok") and mbps is not None and mbps >= fast and r.get("latency_s") is None \
            else why_bad(r)
        verdicts[p] = v
        b = v is not None
        i, j = p
        member[i] = member.get(i, 0) + 1
        failed[i] = failed.get(i, 0) + b
        member[j] = member.get(j, 0) + 1
        failed[j] = failed.get(j, 0) + b
    bad = {p: v is not None for p, v in verdicts.items()}
    bad_machines = sorted(m for m, k in member.items() if k >= 2 and failed[m] == k)
    passed = {m for m, k in member.items() if failed[m] < k}
    if n == 2:
        bad_links = sorted(p for p in merged if bad[p])
    else:
        bad_links = sorted(p for p in merged if bad[p] and p[0] in passed and p[1] in passed)
    pairs = {}
    for i, j in sorted(merged):
        v = verdicts[(i, j)]
        entry = pairs[f"{i}-{j}"] = {**merged[(i, j)], "bad": v is not None}
        if v not in (None, "failed"):
            entry["why"] = v
    return {
        "bad_machines": bad_machines,
        "bad_links": bad_links,
        "pairs": pairs,
        "reference_mbps": speed,
        "reference_latency_s": latency,
    }


def judge_speed(gflops: dict[str, float], min_ratio: float = 1 / 3) -> list[str]:
    """Machines whose matmul speed is below ``min_ratio`` x the median (needs >= 3 machines)."""
    if len(gflops) < 3:
        return []
    median = statistics.median(gflops.values())
    return sorted(m for m, g in gflops.items() if g < min_ratio * median)


def judge_digests(digests: dict[str, str]) -> list[str]:
    """Bitwise alignment: the machines whose digest differs from a strict-majority digest.

    No strict majority (2 vs 2, all different, one of two) is inconclusive: [].
    """
    if not digests:
        return []
    digest, count = Counter(digests.values()).most_common(1)[0]
    if count * 2 <= len(digests):
        return []
    return sorted(m for m, d in digests.items() if d != digest)
