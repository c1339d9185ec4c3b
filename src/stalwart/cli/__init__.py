"""The `stalwart` command, one module per group of subcommands (`services`, `jobs`, `views`, `logs`, and the
backends' and simulator's own). User mistakes end in a one-line `error: …` and a non-zero exit."""
from __future__ import annotations

import argparse
import sys

from stalwart.cli import jobs, logs, services, views
from stalwart.cli.common import UserError, missing_extra_line, resolve_slurm_job
from stalwart.client import ApiError, ControllerUnreachable
from stalwart.errors import StalwartError

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stalwart",
                                description="Keep large PyTorch training jobs training through failures.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING (default), ERROR")
    sub = p.add_subparsers(dest="cmd", required=True)
    _add = sub.add_parser
    sub.add_parser = lambda *a, **kw: _add(*a, parents=[common], **kw)
    services.add_parsers(sub)
    jobs.add_parsers(sub)
    views.add_parsers(sub)
    logs.add_parsers(sub)
    from stalwart.backends.commands import add_commands
    add_commands(sub)        # stalwart slurm …, stalwart k8s …
    from stalwart.sim.command import add_commands as add_sim
    add_sim(sub)             # stalwart sim, stalwart whatif
    whole_names(p)
    return p


def whole_names(parser: argparse.ArgumentParser) -> None:
    """Options are given by their whole name, in every (sub)command: `--port 80` is an unknown
    argument, not `--port-file 80` (argparse takes a unique prefix for the option by default)."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                whole_names(child)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        resolve_slurm_job(args)
        return args.fn(args)
    except ModuleNotFoundError as e:     # an extra this command needs is not installed: say which
        line = missing_extra_line(f"stalwart {args.cmd}", e.name)
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        return 2
    except (UserError, ValueError, StalwartError, ControllerUnreachable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ApiError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # the local cluster could not start: say why, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 1
