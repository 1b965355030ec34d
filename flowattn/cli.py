"""The ``flowattn`` command line: one entry point with a sub-command group per testbed."""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Sequence

from .errors import InverseNotConverged, RunError
from .lm.cli import add_lm_subparsers
from .repro.cli import add_repro_subparsers
from .sets.cli import add_sets_subparsers

__all__ = ["main", "build_parser", "OneLineErrorParser"]


class OneLineErrorParser(argparse.ArgumentParser):
    """An argument parser whose usage errors are a single line on stderr (exit status 2)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: ``flowattn [--debug] GROUP COMMAND ...``."""
    parser = OneLineErrorParser(
        prog="flowattn",
        description="Invertible generative modelling with Lipschitz self-attention.",
    )
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of an error")
    groups = parser.add_subparsers(dest="group", metavar="GROUP", required=True,
                                   parser_class=OneLineErrorParser)
    add_sets_subparsers(groups)
    add_lm_subparsers(groups)
    add_repro_subparsers(groups)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status.

    Errors in the input (a bad file, an invalid option combination, an inverse that does not
    converge) are reported as one line on stderr with exit status 2; ``--debug`` shows the
    traceback instead. From a shell: ``flowattn lm train --steps 200 --out runs/demo``.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args))
    except (ValueError, OSError, RunError, InverseNotConverged) as err:
        if args.debug:
            traceback.print_exc()
        prog = f"flowattn {args.group} {getattr(args, args.group + '_command', '')}".rstrip()
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
