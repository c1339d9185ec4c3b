"""console/watch.py (`stalwart status --watch`): in place with rich on a terminal, plain lines otherwise."""
import io

from stalwart.console.watch import plain_line, watch


def rep(step, state="running", incidents=()):
    return {"job": "test#1", "job_id": 1, "state": state, "reason": None, "steps_completed": step,
            "steps_target": 100, "final_loss": 3.0, "ettr": 0.9, "window_ettr": 0.8, "wall_s": 10.0,
            "machines": [{"id": "m0", "state": "active"}, {"id": "m1", "state": "evicted", "reason": "Xid 79"}],
            "incidents": list(incidents),
            "live": {"state": state, "step": step, "loss": 3.0, "steps_per_s": 12.0}}


INC = {"id": 1, "symptom": "gpu_xid", "mechanism": "evict_restart", "machines_evicted": ["m1"],
       "detected_at": 4.2, "cause": "GPU Xid 79 on m1"}


def feed(reports):
    it = iter(reports)
    return lambda: next(it)


def test_plain_lines_until_the_job_ends():
    out = io.StringIO()
    assert watch(feed([rep(10), rep(10), rep(20, incidents=[INC]), rep(100, "succeeded", [INC])]),
                 interval=0, stream=out, tty=False) == 0
    lines = out.getvalue().splitlines()
    assert "\x1b" not in out.getvalue()
    assert len([ln for ln in lines if "job test#1" in ln]) == 3          # an unchanged state is not repeated
    assert lines.count("incident 1: gpu_xid -> evict_restart; evicted m1; cause: GPU Xid 79 on m1") == 1
    assert "succeeded: step 100/100" in lines[-1]
    assert "ETTR 0.900 (sliding 0.800)" in plain_line(rep(1))


def test_terminal_view_refreshes_in_place():
    out = io.StringIO()
    watch(feed([rep(10), rep(50, incidents=[INC]), rep(100, "succeeded", [INC])]), interval=0, stream=out, tty=True)
    text = out.getvalue()
    assert "\x1b[1A" in text                  # cursor up: the next refresh overwrites the last
    assert "sliding ETTR" in text and "gpu_xid" in text and "m1 evicted: Xid 79" in text
    assert "50/100" in text and "100/100" in text


def test_max_polls_stops_a_running_job_view():
    out = io.StringIO()
    assert watch(lambda: rep(1), interval=0, stream=out, tty=False, max_polls=3) == 0
