"""Losing the active controller: a standby's takeover against a supervisor's restart.

    python bench/controller_failover.py [--step 30] [--steps 60] [--only restart,standby]

One job (4 machines x 2 workers, tp=2 pp=2 dp=2, the bundled GPT) on PostgreSQL; at step 30 the
active controller is SIGKILLed. `restart`: the local cluster's supervisor starts a new controller
on the same database (what `stalwart run` does). `standby`: a second `stalwart controller --lease`
already waits on the database; it takes the lease once the beats stopped for `lease.TAKEOVER_S`
and the agents, given both URLs (`--controller A,B`), follow it. Printed: seconds from the kill to
the next committed step, whether the same run went on, and the ratio. Not a timed test.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "integration"))

from stalwart.backends.local import LocalCluster, _python  # noqa: E402
from stalwart.transport.client import Client, ControllerUnreachable  # noqa: E402
from stalwart.spec import JobSpec  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class HaCluster(LocalCluster):
    """A local cluster whose controllers share the database under a lease: the first on a fixed
    port, standbys added with `standby()`; agents get every controller's URL and no
    controller.json to follow (they find the active one by trying the list). Nothing restarts a
    dead controller: a standby takes over."""

    def __init__(self, state_dir: str, machines: int, gpus: int, db_url: str, standbys: int = 2, **kw):
        super().__init__(state_dir, machines, gpus, db_url=db_url, **kw)
        self.ports = [free_port() for _ in range(1 + standbys)]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.standbys: list[subprocess.Popen] = []

    def _start_controller(self, listen: str, timeout: float, extra=()) -> None:
        super()._start_controller(f"127.0.0.1:{self.ports[0]}", timeout, extra=[])

    def controller_args(self) -> list[str]:
        return ["--lease", "c0"]

    def _supervise(self) -> None:
        return

    def _spawn(self, argv: list[str], log_name: str) -> subprocess.Popen:
        if log_name.startswith("agent-"):
            argv = list(argv)
            argv[argv.index("--controller") + 1] = ",".join(self.urls)
            at = argv.index("--controller-file")
            del argv[at:at + 2]
        return super()._spawn(argv, log_name)

    def standby(self, i: int) -> subprocess.Popen:
        """Start controller `i` (1, 2, ...) as a standby on the same database and state dir."""
        p = self._spawn(_python() + ["controller", "--db", self.db_url, "--listen", f"127.0.0.1:{self.ports[i]}",
                                     "--state-dir", self.state_dir, "--lease", f"c{i}",
                                     "--store-host", self.store_host, "--heartbeat", str(self.heartbeat_s),
                                     "--missed-beats", str(self.missed_beats), "--log-level", self.log_level],
                        f"controller-{i}.log")
        self.standbys.append(p)
        return p

    def client_of(self, i: int, timeout: float = 5.0) -> Client:
        return Client(self.urls[i], timeout=timeout, token=self.token)

    def stop(self) -> None:
        for p in self.standbys:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
            p.wait(timeout=10)
        super().stop()


def live_step(client: Client, job: int) -> int | None:
    try:
        return (client.get(f"/api/jobs/{job}/live").get("live") or {}).get("step")
    except (ControllerUnreachable, OSError):
        return None
    except Exception:
        return None


def wait_step(clients, job: int, above: int, timeout: float) -> tuple[float, int]:
    """Poll every client until one reports a step above `above`: (monotonic time, step)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for c in clients:
            s = live_step(c, job)
            if s is not None and s > above:
                return time.monotonic(), s
        time.sleep(0.05)
    raise TimeoutError(f"no step above {above} within {timeout:.0f}s")


def gpt(steps: int) -> dict:
    return {"name": "failover", "machines": 4, "gpus_per_machine": 2, "steps": steps, "ckpt_every": 5,
            "tp": 2, "pp": 2, "dp": 2,
            "command": [sys.executable, "-m", "stalwart.examples.gpt", "--layers", "2", "--log-every", "0"],
            "policy": {"heartbeat_s": 0.5, "missed_beats": 4}}


def controller_pid(state_dir: str) -> int:
    with open(os.path.join(state_dir, "controller.json")) as f:
        return json.load(f)["pid"]


def run(mode: str, db_url: str, at: int, steps: int) -> dict:
    d = tempfile.mkdtemp(prefix=f"stalwart-failover-{mode}-")
    js = JobSpec.from_dict(gpt(steps))
    if mode == "standby":
        cluster: LocalCluster = HaCluster(d, 4, 2, db_url, standbys=1, heartbeat_s=0.5, missed_beats=4)
    else:
        cluster = LocalCluster(d, 4, 2, heartbeat_s=0.5, missed_beats=4, db_url=db_url)
    try:
        cluster.start()
        if isinstance(cluster, HaCluster):
            cluster.standby(1)
        job = cluster.client().post("/api/jobs", {"spec": js.to_dict()})["job"]
        clients = [cluster.client(timeout=5)] if not isinstance(cluster, HaCluster) else \
            [cluster.client_of(i) for i in range(len(cluster.standbys) + 1)]
        _, s0 = wait_step(clients, job, at - 1, 300)
        os.kill(controller_pid(d), signal.SIGKILL)
        t_kill = time.monotonic()
        if not isinstance(cluster, HaCluster):
            clients = [cluster.client(timeout=5)]
        t_next, s1 = wait_step(clients if isinstance(cluster, HaCluster) else [_Following(cluster)], job, s0, 120)
        rep = _finish(clients if isinstance(cluster, HaCluster) else [_Following(cluster)], job)
        return {"mode": mode, "killed_at_step": s0, "next_step": s1, "kill_to_next_step_s": round(t_next - t_kill, 2),
                "state": rep["state"], "runs": len(rep["runs"]), "incidents": len(rep["incidents"])}
    finally:
        cluster.stop()


class _Following:
    """A client of a local cluster's controller wherever its supervisor restarted it."""

    def __init__(self, cluster: LocalCluster):
        self.cluster = cluster

    def get(self, path: str):
        return self.cluster.client(timeout=5).get(path)


def _finish(clients, job: int, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for c in clients:
            try:
                rep = c.get(f"/api/jobs/{job}")
            except Exception:
                continue
            if rep["state"] != "running":
                return rep
        time.sleep(0.3)
    raise TimeoutError("the job did not finish")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--step", type=int, default=30)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--only", default="restart,standby")
    a = ap.parse_args()
    from pgserver import PgServer, unavailable_reason
    why = unavailable_reason()
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    out = {}
    for mode in a.only.split(","):
        srv = PgServer()
        try:
            out[mode] = run(mode, srv.start(), a.step, a.steps)
        finally:
            srv.stop()
        print(json.dumps(out[mode]), flush=True)
    if "restart" in out and "standby" in out:
        print(f"standby / restart kill-to-next-step: {out['standby']['kill_to_next_step_s']:.2f} / "
              f"{out['restart']['kill_to_next_step_s']:.2f} s = "
              f"{out['standby']['kill_to_next_step_s'] / out['restart']['kill_to_next_step_s']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
