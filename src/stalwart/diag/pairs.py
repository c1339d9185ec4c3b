"""Pure verdicts of the stop-time diagnostics: the inter-machine pair schedule and the judges.

The inter-machine test pairs machines along a ring, so every machine (of n >= 3) is tested
twice, with two different partners: a bad machine fails both of its pairs, a good one passes
at least one unless both of its neighbours are bad. Machines are numbered 0..n-1 here; the
caller maps them to machine ids. No torch import: the controller uses this module.
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
    return [(min(i, (i + 1) % n), max(i, (i + 1) % n)) for i in range(n)]


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


def judge_pairs(results: dict[tuple[int, int], dict], n: int, min_ratio: float = 0.25,
                min_mbps: float = 50.0) -> dict:
    """Which machines and links the pair results accuse.

    ``results[(i, j)] = {"ok": bool, "mbps": float | None, "detail": str}``; a ring pair with no
    result counts as failed ("missing"). A pair is bad when it failed, or its bandwidth is
    below ``min_mbps`` or below ``min_ratio`` x the median of the pairs that passed. A machine is
    bad when it is in >= 2 pairs and all of them are bad; a link is bad when it is bad while both
    of its machines passed some other pair (or, n == 2, when the single pair is bad).
    """
    merged: dict[Pair, dict] = {e: {"ok": False, "mbps": None, "detail": "missing"}
                                for e in ring_edges(n)}
    for pair, res in results.items():
        merged[_key(pair)] = dict(res)
    speeds = [r["mbps"] for r in merged.values() if r.get("ok") and r.get("mbps") is not None]
    median = statistics.median(speeds) if speeds else None

    def is_bad(r: dict) -> bool:
        if not r.get("ok"):
            return True
        mbps = r.get("mbps")
        if mbps is None:
            return False
        return mbps < min_mbps or (median is not None and mbps < min_ratio * median)

    bad = {p: is_bad(r) for p, r in merged.items()}
    member: dict[int, list[Pair]] = {}
    for p in merged:
        for m in p:
            member.setdefault(m, []).append(p)
    bad_machines = sorted(m for m, ps in member.items() if len(ps) >= 2 and all(bad[p] for p in ps))
    passed = {m for m, ps in member.items() if any(not bad[p] for p in ps)}
    if n == 2:
        bad_links = sorted(p for p in merged if bad[p])
    else:
        bad_links = sorted(p for p in merged if bad[p] and p[0] in passed and p[1] in passed)
    return {
        "bad_machines": bad_machines,
        "bad_links": bad_links,
        "pairs": {f"{i}-{j}": {**merged[(i, j)], "bad": bad[(i, j)]} for i, j in sorted(merged)},
        "median_mbps": median,
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
