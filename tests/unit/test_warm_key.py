"""Which runs an agent's warm spare workers may serve (protocol.RunSpec.warm_key)."""
import msgspec

from stalwart.protocol import Layout, RunSpec


def spec(**over) -> RunSpec:
    base = RunSpec(job=1, run=None, command=["python", "-m", "job"], cwd="/code/v1", user_env={},
                   layout=Layout(machines=4, gpus_per_machine=1, dp=4), steps=30, ckpt_every=10,
                   ckpt_dir="/ck", mem_slots=4)
    return msgspec.structs.replace(base, **over)


def test_runs_of_the_same_job_share_spares():
    assert spec(run=3, master=("h", 1234)).warm_key() == spec(run=4, master=("h", 99)).warm_key()
    assert spec(restore_step=5).warm_key() == spec(restore_step=-1).warm_key()


def test_a_replay_or_another_shape_or_version_never_gets_them():
    job = spec().warm_key()
    assert spec(replay=True, layout=Layout(machines=2, gpus_per_machine=1, dp=2)).warm_key() != job
    assert spec(layout=Layout(machines=4, gpus_per_machine=1, dp=2, pp=2)).warm_key() != job
    assert spec(cwd="/code/v2").warm_key() != job
    assert spec(code_path="/versions/abc").warm_key() != job
    assert spec(command=["python", "-m", "other"]).warm_key() != job


def test_a_run_tells_its_workers_torchruns_restart_count():
    from stalwart.protocol import run_env
    assert run_env(spec(run=1))["TORCHELASTIC_RESTART_COUNT"] == "0"      # the first start
    assert run_env(spec(run=3))["TORCHELASTIC_RESTART_COUNT"] == "2"
    assert "TORCHELASTIC_RESTART_COUNT" not in run_env(spec(run=None))      # a spare learns it at activation
