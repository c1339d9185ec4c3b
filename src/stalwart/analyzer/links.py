"""Which machine's links misbehave: the kernel's per-connection figures compared pair by pair.

Every agent sends, each heartbeat, its workers' TCP connections to the other machines summed per
peer address (`protocol.LinkStat`, agent/tcpstats.py): the largest smoothed RTT among the
connections that had data acknowledged, the retransmissions, the RTO backoff. Here they become, per
window and per **pair of machines** (either end's view; unordered):

- ``rtt``: the largest RTT either end saw (the direction that carried data);
- ``loss``: retransmissions in the window, and whether a connection is backing off with data
  unacknowledged.

A slow link (a bandwidth limit and its queue on one machine's NIC) inflates the RTT of every pair
that crosses it; a flapping NIC makes every pair of its machine retransmit; a partition one pair;
the pairs between healthy machines stay as they were. So, per pair, `LinkModel` learns the healthy
distribution of its log RTT (median and robust spread, as `analyzer.traces` does for collectives)
and its largest retransmissions in a window during the job's first healthy minutes; a pair is
abnormal when it leaves that distribution **and** stands out from the pairs it shares no machine
with (its reference: a busy host, which slows every pair alike, names nothing). The machine common
to the pairs found abnormal in the last MEMORY_S is named (`culprits`): one pair alone names both
its ends when it lost packets (a partition: either end is right), and no one when only its RTT
rose (a machine's link slows all its pairs that carry data).

All of it is pure: `LinkWatch` is the state (saved with the job's signals), its methods are fed the
events and `now`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import median
from typing import Iterable, Sequence

from stalwart import protocol

RTT_MIN_RATIO = 4.0         # a pair is slow only past this many times its healthy RTT ...
RTT_Z = 6.0                 # ... and this many robust spreads of its healthy log RTT ...
RTT_MARGIN = 1.5            # ... and 1.5 x the largest deviation it showed while healthy
SPREAD_FLOOR = 0.2          # log RTT: a healthy spread never below this (scheduling noise)
FRESH_S = 5.0               # a pair's last judged value stays its peers' reference this long
MEMORY_S = 10.0             # a pair found abnormal counts this long when the machine is named
SAMPLES_MAX = 64            # healthy log RTTs kept per pair (thinned evenly)
MIN_SAMPLES = 3             # a pair's RTT is judged once its healthy windows gave this many
LOSS_MIN = 2                # retransmissions in a window past the healthy most by more than this many


def pair_key(a: str, b: str) -> str:
    """The key of an unordered pair of machines."""
    return f"{a}|{b}" if a < b else f"{b}|{a}"


def ends(key: str) -> tuple[str, str]:
    a, _, b = key.partition("|")
    return a, b


@dataclass
class PairWindow:
    """One pair's figures in the open window (the largest RTT, retransmissions, backoff seen)."""
    rtt_ms: float | None = None
    retrans: int = 0
    stuck: bool = False           # a connection backing off with data unacknowledged

    def add(self, s: protocol.LinkStat) -> None:
        if s.rtt_ms is not None and s.rtt_ms > 0:
            self.rtt_ms = max(self.rtt_ms or 0.0, s.rtt_ms)
        self.retrans += max(0, s.retrans)
        self.stuck = self.stuck or (s.backoff > 0 and s.unacked > 0)


@dataclass
class PairModel:
    """One pair's healthy figures: its log RTT's median and spread, the largest deviation and the
    most retransmissions it showed in a window, whether it ever backed off while healthy."""
    center: float
    spread: float
    worst: float
    retrans: int
    stuck: bool = False


@dataclass
class LinkModel:
    pairs: dict[str, PairModel] = field(default_factory=dict)
    windows: int = 0

    @classmethod
    def fit(cls, rtts: dict[str, list[float]], retrans: dict[str, int], windows: int,
            stuck: Iterable[str] = ()) -> "LinkModel":
        m = cls(windows=windows)
        stuck = set(stuck)
        for k in set(rtts) | set(retrans):
            vs = rtts.get(k, [])
            if len(vs) >= MIN_SAMPLES:
                c = median(vs)
                spread = max(1.4826 * median(abs(v - c) for v in vs), SPREAD_FLOOR)
                worst = max(abs(v - c) for v in vs)
            else:
                c, spread, worst = math.nan, SPREAD_FLOOR, 0.0
            m.pairs[k] = PairModel(center=c, spread=spread, worst=worst, retrans=retrans.get(k, 0),
                                   stuck=k in stuck)
        return m

    def bound(self, key: str) -> float:
        """How far (log RTT) above its healthy median a pair must be to be slow."""
        pm = self.pairs[key]
        return max(math.log(RTT_MIN_RATIO), RTT_Z * pm.spread, RTT_MARGIN * pm.worst)


