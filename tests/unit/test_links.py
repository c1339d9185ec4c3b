"""The link detector: `ss` output parsed into per-peer figures, the pair analysis on synthetic
per-pair figures (one machine's pairs slow -> that machine; a partitioned pair -> its two ends; a
flapping NIC -> its machine; every pair slower alike, or noise within the learned spread ->
nothing), and the detector in the job core (an alert names the machine, never an eviction on the
figures alone)."""
from __future__ import annotations

import math
import random

from corekit import Harness, of, records

from stalwart import protocol as p
from stalwart.agent.tcpstats import parse_ss, per_peer
from stalwart.analyzer.links import LinkModel, LinkWatch, PairWindow, culprits, judge, pair_key
from stalwart.controller.job import actions as a
from stalwart.controller.job.state import JobPhase, dumps, loads

# captured with `ss -tinHe state established` in a namespace machine's network (10.77.0.0/24):
# a gloo pair of a worker on 10.77.0.3 with a peer whose link is limited by tc tbf (RTO backoff,
# retransmissions, unacknowledged data), a healthy pair, and its connection to the store on loopback
SS_TEXT = """\
0      0      10.77.0.3:41338 10.77.0.2:29500 ino:4174503 sk:1 cgroup:/ <->
\t ts sack bbr wscale:10,10 rto:204 rtt:0.441/0.43 mss:65483 pmtu:65535 rcvmss:536 advmss:65483 cwnd:46 \
ssthresh:8 bytes_sent:10000000 bytes_acked:10000001 segs_out:179 segs_in:34 data_segs_out:177 \
bbr:(bw:104772793752bps,mrtt:0.009,pacing_gain:1,cwnd_gain:2) send 54643410431bps lastsnd:4 lastrcv:8 \
lastack:4 pacing_rate 103725065816bps delivery_rate 13096600000bps delivered:178 busy:4ms reordering:11 \
rcv_space:65495 rcv_ssthresh:65495 minrtt:0.009 snd_wnd:1978368
0      28960  10.77.0.3:52114 10.77.0.4:40121 ino:4174611 sk:3 cgroup:/ <->
\t ts sack bbr wscale:10,10 rto:1632 backoff:2 rtt:403.2/150.1 mss:1448 pmtu:1500 rcvmss:536 advmss:1448 \
cwnd:1 ssthresh:7 bytes_sent:2881304 bytes_retrans:34752 bytes_acked:2817793 segs_out:2012 segs_in:1270 \
data_segs_out:2004 send 28730bps lastsnd:212 lastrcv:1490 lastack:1490 pacing_rate 57455bps \
delivery_rate 1007680bps delivered:1956 busy:15120ms rwnd_limited:12ms(0.1%) unacked:20 retrans:1/24 \
lost:20 rcv_space:14480 rcv_ssthresh:64088 notsent:14480 minrtt:0.05
0      0      127.0.0.1:33922 127.0.0.1:29500 ino:4174700 sk:4 cgroup:/ <->
\t ts sack cubic wscale:7,7 rto:201 rtt:0.03/0.01 mss:32768 bytes_acked:120 segs_out:5 segs_in:5 \
send 8738133333bps lastsnd:44 lastrcv:44 lastack:44 minrtt:0.02
ESTAB 0 0 [::ffff:10.77.0.3]:41400 [::ffff:10.77.0.5]:5555 ino:4174800 sk:5 <->
\t cubic rtt:1.5/0.7 bytes_acked:10 retrans:0/3
garbage line without an address
"""


def test_ss_output_parses_into_sockets():
    socks = parse_ss(SS_TEXT)
    assert [s.inode for s in socks] == [4174503, 4174611, 4174700, 4174800]
    slow = socks[1]
    assert (slow.local, slow.local_port, slow.peer, slow.peer_port) == ("10.77.0.3", 52114, "10.77.0.4", 40121)
    assert (slow.rtt_ms, slow.rttvar_ms, slow.retrans, slow.total_retrans) == (403.2, 150.1, 1, 24)
    assert (slow.unacked, slow.backoff, slow.lost, slow.bytes_acked) == (20, 2, 20, 2817793)
    assert socks[0].rtt_ms == 0.441 and socks[0].total_retrans == 0 and socks[0].backoff == 0
    assert socks[3].peer == "10.77.0.5" and socks[3].total_retrans == 3     # the State column, IPv4-mapped


