"""What-if straggler analysis (SMon's idea): how much faster would a job have been without its slowest
rank, its slowest machine, or its slowest pipeline stage?

Input: the job's `rank_times` events (the controller records every 20th committed step: each rank's
step time and compute time, `step_s` and `compute_s`, lists indexed by rank) and its layout.

The step's critical path, from the compute times `c[r]` (seconds per step, all micro-batches):

- a pipeline stage of one pipeline (its tensor-parallel ranks, and the context/expert ranks with it)
  waits for its slowest rank: `t[p, s] = max c[r]` over the ranks of stage s in pipeline p;
- a pipeline of `S` stages and `m` micro-batches (1F1B or GPipe) takes the fill and drain of every
  stage plus `m - 1` micro-batches at the pace of its slowest stage:
  `T[p] = (sum_s t[p, s] + (m - 1) * max_s t[p, s]) / m`;
- the data-parallel all-reduce waits for the slowest pipeline: `critical = max_p T[p]`;
- the rest of the measured step (communication not overlapped, the optimizer, the data loader) is
  `step - critical` and stays what it was.

"Without X" replaces the compute times of X's ranks by the step's median compute time and
recomputes the critical path. X is the rank / machine / stage (the same stage index in every
pipeline) slowest on average over the recorded steps.
"""
from __future__ import annotations

import statistics
from typing import Any, Sequence

from stalwart.topology import Topology


def _crit(c: Sequence[float], stage_of: Sequence[int], pipe_of: Sequence[int], stages: int, pipes: int,
          m: int) -> float:
    t = [[0.0] * stages for _ in range(pipes)]
    for r, x in enumerate(c):
        row = t[pipe_of[r]]
        s = stage_of[r]
        if x > row[s]:
            row[s] = x
    return max((sum(row) + (m - 1) * max(row)) / m for row in t)


def analyze(records: list[dict], topo: Topology, microbatches: int = 8) -> dict[str, Any]:
    """The what-if answer for `records` (rank_times event data: {"step", "step_s", "compute_s"}).

    Returns the measured mean step, the modelled critical path, and per scenario (rank, machine,
    stage) which one was slowest, the mean step without it and the saving (a fraction of the time)."""
    if microbatches < 1:
        raise ValueError(f"micro-batches must be >= 1 (got {microbatches})")
    world = topo.world_size
    usable = []
    for d in records:
        comp, step = d.get("compute_s") or [], d.get("step_s") or []
        if len(comp) != world or any(not isinstance(x, (int, float)) for x in comp):
            continue
        steps = [x for x in step if isinstance(x, (int, float))]
        usable.append((float(max(steps)) if steps else float(max(comp)), [float(x) for x in comp]))
    if not usable:
        raise ValueError(f"no step has every rank's compute time ({len(records)} rank_times record(s) of "
                         f"{world} ranks); the job's workers must report compute_s through the SDK")
    coords = [topo.coords(r) for r in range(world)]
    stage_of = [c["pp"] for c in coords]
    pipe_of = [c["dp"] for c in coords]
    machine_of = [topo.machine_of(r) for r in range(world)]
    stages, pipes = topo.pp, topo.dp

    def mean_by(key: Sequence[int]) -> dict[int, float]:
        acc: dict[int, list[float]] = {}
        for _, comp in usable:
            per: dict[int, float] = {}
            for r, x in enumerate(comp):
                per[key[r]] = max(per.get(key[r], 0.0), x)
            for k, v in per.items():
                acc.setdefault(k, []).append(v)
        return {k: statistics.fmean(v) for k, v in acc.items()}

    base_step = statistics.fmean(s for s, _ in usable)
    base_crit = statistics.fmean(_crit(c, stage_of, pipe_of, stages, pipes, microbatches) for _, c in usable)
    out: dict[str, Any] = {"steps": len(usable), "ranks": world, "microbatches": microbatches,
                           "step_s": base_step, "critical_s": base_crit, "scenarios": {}}
    for name, key in (("rank", list(range(world))), ("machine", machine_of), ("stage", stage_of)):
        means = mean_by(key)
        worst = max(means, key=lambda k: means[k])
        new_steps = []
        for step, comp in usable:
            med = statistics.median(comp)
            fixed = [med if key[r] == worst and x > med else x for r, x in enumerate(comp)]
            old = _crit(comp, stage_of, pipe_of, stages, pipes, microbatches)
            new = _crit(fixed, stage_of, pipe_of, stages, pipes, microbatches)
            new_steps.append(step - (old - new))
        new_mean = statistics.fmean(new_steps)
        out["scenarios"][name] = {"slowest": worst, "its_compute_s": means[worst],
                                  "median_compute_s": statistics.fmean(statistics.median(c) for _, c in usable),
                                  "step_s": new_mean, "saving": 1.0 - new_mean / base_step if base_step else 0.0}
    return out


def render(job_id: int, res: dict[str, Any]) -> str:
    lines = [f"job {job_id}: {res['steps']} recorded step(s) of {res['ranks']} ranks; mean step "
             f"{res['step_s']:.3f} s, modelled compute critical path {res['critical_s']:.3f} s "
             f"({res['microbatches']} micro-batches)"]
    for name, s in res["scenarios"].items():
        lines.append(f"  without its slowest {name:<8} ({name} {s['slowest']}: compute {s['its_compute_s']:.3f} s "
                     f"vs median {s['median_compute_s']:.3f} s): step {s['step_s']:.3f} s, "
                     f"{s['saving']:.1%} faster")
    return "\n".join(lines)
