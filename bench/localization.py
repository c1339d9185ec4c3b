"""Localization quality over a fault matrix: does stalwart blame the right machine?

    python bench/localization.py [--quick] [--kinds K1,K2] [--layouts dp,tp-dp,tp-pp-dp]
                                 [--positions first,middle,last] [--fault-free N] [--busy N]
                                 [--before REF|none] [--parallel N] [--detector on|off|both]
                                 [--json FILE] [--keep DIR] [--list]

Every chaos kind that can run on this host x fault position (the first, middle and last machine;
in the 3D layout the first and middle machines are pipeline stage 0, the last is stage 1) x
three layouts (pure DP: 4 machines x 1 worker; TP x DP: 3 x 2, tp=2 in a machine; TP x PP x DP:
4 x 2, tp=2, pp=2, dp=2), plus fault-free runs, on a quiet host and on a host busy with other work
(`fault-free-busy`: from step 30 of 250 on, one busy-loop process per core runs beside the job, so
its throughput drops and the fail-slow rounds look for a culprit that is not there); each
case is one real local job (a controller,
agents, gloo workers; network namespaces as root, so network faults are real), run in its own
process, one after the other. The fault lands at step 12 of 28 (the bundled GPT, 2 layers; at
step 30 of 250 for the slow faults: a mild slowdown is measured against 20 healthy steps, and the
job must still run when the fail-slow rounds end). The policy is the
default but for fail-slow rounds 3 s apart instead of 10 (`POLICY`): with the default, fail-slow
localization takes about 35 s longer. Each step computes at least 50 ms (`MIN_COMPUTE_S`).

Per kind it prints: runs; the culprit inside the evicted set (%); the evicted set within the
culprit's smallest parallel group (%: the culprit's own machine, or a smallest group of machines
it shares a TP/PP/DP group with that is smaller than the job); machines evicted per incident;
detection (fault -> incident) and localization (incident -> decision) seconds, median and max;
jobs finished. Kinds with no culprit machine (a killed worker, a single NIC flap) must evict
nothing: their row says how often nothing was evicted. Fault-free runs must never evict, busy
host or not.
`user-error` is not in the matrix: a bug in the job's own code fails the job by design and has
no machine to blame.

The peer, measured in the same run: stalwart before its blame rules (`--before REF`, git; by
default commit 5a07151, with `--quick` only: the kinds whose blame those rules changed), side by
side with wrong and right evictions.

`--quick` runs a subset in a few minutes (DP layout, middle machine: the two classes the blame rules
changed and one of each other mechanism, 2 fault-free runs, and one fault-free run on a busy host in the
TP x DP layout, where a round's stacks can flag a single machine's TP group). The full matrix
(171 cases) runs two cases at a time by default (`--parallel 2`: 52 minutes on a quiet 2-core
host, measured: both cores busy throughout; one at a time, for undisturbed timings, takes longer).
`--json FILE` writes every case and the summary.
`--detector on|off|both` runs the cases with the trace detector off (the default here), on (its
alerts may evict while the job is slowed; `DETECTOR_POLICY`), or both, and prints a table for each
and the detector's own figures: time to its first right alert, recall, precision, fault-free alerts.
Timings are noisy on a busy host; the correctness figures are not allowed to be.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from statistics import median

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BEFORE_BLAME_RULES = "5a07151"       # stalwart before its blame rules: the peer
FAULT_STEP, STEPS = 12, 28
CASE_TIMEOUT_S = 300.0

# batch: sequences per step, a multiple of dp x 2 micro-batches
LAYOUTS: dict[str, dict] = {
    "dp": dict(machines=4, gpus=1, tp=1, pp=1, dp=4, standby=1, batch=16),
    "tp-dp": dict(machines=3, gpus=2, tp=2, pp=1, dp=3, standby=1, batch=12),
    # two standbys: over-evicting a pipeline or data-parallel group of two machines must be possible
    "tp-pp-dp": dict(machines=4, gpus=2, tp=2, pp=2, dp=2, standby=2, batch=16),
}
POSITIONS = ("first", "middle", "last")


@dataclass(frozen=True)
class Kind:
    name: str                      # the row's name
    chaos: str                     # the chaos kind injected
    culprit: str                   # "machine" | "link" (this machine and the next) | "none"
    mechanism: str                 # which mechanism should localize it (README table)
    params: tuple[tuple[str, str], ...] = ()
    steps: int = 0                 # the job's steps (0: STEPS); slow faults need a longer job to be found
    at: int = 0                    # the step the fault lands at (0: FAULT_STEP)


# A mild slowdown is measured against 20 healthy steps before the recent 5 (the fail-slow
# detector's baseline): slow faults land at step SLOW_AT, and the job still runs when the rounds end.
SLOW_AT, SLOW_STEPS = 30, 250
# With the trace detector compared (`--detector on|both`), every fault of every case (detector on or
# off) lands at step TRACE_AT of SLOW_STEPS: the detector must have learned the healthy traces first
# (some 11 s with its start-up windows), and step 100 can come 10 s after the first step.
TRACE_AT = 160
# Fail-slow rounds every 3 s, not 10 (the default): five rounds fit in a short job, and the matrix
# in an hour. No warm spare workers: on this host every simulated machine's spares (and warm
# checkers) start on the same two cores as the training, a fault at step 12 finds them still
# starting (measured with the fork server: a 3D case's failover took 3.3 s with them, 2.4 s
# without), and what they speed up (a restart) is not what this bench measures; the standbys stay
# warm. Everything else is the default policy (heartbeats every 0.5 s, as in the tests).
POLICY = {"failslow_period_s": 3.0, "warm_spares": False}
# The trace detector, on: it learns from 8 s of traces after two 1.5 s windows of start-up (faults
# land at step TRACE_AT in a comparison), and its alerts may evict (still only while the job is
# slowed). Off: not even alerts.
DETECTOR_POLICY = {"on": {"trace_detector": True, "trace_evict": True, "trace_train_s": 8.0,
                          "trace_window_s": 1.5},
                   "off": {"trace_detector": False}}
# Each step's forward and backward take at least 50 ms, as a GPU job's compute-bound steps do; the
# 2-layer model alone computes ~20 ms, within a busy host's scheduling noise, where a throttled
# GPU's extra time would hide.
MIN_COMPUTE_S = 0.05

KINDS = (
    Kind("crash", "crash", "none", "worker exit -> stop-time checks pass -> reattempt"),
    Kind("machine-down", "machine-down", "machine", "missed heartbeats -> evict"),
    Kind("sigstop", "sigstop", "machine", "hang timeout -> stacks: stopped process -> evict"),
    Kind("freeze", "freeze", "machine", "hang timeout -> stacks: frozen processes -> evict"),
    Kind("stage-hang", "stage-hang", "machine", "hang timeout -> stacks -> over-evict the outliers' group"),
    Kind("gpu-xid", "gpu-xid", "machine", "GPU probe (fatal Xid) -> evict at once"),
    Kind("gpu-lost", "gpu-lost", "machine", "GPU probe -> evict at once"),
    Kind("ecc", "ecc", "machine", "GPU probe (double-bit ECC) -> evict at once"),
    Kind("disk-full", "disk-full", "machine", "disk probe -> evict at once"),
    Kind("gpu-hot", "gpu-hot", "machine", "fail-slow rounds: slow compute vs DP peers -> evict", steps=SLOW_STEPS,
         at=SLOW_AT),
    Kind("cpu-throttle", "cpu-throttle", "machine", "fail-slow rounds: slow compute vs DP peers -> evict",
         steps=SLOW_STEPS, at=SLOW_AT),
    Kind("nan", "nan", "machine", "NaN: non-finite local gradient names the machine -> evict"),
    Kind("sdc", "sdc", "machine", "NaN, no culprit -> bitwise alignment test -> evict"),
    Kind("nic-down", "nic-down", "machine", "NIC probe, still down while the job stalls -> evict"),
    Kind("nic-flap", "nic-flap", "machine", "NIC probe: 2 occurrences within 5 min -> evict",
         (("times", "2"),)),
    # down for 1 s: a 1 s probe sees it down at least once, then its carrier change (two reports)
    Kind("nic-flap-once", "nic-flap", "none", "NIC probe: 1 occurrence -> tolerated",
         (("times", "1"), ("down_s", "1"))),
    Kind("link-slow", "link-slow", "machine", "fail-slow or hang, nobody stands out -> pair test -> evict",
         steps=SLOW_STEPS, at=SLOW_AT),
    Kind("partition", "partition", "link", "hang -> stacks narrow nothing -> pair test: bad link -> evict an end"),
)
BY_NAME = {k.name: k for k in KINDS}
QUICK_KINDS = ("nic-flap-once", "nic-flap", "link-slow", "crash", "gpu-xid", "sigstop")
ISSUE_17_KINDS = ("nic-flap-once", "link-slow")       # what the peer runs with --quick
ROOT_ONLY = {"nic-down", "nic-flap", "link-slow", "partition", "freeze", "cpu-throttle"}


# ----- the cases and how they are scored (pure) ----------------------------------------------
@dataclass
class Case:
    kind: str                  # a Kind name, "fault-free" or "fault-free-busy"
    layout: str
    position: str              # first | middle | last | a fault-free run's number
    code: str = "now"          # "now" or the git ref of the peer
    detector: str = "off"      # the trace detector: "on" (it may evict) or "off"
    late: bool = False         # the fault lands at step TRACE_AT of SLOW_STEPS (detector comparisons)

    @property
    def label(self) -> str:
        return (f"{self.kind} {self.layout} {self.position}" + ("" if self.code == "now" else f" [{self.code}]")
                + (" [detector]" if self.detector == "on" else ""))


FAULT_FREE = ("fault-free", "fault-free-busy")


def machine_index(layout: str, position: str) -> int:
    n = LAYOUTS[layout]["machines"]
    return {"first": 0, "middle": (n - 1) // 2, "last": n - 1}[position]


def chaos_text(case: Case) -> str | None:
    if case.kind in FAULT_FREE:
        return None
    kind, m = BY_NAME[case.kind], machine_index(case.layout, case.position)
    params = dict(kind.params)
    if kind.culprit == "link":
        params["peer"] = str((m + 1) % LAYOUTS[case.layout]["machines"])
    extra = "".join(f",{k}={v}" for k, v in params.items())
    return f"{kind.chaos}@step={TRACE_AT if case.late else kind.at or FAULT_STEP},machine={m}{extra}"


def culprits(case: Case) -> list[int]:
    """The slot indices to blame (none for kinds with no culprit machine and fault-free runs)."""
    if case.kind in FAULT_FREE or BY_NAME[case.kind].culprit == "none":
        return []
    m = machine_index(case.layout, case.position)
    if BY_NAME[case.kind].culprit == "link":
        return sorted({m, (m + 1) % LAYOUTS[case.layout]["machines"]})
    return [m]


def allowed_sets(layout: str, culprit: int) -> list[set[int]]:
    """What evicting the culprit's "smallest parallel group" may take: its own machine, or a
    smallest group of machines it shares a TP/PP/DP group with that is smaller than the job."""
    from stalwart.topology import Topology

    lay = LAYOUTS[layout]
    topo = Topology(lay["machines"], lay["gpus"], tp=lay["tp"], pp=lay["pp"], dp=lay["dp"])
    groups = []
    for kind in ("tp", "pp", "dp"):
        if topo.size(kind) == 1:
            continue
        for r in topo.ranks_of_machine(culprit):
            ms = set(topo.machines_of(topo.group(kind, r)))
            if 1 < len(ms) < topo.machines and ms not in groups:
                groups.append(ms)
    smallest = min((len(g) for g in groups), default=0)
    return [{culprit}] + [g for g in groups if len(g) == smallest]


def score(case: Case, raw: dict) -> dict:
    """One case's figures from its raw outcome (see `run_one`)."""
    incidents = raw.get("incidents") or []
    evicted_ids: list[str] = []
    evicted_slots: set[int] = set()
    for inc in incidents:
        slots = {mid: int(i) for i, mid in (raw.get("run_machines", {}).get(str(inc["run"])) or {}).items()}
        for mid in inc["evicted"]:
            evicted_ids.append(mid)
            if mid in slots:
                evicted_slots.add(slots[mid])
    blame = culprits(case)
    out = {"case": case.label, "kind": case.kind, "layout": case.layout, "position": case.position,
           "code": case.code, "finished": raw.get("state") == "succeeded", "state": raw.get("state"),
           "reason": raw.get("reason"), "evicted": evicted_ids, "incidents": len(incidents),
           "culprit": [f"m{i}" for i in blame], "wall_s": raw.get("wall_s"), "error": raw.get("error")}
    first = next((i for i in incidents if i.get("detected_at") is not None), None)
    inj = raw.get("injected_at")
    out["detect_s"] = (round(first["detected_at"] - inj, 3) if first and inj is not None
                       and first["detected_at"] >= inj - 1.0 else None)
    out["localize_s"] = (round(first["localized_at"] - first["detected_at"], 3)
                         if first and first.get("localized_at") is not None else None)
    out["evicted_per_incident"] = (len(evicted_ids) / len(incidents)) if incidents else 0.0
    if blame:
        ids = {f"m{i}" for i in blame}
        out["culprit_in"] = bool(ids & set(evicted_ids))
        if BY_NAME[case.kind].culprit == "link":
            out["within_group"] = bool(evicted_slots) and evicted_slots <= set(blame)
        else:
            out["within_group"] = bool(evicted_slots) and any(evicted_slots <= s
                                                              for s in allowed_sets(case.layout, blame[0]))
    else:
        out["culprit_in"] = out["within_group"] = None
        out["evicted_nothing"] = not evicted_ids
    out["causes"] = [f"{i['symptom']}/{i['mechanism']}: {i['cause']}" for i in incidents]
    out["detector"] = case.detector
    alerts = raw.get("alerts") or []
    ids = {f"m{i}" for i in blame}
    out["alerts"] = len(alerts)
    out["alerts_right"] = sum(1 for al in alerts if set(al["machines"]) & ids)
    hit = next((al for al in alerts if set(al["machines"]) & ids), None)
    out["alert_hit"] = bool(hit) if blame else None
    out["alert_s"] = round(hit["t"] - inj, 3) if hit and inj is not None else None
    return out


