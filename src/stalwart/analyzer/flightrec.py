"""Flight-recorder analysis: which ranks never entered the stuck collective.

Input: one dump per rank of ``torch._C._distributed_c10d._dump_fr_trace_json()``
(works with gloo when ``TORCH_FR_BUFFER_SIZE`` is set; environment.md).  A dump
is a JSON object whose ``entries`` each carry ``pg_id``, ``process_group``
(``[id, name]``), ``collective_seq_id`` (per process group, 1-based, 0 for
point-to-point ops), ``p2p_seq_id``, ``is_p2p``, ``profiling_name`` (e.g.
``"gloo:all_reduce"``) and ``retired`` (completed). A group is identified across ranks by its
name (``process_group[0]``), not by ``pg_id``, which counts the groups each process created: with
``new_group(..., use_local_synchronization=True)`` (the SDK's groups) each rank creates only its own,
so two different data-parallel groups share a pg_id while their names (a hash of the members) differ.
With gloo ``pg_config`` is empty and send/recv are not recorded (measured with torch 2.13), so
group membership is taken from ``pg_ranks`` when given, otherwise from the ranks that recorded an
entry for the group.

:func:`laggards` is pure: per process group, the highest collective sequence id
any rank reached is the collective the job is stuck on; the ranks whose last id
is lower never entered it, and each of them is usually stuck somewhere else
(reported from its newest unfinished entry in any group).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass(frozen=True)
class Op:
    """One flight-recorder entry, reduced to what the analysis needs."""

    pg_id: str
    pg_name: str
    seq: int
    p2p_seq: int
    is_p2p: bool
    name: str
    retired: bool
    record_id: int


@dataclass
class GroupLag:
    """The state of one process group across ranks."""

    pg_id: str
    pg_name: str
    stuck_seq: int                      # highest collective_seq_id reached by any rank
    stuck_op: str | None                # what the leading ranks are blocked in
    last_seq: dict[int, int]            # rank -> last collective_seq_id on this group
    waiting: list[int]                  # ranks inside the stuck collective, not retired
    laggards: list[int]                 # ranks whose last id is lower: never entered it
    laggard_stuck_on: dict[int, Op | None] = field(default_factory=dict)

    def as_dict(self) -> dict:
        """Plain-data form (JSON-ready)."""
        return {
            "pg_id": self.pg_id, "pg_name": self.pg_name, "stuck_seq": self.stuck_seq,
            "stuck_op": self.stuck_op, "last_seq": dict(self.last_seq),
            "waiting": list(self.waiting), "laggards": list(self.laggards),
            "laggard_stuck_on": {r: (None if op is None else
                                     {"pg_id": op.pg_id, "op": op.name, "seq": op.seq})
                                 for r, op in self.laggard_stuck_on.items()},
        }


def parse(dump: str | bytes | Mapping[str, Any]) -> list[Op]:
    """Entries of one rank's dump (raw JSON text/bytes or the decoded object)."""
    if isinstance(dump, (str, bytes, bytearray)):
        try:
            dump = json.loads(dump)
        except ValueError as err:
            raise ValueError(f"flight-recorder dump is not JSON: {err}") from None
    if not isinstance(dump, Mapping) or not isinstance(dump.get("entries", []), list):
        raise ValueError("flight-recorder dump must be an object with an 'entries' list")
    ops = []
    for i, e in enumerate(dump.get("entries", [])):
        try:
            pg = e.get("process_group") or [str(e["pg_id"]), ""]
            ops.append(Op(pg_id=str(pg[0]) if pg and pg[0] not in (None, "") else str(e["pg_id"]),
                          pg_name=str(pg[1]) if len(pg) > 1 else "",
                          seq=int(e.get("collective_seq_id", 0)),
                          p2p_seq=int(e.get("p2p_seq_id", 0)), is_p2p=bool(e.get("is_p2p")),
                          name=str(e.get("profiling_name", "")), retired=bool(e.get("retired")),
                          record_id=int(e.get("record_id", i))))
        except (KeyError, TypeError, ValueError, IndexError) as err:
            raise ValueError(f"flight-recorder entry {i} is malformed: {err!r}") from None
    return ops


def _newest_unretired(ops: list[Op]) -> Op | None:
    pending = [o for o in ops if not o.retired]
    return max(pending, key=lambda o: o.record_id) if pending else None


def laggards(dumps_by_rank: Mapping[int, str | bytes | Mapping[str, Any]],
             pg_ranks: Mapping[str, list[int]] | None = None,
             only_stuck: bool = True) -> dict[str, GroupLag]:
    """Per process group (keyed by pg_id): the stuck collective and the laggard ranks.

    ``pg_ranks`` optionally maps pg_id -> member ranks (global); a member with no
    entry for the group counts as last id 0.  With ``only_stuck`` (default) a
    group is reported only if some rank has an unfinished collective on it or its
    members disagree on the last id.
    """
    if not dumps_by_rank:
        raise ValueError("laggards needs at least one rank's flight-recorder dump")
    ops_by_rank = {int(r): parse(d) for r, d in dumps_by_rank.items()}
    groups: dict[str, str] = {}
    for ops in ops_by_rank.values():
        for o in ops:
            groups.setdefault(o.pg_id, o.pg_name)
    for pg in (pg_ranks or {}):
        groups.setdefault(str(pg), "")
    out: dict[str, GroupLag] = {}
    for pg_id in sorted(groups, key=lambda p: (len(p), p)):
        members = (sorted(pg_ranks[pg_id]) if pg_ranks and pg_id in pg_ranks else
                   sorted(r for r, ops in ops_by_rank.items() if any(o.pg_id == pg_id for o in ops)))
        colls = {r: [o for o in ops_by_rank.get(r, []) if o.pg_id == pg_id and not o.is_p2p]
                 for r in members}
        last = {r: max((o.seq for o in c), default=0) for r, c in colls.items()}
        if not last:
            continue
        top = max(last.values())
        at_top = {r: next((o for o in colls[r] if o.seq == top), None) for r in members
                  if last[r] == top}
        waiting = sorted(r for r, o in at_top.items() if o is not None and not o.retired)
        lag = sorted(r for r in members if last[r] < top)
        if only_stuck and not waiting and not lag:
            continue
        stuck_op = next((o.name for o in at_top.values() if o is not None), None)
        out[pg_id] = GroupLag(
            pg_id=pg_id, pg_name=groups[pg_id], stuck_seq=top, stuck_op=stuck_op,
            last_seq=last, waiting=waiting, laggards=lag,
            laggard_stuck_on={r: _newest_unretired(ops_by_rank.get(r, [])) for r in lag})
    return out


def stuck_ranks(lags: Mapping[str, GroupLag]) -> list[int]:
    """Ranks that are laggards in some group (the ones to look at first)."""
    return sorted({r for g in lags.values() for r in g.laggards})
