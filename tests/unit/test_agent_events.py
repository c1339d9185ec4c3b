"""The agent builds the events it sends from `protocol`'s types, never from dict literals: a
misspelt or retired field then fails where the event is made, not silently at the controller."""
from __future__ import annotations

import ast
from pathlib import Path

import msgspec

from stalwart import protocol as p
from stalwart.agent.monitor import to_event
from stalwart.agent.probes.base import HealthEvent

AGENT = Path(__file__).resolve().parents[2] / "src" / "stalwart" / "agent"


def test_no_event_of_the_agent_is_a_dict_literal():
    found = []
    for path in sorted(AGENT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Dict)
                    and (getattr(node.func, "attr", None) or getattr(node.func, "id", None)) == "emit"):
                found.append(f"{path.relative_to(AGENT.parent)}:{node.lineno}")
    assert found == [], f"events built as dicts: {found}"


def test_a_probe_finding_travels_as_the_controller_decodes_it():
    h = HealthEvent("gpu", "gpu_xid", "fatal", True, {"device": 0, "xid": 79}, 5.0)
    wire = msgspec.to_builtins(to_event(h))
    assert wire["type"] == "health" and wire["severity"] == "fatal"
    ev = p.decode_event(wire)
    assert isinstance(ev, p.Health) and ev.severity is p.Severity.FATAL and ev.machine_certain