def _pct(flags: list[bool]) -> str:
    return f"{100.0 * sum(flags) / len(flags):.0f}%" if flags else "-"


def _med_max(values: list[float]) -> str:
    vals = [v for v in values if v is not None]
    return f"{median(vals):.1f} / {max(vals):.1f}" if vals else "-"


def summarize(rows: list[dict]) -> dict:
    """Per kind (and fault-free), the figures the table prints."""
    out: dict[str, dict] = {}
    for kind in dict.fromkeys(r["kind"] for r in rows):
        rs = [r for r in rows if r["kind"] == kind]
        with_culprit = [r for r in rs if r["culprit_in"] is not None]
        out[kind] = {
            "runs": len(rs),
            "culprit_in_pct": _pct([r["culprit_in"] for r in with_culprit]),
            "within_group_pct": _pct([r["within_group"] for r in with_culprit]),
            "evicted_nothing": sum(1 for r in rs if not r["evicted"]),
            "evicted_per_incident": round(sum(r["evicted_per_incident"] for r in rs) / len(rs), 2),
            "detect_s": _med_max([r["detect_s"] for r in rs]),
            "localize_s": _med_max([r["localize_s"] for r in rs]),
            "finished": sum(1 for r in rs if r["finished"]),
            "false_evictions": sum(len(r["evicted"]) for r in rs) if kind in FAULT_FREE else None,
            "alert_s": _med_max([r.get("alert_s") for r in rs]),
            "recall": _pct([bool(r.get("alert_hit")) for r in rs if r.get("alert_hit") is not None]),
            "precision": (_pct([True] * sum(r.get("alerts_right", 0) for r in rs)
                               + [False] * sum(r.get("alerts", 0) - r.get("alerts_right", 0) for r in rs))),
            "alerts": sum(r.get("alerts", 0) for r in rs),
        }
    return out


