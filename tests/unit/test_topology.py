"""Exhaustive tests of the rank <-> machine <-> group arithmetic and backup placement."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from stalwart.topology import KINDS, Topology, from_spec


def factorizations(n: int, parts: int = 5):
    """Every ordered tuple of ``parts`` positive ints whose product is n."""
    if parts == 1:
        yield (n,)
        return
    for d in range(1, n + 1):
        if n % d == 0:
            for rest in factorizations(n // d, parts - 1):
                yield (d,) + rest


def all_layouts(max_world: int = 32, gpus=(1, 2, 4, 8)):
    for world in range(1, max_world + 1):
        for g in gpus:
            if world % g:
                continue
            for tp, cp, ep, dp, pp in factorizations(world):
                yield Topology(world // g, g, tp=tp, pp=pp, dp=dp, cp=cp, ep=ep)


def coord_table(t: Topology) -> list[dict[str, int]]:
    """Coordinates of every rank, enumerated with pp slowest and tp fastest, checked against
    the defining formula (independent of the module's divmod)."""
    table = []
    for pp, dp, ep, cp, tp in itertools.product(*(range(t.size(k)) for k in reversed(KINDS))):
        assert tp + t.tp * (cp + t.cp * (ep + t.ep * (dp + t.dp * pp))) == len(table)
        table.append({"tp": tp, "cp": cp, "ep": ep, "dp": dp, "pp": pp})
    return table


def shares(table, a: int, b: int) -> bool:
    """Same group of some kind = coordinates differ in at most one kind."""
    return sum(table[a][k] != table[b][k] for k in KINDS) <= 1


# --------------------------------------------------------------- construction
def test_valid_layout_attributes():
    t = Topology(4, 2, tp=2, pp=2, dp=2)
    assert (t.machines, t.gpus_per_machine, t.tp, t.pp, t.dp, t.cp, t.ep, t.world_size) == \
        (4, 2, 2, 2, 2, 1, 1, 8)
    assert t.describe() == "tp=2 pp=2 dp=2 (4 machines x 2)"
    assert Topology(1, 4, tp=2, dp=1, cp=2).describe() == "tp=2 pp=1 dp=1 cp=2 (1 machine x 4)"
    assert Topology(2, 4, ep=2, dp=4).describe() == "tp=1 pp=1 dp=4 ep=2 (2 machines x 4)"


def test_product_mismatch_message():
    with pytest.raises(ValueError) as e:
        Topology(4, 2, tp=2, pp=2, dp=3)
    assert str(e.value) == ("tp*pp*dp must equal machines*gpus-per-machine "
                            "(2*2*3=12, 4*2=8)")
    with pytest.raises(ValueError, match=r"tp\*pp\*dp\*cp\*ep must equal .*\(1\*1\*1\*2\*3=6, 2\*2=4\)"):
        Topology(2, 2, cp=2, ep=3)
    with pytest.raises(ValueError, match=r"tp\*pp\*dp\*ep must equal"):
        Topology(2, 2, ep=3)


@pytest.mark.parametrize("kwargs, field", [
    (dict(machines=0, gpus_per_machine=1), "machines"),
    (dict(machines=1, gpus_per_machine=-2), "gpus-per-machine"),
    (dict(machines=2, gpus_per_machine=1, tp=0), "tp"),
    (dict(machines=2, gpus_per_machine=1, pp=1.5), "pp"),
    (dict(machines=2, gpus_per_machine=1, dp=True), "dp"),
    (dict(machines=2, gpus_per_machine=1, cp="2"), "cp"),
    (dict(machines=2, gpus_per_machine=1, ep=None), "ep"),
])
def test_bad_sizes(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field} must be a positive integer \(got .*\)$"):
        Topology(**kwargs)


def test_bad_arguments():
    t = Topology(2, 2, tp=2, dp=2)
    for bad in (-1, 4, 1.0, True, "0"):
        with pytest.raises(ValueError, match="rank must be an integer in 0..3"):
            t.coords(bad)
    with pytest.raises(ValueError, match="machine must be an integer in 0..1"):
        t.ranks_of_machine(2)
    with pytest.raises(ValueError, match="unknown parallel kind 'xp'"):
        t.group("xp", 0)
    with pytest.raises(ValueError, match="unknown parallel kind 'zz'"):
        t.rank_of(zz=0)
    with pytest.raises(ValueError, match=r"tp coordinate must be in 0..1 \(got 2\)"):
        t.rank_of(tp=2)
    with pytest.raises(ValueError, match="at least one rank"):
        t.shared_group([])


def test_equality_repr_and_from_spec():
    a = Topology(4, 2, tp=2, pp=2, dp=2)
    assert a == Topology(4, 2, tp=2, pp=2, dp=2) and hash(a) == hash(Topology(4, 2, 2, 2, 2))
    assert a != Topology(4, 2, tp=2, pp=1, dp=4)
    assert repr(a) == "Topology(machines=4, gpus_per_machine=2, tp=2, pp=2, dp=2)"
    spec = SimpleNamespace(machines=4, gpus_per_machine=2, tp=2, pp=2, dp=1, cp=2, ep=1)
    assert from_spec(spec) == Topology(4, 2, tp=2, pp=2, dp=1, cp=2)


# -------------------------------------------------------- exhaustive structure
@pytest.mark.timeout(60)
def test_coords_groups_exhaustive():
    for t in all_layouts(24, gpus=(1, 2, 4)):
        w, g = t.world_size, t.gpus_per_machine
        table = coord_table(t)
        for r in range(w):
            c = t.coords(r)
            assert c == table[r]
            assert t.rank_of(**c) == r
            assert t.machine_of(r) == r // g and t.local_rank(r) == r % g
            assert r in t.ranks_of_machine(t.machine_of(r))
        assert t.rank_of() == 0
        for kind in KINDS:
            gs = t.groups(kind)
            assert len(gs) == w // t.size(kind)
            assert all(len(x) == t.size(kind) and list(x) == sorted(x) for x in gs)
            assert sorted(itertools.chain(*gs)) == list(range(w))  # disjoint cover
            assert gs == sorted(gs)
            for r in range(w):
                grp = t.group(kind, r)
                assert gs[t.group_id(kind, r)] == grp and r in grp
                # members differ from r only in `kind`
                for s in grp:
                    cr, cs = t.coords(r), t.coords(s)
                    assert all(cr[k] == cs[k] for k in KINDS if k != kind)
        assert [t.ranks_of_machine(m) for m in range(t.machines)] == \
            [list(range(m * g, m * g + g)) for m in range(t.machines)]


def test_groups_of_reference_layout():
    # tp=2 pp=2 dp=2 on 4 machines x 2: rank = tp + 2*(dp + 2*pp)
    t = Topology(4, 2, tp=2, pp=2, dp=2)
    assert t.groups("tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert t.groups("dp") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert t.groups("pp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert t.groups("cp") == [(r,) for r in range(8)]
    assert t.coords(5) == {"tp": 1, "cp": 0, "ep": 0, "dp": 0, "pp": 1}
    assert t.rank_of(tp=1, pp=1, dp=1) == 7
    assert t.machines_of([7, 0, 1, 6]) == [0, 3]
    assert t.group_id("dp", 7) == 3


# ------------------------------------------------------------- shared_group
def machine_ranks(t: Topology, machines):
    return [r for m in machines for r in t.ranks_of_machine(m)]


def test_shared_group_paper_fig7():
    t = Topology(16, 2, tp=2, pp=4, dp=4)
    assert t.shared_group(machine_ranks(t, [3, 7, 11, 15])) == ("pp", [3, 7, 11, 15])
    assert t.shared_group([30, 14]) == ("pp", [3, 7, 11, 15])   # subset of one pipeline
    assert t.shared_group(machine_ranks(t, [4, 5, 6, 7])) == ("dp", [4, 5, 6, 7])
    assert t.shared_group([0, 9]) == ("pp", [0, 4, 8, 12])      # same dp, other stage
    assert t.shared_group([0, 10]) is None                      # other dp and other stage


def test_shared_group_every_kind():
    # tp spans two machines (G=2, tp=4): outliers on machines 0,1 share a tp group.
    t = Topology(8, 2, tp=4, cp=2, dp=2)
    assert t.shared_group([0, 3]) == ("tp", [0, 1])
    # cp: machines 0 and 2 (rank 0 and rank 4 differ only in cp)
    assert t.shared_group([0, 4]) == ("cp", [0, 2])
    assert t.shared_group([0, 8]) == ("dp", [0, 4])
    t = Topology(4, 1, ep=2, pp=2)
    assert t.shared_group([0, 1]) == ("ep", [0, 1])
    assert t.shared_group([0, 2]) == ("pp", [0, 2])
    assert t.shared_group([0, 3]) is None


def test_shared_group_ties_and_none():
    # tp=2 on one machine each, pp=2, dp=2, G=1: a single machine -> fewest machines wins;
    # tp group {0,1} (2 machines) vs nothing else covering machine 0 and 1.
    t = Topology(8, 1, tp=2, pp=2, dp=2)
    assert t.shared_group([0, 1]) == ("tp", [0, 1])
    # One machine: tp, dp and pp groups each cover it with 2 machines; tie -> tp first.
    assert t.shared_group([0]) == ("tp", [0, 1])
    # Without tp: dp and pp both cover machine 0 with 2 machines; tie -> pp before dp.
    t = Topology(4, 1, pp=2, dp=2)
    assert t.shared_group([0]) == ("pp", [0, 2])
    assert t.shared_group([1, 2]) is None
    # cp and ep tie -> cp first, ep before pp.
    t = Topology(8, 1, cp=2, ep=2, pp=2)
    assert t.shared_group([3]) == ("cp", [2, 3])
    t = Topology(4, 1, ep=2, pp=2)
    assert t.shared_group([3]) == ("ep", [2, 3])
    # Kinds of size 1 are not groups: a single machine with pure DP across 3 machines.
    t = Topology(3, 2, dp=6)
    assert t.shared_group([1]) == ("dp", [0, 1, 2])
    assert Topology(2, 1, tp=1, dp=1, pp=2).shared_group([0, 1]) == ("pp", [0, 1])


def brute_shared(t: Topology, ranks):
    want = set(t.machines_of(ranks))
    order = ("tp", "cp", "ep", "pp", "dp")
    best = None
    for i, kind in enumerate(order):
        if t.size(kind) == 1:
            continue
        for gid, grp in enumerate(t.groups(kind)):
            ms = set(r // t.gpus_per_machine for r in grp)
            if want <= ms:
                key = (len(ms), i, gid)
                if best is None or key < best[0]:
                    best = (key, (kind, sorted(ms)))
    return None if best is None else best[1]


@pytest.mark.timeout(60)
def test_shared_group_matches_brute_force():
    for t in all_layouts(16, gpus=(1, 2, 4)):
        for a in range(t.world_size):
            for b in range(a, t.world_size):
                assert t.shared_group([a, b]) == brute_shared(t, [a, b]), (t, a, b)


# -------------------------------------------------------------- backup peers
def test_backup_paper_fig9():
    t = Topology(8, 2, tp=2, pp=4, dp=2)
    assert (t.backup_peer(8), t.backup_peer(9)) == (2, 3)
    assert (t.backup_peer(2), t.backup_peer(3)) == (8, 9)
    assert t.backup_machine(4) == 1 and t.backup_machine(1) == 4


def test_backup_fallbacks_and_errors():
    t = Topology(4, 2, dp=8)          # pure DP: no rank outside the group -> next machine
    assert [t.backup_peer(r) for r in range(8)] == [2, 3, 4, 5, 6, 7, 0, 1]
    assert t.backup_machine(3) == 0
    t = Topology(2, 2, tp=2, dp=2)    # only a rotated local rank avoids every group
    assert [t.backup_peer(r) for r in range(4)] == [3, 2, 1, 0]
    for one in (Topology(1, 4, tp=4), Topology(1, 1)):
        with pytest.raises(ValueError, match="^backup needs at least 2 machines$"):
            one.backup_peer(0)
        with pytest.raises(ValueError, match="^backup needs at least 2 machines$"):
            one.backup_machine(0)
    with pytest.raises(ValueError, match="rank must be"):
        Topology(2, 1, dp=2).backup_peer(2)


@pytest.mark.timeout(120)
def test_backup_peer_exhaustive():
    """For every layout of 1..32 ranks: the peer is on another machine and shares no group
    whenever some such rank exists (checked by brute force); otherwise it is the same local
    rank on the next machine.  All of a machine's ranks back up to one machine whenever one
    machine can hold valid peers for all of them; most layouts pair machines symmetrically."""
    layouts = pairable = symmetric = 0
    for t in all_layouts(32):
        if t.machines < 2:
            continue
        layouts += 1
        w, g = t.world_size, t.gpus_per_machine
        table = coord_table(t)
        peers = [t.backup_peer(r) for r in range(w)]
        assert peers == [t.backup_peer(r) for r in range(w)]      # deterministic
        all_possible = True
        for r, p in enumerate(peers):
            possible = any(s // g != r // g and not shares(table, r, s) for s in range(w))
            all_possible &= possible
            if possible:
                assert p // g != r // g, (t, r, p)
                assert not shares(table, r, p), (t, r, p)
            else:
                assert p == ((r // g + 1) % t.machines) * g + r % g, (t, r, p)
        for m in range(t.machines):
            # one machine b offers a valid peer to each rank of m (rank-by-rank)
            one_machine = any(
                b != m and all(any(not shares(table, r, b * g + j) for j in range(g))
                               for r in t.ranks_of_machine(m))
                for b in range(t.machines))
            if one_machine:
                assert len(t.backup_machines(m)) == 1, (t, m)
        if all_possible and t.machines % 2 == 0:
            pairable += 1
            symmetric += all(peers[p] == r for r, p in enumerate(peers))
    assert layouts > 3000 and pairable > 2000
    # Even machine counts where every rank has a valid peer: (almost) always symmetric pairs.
    assert symmetric >= 0.98 * pairable, (symmetric, pairable)


def test_backup_strict_machine_separation():
    """When a separate machine exists, over-evicting any group of a rank keeps its backup."""
    for t in all_layouts(32, gpus=(2, 4)):
        if t.machines < 2:
            continue
        g = t.gpus_per_machine
        for m in range(t.machines):
            ranks = t.ranks_of_machine(m)
            group_machines = set()
            for r in ranks:
                for k in KINDS:
                    group_machines |= set(t.machines_of(t.group(k, r)))
            if len(group_machines) < t.machines:
                b = t.backup_machine(m)
                assert b not in group_machines, (t, m, b)
                assert [t.backup_peer(r) for r in ranks] == [b * g + r % g for r in ranks]


@pytest.mark.timeout(30)
def test_backup_plan_scales_to_10k_ranks():
    for t in (Topology(1250, 8, tp=8, pp=10, dp=125), Topology(1250, 8, dp=10000)):
        assert t.backup_peer(9999) // 8 != 1249
