"""Flight-recorder laggard analysis on recorded gloo dumps (re-recorded from a live job by
``python tests/integration/test_flight_recorder_live.py record``)."""

import json
import pathlib

import pytest

from stalwart.analyzer.flightrec import laggards, parse, stuck_ranks

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "stacks"


def _check_deadlock(lags):
    assert set(lags) == {"0", "1"}
    g0, g1 = lags["0"], lags["1"]
    assert g0.pg_name == "default_pg"
    assert g0.stuck_op == "gloo:all_reduce" and g0.stuck_seq == 5
    assert g0.waiting == [0] and g0.laggards == [1] and g0.last_seq == {0: 5, 1: 4}
    assert g0.laggard_stuck_on[1].name == "gloo:broadcast"
    assert g0.laggard_stuck_on[1].pg_id == "1"
    assert g1.stuck_op == "gloo:broadcast" and g1.waiting == [1] and g1.laggards == [0]
    assert g1.laggard_stuck_on[0].name == "gloo:all_reduce"
    assert stuck_ranks(lags) == [0, 1]


def load_fixture():
    return {r: (FIXTURES / f"fr_rank{r}.json").read_text() for r in range(2)}


def test_recorded_dumps_have_the_expected_format():
    ops = parse(load_fixture()[0])
    assert not [o for o in ops if o.is_p2p]  # gloo's recorder leaves send/recv out
    assert {(o.pg_id, o.pg_name) for o in ops} == {("0", "default_pg"), ("1", "undefined")}
    assert [o.seq for o in ops if o.pg_id == "0" and not o.is_p2p] == [1, 2, 3, 4, 5]
    assert [o.retired for o in ops if o.pg_id == "0" and not o.is_p2p] == [True] * 4 + [False]


def test_recorded_cross_deadlock_names_laggards_on_both_groups():
    _check_deadlock(laggards(load_fixture()))
    assert json.dumps(laggards(load_fixture())["0"].as_dict())


def test_rank_that_skipped_a_collective_is_the_laggard():
    """Rank 1 never reached all_reduce #5 and has nothing in flight (e.g. stuck in compute)."""
    d1 = json.loads(load_fixture()[1])
    d1["entries"] = [e for e in d1["entries"] if e["pg_id"] != 1]
    lags = laggards({0: load_fixture()[0], 1: d1})
    assert list(lags) == ["0"]
    assert lags["0"].laggards == [1] and lags["0"].laggard_stuck_on == {1: None}


def test_member_without_entries_counts_via_pg_ranks():
    lags = laggards({0: load_fixture()[0], 1: json.dumps({"entries": []})}, pg_ranks={"0": [0, 1]})
    assert lags["0"].last_seq == {0: 5, 1: 0} and lags["0"].laggards == [1]


def test_healthy_dumps_report_nothing():
    healthy = json.loads(load_fixture()[0])
    healthy["entries"] = [dict(e, retired=True) for e in healthy["entries"]
                          if e["collective_seq_id"] <= 4 and e["pg_id"] == 0]
    assert laggards({0: healthy, 1: healthy}) == {}
    assert set(laggards({0: healthy, 1: healthy}, only_stuck=False)) == {"0"}


def test_bad_dumps_are_refused():
    with pytest.raises(ValueError, match="not JSON"):
        laggards({0: "{nope"})
    with pytest.raises(ValueError, match="entries"):
        laggards({0: {"entries": 3}})
    with pytest.raises(ValueError, match="malformed"):
        laggards({0: {"entries": [{"collective_seq_id": 1}]}})
    with pytest.raises(ValueError, match="at least one"):
        laggards({})
