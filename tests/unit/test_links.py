"""The link detector: `ss` output parsed into per-peer figures, the pair analysis on synthetic
per-pair figures (one machine's pairs slow -> that machine; a partitioned pair -> its two ends; a
flapping NIC -> its machine; every pair slower alike, or noise within the learned spread ->
nothing), and the detector in the job core (an alert names the machine, never an eviction on the
figures alone)."""
from __future__ import annotations

import math
import os
import random

from corekit import Harness, of, records

from stalwart import protocol as p
from stalwart.agent.tcpstats import parse_ss, per_peer
from stalwart.analyzer.links import LinkModel, LinkWatch, PairWindow, culprits, judge, pair_key
from stalwart.controller.job import actions as a
from stalwart.controller.job.state import JobPhase, dumps, loads

# Captured on this host with `ss -tinHe state established` (iproute2 6.1) inside namespace machines:
# two gloo pairs of a healthy 4-machine DP job (one busy: 83 retransmissions, all of them DSACKed
# spurious; one idle), a loopback connection, and (SS_SLOW, SS_PARTED) one socket streaming to a
# peer whose link `chaos.net.link_slow` limited to 1mbit, then to a peer it was partitioned from.
SS_HEALTHY = """\
0      0               10.213.1.12:53502         10.213.1.11:39127 ino:4196630 sk:26 cgroup:/ <->
\t ts sack bbr wscale:10,10 rto:204 rtt:0.135/0.148 ato:40 mss:1448 pmtu:1500 rcvmss:536 advmss:1448 cwnd:417 \
bytes_sent:169413336 bytes_retrans:5584 bytes_acked:169407753 bytes_received:139392 segs_out:122404 segs_in:6085 \
data_segs_out:122050 data_segs_in:2918 bbr:(bw:67849142264bps,mrtt:0.006,pacing_gain:2.88672,cwnd_gain:2.88672) \
send 35781688889bps lastsnd:48 lastrcv:48 lastack:48 pacing_rate 193902777232bps delivery_rate 67849142856bps \
delivered:122051 app_limited busy:1876ms retrans:0/83 dsack_dups:83 rcv_rtt:16290.2 rcv_space:64560 \
rcv_ssthresh:64088 minrtt:0.006 snd_wnd:2745344
0      0               10.213.1.12:40412         10.213.1.10:46777 ino:4196629 sk:28 cgroup:/ <->
\t ts sack bbr wscale:10,10 rto:204 rtt:0.014/0.007 mss:1448 pmtu:1500 rcvmss:536 advmss:1448 cwnd:11 bytes_sent:8 \
bytes_acked:9 segs_out:3 segs_in:2 data_segs_out:1 bbr:(bw:1448000000bps,mrtt:0.008,pacing_gain:2.88672,\
cwnd_gain:2.88672) send 9101714286bps lastsnd:35404 lastrcv:35404 lastack:35404 pacing_rate 22070233680bps \
delivery_rate 1448000000bps delivered:2 app_limited rcv_space:14480 rcv_ssthresh:64088 minrtt:0.008 snd_wnd:65536
0      0      127.0.0.1:59050 127.0.0.1:47721 ino:4174503 sk:1 cgroup:/ <->
\t ts sack bbr wscale:10,10 rto:204 rtt:0.441/0.43 mss:65483 pmtu:65535 rcvmss:536 advmss:65483 cwnd:46 \
ssthresh:8 bytes_sent:10000000 bytes_acked:10000001 segs_out:179 segs_in:34 data_segs_out:177 \
bbr:(bw:104772793752bps,mrtt:0.009,pacing_gain:1,cwnd_gain:2) send 54643410431bps lastsnd:4 lastrcv:8 lastack:4 \
pacing_rate 103725065816bps delivery_rate 13096600000bps delivered:178 busy:4ms reordering:11 rcv_space:65495 \
rcv_ssthresh:65495 minrtt:0.009 snd_wnd:1978368
"""
SS_SLOW = """\
0      3871952 10.213.1.10:40270 10.213.1.11:5555 timer:(on,588ms,0) ino:4214370 sk:58 cgroup:unreachable:1 <->
\t ts sack bbr wscale:10,10 rto:472 rtt:101.42/39.815 mss:1448 pmtu:1500 rcvmss:536 advmss:1448 cwnd:12 \
ssthresh:934 bytes_sent:1211489592 bytes_retrans:810880 bytes_acked:1208434313 segs_out:837852 segs_in:3365 \
data_segs_out:837850 bbr:(bw:956280bps,mrtt:0.005,pacing_gain:1,cwnd_gain:2) send 1370617bps lastsnd:16 \
lastrcv:3988 lastack:12 pacing_rate 946720bps delivery_rate 956608bps delivered:835795 busy:3796ms unacked:334 \
retrans:11/560 lost:281 sacked:53 dsack_dups:1 reordering:90 reord_seen:1 rcv_space:14480 rcv_ssthresh:64088 \
notsent:3388320 minrtt:0.005 snd_wnd:23419904
"""
SS_PARTED = """\
0      3870504 10.213.1.10:40270 10.213.1.11:5555 timer:(on,912ms,2) ino:4214370 sk:58 cgroup:unreachable:1 <->
\t ts sack bbr wscale:10,10 rto:1856 backoff:2 rtt:90.742/41.24 mss:1448 pmtu:1500 rcvmss:536 advmss:1448 cwnd:1 \
ssthresh:934 bytes_sent:1211495384 bytes_retrans:816672 bytes_acked:1208435761 segs_out:837856 segs_in:3366 \
data_segs_out:837854 bbr:(bw:956280bps,mrtt:0.005,pacing_gain:1,cwnd_gain:2) send 127659bps lastsnd:944 \
lastrcv:6504 lastack:2516 pacing_rate 946720bps delivery_rate 157800bps delivered:835796 busy:6312ms unacked:333 \
retrans:1/564 lost:280 sacked:53 dsack_dups:1 reordering:90 reord_seen:1 rcv_space:14480 rcv_ssthresh:64088 \
notsent:3388320 minrtt:0.005 snd_wnd:23419904
"""


