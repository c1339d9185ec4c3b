"""The job's start-up split into phases that add up to the ledger's start-up bucket."""
from stalwart.controller.report.startup import startup_phases


def ev(t, kind, **data):
    return {"t": t, "kind": kind, "data": data}


def test_the_phases_of_a_start_with_the_sdk_add_up_to_the_start_up():
    log = [ev(100.0, "job_submitted"), ev(100.2, "run_started", run=1),
           ev(100.5, "workers_started", run=1, machine="m0"), ev(100.9, "workers_started", run=1, machine="m1"),
           ev(106.0, "workers_ready", run=1, imported=104.9, ready=106.0),
           ev(106.8, "step", run=1, step=0, dur=0.6), ev(107.0, "step", run=1, step=1, dur=0.2),
           ev(200.0, "run_started", run=2), ev(201.0, "workers_ready", run=2, imported=1.0, ready=2.0)]
    ph = startup_phases(log)
    assert ph == {"waiting": 0.2, "spawn": 0.7, "import": 4.0, "rendezvous": 1.1, "first_step": 0.2}
    assert abs(sum(ph.values()) - (106.2 - 100.0)) < 1e-9


def test_a_script_without_the_sdk_folds_import_and_rendezvous_into_its_first_step():
    log = [ev(0.0, "job_submitted"), ev(0.1, "run_started", run=1), ev(0.3, "workers_started", run=1),
           ev(9.0, "step", run=1, step=0, dur=1.0)]
    assert startup_phases(log) == {"waiting": 0.1, "spawn": 0.2, "import": 0.0, "rendezvous": 0.0,
                                   "first_step": 7.7}


def test_nothing_to_split_before_a_first_step():
    assert startup_phases([ev(0.0, "job_submitted"), ev(0.1, "run_started", run=1)]) == {}
