"""What the fork server can become, and what must match between a server and its workers (pure)."""
import pytest

from stalwart.agent import forkclient, forkserver
from stalwart.agent.forkserver import Unsupported, parse_argv


def test_command_lines_the_server_can_become():
    assert parse_argv(["python", "-m", "pkg.mod", "--x", "1"]) == ("module", "pkg.mod", ["pkg.mod", "--x", "1"], False)
    assert parse_argv(["python", "-u", "train.py", "a"]) == ("script", "train.py", ["train.py", "a"], True)
    assert parse_argv(["python", "-B", "-c", "print(1)", "z"]) == ("code", "print(1)", ["-c", "z"], False)
    for bad in (["python"], ["python", "-m"], ["python", "-X", "dev", "t.py"], ["python", "-"],
                ["python", "-O", "t.py"]):
        with pytest.raises(Unsupported):
            parse_argv(bad)


def test_only_import_time_variables_must_match():
    a = {"PATH": "/bin", "OMP_NUM_THREADS": "1", "RANK": "0", "STALWART_RUN": "3", "PYTHONPATH": "/a",
         "MASTER_PORT": "1", "NCCL_DEBUG": "INFO", "CUDA_VISIBLE_DEVICES": "0"}
    b = dict(a, RANK="5", STALWART_RUN="4", PYTHONPATH="/b", MASTER_PORT="2", CUDA_VISIBLE_DEVICES="1",
             PYTHONSAFEPATH="1")      # (a worker's: the stop-time checks run without it, on the same server)
    assert forkclient.import_env(a) == forkclient.import_env(b)
    assert forkclient.import_env(a) != forkclient.import_env(dict(a, OMP_NUM_THREADS="2"))
    assert forkclient.import_env(a) != forkclient.import_env(dict(a, LD_PRELOAD="x.so"))


def test_the_preload_variable_names_agree():
    assert forkclient.PRELOAD_ENV == forkserver.PRELOAD_ENV


def test_keys_name_the_interpreter_and_refuse_other_programs(tmp_path):
    fs = forkclient.ForkServers(str(tmp_path))
    assert fs.key_of(["/bin/echo", "x"], {}, None) is None
    assert fs.key_of(["python3", "-X", "dev", "t.py"], {"PATH": "/usr/bin:/bin"}, None) is None
    key = fs.key_of(["python3", "t.py"], {"PATH": "/usr/bin:/bin"}, ["ip", "netns", "exec", "m0"])
    assert key is not None and key[0].startswith("/") and key[1] == ("ip", "netns", "exec", "m0")
    assert forkclient.ForkServers(str(tmp_path), enabled=False).key_of(["python3", "t.py"], {}, None) is None


def test_an_execd_child_is_stopped_once_its_agent_is_gone_for_its_bound():
    bounded = {11: ("/w1/agent.lock", 5.0, "e11"), 12: ("/w1/agent.lock", 9.0, "e12"),
               21: ("/w2/agent.lock", 1.0, "e21")}
    since: dict[str, float] = {}
    assert forkserver.overdue(bounded, {"/w1/agent.lock": False, "/w2/agent.lock": True}, since, 100.0) == []
    assert since == {"/w1/agent.lock": 100.0}
    assert forkserver.overdue(bounded, {"/w1/agent.lock": False, "/w2/agent.lock": True}, since, 104.9) == []
    assert forkserver.overdue(bounded, {"/w1/agent.lock": False, "/w2/agent.lock": True}, since, 105.0) == [11]
    # a successor came: the count starts over when it is gone too
    assert forkserver.overdue(bounded, {"/w1/agent.lock": True, "/w2/agent.lock": True}, since, 106.0) == []
    assert since == {}
    assert forkserver.overdue(bounded, {"/w1/agent.lock": False, "/w2/agent.lock": False}, since, 107.0) == []
    assert forkserver.overdue(bounded, {"/w1/agent.lock": False, "/w2/agent.lock": False}, since, 116.0) == [11, 12, 21]


def test_the_fork_server_switch_leaves_exec_mode_on(tmp_path, monkeypatch):
    """STALWART_FORK_SERVER=0 (fork-safety of a job's imports) turns off the preloading server only:
    exec'ing a program forks nothing of the job's. STALWART_EXEC_SERVER=0 turns exec mode off."""
    monkeypatch.setenv("STALWART_FORK_SERVER", "0")
    fs = forkclient.ForkServers(str(tmp_path))
    assert not fs.enabled and fs.exec_enabled
    monkeypatch.setenv("STALWART_EXEC_SERVER", "0")
    assert not forkclient.ForkServers(str(tmp_path)).exec_enabled
    monkeypatch.delenv("STALWART_FORK_SERVER")
    fs = forkclient.ForkServers(str(tmp_path))
    assert fs.enabled and not fs.exec_enabled
