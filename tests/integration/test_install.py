"""stalwart installs into the environment people train in, beside the torch already there.

A fresh virtualenv stands for a training image (an NGC container, a conda env): it already holds a
torch and the usual packages (they are this checkout's own environment, seen through a `.pth` file,
as a system site-packages would be). stalwart's wheel is installed there with `--no-index`: every
requirement must be met by what is installed, so pip neither downloads nor replaces anything; the
torch it finds is the one it keeps. A plain job and an SDK job then run from that environment.

The oldest torch stalwart declares (2.7) is installed from the package registry into a virtualenv
of its own, as a user's environment holds it, and stalwart is installed beside it from the registry
too (docs/install.md).
"""
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "ddp_plain.py")


def sh(*cmd, cwd=None, timeout=180) -> subprocess.CompletedProcess:
    out = subprocess.run(list(cmd), cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(map(str, cmd))}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def training_env(path, extra_site: str | None = None) -> str:
    """A fresh virtualenv that sees this environment's packages (torch among them) as installed;
    `extra_site`: a directory put before them (a torch of another version)."""
    sh(sys.executable, "-m", "venv", "--without-pip", str(path))
    py = os.path.join(path, "bin", "python")
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(site, "_training_image.pth"), "w") as f:
        f.write((extra_site + "\n" if extra_site else "") + sysconfig.get_paths()["purelib"] + "\n")
    return py


def pip(py: str, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    # this environment's pip, acting on the fresh one (--python): the fresh one has none of its own
    return sh(sys.executable, "-m", "pip", "--python", py, "--disable-pip-version-check", *args, timeout=timeout)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    dist = tmp_path_factory.mktemp("dist")
    sh(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), ROOT, timeout=300)
    [name] = [n for n in os.listdir(dist) if n.endswith(".whl")]
    return os.path.join(dist, name)


def torch_of(py: str) -> tuple[str, str]:
    out = sh(py, "-c", "import torch, os; print(torch.__version__); print(os.path.dirname(torch.__file__))")
    version, where = out.stdout.split()
    return version, where


def run_both_jobs(stalwart: str, work) -> None:
    """A plain torchrun-style script and an SDK job, run by the given environment's `stalwart`."""
    work.mkdir()
    with open(EXAMPLE) as f:
        (work / "train.py").write_text(f.read())
    plain = sh(stalwart, "run", "--state-dir", "st-plain", "--nnodes", "1", "--nproc-per-node", "2",
               "train.py", "--epochs", "2", "--log-every", "0", cwd=work, timeout=240)
    assert "[rank0]:epoch 1 done" in plain.stdout and "succeeded" in plain.stdout, plain.stdout[-2000:]
    assert (work / "snapshot.pt").exists()
    sdk = sh(stalwart, "run", "--state-dir", "st-sdk", "--machines", "1", "--gpus-per-machine", "2", "--steps", "6",
             "--", "python", "-m", "stalwart.examples.gpt", "--layers", "1", "--log-every", "0", cwd=work, timeout=240)
    assert "succeeded" in sdk.stdout and "steps 6/6" in sdk.stdout, sdk.stdout[-2000:]


@pytest.mark.timeout(420)
def test_stalwart_installs_beside_the_torch_there_and_runs_a_plain_and_an_sdk_job(tmp_path, wheel):
    py = training_env(tmp_path / "image")
    before = torch_of(py)
    # --no-index: whatever stalwart needs must be met by what is there; nothing is replaced
    out = pip(py, "install", "--no-index", "--progress-bar=off", f"{wheel}[controller]")
    assert "torch" not in out.stdout.split("Successfully installed")[-1].split("\n")[0], out.stdout
    assert torch_of(py) == before
    bin_dir = os.path.dirname(py)
    stalwart = os.path.join(bin_dir, "stalwart")
    sh(py, "-c", "import stalwart, sys; assert stalwart.__file__.startswith(sys.prefix), stalwart.__file__")

    run_both_jobs(stalwart, tmp_path / "work")


OLDEST_TORCH = "2.7.0"


def registry_has(requirement: str) -> bool:
    """Whether the package registry answers for `requirement` (a query of its index, no download)."""
    out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "--disable-pip-version-check",
                          requirement.split("==")[0]], capture_output=True, text=True, timeout=120)
    return out.returncode == 0 and requirement.split("==")[-1] in out.stdout


@pytest.mark.timeout(1200)
def test_the_oldest_torch_declared_installed_from_the_registry_is_kept_and_runs_both_jobs(tmp_path, wheel):
    """A virtualenv that holds torch 2.7.0 from the registry (its CUDA build, about 5 GB installed,
    which runs on the CPU): stalwart and its requirements are installed from the registry beside it,
    pip keeps that torch, and a plain job and an SDK job run there.

    It needs the registry; where none answers it is skipped, unless STALWART_REQUIRE_REGISTRY is
    set (CI sets it), where it fails."""
    if not registry_has(f"torch=={OLDEST_TORCH}"):
        if os.environ.get("STALWART_REQUIRE_REGISTRY"):
            pytest.fail(f"the package registry does not offer torch {OLDEST_TORCH}")
        pytest.skip(f"the package registry does not offer torch {OLDEST_TORCH} here")
    image = tmp_path / "image"
    try:
        sh(sys.executable, "-m", "venv", "--without-pip", str(image))
        py = os.path.join(image, "bin", "python")
        pip(py, "install", "--no-cache-dir", "--progress-bar=off", f"torch=={OLDEST_TORCH}", timeout=900)
        before = torch_of(py)
        assert before[0].startswith(OLDEST_TORCH), before
        out = pip(py, "install", "--no-cache-dir", "--progress-bar=off", f"{wheel}[controller]", timeout=600)
        installed = out.stdout.split("Successfully installed")[-1].split("\n")[0]
        assert " torch-" not in installed, out.stdout
        assert torch_of(py) == before
        run_both_jobs(os.path.join(image, "bin", "stalwart"), tmp_path / "work")
    finally:
        shutil.rmtree(image, ignore_errors=True)


BLOCK = """
import importlib.abc, sys
CONTROL_PLANE = {"sqlalchemy", "aiohttp", "uvloop", "scipy", "prometheus_client", "rich", "psycopg", "kubernetes"}
class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in CONTROL_PLANE:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NotInstalled())
"""


def test_a_training_image_without_the_control_plane_runs_the_agent_and_the_sdk(tmp_path):
    """The base install's import paths (worker SDK, hooks, agent) import no control-plane package;
    a command that needs one says which extra, in one line."""
    ok = subprocess.run([sys.executable, "-c", BLOCK + "import stalwart.worker.context, stalwart.agent.daemon\n"
                         "from stalwart.cli import build_parser; build_parser()"], capture_output=True, text=True,
                        timeout=120)
    assert ok.returncode == 0, ok.stderr[-2000:]
    (tmp_path / "train.py").write_text("print(1)\n")
    for cmd in ("run", "controller"):
        args = ["run", "--nnodes", "1", "train.py"] if cmd == "run" else ["controller", "--state-dir", str(tmp_path)]
        r = subprocess.run([sys.executable, "-c", BLOCK + "import sys; from stalwart.cli import main; "
                            f"sys.exit(main({args!r}))"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert r.returncode == 2, r.stderr[-2000:]
        assert r.stderr.strip() == f"error: stalwart {cmd} needs the controller: pip install 'stalwart[controller]'"
