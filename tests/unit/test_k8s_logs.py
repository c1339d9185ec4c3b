"""What `kubectl logs` shows of an agent pod: its `training` container follows the worker output
files of the agent (`k8s_agent.LogFollower`): rank 0's where this pod holds it, else the pod's
first rank; the newest run's, from its start, with a header at each new run."""
from __future__ import annotations

import io

from stalwart.backends.k8s_agent import LogFollower, follow_logs


def test_follows_rank_0_and_moves_to_the_newest_run(tmp_path):
    (tmp_path / "run1_rank1.out").write_bytes(b"rank 1 says hi\n")
    (tmp_path / "run1_rank0.out").write_bytes(b"step 1 loss 9.1\n")
    f = LogFollower(str(tmp_path), rank=0)
    assert f.poll() == [("out", b"== stalwart: run 1, rank 0 ==\n"), ("out", b"step 1 loss 9.1\n")]
    assert f.poll() == []                                        # nothing new
    with open(tmp_path / "run1_rank0.out", "ab") as out:
        out.write(b"step 2 loss 8.7\n")
    (tmp_path / "run1_rank0.err").write_bytes(b"warning: x\n")
    assert f.poll() == [("out", b"step 2 loss 8.7\n"), ("err", b"warning: x\n")]
    # a restart after a failure: the new run's output, from its first line
    (tmp_path / "run2_rank0.out").write_bytes(b"restored step 2\nstep 3 loss 8.2\n")
    assert f.poll() == [("out", b"== stalwart: run 2, rank 0 ==\n"), ("out", b"restored step 2\nstep 3 loss 8.2\n")]


def test_a_pod_without_rank_0_shows_its_first_rank(tmp_path):
    (tmp_path / "run3_rank9.out").write_bytes(b"nine\n")
    (tmp_path / "run3_rank8.out").write_bytes(b"eight\n")
    (tmp_path / "warm.log").write_bytes(b"not a worker's\n")
    assert LogFollower(str(tmp_path), rank=0).poll()[1] == ("out", b"eight\n")
    assert LogFollower(str(tmp_path / "none"), rank=0).poll() == []     # no run yet


def test_the_container_command_writes_to_its_stdout_and_stderr(tmp_path):
    (tmp_path / "run1_rank0.out").write_bytes(b"step 1\n")
    (tmp_path / "run1_rank0.err").write_bytes(b"oops\n")
    out, err = io.BytesIO(), io.BytesIO()
    assert follow_logs(["--logs", str(tmp_path), "--interval", "0"], out, err, polls=1) == 0
    assert out.getvalue() == b"== stalwart: run 1, rank 0 ==\nstep 1\n" and err.getvalue() == b"oops\n"