def detector_table(summary: dict) -> str:
    """The trace detector's own figures: time to its first right alert, recall (faulty runs whose
    culprit an alert named), precision (alerts that named a culprit), and alerts on fault-free runs."""
    head = f"{'kind':<15} {'runs':>4}  {'alert s med/max':>15}  {'recall':>6}  {'precision':>9}  {'alerts':>6}"
    lines = [head, "-" * len(head)]
    for kind, s in summary.items():
        lines.append(f"{kind:<15} {s['runs']:>4}  {s['alert_s']:>15}  {s['recall']:>6}  {s['precision']:>9}  "
                     f"{s['alerts']:>6}")
    return "\n".join(lines)


def table(summary: dict) -> str:
    head = (f"{'kind':<15} {'runs':>4}  {'culprit in':>10}  {'in group':>8}  {'evicted/inc':>11}  "
            f"{'detect s med/max':>16}  {'localize s med/max':>18}  {'finished':>8}")
    lines = [head, "-" * len(head)]
    for kind, s in summary.items():
        culprit, group = s["culprit_in_pct"], s["within_group_pct"]
        if kind in FAULT_FREE:
            culprit, group = f"{s['false_evictions']} false", "evictions"
        elif culprit == "-":
            culprit, group = f"{s['evicted_nothing']}/{s['runs']} none", "(wanted)"
        lines.append(f"{kind:<15} {s['runs']:>4}  {culprit:>10}  {group:>8}  {s['evicted_per_incident']:>11}  "
                     f"{s['detect_s']:>16}  {s['localize_s']:>18}  {s['finished']:>4}/{s['runs']:<3}")
    return "\n".join(lines)


