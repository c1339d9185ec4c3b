"""`standby: auto` on a real local job: the controller keeps the P99 of Binomial(machines, daily
failure rate) standbys, no more, though more machines are free (the simulator's and the
core's sizing are in tests/unit/test_sim.py)."""
from __future__ import annotations

import pytest

from jobrun import gpt_spec, run_job


@pytest.mark.timeout(240)
def test_standby_auto_keeps_the_p99_of_a_binomial_on_a_local_job(tmp_path):
    # 2 machines failing each with probability 0.5 a day: P(X <= 1) = 0.75 < 0.99 <= P(X <= 2) = 1,
    # so 2 standbys (with the default rate, 0.12%, it would be the floor of 1)
    spec = gpt_spec(machines=2, gpus=1, steps=30, standby="auto",
                    policy={"heartbeat_s": 0.5, "missed_beats": 4, "daily_failure_rate": 0.5})
    seen: list[list[str]] = []

    def during(client, job, st):
        if st.get("live", {}).get("state") == "running":
            seen.append(list(st["live"]["standby"]))
    rep = run_job(tmp_path, spec, spare=1, during=during)       # one more machine free than needed
    assert rep["state"] == "succeeded", rep.get("reason")
    assert seen and {len(s) for s in seen} == {2}, seen
