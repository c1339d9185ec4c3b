"""One job in the controller: a thread that takes events from its inbox, asks the job core what to
do, and hands the actions to the executor; the state is saved with them at every transition (and
every second while anything changes, less often where the state is large: SAVE_COST_SHARE), so
a controller killed at any moment can be replaced by one that loads the state and carries on.

A decision is committed before any of its commands leave (a decision that sends something always
saves the state with it). While the store is away the thread waits in the commit (events queue in
the inbox and are handled in order when it returns); the timers that decision set count from when
its commands left (`state.shift_timers`). The thread is supervised: an error in the loop itself is
logged and the loop goes on with the same state.

The runner sees the controller through `job/ports.py` alone (the store to wait on, the clock, the
machines' view its core reads, the parts its executor acts on), never the controller itself."""
from __future__ import annotations

import logging
import queue
import threading
import time

from stalwart.controller.job import actions as A
from stalwart.controller.job import state as S
from stalwart.controller.job.core import JobCore
from stalwart.controller.job.events import JobEvent, Tick
from stalwart.controller.job.executor import Executor
from stalwart.controller.job.ports import JobPorts
from stalwart.controller.supervise import supervised
from stalwart.spec import JobSpec

log = logging.getLogger("stalwart.controller")
TICK_S = 0.2
SAVE_EVERY_S = 1.0
# Saves between transitions (steps, monitoring windows) never take more than this share of the
# job's thread: a job of thousands of machines has a state of megabytes (tens of ms to encode),
# saved less often than every second (at 2,048 machines, every ~2 s: 5% of a core was a tenth of
# the whole controller's CPU); transitions are always saved at once.
SAVE_COST_SHARE = 0.02
WAITED_S = 2.0      # a commit that took longer waited for the store: the decision's timers move


