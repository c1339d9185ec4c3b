"""Dual-phase replay planner: partitions, unique intersection, refusals."""

import itertools

import pytest

from stalwart.analyzer.replay import choose_k, locate, plan


def test_paper_example_24_machines_isolates_13():
    p = plan(list(range(24)), pp=2, dp=12, k=2)  # m = 4, n = 6
    assert (p.m, p.n, p.replay_dp) == (4, 6, 2)
    assert p.horizontal[3] == (12, 13, 14, 15)
    assert p.vertical[1] == (1, 7, 13, 19)
    assert locate(p, {3}, {1}) == [13]


@pytest.mark.parametrize("pp,dp,k", [(1, 4, 1), (2, 4, 1), (2, 8, 2), (4, 16, 2), (3, 9, 1),
                                     (1, 6, 2), (2, 12, 2), (4, 4, 1)])
def test_every_single_fault_is_isolated(pp, dp, k):
    machines = [f"host-{i}" for i in range(pp * dp)]
    p = plan(machines, pp=pp, dp=dp, k=k)
    for phase in p.phases:
        assert len(phase) == p.n
        assert all(len(g) == p.m for g in phase)
        assert sorted(x for g in phase for x in g) == sorted(machines)  # a partition
    for bad in machines:
        fh = {i for i, g in enumerate(p.horizontal) if bad in g}
        fv = {i for i, g in enumerate(p.vertical) if bad in g}
        assert locate(p, fh, fv) == [bad]


def test_horizontal_and_vertical_groups_meet_in_at_most_one_machine():
    p = plan(list(range(32)), pp=2, dp=16, k=2)
    for h, v in itertools.product(p.horizontal, p.vertical):
        assert len(set(h) & set(v)) <= 1


def test_two_faulty_machines_give_the_candidate_set():
    p = plan(list(range(24)), pp=2, dp=12, k=2)
    # machines 1 and 13: H0, H3; V1 only
    assert locate(p, {0, 3}, {1}) == [1, 13]
    assert locate(p, set(), {1}) == []


def test_refuses_m_greater_than_n():
    with pytest.raises(ValueError, match=r"m <= n \(m=k\*pp=8, n=dp/k=4\)"):
        plan(list(range(32)), pp=4, dp=8, k=2)


def test_refuses_bad_inputs():
    with pytest.raises(ValueError, match="divisible"):
        plan(list(range(12)), pp=2, dp=6, k=4)
    with pytest.raises(ValueError, match="m\\*n machines"):
        plan(list(range(23)), pp=2, dp=12, k=2)
    with pytest.raises(ValueError, match="distinct"):
        plan([0] * 24, pp=2, dp=12, k=2)
    with pytest.raises(ValueError, match="positive integer k"):
        plan(list(range(24)), pp=2, dp=12, k=0)
    p = plan(list(range(24)), pp=2, dp=12, k=2)
    with pytest.raises(ValueError, match="no vertical group"):
        locate(p, {0}, {6})


def test_choose_k():
    assert choose_k(2, 12, 24) == 1
    assert choose_k(4, 4, 16) == 1
    with pytest.raises(ValueError, match="dp >= pp"):
        choose_k(8, 4, 32)
    with pytest.raises(ValueError, match="pp\\*dp=24 but 20 machines"):
        choose_k(2, 12, 20)
    k = choose_k(3, 12, 36)
    p = plan(list(range(36)), pp=3, dp=12, k=k)
    assert p.m <= p.n


def test_jobs_list_every_replay_run_with_its_layout():
    p = plan([f"h{i}" for i in range(8)], pp=2, dp=4, k=1)  # m = 2, n = 4
    jobs = p.jobs()
    assert len(jobs) == 2 * p.n
    assert jobs[0] == {"phase": "horizontal", "group": 0, "machines": ["h0", "h1"], "pp": 2, "dp": 1}
    assert jobs[4] == {"phase": "vertical", "group": 0, "machines": ["h0", "h4"], "pp": 2, "dp": 1}
