"""The ``flowattn`` command line: one entry point with a sub-command group per testbed.

Building the parsers imports no torch, so ``flowattn --help`` and argument errors answer at
once; a command imports what it runs. Every error the library raises on purpose
(:class:`~flowattn.errors.FlowattnError`) is reported here, once, as one line on stderr with the
error's exit status (2); ``--debug`` anywhere on the command line shows the traceback instead.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Sequence

from .errors import FlowattnError

__all__ = ["main", "build_parser", "OneLineErrorParser"]


class OneLineErrorParser(argparse.ArgumentParser):
    """An argument parser whose usage errors are a single line on stderr (exit status 2)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: ``flowattn [--debug] GROUP COMMAND ...``."""
    from .lm.cli import add_lm_subparsers
    from .repro.cli import add_repro_subparsers
    from .sets.cli import add_sets_subparsers

    parser = OneLineErrorParser(
        prog="flowattn",
        description="Invertible generative modelling with Lipschitz self-attention.",
    )
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of an error (anywhere on the line)")
    groups = parser.add_subparsers(dest="group", metavar="GROUP", required=True,
                                   parser_class=OneLineErrorParser)
    add_sets_subparsers(groups)
    add_lm_subparsers(groups)
    add_repro_subparsers(groups)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status.

    Errors in the input (a bad file, an invalid setting, a run that cannot resume, an inverse
    that does not converge) are reported as one line on stderr with exit status 2; a training
    run that diverged exits with status 3. From a shell:
    ``flowattn lm train --steps 200 --out runs/demo``.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    argv = [str(a) for a in argv]
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args))
    except FlowattnError as err:
        if debug:
            traceback.print_exc()
        command = getattr(args, f"{args.group}_command", "")
        prog = f"flowattn {args.group} {command}".rstrip()
        message = " ".join(str(err).split("\n"))
        print(f"{prog}: error: {message}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc()
        print("interrupted", file=sys.stderr)
        return 130
