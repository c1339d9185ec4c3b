"""Leaving the process groups joins the communicators' threads before the interpreter exits."""
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import os, torch, torch.distributed as dist
    from stalwart.worker.teardown import release_process_groups
    threads = lambda: len(os.listdir("/proc/self/task"))
    before = threads()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    groups = {"dp": dist.new_group([0]), "tp": dist.new_group([0])}
    for g in (None, *groups.values()):
        t = torch.ones(8)
        dist.all_reduce(t, group=g)
    during = threads()
    del g                                  # the script's own last reference to a group
    release_process_groups(groups)
    print(before, during, threads(), len(groups), dist.is_initialized())
""")


@pytest.mark.timeout(60)
def test_release_joins_every_communicator_thread_and_empties_the_callers_map():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=50, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    before, during, after, left, initialized = out.stdout.split()
    assert int(during) > int(before)      # the groups' worker threads were running
    assert int(after) == int(before), out.stdout
    assert (left, initialized) == ("0", "False")


@pytest.mark.timeout(60)
def test_release_without_process_groups_is_harmless():
    from stalwart.worker.teardown import release_process_groups
    groups: dict = {"dp": None}
    release_process_groups(groups)
    assert groups == {}