def test_per_peer_sums_since_the_previous_sample_and_leaves_loopback_out():
    prev: dict[int, tuple[int, int]] = {}
    first = per_peer(parse_ss(SS_TEXT), prev)
    assert {(s.local, s.peer) for s in first} == {("10.77.0.3", "10.77.0.2"), ("10.77.0.3", "10.77.0.4"),
                                                  ("10.77.0.3", "10.77.0.5")}
    assert all(s.retrans == 0 and s.acked == 0 and s.rtt_ms is None for s in first)   # counted from now
    later = SS_TEXT.replace("retrans:1/24", "retrans:1/30").replace("bytes_acked:2817793", "bytes_acked:2827793")
    by_peer = {s.peer: s for s in per_peer(parse_ss(later), prev)}
    slow = by_peer["10.77.0.4"]
    assert (slow.retrans, slow.acked, slow.rtt_ms) == (6, 10000, 403.2)
    assert (slow.unacked, slow.backoff, slow.socks) == (20, 2, 1)
    assert by_peer["10.77.0.2"].rtt_ms is None                  # no data acknowledged: no RTT sample
    assert set(prev) == {4174503, 4174611, 4174800}


# -- the pair analysis on synthetic figures ---------------------------------------------------------
MACHINES = ["m0", "m1", "m2", "m3"]
PAIRS = [pair_key(x, y) for i, x in enumerate(MACHINES) for y in MACHINES[i + 1:]]


def window(rng: random.Random, slow: str | None = None, factor: float = 1.0, parted: str | None = None,
           flap: str | None = None, noise: float = 0.15) -> dict[str, PairWindow]:
    """One window of every pair: healthy RTT ~0.3 ms with log-normal noise; `slow`'s pairs 300x
    (a tbf queue); every pair `factor` times slower; `parted` (a pair) or `flap`'s pairs retransmit."""
    out = {}
    for k in PAIRS:
        rtt = 0.3 * math.exp(rng.gauss(0, noise)) * factor * (300.0 if slow and slow in k.split("|") else 1.0)
        lossy = k == parted or (flap is not None and flap in k.split("|"))
        out[k] = PairWindow(rtt_ms=None if lossy else rtt, retrans=3 if lossy else 0, stuck=lossy)
    return out


def fitted(rng: random.Random) -> LinkWatch:
    lw = LinkWatch(window_s=1.0, train_s=10.0, machines=MACHINES)
    for _ in range(20):
        lw.learn(window(rng))
    lw.fit()
    return lw


def test_one_machines_slow_pairs_name_that_machine():
    rng = random.Random(1)
    lw = fitted(rng)
    f = lw.judge(window(rng, slow="m2"), 100.0)
    assert f.machines == ["m2"] and set(f.pairs) == {"m0|m2", "m1|m2", "m2|m3"} and not f.loss
    assert "RTT" in f.pairs["m1|m2"]


def test_a_partitioned_pair_names_its_two_ends_and_a_flapping_nic_its_machine():
    rng = random.Random(2)
    lw = fitted(rng)
    f = lw.judge(window(rng, parted="m1|m2"), 100.0)
    assert f.machines == ["m1", "m2"] and list(f.pairs) == ["m1|m2"] and f.loss
    f = lw.judge(window(rng, flap="m3"), 101.0)
    assert f.machines == ["m3"] and f.loss


def test_every_pair_slower_alike_or_losing_alike_names_nothing():
    rng = random.Random(3)
    lw = fitted(rng)
    for t, factor in enumerate((3.0, 10.0, 50.0)):
        assert lw.judge(window(rng, factor=factor), 100.0 + t).machines == []
    everywhere = {k: PairWindow(rtt_ms=None, retrans=5, stuck=True) for k in PAIRS}
    assert lw.judge(everywhere, 110.0).pairs == {}


