"""Every error stalwart raises on purpose is a `StalwartError`: callers (the API, the channel, the
CLI) can tell an error stalwart meant from a bug with one `except`, and the API answers each with
its status. Private control-flow exceptions (a leading underscore) and the protocol's message
types are not errors raised to callers."""
from __future__ import annotations

import ast
import pathlib

import stalwart
from stalwart.cli import main

SRC = pathlib.Path(stalwart.__file__).parent
BUILTIN = {"Exception", "RuntimeError", "ValueError", "OSError", "LookupError", "KeyError", "TypeError"}


def _classes() -> dict[str, tuple[str, list[str]]]:
    """name -> (file, base names) of every class in src/stalwart."""
    out: dict[str, tuple[str, list[str]]] = {}
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""
                         for b in node.bases]
                out[node.name] = (str(path.relative_to(SRC)), bases)
    return out


def test_every_public_exception_is_a_stalwart_error():
    classes = _classes()

    def family(name: str, seen: frozenset = frozenset()) -> bool:
        if name == "StalwartError":
            return True
        if name in seen or name not in classes:
            return False
        return any(family(b, seen | {name}) for b in classes[name][1])

    def exception(name: str, seen: frozenset = frozenset()) -> bool:
        if name in BUILTIN:
            return True
        if name in seen or name not in classes:
            return False
        return any(exception(b, seen | {name}) for b in classes[name][1])

    outside = sorted(f"{where}: {name}" for name, (where, bases) in classes.items()
                     if not name.startswith("_") and any(exception(b) for b in bases) and not family(name)
                     and where not in ("transport/websocket.py",))       # (the WebSocket layer's own frame errors)
    assert outside == [], outside


def test_a_runtime_failure_keeps_its_exit_code_and_one_line(monkeypatch, capsys):
    """A StalwartError that is a RuntimeError (the cluster could not start) exits 1, a mistake 2."""
    from stalwart.backends.local import NetworkUnavailable
    from stalwart.cli import views

    def fail(_a):
        raise NetworkUnavailable("--isolate-network: unavailable here: needs root (uid 1000)")
    monkeypatch.setattr(views, "report", fail)
    assert main(["status", "--state-dir", "/nonexistent-stalwart-test"]) == 1
    assert capsys.readouterr().err == "error: --isolate-network: unavailable here: needs root (uid 1000)\n"
