"""The stop-time diagnostics program run for real: 2 machines x 2 processes over a TCPStore
held by the test (as the controller holds it), gloo groups per machine and per pair."""

import json
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from stalwart.devices.simgpu import SimGpu

MACHINES = ("m0", "m1")
LOCAL = 2
BOUND_S = 100


@pytest.fixture
def store():
    s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=30))
    yield s


def plans(tmp_path, port, tag, simgpu=None, checks=("selftest", "intra", "inter", "align")):
    """One plan per (machine, local rank); returns [(plan_path, results_path)]."""
    out = []
    for mi, machine in enumerate(MACHINES):
        peer = MACHINES[1 - mi]
        for lr in range(LOCAL):
            plan = {"machine": machine, "local_rank": lr, "local_world": LOCAL, "device": lr,
                    "simgpu": (simgpu or {}).get(machine), "checks": list(checks),
                    "store_host": "127.0.0.1",
                    "intra": {"port": port, "prefix": f"diag-{tag}-{machine}"},
                    "inter": [{"round": 0, "peer": peer, "rank": mi, "port": port,
                               "prefix": f"diag-{tag}-r0-m0-m1"}],
                    "timeout_s": 20.0, "inter_bytes": 1 << 20}
            p = tmp_path / f"plan-{machine}-{lr}.json"
            p.write_text(json.dumps(plan))
            out.append((str(p), str(tmp_path / f"results-{machine}-{lr}.jsonl")))
    return out


def run_all(jobs):
    """Run every plan as its own process; all must exit 0 within the bound. Returns
    ({(machine, local_rank): {check: result}}, seconds)."""
    start = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-m", "stalwart.diag.worker", plan, out],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for plan, out in jobs]
    try:
        for p in procs:
            left = max(1.0, BOUND_S - (time.monotonic() - start))
            output = p.communicate(timeout=left)[0]
            assert p.returncode == 0, output
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    seconds = time.monotonic() - start
    results = {}
    for _, out in jobs:
        with open(out) as f:
            for line in f:
                r = json.loads(line)
                results.setdefault((r["machine"], r["local_rank"]), {})[r["check"]] = r
    return results, seconds


@pytest.mark.timeout(120)
def test_healthy_machines_pass_every_check(tmp_path, store):
    results, seconds = run_all(plans(tmp_path, store.port, "1"))
    print(f"4 diagnostic processes took {seconds:.1f}s")
    assert set(results) == {(m, lr) for m in MACHINES for lr in range(LOCAL)}
    for (machine, lr), by_check in results.items():
        expected = {"selftest", "intra", "align"} | ({"inter"} if lr == 0 else set())
        assert set(by_check) == expected, (machine, lr)
        for r in by_check.values():
            assert r["ok"], r
            assert r["machine"] == machine and r["local_rank"] == lr
        assert by_check["selftest"]["measure"]["gflops"] > 0
        assert by_check["intra"]["measure"]["world"] == LOCAL
    inter = results[("m0", 0)]["inter"]
    assert inter["peer"] == "m1" and inter["pair_rank"] == 0 and inter["round"] == 0
    # bandwidth at doubling sizes up to inter_bytes (a transfer that took long enough to measure
    # stops the growth early on a busy host), and latency
    assert inter["measure"]["mbps"] > 0 and 16 << 10 <= inter["measure"]["bytes"] <= 1 << 20
    assert 0 < inter["measure"]["latency_s"] < 1.0
    assert results[("m1", 0)]["inter"]["peer"] == "m0"
    digests = {r["align"]["measure"]["digest"] for r in results.values()}
    assert len(digests) == 1, digests


@pytest.mark.timeout(120)
def test_corrupting_gpu_fails_selftest_and_alignment(tmp_path, store):
    path = tmp_path / "m1-simgpu.json"
    gpus = SimGpu(path, count=LOCAL)
    for d in range(LOCAL):
        gpus.set(d, sdc=True)
    results, _ = run_all(plans(tmp_path, store.port, "2", simgpu={"m1": str(path)}))
    for lr in range(LOCAL):
        a, b = results[("m0", lr)], results[("m1", lr)]
        assert a["selftest"]["ok"], a["selftest"]
        assert not b["selftest"]["ok"] and "silent data corruption" in b["selftest"]["detail"]
        assert a["align"]["measure"]["digest"] != b["align"]["measure"]["digest"]
        assert a["intra"]["ok"] and b["intra"]["ok"]          # the network is fine
    assert results[("m0", 0)]["inter"]["ok"] and results[("m1", 0)]["inter"]["ok"]
    assert (results[("m0", 0)]["align"]["measure"]["digest"]
            == results[("m0", 1)]["align"]["measure"]["digest"])


@pytest.mark.timeout(120)
def test_peer_that_never_joins_fails_its_rounds_without_hanging(tmp_path, store):
    plan = {"machine": "m0", "local_rank": 0, "local_world": 1, "device": 0, "simgpu": None,
            "checks": ["inter", "align"], "store_host": "127.0.0.1", "timeout_s": 2.0,
            "inter": [{"round": r, "peer": f"ghost{r}", "rank": 0, "port": store.port,
                       "prefix": f"diag-3-r{r}"} for r in (0, 1)]}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    out = tmp_path / "results.jsonl"
    results, seconds = run_all([(str(tmp_path / "plan.json"), str(out))])
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(x["check"], x.get("round")) for x in lines] == [("inter", 0), ("inter", 1),
                                                             ("align", None)]
    for x in lines[:2]:
        assert not x["ok"] and f"peer ghost{x['round']} did not join" in x["detail"]
    # round 0 waits 2 s; round 1 until its slot's deadline (start + 1*2*2 + 2 = 6 s)
    assert 5.0 <= lines[1]["elapsed_s"] + lines[0]["elapsed_s"] <= 12.0
    assert lines[2]["ok"]


def test_bad_plan_exits_2(tmp_path):
    p = subprocess.run([sys.executable, "-m", "stalwart.diag.worker", str(tmp_path / "none.json"),
                        str(tmp_path / "out.jsonl")], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "bad plan" in p.stderr