def test_ss_output_parses_into_sockets():
    socks = parse_ss(SS_HEALTHY + SS_SLOW + "ESTAB 0 0 [::ffff:10.0.0.3]:41400 [::ffff:10.0.0.5]:5555 ino:7 <->\n"
                     "\t cubic rtt:1.5/0.7 retrans:0/3\nnot a socket\n")
    assert [s.inode for s in socks] == [4196630, 4196629, 4174503, 4214370, 7]
    busy, idle, _, slow, mapped = socks
    assert (busy.local, busy.local_port, busy.peer, busy.peer_port) == ("10.213.1.12", 53502, "10.213.1.11", 39127)
    assert (busy.rtt_ms, busy.total_retrans, busy.dsack_dups, busy.backoff) == (0.135, 83, 83, 0)
    assert (slow.rtt_ms, slow.rttvar_ms, slow.retrans, slow.total_retrans) == (101.42, 39.815, 11, 560)
    assert (slow.unacked, slow.lost, slow.dsack_dups, slow.bytes_acked) == (334, 281, 1, 1208434313)
    assert idle.bytes_acked == 9 and idle.unacked == 0
    assert (mapped.local, mapped.peer, mapped.total_retrans) == ("10.0.0.3", "10.0.0.5", 3)   # State column
    [parted] = parse_ss(SS_PARTED)
    assert (parted.backoff, parted.unacked, parted.total_retrans) == (2, 333, 564)


