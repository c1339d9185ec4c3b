"""The agent's event buffer while the controller is away: bounded, metrics first, evidence never."""
import threading
import time

import pytest

from stalwart.agent.outbox import Outbox


def test_full_buffer_drops_metrics_then_steps_never_evidence():
    box = Outbox(limit=5)
    box.put({"type": "worker_exit", "rank": 1})
    for i in range(3):
        box.put({"type": "metrics", "i": i})
    box.put({"type": "step", "step": 0})
    box.put({"type": "step", "step": 1})            # 6 > 5: the oldest metrics go
    assert box.dropped == {"metrics": 1}
    for i in range(2, 6):
        box.put({"type": "step", "step": i})
    assert box.dropped == {"metrics": 3, "step": 2}
    out = box.take(0, max_batch=100)
    assert out[0] == {"type": "worker_exit", "rank": 1}
    assert [e["step"] for e in out[1:]] == [2, 3, 4, 5]


def test_evidence_alone_goes_over_the_limit():
    box = Outbox(limit=2)
    for r in range(4):
        box.put({"type": "health", "r": r})
    assert len(box) == 4 and box.dropped == {}


def test_an_undelivered_batch_goes_back_in_order():
    box = Outbox(limit=100)
    for i in range(5):
        box.put({"type": "step", "step": i})
    batch = box.take(0, max_batch=3)
    box.put({"type": "step", "step": 5})
    box.give_back(batch)
    assert [e["step"] for e in box.take(0, max_batch=10)] == [0, 1, 2, 3, 4, 5]


def test_routine_events_linger_for_company_evidence_goes_at_once():
    box = Outbox()
    box.put({"type": "metrics", "step": 0})
    threading.Timer(0.05, lambda: box.put({"type": "metrics", "step": 1})).start()
    t0 = time.monotonic()
    assert [e["step"] for e in box.take(timeout=1.0, linger=0.3)] == [0, 1]     # waited for the second
    assert time.monotonic() - t0 >= 0.25
    box.put({"type": "metrics"})
    threading.Timer(0.05, lambda: box.put({"type": "worker_exit", "rank": 0})).start()
    t0 = time.monotonic()
    out = box.take(timeout=1.0, linger=30.0)         # the exit ends the wait
    assert [e["type"] for e in out] == ["metrics", "worker_exit"] and time.monotonic() - t0 < 20
    box.put({"type": "restored", "rank": 0})         # nothing routine in the queue: no wait at all
    assert box.take(timeout=1.0, linger=30.0) == [{"type": "restored", "rank": 0}]
    box.put({"type": "step", "step": 2})             # a step report goes at once too
    assert box.take(timeout=1.0, linger=30.0) == [{"type": "step", "step": 2}]
    box.put({"type": "metrics"})
    box.give_back([{"type": "health"}])              # given back evidence counts too
    assert len(box.take(timeout=1.0, linger=30.0)) == 2


def test_a_report_of_a_copy_the_machine_holds_waits_for_company_others_go_at_once():
    """A copy in the machine's own memory dies with the machine: its report may wait (the next
    prompt event takes it along, in order); a report of a copy elsewhere or durable may not."""
    box = Outbox()
    box.put({"type": "ckpt", "tier": "own", "rank": 0, "step": 3})
    box.put({"type": "ckpt", "tier": "own", "rank": 1, "step": 3})
    t0 = time.monotonic()
    assert box.take(timeout=1.0, linger=0.2) and time.monotonic() - t0 >= 0.15     # lingered
    box.put({"type": "ckpt", "tier": "own", "rank": 0, "step": 4})
    threading.Timer(0.05, lambda: box.put({"type": "ckpt", "tier": "backup", "rank": 0, "step": 4})).start()
    t0 = time.monotonic()
    out = box.take(timeout=1.0, linger=30.0)
    assert [e["tier"] for e in out] == ["own", "backup"] and time.monotonic() - t0 < 20
    for tier in ("backup", "durable"):
        box.put({"type": "ckpt", "tier": tier, "rank": 0, "step": 9})
        assert len(box.take(timeout=1.0, linger=30.0)) == 1
    # a backup this machine holds for a peer dies with it too: its holder's report may wait
    box.put({"type": "ckpt", "tier": "backup", "rank": 2, "step": 9, "holder": "m1", "machine": "m1"})
    t0 = time.monotonic()
    assert box.take(timeout=1.0, linger=0.2) and time.monotonic() - t0 >= 0.15
    box.put({"type": "ckpt", "tier": "backup", "rank": 2, "step": 9, "holder": "m2", "machine": "m1"})
    assert len(box.take(timeout=1.0, linger=30.0)) == 1      # (a pusher's report of a peer's copy)


