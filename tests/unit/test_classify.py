"""The log/exit classifier on real (and documented hand-written) worker logs."""

from pathlib import Path

import pytest

from stalwart.analyzer.classify import MAX_DETAIL, classify

LOGS = Path(__file__).parent / "fixtures" / "logs"
CODE = "/tmp/glooexp/code"  # where the real fixture scripts lived


def log(name: str) -> str:
    return (LOGS / name).read_text(encoding="utf-8")


@pytest.mark.parametrize(
    "fixture, exit_code, sig, name, category, certain, user, secondary",
    [
        ("cuda_launch_failure.log", 1, None, "cuda_error", "explicit", True, False, False),
        ("cuda_no_device.log", 1, None, "cuda_error", "explicit", True, False, False),
        ("cuda_ecc.log", 1, None, "cuda_error", "explicit", True, False, False),
        ("cuda_illegal_memory.log", 1, None, "illegal_memory_access", "explicit", False, False, False),
        ("device_side_assert.log", 1, None, "cuda_error", "user_code", False, True, False),
        ("cuda_oom.log", 1, None, "gpu_oom", "explicit", False, False, False),
        ("nccl_watchdog_timeout.log", -6, None, "collective_timeout", "implicit", False, False, False),
        ("nccl_system_error.log", 1, None, "nccl_error", "explicit", False, False, False),
        ("nccl_remote_error.log", 1, None, "nccl_error", "explicit", False, False, True),
        ("gloo_reset_by_peer.log", 1, None, "gloo_error", "explicit", False, False, True),
        ("gloo_closed_by_peer.log", 1, None, "gloo_error", "explicit", False, False, True),
        ("gloo_recv_timeout.log", 1, None, "collective_timeout", "implicit", False, False, False),
        ("cpu_oom_killed.log", 137, None, "cpu_oom", "explicit", False, False, False),
        ("nan_anomaly.log", 1, None, "nan", "implicit", False, False, False),
        ("user_index_error.log", 1, None, "user_code_exception", "user_code", False, True, False),
        ("torch_value_error.log", 1, None, "library_exception", "explicit", False, False, False),
        ("disk_full_oserror.log", 1, None, "disk_full", "explicit", False, False, False),
        ("disk_full_torch_save.log", 1, None, "disk_full", "explicit", False, False, False),
        ("segfault_faulthandler.log", -11, None, "segfault", "explicit", False, False, False),
        ("abort.log", -6, None, "abort", "explicit", False, False, False),
        ("killed_no_text.log", -9, None, "worker_crash", "explicit", False, False, False),
    ],
)
def test_fixture_logs(fixture, exit_code, sig, name, category, certain, user, secondary):
    s = classify(log(fixture), exit_code, sig, CODE)
    assert (s.name, s.category, s.machine_certain, s.user_code, s.secondary) == (
        name,
        category,
        certain,
        user,
        secondary,
    ), s
    assert s.detail and len(s.detail) <= MAX_DETAIL


def test_details_carry_the_deciding_line():
    assert classify(log("cuda_launch_failure.log"), 1, None, None).detail == "CUDA error: unspecified launch failure"
    s = classify(log("user_index_error.log"), 1, None, CODE)
    assert s.detail == "IndexError: list index out of range"
    assert s.location == "/tmp/glooexp/code/model_user.py:3"
    assert "4000ms" in classify(log("gloo_recv_timeout.log"), 1, None, None).detail


def test_rank_is_read_from_torchrun_prefix():
    assert classify(log("cuda_launch_failure.log"), 1, None, None).rank == 5
    assert classify(log("gloo_reset_by_peer.log"), 1, None, None).rank == 0
    assert classify(log("user_index_error.log"), 1, None, CODE).rank is None


def test_user_code_needs_the_code_dir():
    # The same traceback is a library exception when the job's code lives elsewhere.
    assert classify(log("user_index_error.log"), 1, None, "/job/code").name == "library_exception"
    # Without a code dir, a frame outside site-packages and the stdlib counts as user code.
    assert classify(log("user_index_error.log"), 1, None, None).name == "user_code_exception"


