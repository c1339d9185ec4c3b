"""The `stalwart` command, one module per group of subcommands (`services`, `jobs`, `views`, `logs`, `spec`, and
the backends' and simulator's own). User mistakes end in a one-line `error: …`; the exit code says
what kind of failure it was (`common.EXIT`, documented in docs/cli.md)."""
from __future__ import annotations

import argparse
import os
import sys

from stalwart import __version__
from stalwart.cli import jobs, logs, services, spec, views
from stalwart.cli.common import EXIT, UserError, log_level, missing_extra_line, resolve_slurm_job, setup_logging
from stalwart.transport.client import ApiError, ControllerUnreachable
from stalwart.errors import StalwartError

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stalwart",
                                description="Keep large PyTorch training jobs training through failures.",
                                epilog="exit codes: 0 success, 1 the job failed, 2 usage error, 3 controller "
                                       "unreachable, 4 the controller refused the request, 130 interrupted")
    p.add_argument("--version", action="version", version=f"stalwart {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default="WARNING", type=log_level, metavar="LEVEL",
                        help="DEBUG, INFO, WARNING (default), ERROR or CRITICAL")
    common.add_argument("--log-format", default="text", choices=("text", "json"),
                        help="log lines on stderr as text (default) or one JSON object per line")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    _add = sub.add_parser
    sub.add_parser = lambda *a, **kw: _add(*a, parents=[common], **kw)
    services.add_parsers(sub)
    jobs.add_parsers(sub)
    views.add_parsers(sub)
    logs.add_parsers(sub)
    spec.add_parsers(sub)
    from stalwart.cli import k8s, slurm
    slurm.add_parsers(sub)   # stalwart slurm …
    k8s.add_parsers(sub)     # stalwart k8s …
    from stalwart.sim.command import add_commands as add_sim
    add_sim(sub)             # stalwart sim
    c = sub.add_parser("completion", help="print the shell completion script (bash or zsh)",
                       description="Print a completion script for the shell: `eval \"$(stalwart completion "
                                   "bash)\"` in ~/.bashrc, or `stalwart completion zsh > ~/.zfunc/_stalwart`.")
    c.add_argument("shell", choices=("bash", "zsh"))
    c.set_defaults(fn=lambda a: cmd_completion(p, a))
    whole_names(p)
    return p


def cmd_completion(parser: argparse.ArgumentParser, a) -> int:
    import shtab
    print(shtab.complete(parser, shell=a.shell))
    return EXIT.OK


def whole_names(parser: argparse.ArgumentParser) -> None:
    """Options are given by their whole name, in every (sub)command: `--port 80` is an unknown
    argument, not `--port-file 80` (argparse takes a unique prefix for the option by default)."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                whole_names(child)


def main(argv: list[str] | None = None) -> int:
    args = None
    try:
        args = build_parser().parse_args(argv)      # (a usage error exits 2 here, argparse's own)
        setup_logging(args.log_level, args.log_format)
        resolve_slurm_job(args)
        return args.fn(args)
    except KeyboardInterrupt:
        print("stalwart: interrupted", file=sys.stderr)
        return EXIT.INTERRUPTED
    except BrokenPipeError:     # `stalwart … | head`: the reader left; no traceback at exit either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT.OK
    except ModuleNotFoundError as e:     # an extra this command needs is not installed: say which
        line = missing_extra_line(f"stalwart {getattr(args, 'cmd', '')}".strip(), e.name)
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        return EXIT.USAGE
    except ControllerUnreachable as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT.UNREACHABLE
    except ApiError as e:
        print(f"error: the controller refused: {e}", file=sys.stderr)
        return EXIT.REFUSED
    except RuntimeError as e:  # the local cluster could not start (a StalwartError or not): say why
        print(f"error: {e}", file=sys.stderr)
        return EXIT.JOB_FAILED
    except (UserError, ValueError, StalwartError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT.USAGE
