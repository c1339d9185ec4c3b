"""bench/gpu_smoke.py's parts that run without a GPU: its one line where none exists, the
snapshot round trips on the CPU, the table."""
import importlib.util
import os

import pytest
import torch

_spec = importlib.util.spec_from_file_location(
    "gpu_smoke", os.path.join(os.path.dirname(__file__), "..", "..", "bench", "gpu_smoke.py"))
gpu_smoke = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_smoke)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the smoke test runs for real")
def test_no_gpu_is_one_line(capsys):
    assert gpu_smoke.main([]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("gpu_smoke: no NVIDIA GPU here") and "nothing to check" in out[0]


def test_snapshot_round_trips_on_cpu(tmp_path):
    ok, down, up = gpu_smoke.pinned_roundtrip(1 << 20, "cpu", str(tmp_path))
    assert ok and down > 0 and up > 0
    assert not os.listdir(tmp_path)                  # the pinned file is removed
    same, per_ms = gpu_smoke.memckpt_roundtrip("cpu", str(tmp_path / "mem"), dim=32)
    assert same and per_ms > 0


def test_table_lines_up():
    t = gpu_smoke.table([("nvml", True, "0: H100"), ("dcp adapter", False, "boom")]).splitlines()
    assert t[2].startswith("nvml         yes ") and t[3].startswith("dcp adapter  NO  ")
