"""`stalwart status --watch`: the job's state, refreshed in place on a terminal (rich), one plain line
per change elsewhere (CI logs, pipes). Ends when the job is no longer running."""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

STATE_STYLE = {"running": "green", "succeeded": "blue", "failed": "red", "cancelled": "red"}


def _f(v, fmt: str = ".3f") -> str:
    return "-" if v is None else format(v, fmt)


def _counts(rep: dict) -> dict[str, int]:
    out: dict[str, int] = {}
    for m in rep.get("machines", []):
        out[m["state"]] = out.get(m["state"], 0) + 1
    return out


def plain_line(rep: dict) -> str:
    """One line of the job's state, for logs."""
    live = rep.get("live") or {}
    counts = ", ".join(f"{n} {s}" for s, n in sorted(_counts(rep).items()))
    target = f"/{rep['steps_target']}" if rep.get("steps_target") else ""      # none for a plain script
    return (f"job {rep['job']} {live.get('state', rep['state'])}: step {live.get('step', rep['steps_completed'])}"
            f"{target} loss {_f(live.get('loss', rep.get('final_loss')), '.4f')} "
            f"{_f(live.get('steps_per_s'), '.1f')} steps/s ETTR {_f(rep.get('ettr'))} "
            f"(sliding {_f(rep.get('window_ettr'))}) machines: {counts or '-'}; "
            f"incidents {len(rep.get('incidents', []))}")


def incident_line(inc: dict) -> str:
    return (f"incident {inc['id']}: {inc['symptom']} -> {inc['mechanism'] or 'localizing'}; evicted "
            f"{', '.join(inc['machines_evicted']) or '-'}" + (f"; cause: {inc['cause']}" if inc.get("cause") else ""))


def render(rep: dict) -> Group:
    """The rich view: header, progress bar, numbers, machines, the last incidents."""
    live = rep.get("live") or {}
    state = live.get("state", rep["state"])
    step, total = live.get("step", rep["steps_completed"]), rep.get("steps_target") or 0
    head = Text.assemble(("stalwart ", "bold"), (rep["job"], "bold cyan"), "  ",
                         (state, f"bold {STATE_STYLE.get(state, 'yellow')}"),
                         (f"  ({rep['reason']})" if rep.get("reason") else "", "red"))
    nums = Table.grid(padding=(0, 3))
    for _ in range(6):
        nums.add_column()
    nums.add_row("step", "loss", "steps/s", "ETTR", "sliding ETTR", "wall")
    nums.add_row(f"{step}/{total}", _f(live.get("loss", rep.get("final_loss")), ".4f"),
                 _f(live.get("steps_per_s"), ".1f"), _f(rep.get("ettr")), _f(rep.get("window_ettr")),
                 f"{rep.get('wall_s', 0):.1f} s")
    machines = Text(", ".join(f"{n} {s}" for s, n in sorted(_counts(rep).items())) or "-")
    evicted = [m for m in rep.get("machines", []) if m["state"] == "evicted"]
    bar = Table.grid(padding=(0, 1))
    bar.add_row(ProgressBar(total=max(1, total), completed=min(step, total), width=50),
                f"{100 * min(step, total) / max(1, total):.0f}%")
    parts: list = [head, bar, nums,
                   Text.assemble(("machines: ", "bold"), machines)]
    for m in evicted[-5:]:
        parts.append(Text(f"  {m['id']} evicted: {m.get('reason') or '-'}", style="red"))
    incs = rep.get("incidents", [])
    if incs:
        t = Table("id", "symptom", "mechanism", "evicted", "detected (s)", "cause", title="incidents",
                  title_justify="left", expand=False)
        for i in incs[-5:]:
            t.add_row(str(i["id"]), i["symptom"], i["mechanism"] or "localizing",
                      ", ".join(i["machines_evicted"]) or "-", _f(i.get("detected_at"), ".1f"),
                      (i.get("cause") or "")[:80])
        parts.append(t)
    return Group(*parts)


def watch(fetch: Callable[[], dict], interval: float = 1.0, stream: TextIO | None = None,
          tty: bool | None = None, max_polls: int | None = None) -> int:
    """Poll ``fetch()`` every ``interval`` seconds until the job stops running (or ``max_polls``)."""
    stream = stream or sys.stdout
    tty = stream.isatty() if tty is None else tty
    polls = 0
    if tty:
        console = Console(file=stream, force_terminal=True)
        with Live(console=console, auto_refresh=False, transient=False) as view:
            while True:
                rep = fetch()
                polls += 1
                view.update(render(rep), refresh=True)
                if rep["state"] != "running" or (max_polls is not None and polls >= max_polls):
                    return 0
                time.sleep(interval)
    last, seen = "", dict[int, str]()
    while True:
        rep = fetch()
        polls += 1
        for inc in rep.get("incidents", []):
            line = incident_line(inc)
            if seen.get(inc["id"]) != line:
                seen[inc["id"]] = line
                stream.write(line + "\n")
        line = plain_line(rep)
        if line != last:
            stream.write(f"{time.strftime('%H:%M:%S')} {line}\n")
            stream.flush()
            last = line
        if rep["state"] != "running" or (max_polls is not None and polls >= max_polls):
            return 0
        time.sleep(interval)
