"""Implicit failures: the job core's detectors (`controller/job/detectors/`: hangs, NaN and loss
jumps, fail-slow rounds, peers that stay unlike each other, collective traces that leave their
learned distribution, machine pairs whose connections misbehave), held here behind one interface.
This flow hands each of them every agent event, committed step and tick, in a fixed order, and asks
nothing else of them."""
from __future__ import annotations

from stalwart import protocol
from stalwart.controller.job.detectors.base import Detector
from stalwart.controller.job.detectors.failslow import FailSlowDetector
from stalwart.controller.job.detectors.links import LinkDetector
from stalwart.controller.job.detectors.hang import ABNORMAL_STATES, TRACE_TIMEOUT_S, HangDetector
from stalwart.controller.job.detectors.peers import PeerDetector, peer_check_period
from stalwart.controller.job.detectors.trace import TraceDetector
from stalwart.controller.job.detectors.training import TrainingAnomalyDetector
from stalwart.controller.job.flows.base import Actions, Ctx, Incidents
from stalwart.controller.job.state import JobPhase, JobState, PendingStep, Signals

__all__ = ["ABNORMAL_STATES", "TRACE_TIMEOUT_S", "ImplicitFlow", "peer_check_period"]


class ImplicitFlow:
    def __init__(self, ctx: Ctx, *, incidents: Incidents):
        self.ctx = ctx
        self.hang = HangDetector(ctx, incidents)
        self.training = TrainingAnomalyDetector(ctx, incidents)
        self.failslow = FailSlowDetector(ctx, incidents)
        self.peers = PeerDetector(ctx, incidents)
        self.trace = TraceDetector(ctx, incidents)
        self.links = LinkDetector(ctx, incidents)
        # the order every hook runs in (a tick stops at the first that stops the run); the hang
        # check comes last, as a hang is what the others did not explain
        self.detectors: tuple[Detector, ...] = (self.training, self.failslow, self.peers, self.trace,
                                                self.links, self.hang)

    def new_run(self, st: JobState, now: float) -> None:
        """A run starts: its throughput, peers and traces are judged afresh (the loss history and
        the fail-slow quiet period carry over, and so does a trace model learned on the same layout)."""
        old = st.signals
        st.signals = Signals(loss_hist=old.loss_hist, grad_hist=old.grad_hist, step_times=old.step_times,
                             failslow_quiet_until=old.failslow_quiet_until, traces=old.traces,
                             links=old.links)
        for d in self.detectors:
            d.new_run(st, now)

    def observe(self, st: JobState, machine: str, ev: protocol.Event, now: float) -> Actions:
        acts: Actions = []
        for d in self.detectors:
            acts += d.observe(st, machine, ev, now)
        return acts

    def training_anomaly(self, st: JobState, s: int, acc: PendingStep, now: float) -> Actions | None:
        """A committed step's NaN or jump (None when the step is fine)."""
        return self.training.check_step(st, s, acc, now)

    def on_committed(self, st: JobState, acc: PendingStep, now: float) -> Actions:
        acts: Actions = []
        for d in self.detectors:
            acts += d.on_committed(st, acc, now)
        return acts

    def tick(self, st: JobState, now: float) -> Actions:
        """Every detector's timer while the run trains."""
        acts: Actions = []
        for d in self.detectors:
            if st.phase != JobPhase.RUNNING:
                break
            acts += d.tick(st, now)
        return acts

    # -- a hang's stack capture (the job is TRACING) ----------------------------------------------
    def trace_tick(self, st: JobState, now: float) -> Actions:
        return self.hang.trace_tick(st, now)

    def finish_trace(self, st: JobState, now: float) -> Actions:
        return self.hang.finish_trace(st, now)