def test_take_waits_for_an_event():
    box = Outbox()
    threading.Timer(0.05, lambda: box.put({"type": "done"})).start()
    assert box.take(timeout=5.0) == [{"type": "done"}]
    assert box.take(timeout=0.01) == []
    with pytest.raises(ValueError):
        Outbox(limit=0)


def test_retry_delay_doubles_to_a_cap_with_jitter():
    from stalwart.agent.outbox import RETRY_CAP_S, retry_delay
    assert retry_delay(1, 0.5, 0.0) == 0.25 and retry_delay(1, 0.5, 0.999) < 0.5
    assert [retry_delay(n, 0.5, 1.0) for n in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, 4.0]
    assert retry_delay(50, 0.5, 1.0) == RETRY_CAP_S and retry_delay(50, 0.5, 0.0) == RETRY_CAP_S / 2
    # agents that failed together spread over half the interval
    spread = {round(retry_delay(10, 1.0, r / 10), 2) for r in range(10)}
    assert len(spread) == 10 and min(spread) >= RETRY_CAP_S / 2


def test_a_step_report_waits_briefly_for_the_other_local_ranks_of_its_step():
    box = Outbox()
    box.put({"type": "step", "run": 1, "step": 7, "rank": 0})
    threading.Timer(0.05, lambda: box.put({"type": "step", "run": 1, "step": 7, "rank": 1})).start()
    t0 = time.monotonic()
    out = box.take(timeout=1.0, gather=5.0, ranks=2)          # the second rank's report ends the wait
    assert [e["rank"] for e in out] == [0, 1] and time.monotonic() - t0 < 4.0
    box.put({"type": "step", "run": 1, "step": 8, "rank": 0})  # the other rank never comes: bounded
    t0 = time.monotonic()
    assert [e["rank"] for e in box.take(timeout=1.0, gather=0.1, ranks=2)] == [0]
    assert 0.08 <= time.monotonic() - t0 < 2.0
    box.put({"type": "step", "run": 1, "step": 9, "rank": 0})  # evidence behind it: no wait
    box.put({"type": "worker_exit", "rank": 1})
    assert len(box.take(timeout=1.0, gather=30.0, ranks=2)) == 2
    box.put({"type": "step", "run": 1, "step": 10, "rank": 0})  # one rank here: nothing to wait for
    t0 = time.monotonic()
    assert len(box.take(timeout=1.0, gather=30.0, ranks=1)) == 1 and time.monotonic() - t0 < 5.0


def test_step_reports_are_paced_anything_else_prompt_goes_at_once():
    """A fast job's step reports go a few per request (at most one request with steps per `pace`);
    the first goes at once, and evidence behind step reports ends the wait."""
    box = Outbox()
    box.put({"type": "step", "step": 0})
    t0 = time.monotonic()
    assert len(box.take(timeout=1.0, pace=30.0)) == 1 and time.monotonic() - t0 < 5.0   # none went before
    box.put({"type": "step", "step": 1})
    threading.Timer(0.05, lambda: box.put({"type": "step", "step": 2})).start()
    t0 = time.monotonic()
    assert [e["step"] for e in box.take(timeout=1.0, pace=0.3)] == [1, 2]   # waited out the pace
    assert time.monotonic() - t0 >= 0.25
    box.put({"type": "step", "step": 3})
    threading.Timer(0.05, lambda: box.put({"type": "worker_exit", "rank": 0})).start()
    t0 = time.monotonic()
    out = box.take(timeout=1.0, pace=30.0)                          # the exit ends the wait
    assert [e["type"] for e in out] == ["step", "worker_exit"] and time.monotonic() - t0 < 20
    box.put({"type": "restored", "rank": 0})                        # no step report: no pace at all
    t0 = time.monotonic()
    assert len(box.take(timeout=1.0, pace=30.0)) == 1 and time.monotonic() - t0 < 20
    box.put({"type": "step", "step": 9})                            # a new run's first: at once
    box.reset_pace()
    t0 = time.monotonic()
    assert len(box.take(timeout=1.0, pace=30.0)) == 1 and time.monotonic() - t0 < 20
    box.put({"type": "step", "step": 4, "loss": float("nan")})      # a NaN is evidence: no pace
    t0 = time.monotonic()
    assert len(box.take(timeout=1.0, pace=30.0)) == 1 and time.monotonic() - t0 < 20
    box.put({"type": "step", "step": 4})                            # a dropped evidence count stays right
    box.give_back([{"type": "health"}])
    assert len(box.take(timeout=1.0, pace=30.0)) == 2