@dataclass
class Finding:
    """A window's verdict: the abnormal pairs (key -> what was wrong) and the machines named."""
    pairs: dict[str, str]
    machines: list[str]
    lossy: list[str] = field(default_factory=list)    # the pairs named for their losses

    @property
    def loss(self) -> bool:
        """Some pair was named for its losses (not only for its RTT)."""
        return bool(self.lossy)


def culprits(abnormal: Iterable[str]) -> list[str]:
    """The machines to name for a set of abnormal pairs (pure): the machine common to all of them; a
    single pair: both its ends; none common: the machines in the most pairs, if in at least two and
    not every machine ties."""
    pairs = [ends(k) for k in abnormal]
    if not pairs:
        return []
    if len(pairs) == 1:
        return sorted(pairs[0])
    common = set(pairs[0]).intersection(*pairs[1:])
    if common:
        return sorted(common)
    count: dict[str, int] = {}
    for a, b in pairs:
        count[a] = count.get(a, 0) + 1
        count[b] = count.get(b, 0) + 1
    top = max(count.values())
    best = sorted(m for m, n in count.items() if n == top)
    return best if top >= 2 and len(best) < len(count) else []


def _reference(key: str, values: dict[str, float]) -> float | None:
    """What a pair is compared with: the median of the pairs it shares no machine with; without
    any, the lowest of the other pairs; None when no other pair has a value."""
    a, b = ends(key)
    disjoint = [v for k, v in values.items() if k != key and not set(ends(k)) & {a, b}]
    if disjoint:
        return median(disjoint)
    others = [v for k, v in values.items() if k != key]
    return min(others) if others else None


def judge(model: LinkModel, window: dict[str, PairWindow], recent: dict[str, float],
          known: Sequence[str]) -> Finding:
    """The abnormal pairs of a closed window (pure; module docstring). `recent`: each pair's log-RTT
    deviation last judged within FRESH_S (this window's included), the references of the slow test;
    `known`: every pair of the job (a lossy pair is compared with those that did not lose)."""
    out: dict[str, str] = {}
    named_lossy: list[str] = []
    for key, w in window.items():
        if key not in model.pairs or w.rtt_ms is None or key not in recent:
            continue
        dev = recent[key]
        ref = _reference(key, recent)
        bound = model.bound(key)
        if ref is not None and dev > bound and dev - ref > bound:
            healthy = math.exp(model.pairs[key].center)
            out[key] = f"RTT {w.rtt_ms:.1f} ms, {math.exp(dev):.0f}x its healthy {healthy:.2f} ms"
    lossy = {k for k, w in window.items() if k in model.pairs and (w.retrans > loss_bound(model.pairs[k])
                                                                     or (w.stuck and not model.pairs[k].stuck))}
    for key in lossy:
        a, b = ends(key)
        others = [k for k in known if k != key and not set(ends(k)) & {a, b}] or [k for k in known if k != key]
        if others and not all(k in lossy for k in others):
            w = window[key]
            what = f"{w.retrans} retransmissions" + (", backing off with data unacknowledged" if w.stuck else "")
            out[key] = (out[key] + "; " if key in out else "") + what
            named_lossy.append(key)
    return Finding(pairs=out, machines=culprits(out), lossy=sorted(named_lossy))


def loss_bound(pm: PairModel) -> int:
    """The retransmissions in a window past which a pair loses (twice its healthy most, and at
    least LOSS_MIN more)."""
    return max(2 * pm.retrans, pm.retrans + LOSS_MIN)