def select(kinds: list[str], layouts: list[str], positions: list[str], fault_free: int, busy: int = 0,
           busy_layouts: list[str] | None = None, detectors: tuple[str, ...] = ("off",)) -> list[Case]:
    cases = [Case(k, lay, pos) for lay in layouts for k in kinds for pos in positions]
    cases += [Case("fault-free", lay, str(i + 1)) for lay in layouts for i in range(fault_free)]
    cases += [Case("fault-free-busy", lay, str(i + 1)) for lay in (busy_layouts or layouts) for i in range(busy)]
    late = "on" in detectors
    return [dataclasses.replace(c, detector=d, late=late) for d in detectors for c in cases]


def busy_host() -> list[subprocess.Popen]:
    """One busy-loop process per core, in the case's process group (stopped with it)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]


# ----- one case, in its own process ------------------------------------------------------------
def run_one(case: Case, state_dir: str) -> dict:
    """Run one case's job on a fresh local cluster; the raw outcome (report facts, injection time)."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
    from jobrun import gpt_spec, run_job

    from stalwart.controller.store.db import Store
    from stalwart.spec import Policy

    lay = LAYOUTS[case.layout]
    steps = (BY_NAME[case.kind].steps if case.kind in BY_NAME else SLOW_STEPS if case.kind == "fault-free-busy"
             else 0) or STEPS
    if case.late:
        steps = SLOW_STEPS
    spec = gpt_spec(machines=lay["machines"], gpus=lay["gpus"], steps=steps, tp=lay["tp"], pp=lay["pp"],
                    dp=lay["dp"], standby=lay["standby"])
    # (the peer's policy may predate a key: it runs with the keys it knows)
    known = set(Policy().to_dict())
    spec["policy"].update({k: v for k, v in {**POLICY, **DETECTOR_POLICY[case.detector]}.items() if k in known})
    spec["command"] += ["--min-compute-s", str(MIN_COMPUTE_S), "--batch", str(lay["batch"])]
    text = chaos_text(case)
    if text:
        spec["chaos"] = [text]
    started = time.monotonic()
    hogs: list[subprocess.Popen] = []

    def during(client, job, st) -> None:
        # the host gets busy once the job has its healthy pace (as when other work starts beside it)
        if case.kind == "fault-free-busy" and not hogs and (st.get("live") or {}).get("step", 0) >= (
                TRACE_AT if case.late else SLOW_AT):
            hogs.extend(busy_host())
    try:
        rep = run_job(state_dir, spec, timeout=CASE_TIMEOUT_S, during=during)
    except Exception as e:  # noqa: BLE001 - a case that could not finish is a result, not a crash
        rep = {"state": "unfinished", "reason": f"{type(e).__name__}: {e}"}
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    raw: dict = {"state": rep.get("state"), "reason": rep.get("reason"), "wall_s": round(time.monotonic() - started, 1),
                 "incidents": [], "run_machines": {}, "injected_at": None}
    store = Store(f"sqlite:///{state_dir}/stalwart.db")
    try:
        for inc in store.incidents(1):
            raw["incidents"].append({k: inc[k] for k in ("symptom", "mechanism", "evicted", "cause", "detected_at",
                                                         "localized_at")} | {"run": inc["run_seq"]})
        raw["run_machines"] = {str(r["seq"]): r["machines"] for r in store.runs(1)}
        evs = store.events(1)
        applied = [e["t"] for e in evs if e["kind"] == "chaos_applied"]
        raw["injected_at"] = min(applied) if applied else None
        raw["alerts"] = [{"t": e["t"], "machines": (e.get("data") or {}).get("machines", [])}
                         for e in evs if e["kind"] == "trace_suspect"]
    finally:
        store.close()
    return raw


