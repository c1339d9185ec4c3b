import glob
import os
import shutil
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "integration"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "unit"))


@pytest.fixture(scope="session", autouse=True)
def _free_test_machines_memory(tmp_path_factory):
    """A machine's checkpoint memory outlives its agent by design (`agent/paths.py`); the
    machines of this session's tests are gone at its end: free the memory they claimed."""
    yield
    from stalwart.agent import paths
    base = os.path.realpath(str(tmp_path_factory.getbasetemp()))
    for root in glob.glob(os.path.join(paths.SHM, paths.PREFIX + "*")):
        try:
            with open(os.path.join(root, paths.OWNER)) as f:
                owner = os.path.realpath(f.read().strip())
        except OSError:
            continue
        if owner == base or owner.startswith(base + os.sep):
            shutil.rmtree(root, ignore_errors=True)
