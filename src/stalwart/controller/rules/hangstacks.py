"""From captured stacks (and flight-recorder dumps) to an eviction decision for a hang.

Pure glue between the agents' tracer output and the analyzers:

1. every machine's :func:`stalwart.agent.tracer.capture` records become
   :class:`~stalwart.analyzer.stacks.ProcessStack` values (rank -> topology machine index);
2. :func:`~stalwart.analyzer.stacks.aggregate` groups ranks by stack and
   :func:`~stalwart.analyzer.stacks.decide_eviction` over-evicts the smallest parallel
   group covering the outliers (ByteRobust §5, Fig. 7);
3. when the stacks cannot name anyone (ambiguous, or every rank shows the same stack) and
   flight-recorder dumps are given, :func:`~stalwart.analyzer.flightrec.laggards` names the
   ranks that never entered the stuck collective, and the same over-eviction applies to them.

Machines are named by the caller's ids (``machine_ids_by_index[i]`` is the id of the
machine at topology index ``i``, which changes when a standby takes an index over).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from stalwart.analyzer import flightrec
from stalwart.analyzer.stacks import ROLES, Aggregation, ProcessStack, aggregate, decide_eviction

_GONE_MARKS = ("does not exist", "exited")


@dataclass(frozen=True)
class Decision:
    """What to do about a hang.

    kind: the parallel kind evicted ("tp", "pp", "dp", ...), "machines" (the outliers' own
        machines), or None (evict nothing).
    machines: ids of the machines to evict (caller's ids), in topology index order.
    outlier_ranks: the ranks that were judged abnormal.
    reason: one human line.
    source: "stacks", "flightrec", or None when nothing could be concluded.
    machine_indices: topology indices of ``machines``.
    not_captured: ranks without a worker stack (machine silent, or capture failed).
    """

    kind: str | None
    machines: list[Any]
    outlier_ranks: list[int]
    reason: str
    source: str | None = None
    machine_indices: list[int] = field(default_factory=list)
    not_captured: list[int] = field(default_factory=list)

    def as_dict(self) -> dict:
        """Plain-data form (JSON-ready)."""
        return {"kind": self.kind, "machines": list(self.machines),
                "outlier_ranks": list(self.outlier_ranks), "reason": self.reason,
                "source": self.source, "machine_indices": list(self.machine_indices),
                "not_captured": list(self.not_captured)}


def _index_of(machine_ids_by_index: Sequence[Any] | Mapping[int, Any], topo: Any) -> tuple[dict, dict]:
    if isinstance(machine_ids_by_index, Mapping):
        by_index = {int(i): m for i, m in machine_ids_by_index.items()}
    else:
        by_index = dict(enumerate(machine_ids_by_index))
    missing = [i for i in range(topo.machines) if i not in by_index]
    if missing:
        raise ValueError(f"machine_ids_by_index has no id for topology machine(s) {missing}")
    by_id: dict[Any, int] = {}
    for i, m in by_index.items():
        if m in by_id:
            raise ValueError(f"machine id {m!r} is given for indices {by_id[m]} and {i}")
        by_id[m] = i
    return by_index, by_id


def to_process_stacks(stacks_by_machine: Mapping[Any, list[dict]], topo: Any,
                      machine_ids_by_index: Sequence[Any] | Mapping[int, Any]
                      ) -> tuple[list[ProcessStack], list[int]]:
    """Tracer records -> ProcessStacks, plus the ranks that have no worker stack.

    A worker whose capture failed keeps an empty stack (``main: <no stack>``, an outlier
    like any other odd stack); a child that vanished during capture is dropped (data-loader
    workers come and go); a rank of the topology with no worker record at all (its machine
    did not answer) also gets an empty stack.  Records naming an unknown machine id, or a
    rank the topology places on another machine, are refused with ValueError.
    """
    _, by_id = _index_of(machine_ids_by_index, topo)
    out: list[ProcessStack] = []
    workers: set[int] = set()
    failed: set[int] = set()
    for mid, records in stacks_by_machine.items():
        if mid not in by_id:
            raise ValueError(f"stacks from unknown machine {mid!r} (not in machine_ids_by_index)")
        idx = by_id[mid]
        for rec in records:
            rank = rec.get("rank")
            if rank is not None and topo.machine_of(rank) != idx:
                raise ValueError(f"machine {mid!r} (index {idx}) reported rank {rank}, which the "
                                 f"topology places on index {topo.machine_of(rank)}")
            role = rec.get("role", "child")
            role = role if role in ROLES else "child"
            threads = rec.get("threads") or []
            error = rec.get("error")
            if error and not threads:
                if role != "worker" and any(m in str(error) for m in _GONE_MARKS):
                    continue
                if role == "worker" and rank is not None:
                    failed.add(rank)
            if role == "worker" and rank is not None:
                workers.add(rank)
            out.append(ProcessStack(rank=rank, pid=int(rec.get("pid") or 0), role=role,
                                    machine=idx, threads=list(threads)))
    absent = [r for r in range(topo.world_size) if r not in workers]
    for r in absent:
        out.append(ProcessStack(rank=r, pid=0, role="worker", machine=topo.machine_of(r), threads=[]))
    return out, sorted(set(absent) | failed)


def _ids(indices: list[int], by_index: dict) -> list[Any]:
    return [by_index[i] for i in indices]


def stuck_groups(fr_dumps: Mapping[int, Any], pg_ranks: Mapping[str, list[int]] | None = None
                 ) -> dict[str, flightrec.GroupLag]:
    """The process groups some rank is blocked in (an unfinished collective), with the ranks
    that never entered it. Groups whose members merely disagree with nobody waiting are left out:
    a summary taken a moment apart from the others (a rank stopped mid-step, a group whose last
    entry left the recorder's buffer) is no evidence of who holds the job up."""
    return {k: g for k, g in flightrec.laggards(fr_dumps, pg_ranks).items() if g.waiting and g.laggards}


def describe_group(members: Sequence[int], topo: Any) -> str:
    """A group of ranks in the job's words: "the world", "dp group [1, 3]", or "ranks [...]"."""
    ranks = sorted(members)
    if ranks == list(range(topo.world_size)):
        return "the world group"
    for kind in ("tp", "cp", "ep", "dp", "pp"):
        try:
            if ranks and sorted(topo.group(kind, ranks[0])) == ranks and topo.size(kind) > 1:
                return f"{kind} group {ranks}"
        except ValueError:
            break
    return f"ranks {ranks}"


def flightrec_evidence(fr_dumps: Mapping[int, Any], topo: Any, now: float) -> dict | None:
    """What the ranks' flight-recorder summaries (agent/progress.py) say about a hang, for the
    incident's record: per stuck group the collective (op and sequence number), the ranks waiting
    in it and the ones that never entered it; and how long before `now` each laggard's recorder
    last wrote (a stopped or frozen process stops writing). None when no group is stuck."""
    groups = stuck_groups(fr_dumps)
    if not groups:
        return None
    out = []
    for g in groups.values():
        out.append({"group": describe_group(list(g.last_seq), topo), "pg": g.pg_id, "op": g.stuck_op,
                    "seq": g.stuck_seq, "waiting": list(g.waiting), "laggards": list(g.laggards),
                    "laggard_last_seq": {str(r): g.last_seq[r] for r in g.laggards}})
    lagging = sorted({r for g in groups.values() for r in g.laggards})
    silent = {str(r): round(now - float(fr_dumps[r]["t"]), 1) for r in lagging
              if isinstance(fr_dumps.get(r), Mapping) and isinstance(fr_dumps[r].get("t"), (int, float))}
    summary = "; ".join(f"ranks {g['laggards']} never entered {g['op'] or 'a collective'} #{g['seq']} of "
                        f"{g['group']} (ranks {g['waiting']} wait in it)" for g in out)
    if silent:
        summary += " (their recorders last wrote " + ", ".join(f"{s:g} s" for s in silent.values()) + \
            " before the capture)"
    return {"groups": out, "laggards": lagging, "silent_s": silent, "summary": summary}


def _from_flightrec(fr_dumps: Mapping[int, Any], pg_ranks: Mapping[str, list[int]] | None,
                    topo: Any, max_fraction: float) -> tuple[Any, str] | None:
    lags = stuck_groups(fr_dumps, pg_ranks)
    lagging = flightrec.stuck_ranks(lags)
    if not lagging:
        return None
    others = sorted(set(range(topo.world_size)) - set(lagging))
    agg = Aggregation(groups=[("entered", others), ("laggards", lagging)], outliers=lagging,
                      ambiguous=False, healthy=others)
    d = decide_eviction(agg, topo, max_fraction)
    where = "; ".join(f"ranks {g.laggards} never entered {g.stuck_op or 'a collective'} #{g.stuck_seq} of "
                      f"{describe_group(list(g.last_seq), topo)} (ranks {g.waiting} wait in it)"
                      for g in lags.values())
    return d, where


def decide_hang(stacks_by_machine: Mapping[Any, list[dict]], topo: Any,
                machine_ids_by_index: Sequence[Any] | Mapping[int, Any],
                fr_dumps: Mapping[int, Any] | None = None,
                pg_ranks: Mapping[str, list[int]] | None = None,
                max_fraction: float = 0.5) -> Decision:
    """Decide which machines to evict for a hang from every machine's tracer records.

    ``stacks_by_machine``: machine id -> list of :func:`stalwart.agent.tracer.capture`
    records.  ``machine_ids_by_index``: the id at each topology index (list or mapping).
    ``fr_dumps``: optional rank -> flight-recorder dump, consulted when the stacks name no
    machine (ambiguous, all identical, or outliers that narrow nothing); ``pg_ranks`` optional
    pg_id -> member ranks for it.
    ``max_fraction``: never evict more than this fraction of the machines (see
    :func:`stalwart.analyzer.stacks.decide_eviction`).
    """
    if not stacks_by_machine:
        raise ValueError("decide_hang needs the stacks of at least one machine")
    by_index, _ = _index_of(machine_ids_by_index, topo)
    stacks, not_captured = to_process_stacks(stacks_by_machine, topo, machine_ids_by_index)
    agg = aggregate(stacks)
    d = decide_eviction(agg, topo, max_fraction)
    note = f" ({len(not_captured)} ranks without a captured worker stack: {not_captured})" \
        if not_captured else ""
    # the flight recorder is asked whenever the stacks evict nothing: identical, ambiguous, or
    # outliers that narrow nothing (on several machines sharing only a group of most of the job)
    if d.machines or not fr_dumps:
        return Decision(d.kind, _ids(d.machines, by_index), d.outlier_ranks, "stacks: " + d.reason + note,
                        "stacks" if d.machines else None, list(d.machines), not_captured)
    found = _from_flightrec(fr_dumps, pg_ranks, topo, max_fraction)
    if found is None:
        return Decision(None, [], d.outlier_ranks, f"stacks: {d.reason}; flight recorder: every "
                        f"rank reached the same collectives{note}", None, [], not_captured)
    fd, where = found
    return Decision(fd.kind, _ids(fd.machines, by_index), fd.outlier_ranks,
                    f"stacks inconclusive ({d.reason}); flight recorder: {where}; {fd.reason}{note}",
                    "flightrec" if fd.machines else None, list(fd.machines), not_captured)
