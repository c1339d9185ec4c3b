"""Live progress of a job for the terminal: a bar with step, loss, steps/s, ETTR, and incidents.

On a terminal the bar is drawn by rich and refreshed in place (incidents print above it); elsewhere
(CI logs, pipes) it is a plain line every 20 steps.
"""
from __future__ import annotations

import sys

from rich.console import Console
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text


class Progress:
    """`target_given`: the user named the job's steps (--steps, a config); otherwise the target is
    shown once the SDK reports steps (it trains that many), never for a plain script, whose steps
    the step hook counts without knowing how many there will be."""

    def __init__(self, stream=None, target_given: bool = True):
        self.target_given = target_given
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.seen_incidents: dict[int, str] = {}
        self.last_line = ""
        self.last_step_printed = -1
        self.live: Live | None = None
        if self.tty:
            self.live = Live(console=Console(file=self.stream, force_terminal=True), auto_refresh=False)
            self.live.start()

    def _bar(self, done: int, total: int, width: int = 28) -> str:
        frac = 0 if not total else min(1.0, done / total)
        n = int(frac * width)
        return "[" + "#" * n + "." * (width - n) + "]"

    def update(self, st: dict) -> None:
        live = st.get("live") or {}
        step = live.get("step") or st.get("steps_completed", 0)   # a new run's first report is not in yet
        script = bool(live.get("script")) or st.get("steps_source") == "script"
        known = not script and (self.target_given or step > 0)
        total = (st.get("steps_target") or 0) if known else 0
        loss = live.get("loss", st.get("final_loss"))
        rate = live.get("steps_per_s")
        line = f"{self._bar(step, total)} step {step}/{total}" if total else f"step {step}"
        line += f"  loss {loss:.4f}" if loss is not None else ""
        line += f"  {rate:.1f} steps/s" if rate else ""
        ettr = f"{st['ettr']:.3f}" if st.get("productive_s") else "-"   # nothing measured before a step
        line += f"  ETTR {ettr}  run {live.get('run', '-')}  [{live.get('state', st['state'])}]"
        if not total and st.get("incidents"):
            line += f"  incidents {len(st['incidents'])}"
        for inc in st.get("incidents", []):
            if inc["mechanism"] is None:
                continue                      # still localizing: say it once it is decided
            key = f"{inc['mechanism']}:{inc['resumed_at']}"
            if self.seen_incidents.get(inc["id"]) != key:
                self.seen_incidents[inc["id"]] = key
                self._print_incident(inc)
        if self.live is not None:
            bar = Table.grid(padding=(0, 1))
            if total:
                bar.add_row(ProgressBar(total=max(1, total), completed=min(step, total), width=28),
                            Text(line.split("] ", 1)[1]))
            else:
                bar.add_row(Text(line))
            self.live.update(bar, refresh=True)
        elif (step // 20 != self.last_step_printed // 20 or (step == total and self.last_step_printed != step)):
            self.stream.write(line + "\n")
            self.last_step_printed = step
        self.last_line = line

    def print_lines(self, lines: list[str]) -> None:
        """Lines of the workers' output, above the bar."""
        if not lines:
            return
        if self.live is not None:
            for line in lines:
                self.live.console.print(Text(line), soft_wrap=True)
            return
        self.stream.write("".join(line + "\n" for line in lines))
        self.stream.flush()

    def _print_incident(self, inc: dict) -> None:
        what = (f"incident {inc['id']}: {inc['symptom']} — suspects {', '.join(inc['machine_suspects']) or '-'}"
                f"; evicted {', '.join(inc['machines_evicted']) or '-'}; {inc['mechanism'] or 'localizing'}")
        if inc.get("detection_s") is not None:
            what += f"; detected {inc['detection_s']:.2f}s after injection"
        if inc.get("resumed_at") is not None:
            what += f"; training resumed at t={inc['resumed_at']:.1f}s"
        if inc.get("cause"):
            what += f"\n    cause: {inc['cause']}"
        if self.live is not None:
            self.live.console.print(Text(what))       # above the bar, which stays at the bottom
            return
        self.stream.write(what + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()


def summary(rep: dict, target_given: bool = True) -> str:
    """The job's end in a few lines. A step target is shown as `Progress` shows it: named by the
    user, or trained to by the SDK; never for steps the step hook counted, nor for a job that
    reported none without a target given."""
    done = rep["steps_completed"]
    script = rep.get("steps_source") == "script"
    target = rep.get("steps_target") if not script and (target_given or done > 0) else None
    steps = f"  steps {done}" + (f"/{target}" if target else "") + (" (counted by the step hook)" if script else "")
    if rep.get("final_loss") is not None:
        steps += f", final loss {rep['final_loss']}"
    lines = [f"job {rep['job']}: {rep['state']}" + (f" ({rep['reason']})" if rep.get("reason") else ""),
             steps,
             f"  wall {rep['wall_s']:.1f}s, productive {rep['productive_s']:.1f}s, ETTR {rep['ettr']:.3f}",
             "  unproductive: " + ", ".join(f"{k} {v:.2f}s" for k, v in rep["unproductive_s"].items() if v)]
    if rep.get("startup_phases"):
        lines.append("  start-up: " + ", ".join(f"{k} {v:.2f}s" for k, v in rep["startup_phases"].items()))
    for inc in rep["incidents"]:
        lines.append(f"  incident {inc['id']}: {inc['symptom']} -> {inc['mechanism']}, evicted "
                     f"{inc['machines_evicted'] or '-'}, detected in "
                     f"{inc['detection_s'] if inc['detection_s'] is not None else '?'}s")
    return "\n".join(lines)
