"""bench/overhead.py's arithmetic: the median over rounds and the ratios written to --json (the
runs themselves are the benchmark, not a test)."""
import importlib.util
import os

PATH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "overhead.py")
spec = importlib.util.spec_from_file_location("overhead_bench", PATH)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def run(steps_per_s: float, own: float, sdk: float | None = None, first: float = 4.0) -> dict:
    r = {"steps_per_s": steps_per_s, "first_step_s": first, "worker_cpu_per_step": 0.1,
         "own_cpu_per_step": own, "step_s": 1 / steps_per_s, "own_by_role": {"agent": own}}
    if sdk is not None:
        r["sdk_s_per_step"] = sdk
    return r


def test_the_median_of_rounds_takes_each_figure_and_each_role_apart():
    m = bench.median_of([run(10.0, 0.004, 0.001), run(8.0, 0.009, 0.003), run(11.0, 0.005, 0.002)])
    assert m["steps_per_s"] == 10.0 and m["own_cpu_per_step"] == 0.005 and m["sdk_s_per_step"] == 0.002
    assert m["own_by_role"] == {"agent": 0.005}
    assert "sdk_s_per_step" not in bench.median_of([run(10.0, 0.0), run(9.0, 0.0)])   # (bare torchrun)


def test_the_json_row_has_exactly_the_issues_keys_and_ratios():
    row = bench.layout_row(2, 1, 2, {"bare": run(10.0, 0.0, first=5.0),
                                     "stalwart": run(9.6, 0.004, 0.00208, first=4.0)})
    assert row == {"workers": 4, "tp": 2, "pp": 1, "dp": 2, "throughput_ratio": 0.96, "own_cpu_share": 0.04,
                   "sdk_blocking_share": 0.02, "first_step_ratio": 0.8}