def test_stalwart_frames_are_library_even_inside_code_dir():
    text = (
        "Traceback (most recent call last):\n"
        '  File "/job/code/train.py", line 3, in <module>\n'
        "    ckpt.save(step)\n"
        '  File "/job/code/.venv/lib/python3.11/site-packages/stalwart/worker/ckpt.py", line 9, in save\n'
        "    raise KeyError(step)\n"
        "KeyError: 3\n"
    )
    assert classify(text, 1, None, "/job/code").name == "library_exception"


def test_signals_from_exit_code_forms():
    assert classify("", -11, None, None).name == "segfault"
    assert classify("", 139, None, None).name == "segfault"  # shell style 128 + 11
    assert classify("", None, 11, None).name == "segfault"
    assert classify("", -6, None, None).name == "abort"
    assert classify("", 134, None, None).name == "abort"
    assert classify("", -7, None, None).name == "segfault"  # SIGBUS
    k = classify("", 137, None, None)
    assert k.name == "worker_crash" and k.detail.startswith("killed by SIGKILL")
    # A shell's bare "Killed" is not evidence of OOM.
    assert classify("step 3\nKilled\n", 137, None, None).name == "worker_crash"


def test_oom_text_with_sigkill_is_cpu_oom():
    text = "Out of memory: Killed process 4242 (python) total-vm:1kB, anon-rss:1kB\n"
    assert classify(text, None, 9, None).name == "cpu_oom"
    tb = "Traceback (most recent call last):\n  File \"/x/t.py\", line 1, in <module>\nMemoryError\n"
    assert classify(tb, 1, None, "/x").name == "cpu_oom"


def test_nan_lines():
    for line in ("step 10 loss nan", "loss=nan grad_norm=3.1", "iter 4 | loss: NaN", "[rank0]: loss is nan"):
        assert classify(line, 1, None, None).name == "nan", line
    assert classify("step 0 loss -inf", 1, None, None).name == "unknown"
    assert classify("loss 2.3 nanoseconds 12", 1, None, None).name == "unknown"


def test_root_cause_beats_its_consequences():
    # The NCCL watchdog aborts the process: the timeout, not the abort, is the symptom.
    assert classify(log("nccl_watchdog_timeout.log"), -6, None, None).name == "collective_timeout"
    # A CUDA error that NCCL reports afterwards stays a CUDA error.
    text = log("cuda_launch_failure.log") + "\n" + log("nccl_remote_error.log")
    assert classify(text, 1, None, None).name == "cuda_error"
    # A user-code exception on this rank outranks a gloo peer error.
    text = log("gloo_reset_by_peer.log") + "\n" + log("user_index_error.log")
    s = classify(text, 1, None, CODE)
    assert s.name == "user_code_exception" and not s.secondary


def test_gloo_non_peer_error_is_primary():
    text = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:144] connect [10.0.0.2]:23456: "
            "Connection refused")
    s = classify(text, 1, None, None)
    assert s.name == "gloo_error" and not s.secondary


def test_torchrun_summary_points_at_the_first_failure():
    s = classify(log("torchrun_peer_killed.log"), 1, None, "/tmp/glooexp")
    assert s.name == "worker_crash" and "torchrun root cause" in s.detail


def test_unknown_and_clean_exits():
    assert classify("", 1, None, None).name == "unknown"
    assert classify("all good\n", 0, None, None).detail == "exit code 0"
    assert classify("", None, None, None).detail == "no exit status"


def test_bad_input_is_rejected():
    with pytest.raises(ValueError):
        classify("", "1", None, None)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        classify("", 1, 0, None)


@pytest.mark.timeout(10)
def test_long_tails_stay_linear():
    # 2 000 long lines must not trigger regex backtracking blow-ups (was 2 s for 46 KB).
    tail = ("x" * 300 + " loss 2.31 step 9\n") * 2000 + log("gloo_reset_by_peer.log")
    s = classify(tail, 1, None, None)
    assert s.name == "gloo_error" and s.secondary
