"""The `stalwart` command's conventions, through `main([...])` against a real controller API served
in this process (a synthetic job in its store; threads, no processes): one exit code per kind of
failure, `--json` that json.loads reads, --version, the environment's controller and credentials,
validated --log-level and JSON logs, completion scripts, `stacks` and `whatif` through the API, one
meaning per option across subcommands."""
import argparse
import json
import logging
import socket
import sys
import time

import pytest
from synthjob import write_synthetic_job

from stalwart import __version__
from stalwart.cli import build_parser, main, views
from stalwart.cli.common import EXIT, log_handler
from stalwart.transport.client import Client
from stalwart.controller.api.server import ApiServer
from stalwart.controller.service import Controller
from stalwart.controller.store.db import Store

TOKEN = "cli-test-token"


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    """(url, token file, job id, what-if job id) of a controller whose first job failed after 2
    incidents; its second has the per-rank times of 5 steps, rank 3 the slowest."""
    d = tmp_path_factory.mktemp("cli")
    store = Store(f"sqlite:///{d}/stalwart.db")
    try:        # (a running job with no saved state: the controller fails it as it starts)
        job = write_synthetic_job(store, machines=12, standby=2, incidents=2, steps=300, gpus=8)
        spec = {"name": "w", "machines": 4, "gpus_per_machine": 2, "tp": 2, "pp": 2, "command": ["python", "t.py"]}
        slow = store.create_job("w", spec, now=1.0, submitted=True)
        for i in range(5):
            comp = [2.0 if r == 3 else 1.0 for r in range(8)]
            store.add_event(slow, "rank_times", {"step": 20 * i, "step_s": [2.2] * 8, "compute_s": comp}, t=10.0 + i)
    finally:
        store.close()
    ctl = Controller(f"sqlite:///{d}/stalwart.db", str(d))
    srv = None
    try:
        srv = ApiServer(ctl, "127.0.0.1", 0, token=TOKEN)
        srv.start()
        (d / "token").write_text(TOKEN + "\n")
        yield f"http://127.0.0.1:{srv.port}", str(d / "token"), job, slow
    finally:
        if srv is not None:
            srv.stop()
        ctl.close()


@pytest.fixture
def remote(api, monkeypatch):
    """The controller and its token from the environment alone, as an operator's shell sets them."""
    url, token_file, job, _ = api
    monkeypatch.setenv("STALWART_CONTROLLER", url)
    monkeypatch.setenv("STALWART_TOKEN_FILE", token_file)
    monkeypatch.delenv("STALWART_TOKEN", raising=False)
    return api


