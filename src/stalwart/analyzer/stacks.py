"""Stack aggregation and over-eviction for hangs (ByteRobust §5, papers.md §1.6).

Input: what the agent's tracer captures on each machine, one
``py-spy dump --json --nonblocking --pid P`` per training process (worker,
data-loader workers, checkpoint helpers, other children).  py-spy's JSON is a list
of threads ``{pid, thread_id, thread_name, os_thread_id, active, owns_gil,
frames, process_info}``; each frame ``{name, filename, module, short_filename,
line, locals, is_entry, is_shim_entry}``, innermost frame first.

Under a single implicit fault most healthy ranks show identical stacks: the
ranks are grouped by a canonical stack string, the largest group is healthy, the
rest are outliers, and the smallest parallel group covering the outliers'
machines is evicted (over-eviction).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable

ROLES = ("worker", "dataloader", "ckpt", "child")
_STDLIB = frozenset(sys.stdlib_module_names)
SDK_THREAD_PREFIX = "stalwart-"      # every thread the worker SDK starts is named so


@dataclass
class ProcessStack:
    """One captured process: its rank (None for a machine-level helper), role and threads.

    ``threads`` is py-spy's JSON list for that process.
    """

    rank: int | None
    pid: int
    role: str
    machine: int
    threads: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"unknown process role {self.role!r} (expected one of {', '.join(ROLES)})")


def from_pyspy(raw: str | bytes | list, rank: int | None, machine: int,
               role: str = "worker") -> ProcessStack:
    """Build a ProcessStack from one ``py-spy dump --json`` output of a single process."""
    if isinstance(raw, (str, bytes, bytearray)):
        try:
            raw = json.loads(raw)
        except ValueError as e:
            raise ValueError(f"py-spy output is not JSON: {e}") from None
    if not isinstance(raw, list) or not all(isinstance(t, dict) for t in raw):
        raise ValueError("py-spy JSON must be a list of thread objects")
    pids = {t.get("pid") for t in raw}
    if len(pids) > 1:
        raise ValueError(f"py-spy JSON holds several processes ({sorted(pids)}); split it per pid")
    pid = pids.pop() if pids else 0
    return ProcessStack(rank=rank, pid=int(pid or 0), role=role, machine=machine, threads=raw)


def _module(frame: dict) -> str | None:
    """Dotted module of a frame, without path prefixes; None for frozen/bootstrap noise."""
    path = frame.get("short_filename") or frame.get("filename") or ""
    if frame.get("module"):
        return str(frame["module"])
    if path.startswith("<frozen") or "<frozen " in (frame.get("filename") or ""):
        return None
    if path.startswith("<"):
        return path
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            path = path.rsplit(marker, 1)[1]
            break
    else:
        if path.startswith("/"):
            path = path.rsplit("/", 1)[1]
    if path.endswith(".py"):
        path = path[:-3]
    if path.endswith("/__init__"):
        path = path[: -len("/__init__")]
    return path.replace("/", ".")


def frames(thread: dict) -> list[str]:
    """A thread's frames as ``module:function``, outermost first, innermost last."""
    out = []
    for f in reversed(thread.get("frames") or []):
        mod = _module(f)
        if mod is None:
            continue
        out.append(f"{mod}:{f.get('name', '?')}")
    return out


def _is_main(thread: dict, pid: int) -> bool:
    return thread.get("thread_name") == "MainThread" or (
        thread.get("os_thread_id") is not None and thread.get("os_thread_id") == pid)


def _in_user_code(frame_strings: list[str]) -> bool:
    """True when some frame is outside the standard library (user code or torch)."""
    return any(s.split(":", 1)[0].split(".", 1)[0] not in _STDLIB and not s.startswith("<")
               for s in frame_strings)


def normalize(ps: ProcessStack) -> str:
    """Canonical stack string of one process.

    Keeps the main thread plus threads that run user or torch code (idle pool,
    queue-feeder and resource-sharer threads are dropped, and so are the worker SDK's own
    threads, all named ``stalwart-*``: the flight-recorder dump, the agent link and the
    checkpoint commit run on timers of their own, so two healthy ranks caught with one of them
    in different places would otherwise land in different groups), frames as
    ``module:function`` joined by `` > `` innermost last; no line numbers,
    addresses, path prefixes, pids or ``<frozen ...>`` frames.
    """
    main, others = [], []
    for t in ps.threads:
        fs = frames(t)
        if _is_main(t, ps.pid):
            main.append("main: " + (" > ".join(fs) or "<no python frames>"))
        elif not str(t.get("thread_name") or "").startswith(SDK_THREAD_PREFIX) and _in_user_code(fs):
            others.append("thread: " + " > ".join(fs))
    if not main and not others:
        return "main: <no stack>"
    return "\n".join(sorted(main) + sorted(others))


@dataclass
class Aggregation:
    """Ranks grouped by stack: ``groups`` largest first, ``outliers`` outside the healthy group(s)."""

    groups: list[tuple[str, list[int]]]
    outliers: list[int]
    ambiguous: bool
    healthy: list[int] = field(default_factory=list)


