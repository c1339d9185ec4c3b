"""Which one-class model the trace detector uses: a peer-relative density model or an LSTM autoencoder.

    python bench/tracemodel.py [--ranks 8] [--train-steps 600] [--test-steps 300] [--seeds 3] [--epochs 40]

Both learn from the same healthy synthetic traces (`stalwart.sim.traces`: synchronous collectives,
noise on every rank), cut into 0.5 s windows, and judge the same faulty ones: one rank with a slow
compute, a slow collective, a missing collective, a reordered pair; a job slowed alike on every rank
(x1.5 and x3, no fault: must not be flagged); a healthy run of another seed (must not be flagged).
A rank counts as flagged when 2 windows in a row pass the model's threshold (as the detector asks).

- density: `analyzer.traces.DensityModel` over the window's peer-relative features;
- lstm: an LSTM autoencoder (encoder and decoder of `--hidden` units) over each rank's window as a
  sequence of its first 64 operations, each a one-hot of its collective key plus its log gap and log
  duration minus the peers' median for the same transition (the same peer-relative inputs: raw
  timings would flag a uniformly slower job by construction); score: the mean squared
  reconstruction error; threshold: 1.5 x the largest on the healthy windows (as the density model).

Per scenario it prints recall (runs whose faulty rank was flagged), false ranks (healthy ranks
flagged, over all runs), and per model the fit time and the time to score one window of every rank
(one CPU thread).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from statistics import median

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

from stalwart.analyzer.traces import THRESHOLD_MARGIN, DensityModel, RankWindow, window_features  # noqa: E402
from stalwart.protocol import TraceOp  # noqa: E402
from stalwart.sim.traces import Fault, synth  # noqa: E402

WINDOW_S = 0.5
SEQ = 64
SCENARIOS = [("slow-compute", Fault("slow-compute", rank=3, factor=2.0)),
             ("slow-op", Fault("slow-op", rank=3, factor=2.0, op=1)),
             ("missing", Fault("missing", rank=3, op=3)),
             ("reordered", Fault("reordered", rank=3, op=1)),
             ("uniform x1.5", Fault("uniform", factor=1.5)),
             ("uniform x3", Fault("uniform", factor=3.0)),
             ("healthy", None)]


def windows_of(ops: list[tuple[float, int, TraceOp]]) -> list[dict[int, list[TraceOp]]]:
    out: list[dict[int, list[TraceOp]]] = []
    start = ops[0][0]
    for t, r, op in ops:
        i = int((t - start) // WINDOW_S)
        while len(out) <= i:
            out.append({})
        out[i].setdefault(r, []).append(op)
    return out[1:-1]                     # the partial first and last windows


def rank_windows(w: dict[int, list[TraceOp]]) -> dict[int, RankWindow]:
    out: dict[int, RankWindow] = {}
    for r, ops in w.items():
        rw = out.setdefault(r, RankWindow())
        for op in ops:
            rw.add(f"{op.kind}@{op.desc}", op.group, op.dur_ms, op.gap_ms)
    return out


# -- the density model --------------------------------------------------------------------------
class Density:
    def __init__(self, peers):
        self.peers = peers

    def fit(self, wins):
        self.m = DensityModel.fit_rows(row for w in wins
                                       for row in window_features(rank_windows(w), self.peers).values())

    def flags(self, w) -> dict[int, bool]:
        return {r: bool(self.m.score(row)[1]) for r, row in window_features(rank_windows(w), self.peers).items()}


# -- the LSTM autoencoder -----------------------------------------------------------------------
class LSTMAE:
    def __init__(self, peers, hidden: int, epochs: int):
        import torch
        self.torch, self.peers, self.hidden, self.epochs = torch, peers, hidden, epochs
        torch.manual_seed(0)
        torch.set_num_threads(1)

    def encode(self, w) -> dict[int, list[list[float]]]:
        """Each rank's sequence: one-hot key, peer-relative log gap and log duration."""
        med: dict[str, float] = {}
        medd: dict[str, float] = {}
        per: dict[str, list[float]] = {}
        perd: dict[str, list[float]] = {}
        seqs: dict[int, list[tuple[str, float, float | None]]] = {}
        for r, ops in w.items():
            last, seq = None, []
            for op in ops[:SEQ]:
                k = f"{op.kind}@{op.desc}"
                t = f"{last}>{k}"
                g = math.log((op.gap_ms or 0.0) + 0.1)
                d = math.log(op.dur_ms + 0.1) if op.dur_ms is not None else None
                per.setdefault(t, []).append(g)
                if d is not None:
                    perd.setdefault(t, []).append(d)
                seq.append((k, t, g, d))
                last = k
            seqs[r] = seq
        med = {t: median(v) for t, v in per.items()}
        medd = {t: median(v) for t, v in perd.items()}
        out = {}
        for r, seq in seqs.items():
            rows = []
            for k, t, g, d in seq:
                one = [0.0] * len(self.keys)
                if k in self.keys:
                    one[self.keys[k]] = 1.0
                rows.append(one + [g - med[t], (d - medd[t]) if d is not None else 0.0])
            rows += [[0.0] * (len(self.keys) + 2)] * (SEQ - len(rows))
            out[r] = rows
        return out

    def fit(self, wins):
        torch = self.torch
        self.keys = {}
        for w in wins:
            for ops in w.values():
                for op in ops:
                    self.keys.setdefault(f"{op.kind}@{op.desc}", len(self.keys))
        dim = len(self.keys) + 2
        self.enc = torch.nn.LSTM(dim, self.hidden, batch_first=True)
        self.dec = torch.nn.LSTM(self.hidden, self.hidden, batch_first=True)
        self.out = torch.nn.Linear(self.hidden, dim)
        params = list(self.enc.parameters()) + list(self.dec.parameters()) + list(self.out.parameters())
        opt = torch.optim.Adam(params, lr=1e-2)
        x = torch.tensor([s for w in wins for s in self.encode(w).values()])
        for _ in range(self.epochs):
            for i in range(0, len(x), 64):
                b = x[i:i + 64]
                loss = ((self._recon(b) - b) ** 2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
        with torch.no_grad():
            self.threshold = THRESHOLD_MARGIN * float(((self._recon(x) - x) ** 2).mean(dim=(1, 2)).max())

    def _recon(self, b):
        _, (h, _) = self.enc(b)
        z = h[-1].unsqueeze(1).repeat(1, b.shape[1], 1)
        y, _ = self.dec(z)
        return self.out(y)

    def flags(self, w) -> dict[int, bool]:
        torch = self.torch
        enc = self.encode(w)
        ranks = sorted(enc)
        with torch.no_grad():
            x = torch.tensor([enc[r] for r in ranks])
            err = ((self._recon(x) - x) ** 2).mean(dim=(1, 2))
        return {r: float(e) > self.threshold for r, e in zip(ranks, err)}


def judge(model, wins, faulty: int | None) -> tuple[bool, int]:
    """(the faulty rank flagged 2 windows in a row, healthy ranks so flagged)."""
    run: dict[int, int] = {}
    hit: set[int] = set()
    for w in wins:
        for r, bad in model.flags(w).items():
            run[r] = run.get(r, 0) + 1 if bad else 0
            if run[r] >= 2:
                hit.add(r)
    return (faulty in hit) if faulty is not None else False, len(hit - {faulty})


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--train-steps", type=int, default=600)
    ap.add_argument("--test-steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, default=3, help="test runs per scenario")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--hidden", type=int, default=32)
    a = ap.parse_args(argv)
    if a.ranks < 3 or a.seeds < 1:
        ap.error("--ranks must be >= 3 and --seeds >= 1")
    peers = [list(range(a.ranks))]
    train = windows_of(synth(a.ranks, a.train_steps, seed=1))
    models = {"density": Density(peers), "lstm": LSTMAE(peers, a.hidden, a.epochs)}
    fit_s, score_s = {}, {}
    for name, m in models.items():
        t = time.perf_counter()
        m.fit(train)
        fit_s[name] = time.perf_counter() - t
    tests = {name: [windows_of(synth(a.ranks, a.test_steps, seed=100 + s, fault=f)) for s in range(a.seeds)]
             for name, f in SCENARIOS}
    rows = []
    for name, f in SCENARIOS:
        faulty = f.rank if f is not None and f.kind != "uniform" else None
        row = [name]
        for mname, m in models.items():
            res = [judge(m, wins, faulty) for wins in tests[name]]
            recall = f"{sum(h for h, _ in res)}/{len(res)}" if faulty is not None else "-"
            row += [recall, str(sum(n for _, n in res))]
        rows.append(row)
    for mname, m in models.items():
        w = tests["healthy"][0]
        t = time.perf_counter()
        for x in w:
            m.flags(x)
        score_s[mname] = (time.perf_counter() - t) / len(w)
    print(f"{a.ranks} ranks, {len(train)} healthy windows of {WINDOW_S}s to learn from, {a.seeds} runs per scenario "
          f"of {a.test_steps} steps; load average {os.getloadavg()[0]:.1f}\n")
    head = f"{'scenario':<14} | {'density recall':>14} {'false ranks':>11} | {'lstm recall':>11} {'false ranks':>11}"
    print(head + "\n" + "-" * len(head))
    for r in rows:
        print(f"{r[0]:<14} | {r[1]:>14} {r[2]:>11} | {r[3]:>11} {r[4]:>11}")
    print()
    for mname in models:
        print(f"{mname:<8} fit {fit_s[mname]:7.2f} s   score one window of {a.ranks} ranks "
              f"{1e3 * score_s[mname]:7.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