def _await_pacing(box: Outbox) -> None:
    """Until a `take` in another thread waits out its pace (10 s at most)."""
    deadline = time.monotonic() + 10
    while not box._pacing:
        assert time.monotonic() < deadline
        time.sleep(0.005)

def test_a_pacing_take_is_not_woken_by_more_step_reports_but_is_by_evidence_and_a_new_run():
    box = Outbox()
    box.put({"type": "step", "step": 0})
    box.take(timeout=1.0, pace=30.0)                 # (the pace starts now)
    notified = []
    real = box._cond.notify
    box._cond.notify = lambda n=1: (notified.append(n), real(n))    # type: ignore[method-assign]
    out: list = []
    box.put({"type": "step", "step": 1})
    t = threading.Thread(target=lambda: out.extend(box.take(timeout=1.0, pace=30.0)))
    t.start()
    try:
        _await_pacing(box)                          # the taker waits out its pace
        before = len(notified)
        for s in range(2, 12):
            box.put({"type": "step", "step": s, "rank": 0})
        assert len(notified) == before and not out            # nobody woken, nothing taken
        box.reset_pace()                                      # a new run: the taker looks again
    finally:
        t.join(timeout=10)
    assert [e["step"] for e in out] == list(range(1, 12))
    box.put({"type": "step", "step": 12})
    out.clear()
    t = threading.Thread(target=lambda: out.extend(box.take(timeout=1.0, pace=30.0)))
    t.start()
    try:
        _await_pacing(box)
        box.put({"type": "worker_exit", "rank": 0})           # evidence wakes it at once
    finally:
        t.join(timeout=10)
    assert [e["type"] for e in out] == ["step", "worker_exit"]


def test_an_empty_take_inside_the_pace_is_not_woken_by_step_reports_and_goes_at_its_end():
    box = Outbox()
    box.put({"type": "step", "step": 0})
    box.take(timeout=1.0, pace=0.6)                  # (the pace starts now: the queue is empty)
    notified = []
    real = box._cond.notify
    box._cond.notify = lambda n=1: (notified.append(n), real(n))    # type: ignore[method-assign]
    out: list = []
    t0, end = time.monotonic(), box._paced_at + 0.6
    t = threading.Thread(target=lambda: out.extend(box.take(timeout=30.0, pace=0.6)))
    t.start()
    try:
        _await_pacing(box)                          # the taker sleeps out the pace, queue empty
        box.put({"type": "step", "step": 1, "rank": 0})
        box.put({"type": "metrics", "values": {}})
        assert not notified and not out             # nobody woken, nothing taken yet
    finally:
        t.join(timeout=10)
    # taken at the pace's end, not at the take's 30 s timeout nor at the first report
    assert [e["type"] for e in out] == ["step", "metrics"]
    assert time.monotonic() >= end and time.monotonic() - t0 < 10
    # evidence still wakes an empty taker inside the pace at once
    out.clear()
    t = threading.Thread(target=lambda: out.extend(box.take(timeout=30.0, pace=30.0)))
    t.start()
    try:
        _await_pacing(box)
        box.put({"type": "worker_exit", "rank": 0})
    finally:
        t.join(timeout=10)
    assert [e["type"] for e in out] == ["worker_exit"]