@dataclass
class LinkWatch:
    """The link detector's state for one job: which address is which machine, the open window, the
    healthy values learned so far, the model once fitted, and each named set's run of windows."""
    window_s: float
    train_s: float
    machines: list[str] = field(default_factory=list)
    owner: dict[str, str] = field(default_factory=dict)            # address -> machine
    window_end: float = 0.0
    train_until: float = 0.0
    current: dict[str, PairWindow] = field(default_factory=dict)
    rtts: dict[str, list[float]] = field(default_factory=dict)     # healthy log RTTs per pair
    retrans: dict[str, int] = field(default_factory=dict)          # healthy max retransmissions per window
    stuck: list[str] = field(default_factory=list)                 # pairs that backed off while healthy
    learned: int = 0
    model: LinkModel | None = None
    last: dict[str, tuple[float, float]] = field(default_factory=dict)   # pair -> (deviation, when)
    abnormal: dict[str, float] = field(default_factory=dict)             # pair -> when last found so
    lost: dict[str, float] = field(default_factory=dict)                 # ... for its losses
    named: tuple[str, ...] = ()
    streak: int = 0
    last_alert: dict[str, float] = field(default_factory=dict)

    def start(self, now: float, warmup_s: float) -> None:
        self.window_end = now + self.window_s
        if self.model is None and not self.train_until:
            self.train_until = now + warmup_s + self.train_s

    def add(self, machine: str, links: Iterable[protocol.LinkStat]) -> None:
        """One machine's sample: its addresses are learned from its own side of the connections."""
        links = list(links)
        for s in links:
            self.owner[s.local] = machine
        for s in links:
            peer = self.owner.get(s.peer)
            if peer is None or peer == machine:
                continue
            self.current.setdefault(pair_key(machine, peer), PairWindow()).add(s)

    def known_pairs(self) -> list[str]:
        ms = sorted(set(self.machines) | set(self.owner.values()))
        return [pair_key(a, b) for i, a in enumerate(ms) for b in ms[i + 1:]]

    def close(self, now: float) -> dict[str, PairWindow]:
        closed, self.current = self.current, {}
        self.window_end = now + self.window_s
        return closed

    def learn(self, window: dict[str, PairWindow]) -> None:
        self.learned += 1
        for k, w in window.items():
            self.retrans[k] = max(self.retrans.get(k, 0), w.retrans)
            if w.stuck and k not in self.stuck:
                self.stuck.append(k)
            if w.rtt_ms is not None:
                kept = self.rtts.setdefault(k, [])
                kept.append(math.log(w.rtt_ms))
                if len(kept) > SAMPLES_MAX:
                    self.rtts[k] = kept[::2]

    def fit(self) -> LinkModel:
        self.model = LinkModel.fit(self.rtts, self.retrans, self.learned, self.stuck)
        self.rtts, self.retrans, self.stuck = {}, {}, []
        return self.model

    def judge(self, window: dict[str, PairWindow], now: float) -> Finding:
        """This window's finding; the pairs' deviations are kept FRESH_S as references."""
        model = self.model
        assert model is not None
        for k, w in window.items():
            pm = model.pairs.get(k)
            if pm is not None and w.rtt_ms is not None and not math.isnan(pm.center):
                self.last[k] = (math.log(w.rtt_ms) - pm.center, now)
        for k in [k for k, (_, t) in self.last.items() if now - t > FRESH_S]:
            del self.last[k]
        recent = {k: d for k, (d, _) in self.last.items()}
        found = judge(model, window, recent, self.known_pairs())
        # the machines are named from the pairs found abnormal within MEMORY_S: with a slow link the
        # ring nearly stops, and one window may see only one of the culprit's pairs carry data
        for k in found.pairs:
            self.abnormal[k] = now
        for k in found.lossy:
            self.lost[k] = now
        for seen in (self.abnormal, self.lost):
            for k in [k for k, t in seen.items() if now - t > MEMORY_S]:
                del seen[k]
        if found.pairs:
            # one pair slow by its RTT alone names no one: a machine's slow link or NIC slows every
            # pair of it that carries data, and a partition loses; a lone pair's RTT that left its
            # healthy range is its two hosts' scheduling (delayed acknowledgements on a loaded
            # host: a healthy pair measured 5x its healthy RTT for two windows) or its path
            alone = len(self.abnormal) == 1 and not self.lost
            found.machines = [] if alone else culprits(self.abnormal)
        return found

    def track(self, finding: Finding) -> int:
        """How many windows in a row named the same machines (0: none named now)."""
        named = tuple(finding.machines)
        self.streak = self.streak + 1 if named and named == self.named else (1 if named else 0)
        self.named = named
        return self.streak
