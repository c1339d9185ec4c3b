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
