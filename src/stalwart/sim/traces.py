"""Synthetic collective traces: what the workers' flight-recorder hooks would send for a job of
synchronous collectives, healthy or with one partial fault, for the trace detector's tests and its
model comparison (`bench/tracemodel.py`).

Each step runs the same ops on every rank. A rank computes before each op (`compute_s`, with noise)
and enters it; an op ends for every participant when the last one entered plus its communication
time, so a rank that computes slowly enters late (a long gap) and its peers wait inside the op (long
durations): as on a real job. Faults (on rank `rank` from step `at` on):

- ``slow-compute``  its compute takes `factor` times longer (a hot GPU, a throttled CPU);
- ``slow-op``       op `op` takes `factor` times longer on it (a slow link seen by one end);
- ``missing``       it skips op `op`;
- ``reordered``     it runs ops `op` and `op + 1` in the other order;
- ``uniform``       every rank computes and communicates `factor` times slower (a loaded host: no
                    fault of any one rank);
- ``stuck``         it never enters op `op` of step `at` (a hung stage, a stopped process): its
                    peers enter it and wait there, so nobody enters anything after.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from stalwart.analyzer.traces import RankWindow, op_key
from stalwart.protocol import TraceOp

FAULTS = ("slow-compute", "slow-op", "missing", "reordered", "uniform", "stuck")
DEFAULT_OPS = (("gloo:all_reduce", "dp", 0.004, 0.002), ("gloo:all_reduce", "dp", 0.003, 0.002),
               ("gloo:all_reduce", "dp", 0.002, 0.001), ("gloo:broadcast", "tp", 0.001, 0.0005),
               ("gloo:all_gather", "tp", 0.001, 0.0005), ("gloo:barrier", "default_pg", 0.0, 0.0002))


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int = 0
    at: int = 0
    factor: float = 2.0
    op: int = 1


def synth(ranks: int, steps: int, seed: int = 0, fault: Fault | None = None, noise: float = 0.1,
          ops: tuple[tuple[str, str, float, float], ...] = DEFAULT_OPS, durations: bool = True,
          t0: float = 0.0) -> list[tuple[float, int, TraceOp]]:
    """The job's trace operations in time order: (entry time s, rank, op). `ops` are (kind, group,
    compute before it s, communication s); `durations` False leaves them out (as gloo does)."""
    rnd = random.Random(seed)
    out: list[tuple[float, int, TraceOp]] = []
    t = {r: t0 for r in range(ranks)}
    last_entry = {r: t0 for r in range(ranks)}
    seq = {r: 0 for r in range(ranks)}
    for step in range(steps):
        faulty = fault is not None and step >= fault.at
        order = {r: list(range(len(ops))) for r in range(ranks)}
        if faulty and fault is not None and fault.kind == "reordered":
            o = order[fault.rank]
            o[fault.op], o[fault.op + 1] = o[fault.op + 1], o[fault.op]
        # ops run in each rank's order; a collective ends when its last participant entered
        for pos in range(len(ops)):
            if faulty and fault is not None and fault.kind == "stuck" and pos == fault.op:
                for r in range(ranks):
                    if r != fault.rank:
                        seq[r] += 1
                        e = t[r] + ops[order[r][pos]][2]
                        kind, group = ops[order[r][pos]][0], ops[order[r][pos]][1]
                        out.append((e, r, TraceOp(kind=kind, group=f"{group}-{r % 2}", desc=group, dur_ms=None,
                                                  nbytes=None, gap_ms=round((e - last_entry[r]) * 1e3, 3),
                                                  seq=seq[r])))
                out.sort(key=lambda x: x[0])
                return out
            entries: dict[int, tuple[float, int]] = {}
            for r in range(ranks):
                i = order[r][pos]
                comp = ops[i][2] * (1 + noise * rnd.uniform(-1, 1)) + 0.0005 * rnd.random()
                if faulty and fault is not None and fault.kind == "uniform":
                    comp *= fault.factor
                if faulty and fault is not None and fault.kind == "slow-compute" and r == fault.rank:
                    comp *= fault.factor
                entries[r] = (t[r] + comp, i)
            end = max(e for e, _ in entries.values())
            for r, (e, i) in entries.items():
                comm = ops[i][3] * (1 + noise * rnd.uniform(-1, 1))
                if faulty and fault is not None and fault.kind == "uniform":
                    comm *= fault.factor
                if faulty and fault is not None and fault.kind == "slow-op" and r == fault.rank and i == fault.op:
                    comm *= fault.factor
                done = end + comm
                skip = faulty and fault is not None and fault.kind == "missing" and r == fault.rank and i == fault.op
                if not skip:
                    seq[r] += 1
                    kind, group = ops[i][0], ops[i][1]
                    out.append((e, r, TraceOp(kind=kind, group=f"{group}-{r % 2}", desc=group,
                                              dur_ms=round((done - e) * 1e3, 3) if durations else None,
                                              nbytes=None, gap_ms=round((e - last_entry[r]) * 1e3, 3),
                                              seq=seq[r])))
                    last_entry[r] = e
                t[r] = done
    out.sort(key=lambda x: x[0])
    return out


def to_windows(ops: list[tuple[float, int, TraceOp]], window_s: float) -> list[dict[int, RankWindow]]:
    """The operations cut into windows of `window_s` by entry time, each rank's as the detector
    keeps it."""
    out: list[dict[int, RankWindow]] = []
    if not ops:
        return out
    start = ops[0][0]
    for t, r, op in ops:
        i = int((t - start) // window_s)
        while len(out) <= i:
            out.append({})
        out[i].setdefault(r, RankWindow()).add(op_key(op.kind, op.desc), op.group, op.dur_ms, op.gap_ms)
    return out
