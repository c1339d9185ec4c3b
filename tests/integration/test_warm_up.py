"""A warm spare pays torch's first-use costs before it reports ready (restarts are fast)."""
import subprocess
import sys


def test_warm_up_imports_what_the_first_optimizer_needs():
    code = ("import sys, torch\n"
            "assert 'torch._dynamo' not in sys.modules\n"
            "from stalwart.worker.warmup import warm_up_torch\n"
            "warm_up_torch()\n"
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
