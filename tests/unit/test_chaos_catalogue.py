import pathlib
import re

import pytest

from stalwart.chaos import catalogue
from stalwart.chaos.catalogue import ChaosError
from stalwart.chaos.machine import AGENT_KINDS, HANDLERS
from stalwart.protocol import WorkerChaos


def test_parse_full_and_minimal():
    c = catalogue.parse("crash@step=60,machine=1,rank=3")
    assert (c.kind, c.step, c.machine, c.rank, c.machine_id()) == ("crash", 60, 1, 3, "m1")
    c = catalogue.parse("machine-down@machine=2")
    assert (c.kind, c.step, c.rank) == ("machine-down", None, None)


@pytest.mark.parametrize("text,msg", [
    ("explode@step=1,machine=0", "unknown chaos kind 'explode'"),
    ("crash@step=x,machine=0", "step must be an integer"),
    ("crash@step=1", "machine=M is required"),
    ("crash@step=1,machine", "is not key=value"),
    ("crash@step=-1,machine=0", "step must be >= 0"),
    ("!!", "cannot parse chaos"),
])
def test_parse_errors_are_clear(text, msg):
    with pytest.raises(ChaosError, match=msg):
        catalogue.parse(text)


def test_validate_against_cluster():
    catalogue.validate_against(catalogue.parse("crash@machine=1,rank=3"), 3, 2, 2)
    with pytest.raises(ChaosError, match=r"rank 1 does not live on machine m1 \(it holds ranks 2..3\)"):
        catalogue.validate_against(catalogue.parse("crash@machine=1,rank=1"), 3, 2, 2)
    with pytest.raises(ChaosError, match="machine 5 does not exist"):
        catalogue.validate_against(catalogue.parse("crash@machine=5"), 3, 2, 2)
    with pytest.raises(ChaosError, match="m2 holds no rank of the job"):
        catalogue.validate_against(catalogue.parse("crash@machine=2,rank=4"), 3, 2, 2)


def test_validate_against_a_running_job_after_standbys_took_over():
    # m1 was evicted, m4 holds its ranks (2, 3); m3 is a standby, m1 is gone from the cluster
    now = {"slots": ["m0", "m4"], "known": {"m0", "m3", "m4"}}
    catalogue.validate_against(catalogue.parse("crash@machine=4,rank=3"), 3, 2, 2, **now)
    catalogue.validate_against(catalogue.parse("gpu-xid@machine=3"), 3, 2, 2, **now)
    with pytest.raises(ChaosError, match="machine m1 does not exist"):
        catalogue.validate_against(catalogue.parse("crash@machine=1"), 3, 2, 2, **now)
    with pytest.raises(ChaosError, match=r"rank 1 does not live on machine m4 \(it holds ranks 2..3\)"):
        catalogue.validate_against(catalogue.parse("crash@machine=4,rank=1"), 3, 2, 2, **now)
    with pytest.raises(ChaosError, match="m3 holds no rank"):
        catalogue.validate_against(catalogue.parse("sigstop@machine=3,rank=0"), 3, 2, 2, **now)


def test_root_only_kinds_are_refused_without_root():
    catalogue.check_runnable("nic-down", euid=0)
    catalogue.check_runnable("crash", euid=1000)
    with pytest.raises(ChaosError,
                       match=r"chaos partition needs root \(network namespaces and nftables\); this runs as uid 1000"):
        catalogue.check_runnable("partition", euid=1000)


def test_stage_hang_is_a_kind_forwarded_to_the_worker_sdk():
    from stalwart.chaos.machine import SDK_KINDS, MachineChaos
    c = catalogue.parse("stage-hang@step=20,machine=1")
    assert (c.kind, c.step, c.machine) == ("stage-hang", 20, 1)
    assert "stage-hang" in SDK_KINDS and "pipeline" in catalogue.KINDS["stage-hang"]
    sent = []

    class W:
        def __init__(self, rank):
            self.rank = rank

    class Workers:
        workers = [W(2), W(3), W(None)]          # a warm spare holds no rank yet

    mc = MachineChaos("m1", "/nonexistent", "/nonexistent", 2, "/nonexistent", "/nonexistent",
                      None, Workers(), lambda rank, msg: sent.append((rank, msg)))
    mc.apply({"kind": "stage-hang", "from_step": 20})
    hang = WorkerChaos(kind="stage-hang", from_step=20)
    assert sent == [(2, hang), (3, hang)]


