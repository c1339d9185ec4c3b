"""Training anomalies: NaN/inf or a jump in loss or gradient norm (`anomalies.anomaly`); the
ranks whose local gradient norm is not finite name the machine that corrupted the update."""
from __future__ import annotations

import math

from stalwart.controller.rules.anomalies import anomaly, culprit_machines
from stalwart.controller.job.detectors.base import Actions, BaseDetector
from stalwart.controller.job.flows.base import record
from stalwart.controller.job.state import OPEN_END, BadSteps, JobState, PendingStep

HISTORY_N = 50                  # loss and grad-norm history kept for the jump rule
JUMPS_KEPT = 20                 # jumps remembered, to tell one a restart reproduces


class TrainingAnomalyDetector(BaseDetector):
    name = "training"

    def check_step(self, st: JobState, s: int, acc: PendingStep, now: float) -> Actions | None:
        """NaN/inf or a jump >= loss_jump_factor in loss or grad norm: suspend and open an incident
        (None when the step is fine). The ranks whose LOCAL gradient norm (before the data-parallel
        reduction) is not finite name the machine that corrupted the update."""
        sig = st.signals
        loss, gn = acc.loss, acc.grad_norm
        if loss is None:
            return None
        reason = anomaly(sig.loss_hist + [loss], sig.grad_hist + ([gn] if gn is not None else []) or None,
                         self.ctx.policy.loss_jump_factor)
        if reason is None:
            sig.loss_hist = (sig.loss_hist + [loss])[-HISTORY_N:]
            if gn is not None:
                sig.grad_hist = (sig.grad_hist + [gn])[-HISTORY_N:]
            return None
        local = {r: v for r, v in acc.local.items() if v is not None}
        jumped = gn if gn is not None and "grad norm" in reason else loss
        if jumped is not None and math.isfinite(jumped) and self._reproduced(st, s, jumped):
            # the same jump at the same step after a restart from before it (other machines, or
            # the same ones again): the training's own (its data), not a machine's fault
            sig.loss_hist = (sig.loss_hist + [loss])[-HISTORY_N:]
            if gn is not None:
                sig.grad_hist = (sig.grad_hist + [gn])[-HISTORY_N:]
            return [record("jump_reproduced", now, run=st.run_seq, step=s, reason=reason)]
        culprits = [st.slots[i] for i in culprit_machines(local, self.ctx.topo)] if local else []
        st.bad_steps.append(BadSteps(lo=s, hi=OPEN_END))      # never restore the corrupted state
        # the corrupted steps were no progress: a restart that trains past the NaN again is
        # progress (else independent faults while the job catches up look like a crash loop)
        st.best_steps = min(st.best_steps, s)
        kind = "nan" if "nan" in reason.lower() or "inf" in reason.lower() else "loss_spike"
        acts = self.incidents.open(st, kind, now)
        if st.incident is not None:
            st.incident.implicit_evict = culprits
            st.incident.reason = reason + (f"; non-finite local gradients on {', '.join(culprits)}"
                                           if culprits else "")
        return acts

    @staticmethod
    def _reproduced(st: JobState, step: int, value: float) -> bool:
        """Whether a jump of `value` at `step` was seen before (within 1%); remembers it if not."""
        if any(s == step and abs(v - value) <= 0.01 * abs(v) for s, v in st.jumps):
            return True
        st.jumps = (st.jumps + [(step, value)])[-JUMPS_KEPT:]
        return False