def run(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:         # argparse's usage errors, --version, --help
        return int(e.code or 0)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("argv,code,says", [
    (["versions"], EXIT.OK, ""),
    (["status", "--log-level", "bogus"], EXIT.USAGE, "--log-level: must be one of DEBUG"),
    (["status", "--no-such-option"], EXIT.USAGE, "unrecognized arguments"),
    (["status", "--watch", "--interval", "0"], EXIT.USAGE, "error: --interval must be > 0"),
    (["status", "--watch", "--json"], EXIT.USAGE, "error: --json prints one status"),
    (["status", "--controller", "http://127.0.0.1:{closed}"], EXIT.UNREACHABLE, "is not reachable"),
    (["status", "--job", "999"], EXIT.REFUSED, "error: the controller refused: no job 999"),
    (["status", "--token-file", "{bad_token}"], EXIT.REFUSED, "unauthorized"),
    (["whatif", "--job", "{job}"], EXIT.REFUSED, "compute time"),
    (["stacks", "7", "--job", "{job}"], EXIT.REFUSED, "no incident 7"),
    (["status", "--watch", "--interval", "0.01", "--job", "{job}"], EXIT.JOB_FAILED, ""),
    (["status", "--controller", "https://127.0.0.1:{closed}", "--tls-cert", "{bad_token}"], EXIT.USAGE,
     "error: a client certificate and its key go together"),
    (["controller", "--tls-client-ca", "{bad_token}", "--state-dir", "{tmp}"], EXIT.USAGE,
     "error: client certificates (--tls-client-ca) need HTTPS"),
    (["agent", "--controller", "http://127.0.0.1:{closed}", "--machine-id", "m0", "--workdir", "{tmp}",
      "--tls-cert", "{bad_token}", "--tls-key", "{bad_token}"], EXIT.USAGE, "needs an https:// --controller"),
])
def test_each_kind_of_failure_has_its_exit_code(remote, tmp_path, capsys, argv, code, says):
    bad = tmp_path / "bad-token"
    bad.write_text("wrong\n")
    argv = [x.format(closed=closed_port(), bad_token=bad, job=remote[2], tmp=tmp_path / "x") for x in argv]
    assert run(argv) == code
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err
    if code in (EXIT.UNREACHABLE, EXIT.REFUSED) or (code == EXIT.USAGE and "usage:" not in err):
        assert err.strip().count("\n") == 0, err        # one line


def test_interrupted_is_130(remote, monkeypatch, capsys):
    def interrupted(a):
        raise KeyboardInterrupt
    monkeypatch.setattr(views, "report", interrupted)
    assert run(["status"]) == EXIT.INTERRUPTED == 130
    assert "interrupted" in capsys.readouterr().err


def test_version(capsys):
    assert run(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"stalwart {__version__}"


def test_json_outputs_parse(remote, capsys, tmp_path):
    url, _, job, _ = remote
    j = ["--job", str(job)]
    for argv, check in ((["status", "--json", *j], lambda d: d["job_id"] == job and d["state"] == "failed"),
                        (["machines", "--json"], lambda d: len(d["machines"]) == 12),
                        (["whatif", "--json", *j[:1], str(remote[3])], lambda d: d["steps"] == 5),
                        (["versions", "--json", *j], lambda d: d["versions"] == []),
                        (["report", "--json", *j], lambda d: len(d["incidents"]) == 2 and "live" not in d),
                        (["report", "--json", "-", *j], lambda d: d["job_id"] == job)):
        assert run(argv) == 0, argv
        out = capsys.readouterr().out
        assert check(json.loads(out)), argv
    path = tmp_path / "r.json"
    assert run(["report", "--json", str(path), "--job", str(job)]) == 0
    assert json.loads(path.read_text())["job_id"] == job
    assert "ETTR" in capsys.readouterr().out        # (the summary, with the JSON in the file)


def test_submit_json(remote, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)         # (the job's code directory: snapshotted by the controller)
    assert run(["submit", "--json", "--machines", "1", "--steps", "5", "--", "python", "-c", "pass"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert isinstance(out["job"], int) and out["state"]
    assert run(["status", "--job", str(out["job"]), "--json"]) == 0     # (the controller has it)
    assert json.loads(capsys.readouterr().out)["job_id"] == out["job"]
    # (no machine will come: cancelled, its runner's thread ends with it)
    client = Client(remote[0], token=TOKEN)
    client.post(f"/api/jobs/{out['job']}/cancel", {})
    deadline = time.monotonic() + 30
    while client.get(f"/api/jobs/{out['job']}")["state"] == "running" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.get(f"/api/jobs/{out['job']}")["state"] == "cancelled"


def test_stacks_through_the_api_and_from_the_store(remote, capsys, tmp_path):
    url, token_file, job, _ = remote
    assert run(["stacks", "1", "--job", str(job)]) == 0
    via_api = capsys.readouterr().out
    assert via_api.startswith("incident 1: gpu_xid") and "process(es)" in via_api
    db = f"sqlite:///{token_file.rsplit('/', 1)[0]}/stalwart.db"
    assert run(["stacks", "1", "--job", str(job), "--db", db]) == 0
    assert capsys.readouterr().out == via_api


def test_whatif_through_the_api_is_the_stores_answer(remote, capsys):
    url, token_file, _, slow = remote
    db = f"sqlite:///{token_file.rsplit('/', 1)[0]}/stalwart.db"
    answers = []
    for where in ([], ["--db", db]):
        assert run(["whatif", "--job", str(slow), "--microbatches", "4", "--json", *where]) == 0
        answers.append(json.loads(capsys.readouterr().out))
    assert answers[0] == answers[1]
    assert answers[0]["job_id"] == slow and answers[0]["scenarios"]["rank"]["slowest"] == 3
    assert run(["whatif", "--job", str(slow)]) == 0
    assert "without its slowest rank" in capsys.readouterr().out


def test_log_level_and_json_logs():
    p = build_parser()
    assert p.parse_args(["status", "--log-level", "debug"]).log_level == "DEBUG"
    h = log_handler("json")
    rec = logging.LogRecord("stalwart.api", logging.WARNING, __file__, 1, "refused %s", ("x",), None)
    line = json.loads(h.format(rec))
    assert (line["level"], line["logger"], line["message"]) == ("WARNING", "stalwart.api", "refused x")
    assert "time" in line
    assert not log_handler("text").format(rec).startswith("{")


def test_the_agent_finds_its_controller_in_the_environment_and_gpus_is_per_machine(monkeypatch):
    monkeypatch.setenv("STALWART_CONTROLLER", "http://10.0.0.1:7420")
    a = build_parser().parse_args(["agent", "--machine-id", "m0", "--gpus-per-machine", "8"])
    assert (a.controller, a.gpus_per_machine, a.gpus) == ("http://10.0.0.1:7420", 8, None)
    a = build_parser().parse_args(["agent", "--machine-id", "m0", "--gpus", "4"])     # (deprecated alias)
    assert a.gpus == 4
    monkeypatch.delenv("STALWART_CONTROLLER")
    assert run(["agent", "--machine-id", "m0"]) == EXIT.USAGE


@pytest.mark.parametrize("shell,marker", [("bash", "complete -o"), ("zsh", "#compdef stalwart")])
def test_completion_scripts(shell, marker, capsys):
    assert run(["completion", shell]) == 0
    out = capsys.readouterr().out
    assert marker in out and "status" in out and "whatif" in out


def options() -> dict[str, list[tuple[str, argparse.Action]]]:
    """Every option string -> [(subcommand, action)] of the whole command."""
    out: dict[str, list[tuple[str, argparse.Action]]] = {}

    def walk(parser, path):
        for act in parser._actions:
            if isinstance(act, argparse._SubParsersAction):
                for name, child in act.choices.items():
                    walk(child, f"{path} {name}".strip())
            for o in act.option_strings:
                out.setdefault(o, []).append((path, act))
    walk(build_parser(), "")
    return out


def test_one_meaning_per_option():
    opts = options()
    # --job names a job (an id or latest) wherever it is (`k8s manifests --job` is the deprecated,
    # hidden alias of its --config)
    for cmd, act in opts["--job"]:
        if act.help != argparse.SUPPRESS:
            assert act.default == "latest" and "job id" in act.help, cmd
    # --gpus-per-machine is a machine's GPUs everywhere; --gpus (the whole job's) only in sim
    assert [cmd for cmd, act in opts["--gpus"] if act.help != argparse.SUPPRESS] == ["sim"]
    assert {cmd for cmd, _ in opts["--gpus-per-machine"]} >= {"agent", "run", "submit", "sim"}
    # every command that talks to a controller takes it and its credentials from the environment
    for o in ("--controller", "--token-file", "--tls-ca", "--tls-cert", "--tls-key"):
        for cmd, act in opts[o]:
            if cmd != "controller" and not cmd.startswith(("slurm", "k8s")):
                assert "$STALWART_" in act.help, (o, cmd)


def test_run_refuses_a_network_fault_on_the_host_s_network_before_starting(tmp_path, capsys):
    state = tmp_path / "state"
    argv = ["run", "--state-dir", str(state), "--machines", "2", "--gpus-per-machine", "1",
            "--chaos", "partition@step=3,machine=0,peer=1", "--", sys.executable, "-c", "pass"]
    assert run(argv) == EXIT.USAGE
    err = capsys.readouterr().err
    assert "chaos partition needs machines with their own network" in err and "--isolate-network" in err
    assert len(err.strip().splitlines()) == 1 and not state.exists()      # nothing started


def test_run_isolate_network_says_why_it_cannot(tmp_path, capsys, monkeypatch):
    from stalwart.devices import netns
    monkeypatch.setattr(netns, "available", lambda: (False, "needs root (uid 1000)"))
    state = tmp_path / "state"
    argv = ["run", "--state-dir", str(state), "--isolate-network", "--machines", "2", "--gpus-per-machine", "1",
            "--chaos", "nic-down@step=3,machine=1", "--", sys.executable, "-c", "pass"]
    assert run(argv) == EXIT.USAGE
    err = capsys.readouterr().err.strip()
    assert err == ("error: --isolate-network: machines with their own network are unavailable here: "
                   "needs root (uid 1000)")
    assert not state.exists()
