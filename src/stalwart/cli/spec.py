"""The `stalwart spec` commands: `schema` prints the job spec's JSON Schema (the one
docs/jobspec.schema.json holds), for editors and CI that check a job's YAML before it runs;
`check` reads a job spec file and prints it with every default and derived value filled in."""
from __future__ import annotations

import sys

from stalwart.errors import UserError


def cmd_spec_schema(a) -> int:
    from stalwart.spec.schema import schema_text
    sys.stdout.write(schema_text())
    return 0


def cmd_spec_check(a) -> int:
    from stalwart.spec import JobSpec
    try:
        spec = JobSpec.from_yaml(a.config)
    except ValueError as e:
        raise UserError(str(e)) from None
    sys.stdout.write(spec.to_yaml())
    return 0


def add_parsers(sub) -> None:
    s = sub.add_parser("spec", help="the job spec: its JSON Schema, or a spec file checked").add_subparsers(
        dest="spec_cmd", required=True)
    p = s.add_parser("schema", help="print the job spec's JSON Schema (docs/jobspec.md describes the fields)")
    p.set_defaults(fn=cmd_spec_schema)
    c = s.add_parser("check", help="check a job spec file; print it with its defaults and derived values")
    c.add_argument("config", metavar="JOB.yaml")
    c.set_defaults(fn=cmd_spec_check)
