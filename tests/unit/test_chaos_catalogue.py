import pytest

from stalwart.chaos import catalogue
from stalwart.chaos.catalogue import ChaosError


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
    with pytest.raises(ChaosError, match="is a standby"):
        catalogue.validate_against(catalogue.parse("crash@machine=2,rank=4"), 3, 2, 2)


def test_root_only_kinds_are_refused_without_root():
    catalogue.check_runnable("nic-down", euid=0)
    catalogue.check_runnable("crash", euid=1000)
    with pytest.raises(ChaosError, match=r"chaos partition needs root \(network namespaces and nftables\); this runs as uid 1000"):
        catalogue.check_runnable("partition", euid=1000)
