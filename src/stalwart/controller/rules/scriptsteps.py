"""Numbering a plain script's steps across restarts, from its own snapshots.

A script without the SDK tells its steps through the step hook (worker/stephook.py): each rank
counts the optimizer steps its process completed (`n`) and says when it saved or loaded a file.
The job's steps are numbered from its start, so a restarted script that resumed from its own
snapshot must go on from the step that snapshot holds, and the steps it runs again after a crash
must carry the numbers they had (the ledger books the earlier executions as lost progress).

- A `save` of a path after `n` steps of a run whose first step was number `base` is a *mark*: that
  file holds `base + n` completed steps (the job's marks live in its state, keyed by the absolute
  path; a later save of the same path replaces its mark; renaming the file moves its mark).
- A run's `base` is the mark of the first marked file one of its ranks loaded before stepping (the
  mark the step hook found on the file itself, an extended attribute, first: it survives a lost
  machine whose records of the save never arrived; else the job's);
  when rank 0 steps before any such load, the script started over: base 0. Records of other ranks
  wait until the base is known (rank 0 usually loads first; the others may not load at all).
- Step `n` of a rank is the job's step `base + n - 1`; it lasted from the end of the rank's step
  before (the SDK's convention; the first step of a process: 0 s).

Pure: a function of the run's `ScriptRun`, the job's marks and one rank's records.
"""
from __future__ import annotations

from dataclasses import dataclass, field

Record = list      # [kind, n, t, path(, dest)]: kind "step", "save", "load" or "move"


@dataclass
class ScriptRun:
    """One run's numbering of a plain script's steps."""
    base: int | None = None                        # steps done before the run's first one
    waiting: dict[int, list[Record]] = field(default_factory=dict)    # rank -> records before base
    last_t: dict[int, float] = field(default_factory=dict)            # rank -> end of its last step
    seen: bool = False                             # a step hook reported (the job runs a plain script)


@dataclass(frozen=True)
class NumberedStep:
    rank: int
    step: int
    t: float
    dur: float


def number(run: ScriptRun, marks: dict[str, int], rank: int, records: list[Record]) -> list[NumberedStep]:
    """Take one rank's records (in order); the steps they complete, numbered. Updates `run` and
    `marks` (saves)."""
    run.seen = True
    out: list[NumberedStep] = []
    if run.base is None:
        held = run.waiting.setdefault(rank, [])
        for i, rec in enumerate(records):
            kind, path = rec[0], rec[3] if len(rec) > 3 else ""
            mark = rec[4] if kind == "load" and len(rec) > 4 else None
            if isinstance(mark, int) and not isinstance(mark, bool):
                run.base = mark             # the file's own mark (it survives a lost machine's records)
            elif kind == "load" and path in marks:
                run.base = marks[path]
            elif kind == "step" and rank == 0:
                run.base = 0
            if run.base is not None:
                held.extend(records[i:])
                break
        else:
            held.extend(records)
            return out
        for r in sorted(run.waiting, key=lambda r: (r != rank, r)):
            out += _apply(run, marks, r, run.waiting.pop(r))
        return out
    return _apply(run, marks, rank, records)


def _apply(run: ScriptRun, marks: dict[str, int], rank: int, records: list[Record]) -> list[NumberedStep]:
    assert run.base is not None
    out = []
    for rec in records:
        kind, n, t = rec[0], int(rec[1]), float(rec[2])
        if kind == "step":
            last = run.last_t.get(rank)
            run.last_t[rank] = t
            out.append(NumberedStep(rank=rank, step=run.base + n - 1, t=t, dur=max(0.0, t - last) if last else 0.0))
        elif kind == "save" and len(rec) > 3:
            marks[str(rec[3])] = run.base + n
        elif kind == "move" and len(rec) > 4 and rec[3] in marks:
            marks[str(rec[4])] = marks.pop(rec[3])
    return out
