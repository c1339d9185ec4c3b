"""The job spec's JSON Schema, and the field tables of docs/jobspec.md, both from the types.

``msgspec.json.schema`` writes the schema of ``JobSpec`` and ``Policy``; one step follows it:
a field whose type says ``x-or`` (what the decoder's pre-pass also takes: a duration's text, a
command as one string, a number as an environment value) becomes ``anyOf`` the declared type
and that alternative, so a document the schema accepts is a spec ``JobSpec.from_dict`` accepts.

``stalwart spec schema`` prints the schema; ``python -m stalwart.spec.schema --write docs``
rewrites docs/jobspec.schema.json and the generated part of docs/jobspec.md (a unit test
fails when either differs from what the types say).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import msgspec

from stalwart.spec import MAX_FLOAT, MAX_INT, JobSpec
from stalwart.spec.duration import PATTERN as DURATION_PATTERN

SCHEMA_FILE = "jobspec.schema.json"
DOC_FILE = "jobspec.md"
BEGIN = "<!-- fields: generated from the JSON Schema by `python -m stalwart.spec.schema --write docs` -->"
END = "<!-- end of the generated fields -->"
_ANNOTATIONS = ("title", "description", "default")


def _tidy(node: Any) -> Any:
    """`node` with every `x-or` turned into anyOf and descriptions on one line."""
    if isinstance(node, list):
        return [_tidy(n) for n in node]
    if not isinstance(node, dict):
        return node
    node = {k: _tidy(v) for k, v in node.items()}
    if isinstance(node.get("description"), str):
        node["description"] = " ".join(node["description"].split())
    if "x-or" in node:
        alt = node.pop("x-or")
        notes = {k: node.pop(k) for k in _ANNOTATIONS if k in node}
        declared = node["anyOf"] if list(node) == ["anyOf"] else [node]
        node = {**{k: notes[k] for k in ("title", "description") if k in notes},
                "anyOf": [*declared, alt],
                **({"default": notes["default"]} if "default" in notes else {})}
    return node


def components(ref_template: str = "#/$defs/{name}") -> tuple[dict[str, Any], dict[str, Any]]:
    """(the reference to JobSpec, the definitions of JobSpec and Policy) for `ref_template`."""
    (ref,), defs = msgspec.json.schema_components([JobSpec], ref_template=ref_template)
    return ref, _tidy(defs)


def job_schema() -> dict[str, Any]:
    """The job spec's JSON Schema (draft 2020-12), as docs/jobspec.schema.json holds it."""
    ref, defs = components()
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "title": "stalwart job spec", **ref, "$defs": defs}


def schema_text() -> str:
    """The schema as the checked-in file's text."""
    return json.dumps(job_schema(), indent=2) + "\n"


# ----------------------------------------------------------------- the docs' tables
def _number(v: Any) -> str:
    return "2^53-1" if v == MAX_INT else "1e12" if v == MAX_FLOAT else f"{v:g}" if isinstance(v, float) else str(v)


def _type(node: dict[str, Any]) -> str:
    if "anyOf" in node:
        return " or ".join(_type(n) for n in node["anyOf"])
    if "$ref" in node:
        name = node["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{name.lower()})"
    if "enum" in node:
        return " or ".join(f'`{json.dumps(v)}`' for v in node["enum"])
    kind = node.get("type")
    if kind == "array":
        return f"list of {_type(node['items'])}s"
    if kind == "object":
        values = node["additionalProperties"]
        return f"mapping of names to {_type(values)}{'' if 'anyOf' in values else 's'}"
    if kind == "string" and node.get("pattern") == DURATION_PATTERN:
        return 'duration text ("90s", "5m", "1h30m")'
    words = {"integer": "integer", "number": "number", "boolean": "true/false", "string": "string",
             "null": "null"}
    return words.get(str(kind), str(kind))


def _bounds(node: dict[str, Any]) -> list[str]:
    out = []
    for key, op in (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<="),
                    ("exclusiveMaximum", "<")):
        if key in node:
            out.append(f"{op} {_number(node[key])}")
    if "minItems" in node:
        out.append(f"at least {node['minItems']} item{'s' if node['minItems'] > 1 else ''}")
    if node.get("minLength") == 1:
        out.append("not empty")
    if "pattern" in node and node["pattern"] != DURATION_PATTERN:
        out.append(f"matches `{node['pattern']}`")
    if "propertyNames" in node:
        out.append(f"names match `{node['propertyNames']['pattern']}`")
    if node.get("type") == "array" and isinstance(node.get("items"), dict):
        out += [f"each {b}" for b in _bounds(node["items"])]
    for n in node.get("anyOf", ()):
        out += _bounds(n)
    return out


def _table(name: str, struct: dict[str, Any]) -> str:
    rows = [f"### {name}", "", struct.get("description", ""), "",
            "| field | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    required = set(struct.get("required", ()))
    for field, node in struct["properties"].items():
        default = "required" if field in required else \
            f"`{json.dumps(node['default'])}`" if "default" in node else "its defaults"
        allowed = ", ".join(_bounds(node)).replace("|", "\\|")
        meaning = node.get("description", "").replace("|", "\\|")
        rows.append(f"| `{field}` | {_type(node)} | {default} | {allowed} | {meaning} |")
    return "\n".join(rows)


def fields_markdown() -> str:
    """The generated part of docs/jobspec.md: one table per struct, read from the schema."""
    _, defs = components()
    return "\n\n".join(_table(name, defs[name]) for name in ("JobSpec", "Policy"))


def docs_with_fields(doc: str) -> str:
    """`doc` (docs/jobspec.md's text) with its generated part replaced by today's."""
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
    if not pattern.search(doc):
        raise ValueError(f"{DOC_FILE} lacks the markers {BEGIN!r} ... {END!r}")
    return pattern.sub(lambda _: f"{BEGIN}\n\n{fields_markdown()}\n\n{END}", doc)


def write_docs(docs: Path) -> list[Path]:
    """Rewrite docs/jobspec.schema.json and docs/jobspec.md's fields; the files changed."""
    changed = []
    for path, text in ((docs / SCHEMA_FILE, schema_text()),
                       (docs / DOC_FILE, docs_with_fields((docs / DOC_FILE).read_text(encoding="utf-8")))):
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            changed.append(path)
    return changed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stalwart.spec.schema", description=__doc__.split("\n\n")[0])
    p.add_argument("--write", metavar="DOCS_DIR", type=Path,
                   help=f"rewrite DOCS_DIR/{SCHEMA_FILE} and the fields of DOCS_DIR/{DOC_FILE}")
    a = p.parse_args(argv)
    if a.write is None:
        sys.stdout.write(schema_text())
        return 0
    for path in write_docs(a.write):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
