"""The stop-time diagnostics program, one process per accelerator of a machine.

    python -m stalwart.diag.worker PLAN_JSON RESULTS_JSONL

The agent writes one plan per process and launches this program; every check result is
appended to RESULTS_JSONL as one JSON line as soon as it is known (a process killed at the
agent's time bound keeps what it finished). Plan::

    {"machine": "m1", "local_rank": 0, "local_world": 2, "device": 0, "simgpu": path | null,
     "checks": ["selftest", "intra", "inter", "align"],      # any subset, run in this order
     "store_host": "10.0.0.1",                               # the controller's TCPStore host
     "intra": {"port": 1234, "prefix": "diag-7-m1"},         # all local ranks meet here
     "inter": [{"round": 0, "peer": "m2", "rank": 0, "port": 4567, "prefix": "..."}, ...],
     "timeout_s": 10.0, "inter_bytes": 2097152}

Only local rank 0 runs the inter rounds. A result line is the check's dict plus ``machine``,
``local_rank``, ``elapsed_s`` and, for inter, ``round``, ``peer``, ``pair_rank``. Exit 0 when
the program ran (whatever the checks found), 2 for a bad plan.

Process groups are independent gloo groups (no ``init_process_group``) over a PrefixStore of the
controller's TCPStore, on the interfaces named by ``GLOO_SOCKET_IFNAME`` when it is set.
Every wait is bounded by ``timeout_s``; inter round r waits for its peer until
``start + r * 2 * timeout_s + timeout_s`` (at least ``timeout_s``), so a machine held up by a
no-show peer in an earlier round still meets its next peer in time.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import timedelta

from stalwart.errors import StalwartError

CHECKS = ("selftest", "intra", "inter", "align")
PAIR_BOUND = 1.5     # a pair's test, once both ends joined, takes at most this many timeouts


class PlanError(StalwartError, ValueError):
    pass


def _need(d: dict, key: str, kind, where: str = "plan"):
    value = d.get(key) if isinstance(d, dict) else None
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        name = getattr(kind, "__name__", "a number")
        raise PlanError(f"{where}: {key!r} must be {name}, got {value!r}")
    return value


def load_plan(path: str) -> dict:
    """Read and validate a plan (PlanError says what is wrong); fills defaults."""
    try:
        with open(path, encoding="utf-8") as f:
            plan = json.load(f)
    except (OSError, ValueError) as e:
        raise PlanError(f"cannot read plan {path}: {e}") from None
    if not isinstance(plan, dict):
        raise PlanError("plan must be a JSON object")
    _need(plan, "machine", str)
    if _need(plan, "local_rank", int) < 0 or _need(plan, "local_world", int) <= plan["local_rank"]:
        raise PlanError(f"local_rank {plan['local_rank']} is not in a machine of "
                        f"{plan['local_world']}")
    if _need(plan, "device", int) < 0:
        raise PlanError("device must be >= 0")
    if plan.get("simgpu") is not None:
        _need(plan, "simgpu", str)
    checks = _need(plan, "checks", list)
    unknown = [c for c in checks if c not in CHECKS]
    if unknown:
        raise PlanError(f"unknown checks {unknown} (known: {', '.join(CHECKS)})")
    plan.setdefault("timeout_s", 10.0)
    plan.setdefault("inter_bytes", 1 << 21)
    if _need(plan, "timeout_s", (int, float)) <= 0 or _need(plan, "inter_bytes", int) < 4:
        raise PlanError("timeout_s must be > 0 and inter_bytes >= 4")
    if "intra" in checks or "inter" in checks:
        _need(plan, "store_host", str)
    if "intra" in checks:
        _need(plan, "intra", dict)
        _need(plan["intra"], "port", int, "intra")
        _need(plan["intra"], "prefix", str, "intra")
    if "inter" in checks:
        plan.setdefault("inter", [])
        for i, r in enumerate(_need(plan, "inter", list)):
            where = f"inter[{i}]"
            for key, kind in (("round", int), ("peer", str), ("rank", int), ("port", int),
                              ("prefix", str)):
                _need(r, key, kind, where)
            if r["rank"] not in (0, 1):
                raise PlanError(f"{where}: rank must be 0 or 1 within the pair")
    return plan


def connect(host: str, port: int, prefix: str, rank: int, size: int, timeout_s: float):
    """An independent gloo process group over ``PrefixStore(prefix, TCPStore(host, port))``.

    Raises (after at most about ``timeout_s``) when the store or a member does not show up.
    """
    import torch.distributed as dist
    from torch.distributed import ProcessGroupGloo

    wait = timedelta(seconds=timeout_s)
    store = dist.PrefixStore(prefix, dist.TCPStore(host, port, is_master=False, timeout=wait))
    opts = ProcessGroupGloo._Options()
    opts._timeout = wait
    ifnames = [i for i in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if i]
    if ifnames:
        opts._devices = [ProcessGroupGloo.create_device(interface=i) for i in ifnames]
    else:
        opts._devices = [ProcessGroupGloo.create_default_device()]
    opts._threads = 2 * len(opts._devices)
    return ProcessGroupGloo(store, rank, size, opts)


def _failed(check: str, e: BaseException) -> dict:
    return {"check": check, "ok": False, "detail": f"{type(e).__name__}: {e}", "measure": {}}


class Runner:
    def __init__(self, plan: dict, out_path: str):
        self.plan = plan
        self.out_path = out_path
        self.groups: list = []   # kept to the end: a wedged group's destructor could block

    def emit(self, res: dict, started: float, **extra) -> None:
        line = {**res, "machine": self.plan["machine"], "local_rank": self.plan["local_rank"],
                "elapsed_s": round(time.monotonic() - started, 3), **extra}
        data = (json.dumps(line, sort_keys=True) + "\n").encode()
        fd = os.open(self.out_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)   # one write per line: lines stay whole if processes share a file
        finally:
            os.close(fd)

    def run(self) -> None:
        from stalwart.worker.simgpu_view import SimGpuView

        plan = self.plan
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
        import torch

        from stalwart.diag import checks

        device = "cpu"
        # one intra-op thread: every worker of every machine runs its checks at once, and on a
        # CPU host (the simulated-GPU backend) threads beyond its share only add scheduler noise
        torch.set_num_threads(1)
        if torch.cuda.is_available() and plan["device"] < torch.cuda.device_count():
            device = f"cuda:{plan['device']}"
            torch.cuda.set_device(device)
        gpu = SimGpuView(plan.get("simgpu"), plan["device"])
        timeout = float(plan["timeout_s"])
        for check in plan["checks"]:
            started = time.monotonic()
            if check == "selftest":
                self.emit(checks.selftest(gpu, device), started)
            elif check == "align":
                self.emit(checks.alignment_digest(gpu, device=device), started)
            elif check == "intra":
                self.emit(self._intra(checks, timeout), started)
            elif check == "inter" and plan["local_rank"] == 0:
                self._inter(checks, timeout)

    def _intra(self, checks, timeout: float) -> dict:
        p = self.plan
        try:
            pg = connect(p["store_host"], p["intra"]["port"], p["intra"]["prefix"],
                         p["local_rank"], p["local_world"], timeout)
        except Exception as e:  # noqa: BLE001 - a sibling that never came is a failed check
            return _failed("intra", e)
        self.groups.append(pg)
        return checks.intra_alltoall(pg, p["local_rank"], p["local_world"], timeout_s=timeout)

    def _inter(self, checks, timeout: float) -> None:
        p = self.plan
        t0 = time.monotonic()
        for r in sorted(p.get("inter", []), key=lambda r: r["round"]):
            started = time.monotonic()
            extra = {"round": r["round"], "peer": r["peer"], "pair_rank": r["rank"]}
            deadline = t0 + r["round"] * 2 * timeout + timeout
            wait = max(timeout, deadline - started)
            self.emit(self._pair(checks, r, wait, timeout), started, **extra)

    def _pair(self, checks, r: dict, wait: float, timeout: float) -> dict:
        """One pair's test under a hard bound. A peer cut off by a partition can leave gloo's
        connection set-up blocked past its own timeout, so the test runs in a thread: both ends
        first mark their presence in the store (up to `wait`: a peer may be late from an earlier
        round), then the test has PAIR_BOUND x `timeout`; a pair that has not answered by then
        fails (the thread is abandoned; the process exits with os._exit at the end)."""
        import torch.distributed as dist

        p, box = self.plan, {}

        def test() -> None:
            try:
                store = dist.TCPStore(p["store_host"], r["port"], is_master=False, timeout=timedelta(seconds=wait))
                here = dist.PrefixStore(r["prefix"] + "here/", store)
                here.set(str(r["rank"]), "1")
                here.wait([str(1 - r["rank"])], timedelta(seconds=wait))
                box["present"] = time.monotonic()
                pg = connect(p["store_host"], r["port"], r["prefix"], r["rank"], 2, timeout)
            except Exception as e:  # noqa: BLE001
                res = _failed("inter", e)
                res["detail"] = f"peer {r['peer']} did not join within {wait:.1f}s: {res['detail']}"
                box["res"] = res
                return
            self.groups.append(pg)
            box["res"] = checks.pair_allgather(pg, r["rank"], p["inter_bytes"], timeout_s=timeout)

        worker = threading.Thread(target=test, name=f"pair-{r['peer']}", daemon=True)
        started = time.monotonic()
        worker.start()
        while worker.is_alive():
            present = box.get("present")
            limit = present + PAIR_BOUND * timeout if present else started + wait + timeout
            if time.monotonic() >= limit:
                break
            worker.join(0.05)
        if "res" in box:
            return box["res"]
        return {"check": "inter", "ok": False, "measure": {},
                "detail": f"no answer from peer {r['peer']} within {PAIR_BOUND * timeout:.0f}s of both "
                          "joining (connection set-up or transfer blocked: a partition?)"}


def serve(stdin) -> int:
    """Warm mode (``--serve``): import torch and the checks once, then wait for one request line
    ``{"plans": [[PLAN_JSON, RESULTS_JSONL, LOG], ...], "env": {...}}`` and fork one checker per
    plan (each logs to its LOG). Exits when every checker has; 0 also when stdin closes unused.

    The agent keeps one such process per machine between failures, so stop-time checks do not
    wait for `import torch` in every checker. Nothing before the fork runs a torch operation
    (no thread pools, no device context), so the forked checkers start clean.
    """
    import torch  # noqa: F401  (the point: paid before the failure)

    from stalwart.diag import checks  # noqa: F401
    line = stdin.readline()
    if not line.strip():
        return 0
    req = json.loads(line)
    os.environ.update({k: str(v) for k, v in (req.get("env") or {}).items()})
    children = []
    for plan_path, out, log in req["plans"]:
        pid = os.fork()
        if pid == 0:
            code = 2
            try:
                fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                code = main([plan_path, out])
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        children.append(pid)
    for pid in children:
        os.waitpid(pid, 0)
    return 0


def main(argv: list[str]) -> int:
    if argv == ["--serve"]:
        return serve(sys.stdin)
    if len(argv) != 2:
        print("usage: python -m stalwart.diag.worker PLAN_JSON RESULTS_JSONL\n"
              "       python -m stalwart.diag.worker --serve   (warm: plans come on stdin)",
              file=sys.stderr)
        return 2
    try:
        plan = load_plan(argv[0])
    except PlanError as e:
        print(f"stalwart.diag.worker: bad plan: {e}", file=sys.stderr)
        return 2
    Runner(plan, argv[1]).run()
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)   # do not wait on the destructors of groups whose peer vanished