def spawn(case: Case, src: str | None, keep: str | None) -> dict:
    """Run `case` in a child process (the peer's code on its PYTHONPATH); never leaves a cluster
    behind: a child past its bound is stopped and its cluster cleaned up."""
    base = keep or tempfile.mkdtemp(prefix="stalwart-loc-")
    state_dir = os.path.join(base, case.label.replace(" ", "-").replace("[", "").replace("]", ""))
    os.makedirs(state_dir, exist_ok=True)
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    out = os.path.join(state_dir, "outcome.json")
    argv = [sys.executable, os.path.abspath(__file__), "--one", json.dumps(asdict(case)), "--state-dir", state_dir,
            "--out", out]
    proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=open(os.path.join(state_dir, "bench.log"), "ab"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        proc.wait(timeout=CASE_TIMEOUT_S + 90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    finally:
        from stalwart.backends.local import cleanup_stale
        cleanup_stale(state_dir)
    try:
        with open(out) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        raw = {"state": "unfinished", "error": f"the case's process exited {proc.returncode} without an "
                                               f"outcome; see {state_dir}/bench.log"}
    if not keep:
        shutil.rmtree(base, ignore_errors=True)
    return raw


# ----- the driver -------------------------------------------------------------------------------
@dataclass
class Run:
    rows: list[dict] = field(default_factory=list)

    def add(self, row: dict, i: int, n: int) -> None:
        self.rows.append(row)
        blame = f" (culprit {', '.join(row['culprit'])})" if row["culprit"] else ""
        times = "".join(f" {k.split('_')[0]} {row[k]:.1f}s" for k in ("detect_s", "localize_s")
                        if row[k] is not None)
        print(f"[{i}/{n}] {row['case']}: {row['state']}, evicted {', '.join(row['evicted']) or 'nothing'}"
              f"{blame}{times}; {row['wall_s'] or '-'}s" + (f"; {row['error']}" if row.get("error") else ""),
              flush=True)
        for c in row["causes"]:
            print(f"      {c[:220]}", flush=True)


def source_of(ref: str, into: str) -> str:
    """The package source at git `ref`, unpacked under `into` (for PYTHONPATH)."""
    import tarfile
    archive = os.path.join(into, "src.tar")
    subprocess.run(["git", "-C", ROOT, "archive", "--format=tar", "-o", archive, ref, "src"], check=True,
                   capture_output=True)
    with tarfile.open(archive) as tf:
        tf.extractall(into, filter="data")
    return os.path.join(into, "src")


def parse_list(text: str | None, known: tuple | list, what: str) -> list[str]:
    items = [x.strip() for x in (text or "").split(",") if x.strip()]
    bad = [x for x in items if x not in known]
    if bad:
        raise ValueError(f"unknown {what} {', '.join(bad)} (known: {', '.join(known)})")
    return items


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a subset in a few minutes")
    ap.add_argument("--kinds", help="comma list of kinds (default: all this host can run; 'none': only "
                                    "fault-free runs)")
    ap.add_argument("--layouts", help=f"comma list of {', '.join(LAYOUTS)} (default: all)")
    ap.add_argument("--positions", help="comma list of first, middle, last (default: all)")
    ap.add_argument("--fault-free", type=int, default=None, help="fault-free runs per layout (default 2)")
    ap.add_argument("--busy", type=int, default=None,
                    help="fault-free runs per layout on a host kept busy by one busy loop per core (default 1; "
                         "with --quick, in the TP x DP layout)")
    ap.add_argument("--before", default=None, help=f"git ref of the peer (default {BEFORE_BLAME_RULES} with "
                                                    "--quick, none otherwise); 'none' to skip")
    ap.add_argument("--parallel", type=int, default=None,
                    help="cases run at once (default 2 for the full matrix, 1 otherwise; more is faster "
                         "but loads the host: noisier times)")
    ap.add_argument("--json", help="write every case and the summary here")
    ap.add_argument("--keep", help="keep each case's state dir under this directory")
    ap.add_argument("--detector", choices=("on", "off", "both"), default="off",
                    help="the trace detector: on (alerts, and evictions while the job is slowed), off "
                         "(default), or both: every case once each way, side by side")
    ap.add_argument("--list", action="store_true", help="print the cases and exit")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--state-dir", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.one:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))     # the cluster's finally runs
        raw = run_one(Case(**json.loads(a.one)), a.state_dir)
        with open(a.out, "w") as f:
            json.dump(raw, f)
        return 0
    signal.signal(signal.SIGTERM, _interrupt)       # like Ctrl-C: finish the running cases, summarize
    root = os.geteuid() == 0
    try:
        kinds = [] if a.kinds == "none" else \
            parse_list(a.kinds, list(BY_NAME), "kinds") or list(QUICK_KINDS if a.quick else BY_NAME)
        layouts = parse_list(a.layouts, list(LAYOUTS), "layouts") or (["dp"] if a.quick else list(LAYOUTS))
        positions = parse_list(a.positions, POSITIONS, "positions") or (["middle"] if a.quick else list(POSITIONS))
    except ValueError as e:
        ap.error(str(e))
    if a.fault_free is not None and a.fault_free < 0:
        ap.error("--fault-free must be >= 0")
    if a.busy is not None and a.busy < 0:
        ap.error("--busy must be >= 0")
    full = not (a.quick or a.kinds or a.layouts or a.positions)
    a.parallel = a.parallel if a.parallel is not None else (2 if full else 1)
    if a.parallel < 1:
        ap.error("--parallel must be >= 1")
    skipped = [k for k in kinds if k in ROOT_ONLY and not root]
    if skipped:
        print(f"not root: skipping {', '.join(skipped)} (network namespaces, tc, nftables, cgroups need root)")
    kinds = [k for k in kinds if k not in skipped]
    cases = select(kinds, layouts, positions, 2 if a.fault_free is None else a.fault_free,
                   1 if a.busy is None else a.busy, ["tp-dp"] if a.quick and not a.layouts else None,
                   ("off", "on") if a.detector == "both" else (a.detector,))
    before = a.before or (BEFORE_BLAME_RULES if a.quick else "none")
    peer_cases = []
    if before != "none":
        peer_kinds = [k for k in kinds if k in ISSUE_17_KINDS] if a.quick else kinds
        peer_cases = [Case(c.kind, c.layout, c.position, code=before) for c in cases
                      if c.kind in peer_kinds and c.detector == "off"]
    if a.list:
        for c in cases + peer_cases:
            print(c.label, "|", chaos_text(c) or "no fault")
        return 0
    print(f"{len(cases)} cases" + (f" + {len(peer_cases)} with the code of {before}" if peer_cases else "")
          + f", {a.parallel} at a time"
          + (f"; every fault at step {TRACE_AT} of {SLOW_STEPS} (the trace detector learns first); "
             if any(c.late for c in cases) else
             f"; fault at step {FAULT_STEP} of {STEPS} ({SLOW_AT} of {SLOW_STEPS} for slow faults); ")
          + f"load average now {os.getloadavg()[0]:.1f}", flush=True)
    run, tmp = Run(), tempfile.mkdtemp(prefix="stalwart-before-")
    try:
        src = source_of(before, tmp) if peer_cases else None
        todo = [(c, None) for c in cases] + [(c, src) for c in peer_cases]
        with ThreadPoolExecutor(max_workers=a.parallel) as pool:
            futures = [pool.submit(spawn, case, code, a.keep) for case, code in todo]
            by_future = {f: case for f, (case, _) in zip(futures, todo)}
            pending, i = set(futures), 0
            try:
                while pending:     # short waits: Ctrl-C reaches this thread
                    done, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
                    for f in done:
                        i += 1
                        run.add(score(by_future[f], f.result()), i, len(todo))
            except KeyboardInterrupt:
                for f in futures:
                    f.cancel()     # cases not started never start; running ones finish and clean up
                raise
    except KeyboardInterrupt:
        print("interrupted: summarizing the cases done so far")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    now_rows = [r for r in run.rows if r["code"] == "now"]
    summary = summarize(now_rows)
    by_detector = {d: summarize([r for r in now_rows if r["detector"] == d]) for d in ("off", "on")}
    for d, summ in by_detector.items():
        if summ:
            print(f"\ntrace detector {d}\n" + table(summ))
    if by_detector["on"]:
        print("\ntrace detector on: its alerts\n" + detector_table(by_detector["on"]))
    peer = summarize([r for r in run.rows if r["code"] != "now"])
    if peer:
        print(f"\nthe peer: stalwart before its blame rules ({before}), same cases\n" + table(peer))
        print("\n" + "\n".join(compare(now_rows, [r for r in run.rows if r["code"] != "now"])))
    print(f"\nload average at the end {os.getloadavg()[0]:.1f} (timings are noisy on a busy host)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"fault_step": FAULT_STEP, "steps": STEPS, "layouts": LAYOUTS, "cases": run.rows,
                       "summary": summary, "by_detector": by_detector,
                       "peer": {"code": before, "summary": peer} if peer else None,
                       "mechanisms": {k.name: k.mechanism for k in KINDS}}, f, indent=1)
    ok = all(r["finished"] for r in now_rows) and not any(r["evicted"] for r in now_rows if r["kind"] in FAULT_FREE)
    return 0 if ok else 1


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def compare(now: list[dict], peer: list[dict]) -> list[str]:
    """Right and wrong evictions now vs the peer, and their ratio."""
    def counts(rows: list[dict]) -> tuple[int, int]:
        right = wrong = 0
        for r in rows:
            blame = set(r["culprit"])
            right += len(blame & set(r["evicted"]))
            wrong += len(set(r["evicted"]) - blame)
        return right, wrong
    cases = {r["case"].split(" [")[0] for r in peer}
    (rn, wn), (rp, wp) = counts([r for r in now if r["case"] in cases]), counts(peer)
    fin_n = sum(r["finished"] for r in now if r["case"] in cases)
    fin_p = sum(r["finished"] for r in peer)
    return [f"on the peer's {len(cases)} cases: culprits evicted {rn} now vs {rp} before; healthy machines "
            f"evicted {wn} now vs {wp} before (ratio {wp / wn:.1f}x)" if wn else
            f"on the peer's {len(cases)} cases: culprits evicted {rn} now vs {rp} before; healthy machines "
            f"evicted {wn} now vs {wp} before",
            f"jobs finished {fin_n}/{len(cases)} now vs {fin_p}/{len(peer)} before"]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
