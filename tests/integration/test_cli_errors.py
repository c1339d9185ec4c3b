"""Bad input ends in one clear line and a non-zero exit, never a traceback."""
import os
import socket
import subprocess
import sys
import time

import pytest


def stalwart(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "stalwart.cli", *args], capture_output=True, text=True,
                          timeout=240, cwd=cwd)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("args,msg", [
    (["run", "--machines", "4", "--gpus-per-machine", "2", "--tp", "2", "--pp", "2", "--dp", "3",
      "--", "python", "x.py"], "tp*pp*dp must equal machines*gpus-per-machine"),
    (["run", "--machines", "2", "--steps", "0", "--", "python", "x.py"], "steps"),
    (["run", "--machines", "2", "--chaos", "explode@step=3,machine=0", "--", "python", "x.py"],
     "unknown chaos kind 'explode'"),
    (["run", "--machines", "2", "--chaos", "crash@step=3,machine=7", "--", "python", "x.py"],
     "machine 7 does not exist"),
    (["run", "--machines", "2"], "no training command given"),
    (["run", "--machines", "2", "--standby", "many", "--", "python", "x.py"], "--standby takes a number"),
    (["run", "--config", "/nonexistent.yaml", "--", "python", "x.py"], "does not exist"),
    (["run", "--machines", "1", "nosuch.py", "--epochs", "3"], "script nosuch.py does not exist"),
    (["run", "--nnodes", "1", "-m", "nosuch_module_xyz"], "module nosuch_module_xyz not found"),
    (["inject", "explode", "--machine", "0", "--controller", "http://127.0.0.1:1"], "unknown chaos kind"),
    (["status", "--watch", "--interval", "0", "--controller", "http://127.0.0.1:1"], "--interval must be > 0"),
    (["controller", "--listen", "127.0.0.1:0", "--db", "sqlite:////nonexistent/dir/x.db"],
     "cannot open the database sqlite:////nonexistent/dir/x.db"),
])
@pytest.mark.timeout(60)
def test_bad_input_is_one_clear_line(args, msg, tmp_path):
    if args[0] in ("run", "controller"):
        args = [args[0], "--state-dir", str(tmp_path), *args[1:]]
    r = stalwart(*args)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    assert msg in r.stderr, r.stderr
    assert r.stderr.strip().count("\n") == 0, r.stderr


@pytest.mark.timeout(60)
def test_unreachable_controller(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    for args in (["inject", "crash", "--machine", "0", "--controller", url],
                 ["status", "--controller", url], ["status", "--watch", "--controller", url]):
        r = stalwart(*args)
        assert r.returncode == 3 and "Traceback" not in r.stderr        # (3: the controller did not answer)
        assert f"controller at {url} is not reachable" in r.stderr


@pytest.mark.timeout(60)
def test_report_without_state(tmp_path):
    r = stalwart("report", "--state-dir", str(tmp_path / "none"))
    assert r.returncode == 2 and "no stalwart state in" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.timeout(300)
def test_a_second_job_from_the_same_directory_runs(tmp_path):
    """The second `stalwart run` in a directory holding the first one's state dir (live
    sockets, a database) snapshots the code without it and trains."""
    code = tmp_path / "proj"
    code.mkdir()
    (code / "train.py").write_text("from stalwart.examples.gpt import main\nimport sys\nsys.exit(main())\n")
    run = ["run", "--machines", "1", "--gpus-per-machine", "1", "--steps", "4", "--",
           "python", "train.py", "--layers", "1", "--log-every", "0"]
    first = stalwart(*run[:1], "--state-dir", "sd40", *run[1:], cwd=code)
    assert first.returncode == 0, first.stderr[-2000:]
    second = stalwart(*run[:1], "--state-dir", "sd140", *run[1:], cwd=code)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "internal error" not in second.stdout + second.stderr


@pytest.mark.timeout(300)
def test_a_second_run_on_a_live_state_dir_is_refused_and_the_first_finishes(tmp_path):
    """One `stalwart run` per state dir: a second one (with --fresh, which would delete the first
    one's state under it) is refused in one line, `cleanup` leaves a live run alone, and the first
    job trains on to the end."""

    sd = str(tmp_path / "sd")
    run = ["run", "--state-dir", sd, "--machines", "1", "--gpus-per-machine", "1", "--steps", "60", "--",
           sys.executable, "-m", "stalwart.examples.gpt", "--layers", "1", "--log-every", "0",
           "--min-compute-s", "0.1"]
    first = subprocess.Popen([sys.executable, "-m", "stalwart.cli", *run], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(sd, "controller.json")) and time.monotonic() < deadline:
            assert first.poll() is None, first.communicate()
            time.sleep(0.1)
        second = stalwart(*run[:3], "--fresh", *run[3:])
        assert second.returncode == 2, second.stderr
        assert "is in use by another `stalwart run`" in second.stderr and "Traceback" not in second.stderr
        assert str(first.pid) in second.stderr
        cleanup = stalwart("cleanup", "--state-dir", sd)
        assert cleanup.returncode == 2 and "still runs" in cleanup.stderr
        out, err = first.communicate(timeout=240)
        assert first.returncode == 0, err[-2000:]
        assert "succeeded" in out
    finally:
        if first.poll() is None:
            os.killpg(first.pid, 9)
            first.wait()
            stalwart("cleanup", "--state-dir", sd)
    # once it ended, the state dir is free again
    again = stalwart("cleanup", "--state-dir", sd)
    assert again.returncode == 0, again.stderr


@pytest.mark.timeout(60)
def test_a_controller_keeps_its_database_in_its_state_dir(tmp_path):
    # (its default database was ./.stalwart/stalwart.db whatever --state-dir said: started from
    # a directory without one, it died on a traceback)
    sd = tmp_path / "sd"
    proc = subprocess.Popen([sys.executable, "-m", "stalwart.cli", "controller", "--state-dir", str(sd),
                             "--listen", "127.0.0.1:0"], cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 40
        while not (sd / "controller.json").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (sd / "controller.json").exists(), proc.stderr.read() if proc.poll() is not None else "no start"
        assert (sd / "stalwart.db").exists() and not (tmp_path / ".stalwart").exists()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.timeout(60)
def test_an_abbreviated_option_is_refused_not_taken_for_another(tmp_path):
    """Found as a new user: `stalwart controller --port 18931` was taken for `--port-file 18931`
    (argparse's prefix matching): the controller listened on its default port and wrote a file."""
    r = stalwart("controller", "--state-dir", str(tmp_path), "--port", "18931", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "unrecognized arguments: --port 18931" in r.stderr, r.stderr
    assert not (tmp_path / "18931").exists()