def test_per_peer_sums_since_the_previous_sample_and_leaves_loopback_out():
    prev: dict[int, tuple[int, int, int]] = {}
    first = per_peer(parse_ss(SS_HEALTHY + SS_SLOW), prev)
    assert [(s.local, s.peer) for s in first] == [("10.213.1.10", "10.213.1.11"), ("10.213.1.12", "10.213.1.10"),
                                                  ("10.213.1.12", "10.213.1.11")]
    assert all(s.retrans == 0 and s.acked == 0 and s.rtt_ms is None for s in first)   # counted from now
    assert set(prev) == {4196630, 4196629, 4214370}
    [parted] = per_peer(parse_ss(SS_PARTED), prev)
    assert (parted.retrans, parted.acked, parted.rtt_ms) == (0, 1448, 90.742)   # 4 retransmitted: wait
    assert (parted.unacked, parted.backoff, parted.socks) == (333, 2, 1)
    assert set(prev) == {4214370}                               # the others are gone
    [still] = per_peer(parse_ss(SS_PARTED), prev)               # a sample later, none reported a duplicate
    assert (still.retrans, still.acked, still.rtt_ms) == (4, 0, None)
    [again] = per_peer(parse_ss(SS_PARTED), prev)
    assert again.retrans == 0                                   # each counted once


def test_spurious_retransmissions_are_not_losses_even_when_reported_a_sample_later():
    prev: dict[int, tuple[int, int, int]] = {}
    per_peer(parse_ss(SS_HEALTHY), prev)
    more = SS_HEALTHY.replace("retrans:0/83 dsack_dups:83", "retrans:0/90 dsack_dups:85")
    by_peer = {s.peer: s for s in per_peer(parse_ss(more), prev)}
    assert by_peer["10.213.1.11"].retrans == 0                  # 7 retransmitted, 2 reported duplicates so far
    later = more.replace("retrans:0/90 dsack_dups:85", "retrans:0/90 dsack_dups:90")
    assert {s.peer: s.retrans for s in per_peer(parse_ss(later), prev)}["10.213.1.11"] == 0   # the other 5 now
    lost = later.replace("retrans:0/90 dsack_dups:90", "retrans:0/92 dsack_dups:90")
    assert {s.peer: s.retrans for s in per_peer(parse_ss(lost), prev)}["10.213.1.11"] == 0    # 2 retransmitted
    assert {s.peer: s.retrans for s in per_peer(parse_ss(lost), prev)}["10.213.1.11"] == 2    # never reported


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
    assert lw.judge(only, 100.0).machines == []          # one pair slow by its RTT: not yet a machine's link
    second = {k: w for k, w in window(rng, slow="m2").items() if k != "m0|m2"}
    assert lw.judge(second, 101.0).machines == ["m2"]
    assert lw.judge(window(rng, slow="m3"), 200.0).machines == ["m3"]      # the old pairs are forgotten


def test_a_lone_pair_slow_by_its_rtt_names_no_one_and_a_lone_lossy_pair_both_ends():
    rng = random.Random(8)
    lw = fitted(rng)
    for t in range(12):                                   # two of its hosts' processes held off the CPU
        w = window(rng)
        w["m0|m3"] = PairWindow(rtt_ms=0.3 * 20)
        f = lw.judge(w, 100.0 + t)
        assert list(f.pairs) == ["m0|m3"] and f.machines == [] and lw.track(f) == 0
    w = {k: PairWindow(rtt_ms=pw.rtt_ms, retrans=4) for k, pw in window(rng).items()}
    w["m0|m3"] = PairWindow(rtt_ms=0.3 * 20, retrans=4)
    f = lw.judge(w, 112.0)                                # every pair retransmits alike: no pair lost
    assert list(f.pairs) == ["m0|m3"] and f.lossy == [] and f.machines == []
    w = window(rng)
    w["m0|m3"] = PairWindow(rtt_ms=None, retrans=4, stuck=True)
    f = lw.judge(w, 113.0)
    assert f.lossy == ["m0|m3"] and f.machines == ["m0", "m3"]    # it loses packets: a partition


def test_the_sampler_without_ss_is_off_and_samples_nothing(monkeypatch, caplog):
    import stalwart.agent.tcpstats as tcpstats

    monkeypatch.setattr(tcpstats.shutil, "which", lambda name: None)
    with caplog.at_level("INFO", logger="stalwart.agent.tcpstats"):
        sampler = tcpstats.TcpSampler()
    assert sampler.off and "ss not found" in sampler.off
    assert sampler.sample([os.getpid()]) == []
    assert sum("per-peer TCP figures off" in r.getMessage() for r in caplog.records) == 1
