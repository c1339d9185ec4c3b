"""The import graph of `src/stalwart`: no circles, and no layer imports a higher one.

Every import counts: module level, inside functions, and under `TYPE_CHECKING`. A
`from a.b import c` is an edge to `a.b.c` when that is a module, and to `a.b` always
(Python runs a package's `__init__` before its submodules). Layers are declared in
`LAYERS` (bottom first), the same table as in docs/architecture.md "Layers": a module
may import its own layer and the layers below it.

The imports that still break a rule are listed in `KNOWN_CYCLES` and `KNOWN_UPWARD`,
each with its reason. A new one fails the test; so does a listed one that has gone,
so the lists only shrink.
"""
from __future__ import annotations

import ast
import functools
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

# Bottom first. A module's layer is the entry naming the longest prefix of its dotted
# name ("stalwart" itself names only the package's `__init__`).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundation", ("stalwart", "stalwart.errors", "stalwart.topology", "stalwart.protocol", "stalwart.spec",
                    "stalwart.security", "stalwart.transport", "stalwart.console")),
    ("devices", ("stalwart.devices",)),
    ("analysis", ("stalwart.analyzer", "stalwart.chaos")),
    ("worker", ("stalwart.worker", "stalwart.examples", "stalwart.diag")),
    ("agent", ("stalwart.agent",)),
    ("controller", ("stalwart.controller", "stalwart.dashboard",
                    "stalwart.backends.base", "stalwart.backends.statedir")),
    ("backends", ("stalwart.backends",)),
    ("sim", ("stalwart.sim",)),
    ("cli", ("stalwart.cli",)),
]

# Strongly connected components that remain, as sorted module lists, with the reason.
KNOWN_CYCLES: dict[tuple[str, ...], str] = {
}

# (importer, imported) pairs that point to a higher layer, with the reason.
KNOWN_UPWARD: dict[tuple[str, str], str] = {
}


@functools.cache
def modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for path in (SRC / "stalwart").rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


@functools.cache
def import_graph() -> dict[str, set[str]]:
    mods = modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = defaultdict(set)
    for mod, path in mods.items():
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                if t == "stalwart" or t.startswith("stalwart."):
                    got = resolve(t)
                    if got and got != mod:
                        edges[mod].add(got)
    return edges


def cycles(edges: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: set[tuple[str, ...]] = set()
    nodes = sorted(set(edges) | {w for ws in edges.values() for w in ws})
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.add(tuple(sorted(comp)))
    return found


def layer_of(mod: str) -> int | None:
    best: tuple[int, int] | None = None
    for rank, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            hit = mod == p or (p != "stalwart" and mod.startswith(p + "."))
            if hit and (best is None or len(p) > best[0]):
                best = (len(p), rank)
    return None if best is None else best[1]


def upward(edges: dict[str, set[str]]) -> set[tuple[str, str]]:
    out = set()
    for a, bs in edges.items():
        for b in bs:
            la, lb = layer_of(a), layer_of(b)
            if la is not None and lb is not None and lb > la:
                out.add((a, b))
    return out


def test_every_module_has_a_layer() -> None:
    assert [m for m in sorted(modules()) if layer_of(m) is None] == []


def test_no_new_import_cycle_and_none_listed_has_gone() -> None:
    got = cycles(import_graph())
    assert sorted(got - set(KNOWN_CYCLES)) == [], "new import cycle"
    assert sorted(set(KNOWN_CYCLES) - got) == [], "gone: remove it from KNOWN_CYCLES"


def test_no_new_upward_import_and_none_listed_has_gone() -> None:
    got = upward(import_graph())
    assert sorted(got - set(KNOWN_UPWARD)) == [], "a lower layer imports a higher one"
    assert sorted(set(KNOWN_UPWARD) - got) == [], "gone: remove it from KNOWN_UPWARD"


def test_the_checks_see_a_cycle_and_an_upward_import() -> None:
    edges = {"stalwart.agent.a": {"stalwart.agent.b"}, "stalwart.agent.b": {"stalwart.agent.a"},
             "stalwart.worker.x": {"stalwart.controller.y"}, "stalwart.cli.z": {"stalwart.errors"}}
    assert cycles(edges) == {("stalwart.agent.a", "stalwart.agent.b")}
    assert upward(edges) == {("stalwart.worker.x", "stalwart.controller.y")}


def test_the_layer_table_in_the_docs_is_this_one() -> None:
    page = (SRC.parent / "docs" / "architecture.md").read_text()
    section = page.split("## Layers", 1)[1]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line][1:]
    documented = [(r.split("|")[1].strip(), tuple(sorted(x.strip(" `") for x in r.split("|")[2].split(","))))
                  for r in rows]
    assert documented == [(name, tuple(sorted(p))) for name, p in LAYERS]