def rank_keys(stacks: Iterable[ProcessStack]) -> dict[int, str]:
    """Per rank: its worker stack plus the sorted stacks of its children.

    Helpers captured with ``rank=None`` serve the whole machine and are added to
    every rank of that machine.  A rank with children but no captured worker
    gets ``main: <no stack>`` as its worker part.
    """
    workers: dict[int, list[str]] = defaultdict(list)
    children: dict[int, list[str]] = defaultdict(list)
    machine_helpers: dict[int, list[str]] = defaultdict(list)
    rank_machine: dict[int, int] = {}
    for ps in stacks:
        text = normalize(ps)
        if ps.rank is None:
            machine_helpers[ps.machine].append(f"[{ps.role}]\n{text}")
            continue
        rank_machine[ps.rank] = ps.machine
        if ps.role == "worker":
            workers[ps.rank].append(text)
        else:
            children[ps.rank].append(f"[{ps.role}]\n{text}")
    keys = {}
    for rank, machine in rank_machine.items():
        parts = ["[worker]\n" + ("\n".join(sorted(workers[rank])) or "main: <no stack>")]
        parts += sorted(children[rank] + machine_helpers.get(machine, []))
        keys[rank] = "\n".join(parts)
    return keys


def aggregate(stacks: Iterable[ProcessStack]) -> Aggregation:
    """Group ranks by canonical stack; the dominant group(s) are healthy, the rest outliers.

    The largest group (several tied for largest: all of them) is healthy only if it covers
    more than half of the ranks; otherwise the result is ``ambiguous`` (no group can be called
    healthy). A plurality is no evidence of health in a hang: a partition between the two
    machines of a pipeline stage left that stage's four ranks in one stack and the other
    stage's four, waiting for them, split over two; the waiting ones were taken for outliers.
    """
    keys = rank_keys(stacks)
    if not keys:
        raise ValueError("aggregate needs at least one rank's stacks")
    by_key: dict[str, list[int]] = defaultdict(list)
    for rank in sorted(keys):
        by_key[keys[rank]].append(rank)
    groups = sorted(by_key.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
    top = len(groups[0][1])
    tied = [g for g in groups if len(g[1]) == top]
    covered = sum(len(r) for _, r in tied)
    ambiguous = covered * 2 <= len(keys)
    healthy = sorted(r for _, rs in tied for r in rs)
    outliers = sorted(r for _, rs in groups[len(tied):] for r in rs)
    if ambiguous:
        healthy = []
    return Aggregation(groups=[(k, list(r)) for k, r in groups], outliers=outliers,
                       ambiguous=ambiguous, healthy=healthy)


@dataclass(frozen=True)
class EvictionDecision:
    """What to evict: ``kind`` (a parallel kind, ``"machines"`` or None), the machines, why."""

    kind: str | None
    machines: list[int]
    outlier_ranks: list[int]
    reason: str


def decide_eviction(agg: Aggregation, topo: Any, max_fraction: float = 0.5) -> EvictionDecision:
    """Over-eviction from an aggregation: the smallest parallel group covering the outliers.

    No eviction when all ranks agree or the aggregation is ambiguous.  Outliers all on one
    machine name that machine when no group of at most ``max_fraction`` of the job's machines
    covers them (a machine is the narrowest fault domain).  Outliers on several machines that
    no such group covers narrow nothing: the only group they share is (nearly) the whole job,
    or none, and their stacks are as likely a moment of a slow job as a fault (a slow link
    leaves healthy ranks caught mid-step), so nothing is evicted and the reason says so: the
    stop-time checks decide.
    """
    out = list(agg.outliers)
    if agg.ambiguous:
        sizes = ", ".join(str(len(r)) for _, r in agg.groups[:5])
        return EvictionDecision(None, [], out, f"ambiguous: no stack group covers more than half "
                                               f"of the ranks (group sizes {sizes})")
    if not out:
        n = sum(len(r) for _, r in agg.groups)
        return EvictionDecision(None, [], [], f"all {n} ranks show the same stack")
    shared = topo.shared_group(out)
    limit = max_fraction * topo.machines
    if shared is not None and len(shared[1]) <= limit:
        kind, machines = shared
        return EvictionDecision(kind, list(machines), out,
                                f"{len(out)} outlier ranks in {len(agg.groups) - 1} stack group(s) "
                                f"share one {kind} group on machines {list(machines)}")
    why = ("share no parallel group" if shared is None else
           f"share only a {shared[0]} group of {len(shared[1])} of {topo.machines} machines")
    machines = topo.machines_of(out)
    if len(machines) == 1:
        return EvictionDecision("machines", machines, out, f"outliers {why}; all on machine {machines[0]}: "
                                                           f"evicting it")
    return EvictionDecision(None, [], out, f"outliers on {len(machines)} machines {machines} {why}: the "
                                           f"stacks narrow nothing, not evicting (stop-time checks decide)")


def group_records(stacks: dict[str, list[dict]]) -> list[tuple[str, list[str]]]:
    """An incident's captured stacks, as stored (``{machine: [tracer record]}``), grouped by
    canonical stack, largest group first: ``[(stack text, ["m0/rank1/worker[S]", ...])]``.

    What `stalwart stacks` prints and the dashboard shows; a record without threads is grouped
    under ``<its error>``.
    """
    groups: dict[str, list[str]] = {}
    for machine, recs in sorted(stacks.items()):
        for r in recs:
            key = normalize(from_pyspy(r.get("threads") or [], r.get("rank"), machine,  # type: ignore[arg-type]
                                       r.get("role", "worker"))) \
                if r.get("threads") else f"<{r.get('error') or 'no stack'}>"
            groups.setdefault(key, []).append(f"{machine}/rank{r.get('rank')}/{r.get('role')}"
                                              f"[{r.get('status', '?')}]")
    return sorted(groups.items(), key=lambda kv: -len(kv[1]))
