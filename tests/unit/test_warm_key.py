"""Which runs an agent's warm spare workers may serve (agent.daemon.warm_key)."""
from stalwart.agent.daemon import warm_key


def cmd(**env):
    base = {"WORLD_SIZE": 4, "STALWART_TP": 1, "STALWART_PP": 1, "STALWART_DP": 4,
            "STALWART_MACHINES": 4, "STALWART_STEPS": 30, "STALWART_REPLAY": 0}
    base.update(env)
    return {"command": ["python", "-m", "job"], "cwd": "/code/v1", "env": base}


def test_runs_of_the_same_job_share_spares():
    assert warm_key(cmd(STALWART_RUN=3, MASTER_PORT=1234)) == warm_key(cmd(STALWART_RUN=4, MASTER_PORT=99))
    assert warm_key(cmd(STALWART_DP=4)) == warm_key(cmd(STALWART_DP="4"))   # JSON may carry strings


def test_a_replay_or_another_shape_or_version_never_gets_them():
    job = warm_key(cmd())
    assert warm_key(cmd(STALWART_REPLAY=1, STALWART_DP=2, WORLD_SIZE=2)) != job
    assert warm_key(cmd(STALWART_DP=2)) != job
    assert warm_key(dict(cmd(), cwd="/code/v2")) != job
    assert warm_key(dict(cmd(), command=["python", "-m", "other"])) != job