def test_noise_within_the_learned_spread_names_nothing():
    rng = random.Random(4)
    lw = fitted(rng)
    for t in range(200):
        assert lw.judge(window(rng), 100.0 + t).pairs == {}


def test_a_slow_pair_without_a_reference_is_not_judged():
    model = LinkModel.fit({"m0|m1": [math.log(0.3)] * 5}, {}, 5)
    assert judge(model, {"m0|m1": PairWindow(rtt_ms=100.0)}, {"m0|m1": math.log(300.0)}, ["m0|m1"]).pairs == {}


def test_culprits_of_a_set_of_pairs():
    assert culprits([]) == []
    assert culprits(["m1|m2"]) == ["m1", "m2"]
    assert culprits(["m0|m2", "m2|m3"]) == ["m2"]
    assert culprits(["m0|m1", "m2|m3"]) == []               # nothing in common, nobody stands out
    assert culprits(["m0|m1", "m1|m2", "m2|m3"]) == ["m1", "m2"]


# -- in the job core --------------------------------------------------------------------------------
POLICY = {"trace_train_s": 5.0, "trace_window_s": 1.0, "failslow_drop": 0.3}


def addr(m: str) -> str:
    return f"10.77.0.{int(m[1:]) + 2}"


def feed(h: Harness, seconds: float, rng: random.Random, slow: str | None = None) -> list:
    """`seconds` of per-peer figures, two samples a second per machine (a ring: i sends to i+1)."""
    out: list = []
    n = len(h.st.slots)
    for _ in range(int(seconds * 2)):
        for i, m in enumerate(h.st.slots):
            links = []
            for j, peer in enumerate(h.st.slots):
                if peer == m:
                    continue
                sends = j == (i + 1) % n
                rtt = 0.3 * math.exp(rng.gauss(0, 0.15)) * (300.0 if slow in (m, peer) else 1.0)
                links.append(p.LinkStat(local=addr(m), peer=addr(peer), socks=2, rtt_ms=rtt if sends else None,
                                        retrans=0, unacked=0, backoff=0, acked=4096 if sends else 0))
            out += h.agent(m, p.Activity(run=h.st.run_seq, links=links, t=h.now))
        out += h.steps(1, dur=0.5)
    return out


def test_the_core_learns_the_pairs_then_names_a_slow_link_without_evicting():
    h = Harness(machines=4, gpus=1, standby=1, steps=10_000, policy=POLICY)
    h.tick()
    assert h.st.phase == JobPhase.RUNNING
    rng = random.Random(5)
    acts = feed(h, 10, rng)
    [fit] = records(acts, "link_model_fitted")
    assert fit["pairs"] == 6 and not records(acts, "trace_suspect")
    saved = dumps(h.st)
    assert dumps(loads(saved)) == saved and h.st.signals.links.model is not None
    acts = feed(h, 4, rng, slow="m2")
    alerts = records(acts, "trace_suspect")
    assert alerts and alerts[0]["link"] is True and alerts[0]["machines"] == ["m2"]
    assert set(alerts[0]["pairs"]) <= {"m1|m2", "m2|m3", "m0|m2"}
    assert not of(acts, a.OpenIncident)              # trace_evict is off: an alert, no eviction
    assert h.st.phase == JobPhase.RUNNING
    assert not records(feed(h, 10, random.Random(6)), "trace_suspect")


def test_the_pairs_found_within_the_memory_name_the_machine_together():
    rng = random.Random(7)
    lw = fitted(rng)
    first = window(rng, slow="m2")
    only = {k: w for k, w in first.items() if k != "m1|m2" and k != "m2|m3"}   # one of m2's pairs carried data
    assert lw.judge(only, 100.0).machines == ["m0", "m2"]
    second = {k: w for k, w in window(rng, slow="m2").items() if k != "m0|m2"}
    assert lw.judge(second, 101.0).machines == ["m2"]
    assert lw.judge(window(rng, slow="m3"), 200.0).machines == ["m3"]      # the old pairs are forgotten
