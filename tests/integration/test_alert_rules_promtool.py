"""`promtool` (Debian's prometheus package, installed by .ci/run) checks docs/alerts' rule file and
runs its unit tests: each alert fires on the series it is for and not on their look-alikes."""
import os
import shutil
import subprocess

import pytest

ALERTS = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "alerts")


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (apt-get install prometheus)")
@pytest.mark.parametrize("argv", [["check", "rules", "stalwart-rules.yml"],
                                  ["test", "rules", "stalwart-rules.test.yml"]])
def test_promtool(argv):
    r = subprocess.run(["promtool", *argv], cwd=ALERTS, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