class JobRunner:
    def __init__(self, ports: JobPorts, spec: JobSpec, state: S.JobState):
        self.ports = ports
        self.job_id, self.spec, self.state = state.job_id, spec, state
        self.core = JobCore(spec, ports.cluster)
        self.executor = Executor(ports, state.job_id, spec)
        self.inbox: queue.Queue[JobEvent | list[JobEvent]] = queue.Queue()
        self._saved_key: tuple | None = None
        self._saved_at = 0.0
        self._save_cost = 0.0          # seconds the last save took to encode
        self._save_bytes = 1 << 62     # its size (unknown before the first: written in pieces)
        self._dirty = True
        self._halt = threading.Event()
        self.thread = supervised(f"job-{state.job_id}", self._loop, self._halt, start=False)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """End the loop (the controller closes): the job stays as it is in the store, for the next
        controller to take over. Returns at once; `thread` ends after the event in hand."""
        self._halt.set()
        self.inbox.put([])          # wakes the loop, which dispatches nothing and sees the flag

    def post(self, ev: JobEvent) -> None:
        self.inbox.put(ev)

    def post_many(self, evs: list[JobEvent]) -> None:
        """Several events in order, one wake-up of the job's thread (an agent's batch)."""
        self.inbox.put(evs)

    @property
    def terminal(self) -> bool:
        return self.state.terminal

    def live(self) -> dict:
        return self.core.live(self.state)

    @property
    def waiting(self) -> bool:
        return self.state.phase == S.JobPhase.WAITING

    def held(self) -> set[str]:
        """The machines this job has a role for (slots and standbys); read from other threads
        without a lock: the loop replaces or appends to those lists, never leaves them torn."""
        st = self.state
        return set(st.slots) | set(st.pool.standby)

    # -- the loop ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        self.ports.store.patient()
        next_tick = time.monotonic()
        while not self.state.terminal and not self._halt.is_set():
            try:
                got = self.inbox.get(timeout=max(0.0, next_tick - time.monotonic()))
            except queue.Empty:
                got = Tick()
            batch = got if isinstance(got, list) else [got]
            for ev in batch:
                self.dispatch(ev)
            if not batch:
                continue
            if time.monotonic() >= next_tick and not self.state.terminal:
                if not isinstance(ev, Tick):
                    # timers run even while events keep flowing, but after the events already
                    # queued: a deadline is judged on what arrived before it (a thread that fell
                    # behind, after a store outage or on a loaded host, must not call a machine
                    # silent whose registration waits in its inbox)
                    for _ in range(self.inbox.qsize()):
                        try:
                            more = self.inbox.get_nowait()
                        except queue.Empty:
                            break
                        for one in more if isinstance(more, list) else [more]:
                            self.dispatch(one)
                    if not self.state.terminal:
                        self.dispatch(Tick())
                next_tick = time.monotonic() + TICK_S

    def dispatch(self, ev: JobEvent) -> None:
        now = self.ports.now()
        before = self.state.phase
        try:
            acts = self.core.handle(self.state, ev, now)
        except Exception as e:  # a bug must not leave the job silently stuck
            log.exception("job %s: handling %s failed", self.job_id, type(ev).__name__)
            acts = self.core.failure.finish(self.state, "failed",
                                            f"internal error while handling {type(ev).__name__}: {e}", now)
        if acts or not isinstance(ev, Tick):
            self._dirty = True
        key = self._key()
        every = max(SAVE_EVERY_S, self._save_cost / SAVE_COST_SHARE)
        save = key != self._saved_key or (self._dirty and time.monotonic() - self._saved_at >= every)
        if not save and any(not isinstance(act, A.STORE_ACTIONS) for act in acts):
            save = True         # nothing leaves for an agent that is not committed
        data = None
        if save:
            t0 = time.perf_counter()
            data = S.dumps(self.state, pieces=self._save_bytes > S.ONE_CALL_BYTES)
            self._save_cost = time.perf_counter() - t0
            self._save_bytes = len(data)
        t0 = time.monotonic()
        try:
            self.executor.perform(self.state, acts, data, on_committed=lambda: self._waited(now, t0))
        except Exception as e:
            log.exception("job %s: carrying out %d action(s) failed", self.job_id, len(acts))
            if not self.state.terminal:
                self.executor.perform(self.state, self.core.failure.finish(
                    self.state, "failed", f"internal error while acting on {type(ev).__name__}: {e}", now),
                    S.dumps(self.state))
            return
        if save:
            self._saved_key, self._saved_at, self._dirty = _frozen(key), time.monotonic(), False
        if self.state.phase != before and self.ports.on_phase is not None:
            self.ports.on_phase(self.job_id, self.state.phase.value)

    def _waited(self, now: float, t0: float) -> None:
        """The decision made at `now` is committed: if its commit waited for the store, its
        timers start now, as its commands leave."""
        waited = time.monotonic() - t0
        if waited > WAITED_S:
            moved = S.shift_timers(self.state, now, waited)
            log.warning("job %s: a decision waited %.1fs for the store; %d timer(s) start as its commands "
                        "leave", self.job_id, waited, moved)

    def _key(self) -> tuple:
        """What changes at a transition (saved at once); anything else is saved within a second.
        The machine lists are the live ones, compared element by element with the copies saved
        (`_frozen`): copying them at every event cost 7% of a 2,048-machine job's thread."""
        st = self.state
        inc = st.incident
        return (st.phase, st.run_seq, st.incident_seq, inc.phase if inc else None,
                st.diag.name if st.diag else None, st.replay.phase if st.replay else None,
                st.slots, st.pool.standby, st.version_id, len(st.history),
                len(st.gaps), st.gaps[-1].reconciled_at if st.gaps else None, len(st.awaiting_resume))


def _frozen(key: tuple) -> tuple:
    """A copy of `_key`'s value that later changes to the live lists do not reach."""
    return tuple(list(v) if isinstance(v, list) else v for v in key)
