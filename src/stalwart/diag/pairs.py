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
from typing import Sequence

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


def round_count(n: int) -> int:
    """How many rounds `pair_rounds(n)` has."""
    return 0 if n < 2 else 1 if n == 2 else 2 if n % 2 == 0 else 3


def edge_round(n: int, e: int) -> int:
    """The round `pair_rounds(n)` schedules ring edge `e` (an index into `ring_edges(n)`) in."""
    if n % 2 == 0 or e < n - 1:
        return e % 2
    return 2                    # odd n: the closing edge meets both of the first two rounds


def edge_of(n: int, i: int, j: int) -> int | None:
    """The index in `ring_edges(n)` of the edge between machines `i` and `j` (either order), None
    when they are not neighbours on the ring."""
    lo, hi = (i, j) if i <= j else (j, i)
    if lo < 0 or hi >= n or lo == hi:
        return None
    if hi == lo + 1:
        return lo
    return n - 1 if lo == 0 and hi == n - 1 and n > 2 else None


def pairs_of(n: int, i: int) -> list[tuple[int, int, int]]:
    """Machine `i`'s pair tests in a ring of `n`, in round order: (round, partner, end), end 0 for
    the pair's lower machine (as `pair_rounds` orders it) and 1 for the higher. What
    `pair_rounds(n)` gives machine `i`, without scheduling the whole ring (the simulated agents
    ask it for each of 12,500 machines)."""
    if n < 2 or not 0 <= i < n:
        return []
    if n == 2:
        return [(0, 1 - i, i)]
    out = []
    if i > 0:                                           # the edge (i - 1, i)
        out.append((edge_round(n, i - 1), i - 1, 1))
    if i < n - 1:                                       # the edge (i, i + 1)
        out.append((edge_round(n, i), i + 1, 0))
    if i == 0:                                          # the closing edge (0, n - 1)
        out.append((edge_round(n, n - 1), n - 1, 0))
    elif i == n - 1:
        out.append((edge_round(n, n - 1), 0, 1))
    out.sort()
    return out


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
    edges = list(merged)
    rows = list(merged.values())
    judged = judge_columns(edges, [r.get("ok") for r in rows], [r.get("mbps") for r in rows],
                           [r.get("latency_s") for r in rows], n, min_ratio=min_ratio, min_mbps=min_mbps,
                           max_latency_s=max_latency_s, latency_ratio=latency_ratio)
    verdicts = dict(zip(edges, judged.pop("verdicts")))
    pairs = {}
    for i, j in sorted(merged):
        v = verdicts[(i, j)]
        entry = pairs[f"{i}-{j}"] = {**merged[(i, j)], "bad": v is not None}
        if v not in (None, "failed"):
            entry["why"] = v
    return {
        "bad_machines": judged["bad_machines"],
        "bad_links": judged["bad_links"],
        "pairs": pairs,
        "reference_mbps": judged["reference_mbps"],
        "reference_latency_s": judged["reference_latency_s"],
    }


def judge_columns(edges: Sequence[Pair], ok: Sequence, mbps: Sequence[float | None],
                  latency: Sequence[float | None], n: int, min_ratio: float = 0.25, min_mbps: float = 50.0,
                  max_latency_s: float = 0.1, latency_ratio: float = 10.0) -> dict:
    """`judge_pairs` over columns: pair k is `edges[k]` (low, high) with its result `ok[k]`,
    `mbps[k]` and `latency[k]` (None: not measured); every pair listed once. Returns "verdicts"
    (pair k's reason to be bad, "failed" when it failed, None when it is good) with
    "bad_machines", "bad_links", "reference_mbps" and "reference_latency_s" as `judge_pairs`.
    (Columns: the stop-time verdict of a 12,500-machine job judges its pairs without a dict each.)"""
    speed = _reference({p: v for p, good, v in zip(edges, ok, mbps) if good and v is not None}, max)
    lat_ref = _reference({p: v for p, good, v in zip(edges, ok, latency) if good and v is not None}, min)
    fast = min_mbps if speed is None else max(min_mbps, min_ratio * speed)

    def why_bad(good, mb: float | None, lat: float | None) -> str | None:
        if not good:
            return "failed"
        if mb is not None and mb < min_mbps:
            return f"{mb:.2f} Mbit/s is below {min_mbps:g}"
        if mb is not None and speed is not None and mb < min_ratio * speed:
            return f"{mb:.2f} Mbit/s is below {min_ratio:g} x the others' {speed:.1f}"
        if lat is not None and lat > max_latency_s and (lat_ref is None or lat > latency_ratio * lat_ref):
            return f"latency {lat * 1e3:.1f} ms is above {latency_ratio:g} x the others' " \
                   f"{(lat_ref or 0) * 1e3:.2f} ms"
        return None

    if any(i < 0 or j < 0 for i, j in edges):
        raise ValueError("pair indices are machine numbers, 0 or more")
    size = 1 + max((max(i, j) for i, j in edges), default=-1)
    member = [0] * size                 # machine -> its pairs, and how many of them are bad
    failed = [0] * size
    verdicts: list[str | None] = []
    for (i, j), good, mb, lat in zip(edges, ok, mbps, latency):
        # (the usual pair: passed, fast enough, no latency measured; else `why_bad` says)
        v = None if good and mb is not None and mb >= fast and lat is None else why_bad(good, mb, lat)
        verdicts.append(v)
        member[i] += 1
        member[j] += 1
        if v is not None:
            failed[i] += 1
            failed[j] += 1
    bad_machines = [m for m, k in enumerate(member) if k >= 2 and failed[m] == k]
    if n == 2:
        bad_links = sorted(p for p, v in zip(edges, verdicts) if v is not None)
    else:
        bad_links = sorted((i, j) for (i, j), v in zip(edges, verdicts)
                           if v is not None and failed[i] < member[i] and failed[j] < member[j])
    return {"verdicts": verdicts, "bad_machines": bad_machines, "bad_links": bad_links,
            "reference_mbps": speed, "reference_latency_s": lat_ref}


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