class _Blocked(Exception):
    pass


@pytest.mark.parametrize("pp,blocks_at", [(2, "pp"), (1, "dp")])
def test_maybe_hang_blocks_in_the_pipeline_or_without_one_in_the_all_reduce(monkeypatch, pp, blocks_at):
    from stalwart.topology import Topology
    from stalwart.worker import context
    ctx = object.__new__(context.Context)       # the hook needs no process groups
    ctx._chaos, ctx.rank = {}, 0
    ctx.topology = Topology(2, 1, pp=pp, dp=2 // pp)
    naps = []

    def sleep(s):
        naps.append(s)
        if len(naps) >= 3:                      # it keeps sleeping: stop the test's "forever"
            raise _Blocked

    monkeypatch.setattr(context.time, "sleep", sleep)
    for where in ("pp", "dp"):
        ctx.maybe_hang(5, where)                # no chaos armed: never blocks
    ctx._on_agent_message(WorkerChaos(kind="stage-hang", from_step=7))
    ctx.maybe_hang(6, "pp")
    ctx.maybe_hang(6, "dp")                     # armed, not yet in effect
    assert naps == []
    if pp > 1:
        ctx.maybe_hang(7, "dp")                 # with a pipeline, the sends block, not the all-reduce
        assert naps == []
    with pytest.raises(_Blocked):
        ctx.maybe_hang(7, blocks_at)
    assert naps == [0.5, 0.5, 0.5]


# -- one registry: every kind has a handler, a line in the docs' table and a test --------------
ROOT = pathlib.Path(__file__).resolve().parents[2]
# kinds whose injection is tested at the mechanism (no job injects them), and where
MECHANISM_TESTS = {"partition": ("tests/integration/test_netns.py", "def test_partition_drops_and_heal_restores")}


def test_every_kind_has_one_handler_and_every_handler_a_kind():
    assert set(HANDLERS) | AGENT_KINDS == set(catalogue.KINDS)
    assert not set(HANDLERS) & AGENT_KINDS
    assert all(callable(fn) for fn in HANDLERS.values())


def test_every_kind_is_in_the_docs_table_with_a_description():
    table = (ROOT / "docs" / "cli.md").read_text()
    rows = dict(re.findall(r"^\| `([a-z-]+)` \| (.+) \|$", table, flags=re.M))
    assert set(rows) >= set(catalogue.KINDS), sorted(set(catalogue.KINDS) - set(rows))
    for kind, text in catalogue.KINDS.items():
        assert text.strip() and rows[kind].strip()


def test_every_kind_is_injected_by_some_test():
    tests = "\n".join(p.read_text() for p in (ROOT / "tests" / "integration").glob("*.py"))
    for kind in catalogue.KINDS:
        if kind in MECHANISM_TESTS:
            path, marker = MECHANISM_TESTS[kind]
            assert marker in (ROOT / path).read_text(), kind
        else:
            assert re.search(rf"[\"'(]{re.escape(kind)}[@\"']", tests), f"no integration test injects {kind}"


def test_network_kinds_need_machines_with_their_own_network():
    assert catalogue.NETWORK_KINDS == {"nic-down", "nic-flap", "link-slow", "partition"} <= set(catalogue.KINDS)
    catalogue.check_isolated("crash", isolated=False)
    catalogue.check_isolated("link-slow", isolated=True)
    for kind in sorted(catalogue.NETWORK_KINDS):
        with pytest.raises(ChaosError, match=rf"chaos {kind} needs machines with their own network: start "
                                             r"the cluster with `stalwart run --isolate-network` \(as root\)"):
            catalogue.check_isolated(kind, isolated=False)
