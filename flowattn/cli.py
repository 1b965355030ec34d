"""The ``flowattn`` command line: one entry point with a sub-command group per testbed.

Building the parsers imports no torch, so ``flowattn --help`` and argument errors answer at
once; a command imports what it runs. Every error the library raises on purpose
(:class:`~flowattn.errors.FlowattnError`) is reported here, once, as one line on stderr with the
error's exit status (2); ``--debug`` anywhere on the command line shows the traceback instead.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import sys
import threading
import traceback
from collections.abc import Sequence
from pathlib import Path

from .errors import FlowattnError

__all__ = ["main", "build_parser", "OneLineErrorParser"]


class OneLineErrorParser(argparse.ArgumentParser):
    """An argument parser whose usage errors are a single line on stderr (exit status 2).

    Every such parser records itself as the namespace's ``command_parser``; the innermost one
    that parsed (the command's) wins, so an unknown flag is reported by the command it was
    given to."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.set_defaults(command_parser=self)

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
    that does not converge) are reported as one line on stderr with exit status 2, as are
    settings too large for the machine's memory; a training run that diverged exits with status
    3; a file the system would not read or write during a command (its run folder removed,
    say) is one line with exit status 74 (``EX_IOERR``). From a shell:
    ``flowattn lm train --steps 200 --out runs/demo``.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    argv = [str(a) for a in argv]
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    command_parser = vars(args).pop("command_parser", parser)
    if unknown:
        command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    command = getattr(args, f"{args.group}_command", "")
    prog = f"flowattn {args.group} {command}".rstrip()
    # a scheduler's stop (SIGTERM) as Ctrl-C; signals can be set in the main thread only
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
    try:
        if not getattr(args, "print_config", None):  # every command but these imports torch
            _import_torch()
        return int(args.handler(args))
    except FlowattnError as err:
        if debug:
            traceback.print_exc()
        print(f"{prog}: error: {err.line()}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt as err:
        if debug:
            traceback.print_exc()
        print(f"{prog}: {'terminated' if isinstance(err, Terminated) else 'interrupted'}"
              f"{_resumable(args, prog)}", file=sys.stderr)
        return 143 if isinstance(err, Terminated) else 130
    except BrokenPipeError:  # standard output closed by its reader (`| head`)
        with contextlib.suppress(OSError):  # no second error when Python flushes it at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print(f"{prog}: stopped: its standard output was closed by the program reading it"
              f"{_resumable(args, prog)}", file=sys.stderr)
        return 141
    except (OSError, RuntimeError) as err:
        reason = _machine_failure(err)
        if reason is None:  # a defect: its traceback
            raise
        if debug:
            traceback.print_exc()
        print(f"{prog}: error: {reason}{_resumable(args, prog)}", file=sys.stderr)
        return 2 if isinstance(err, RuntimeError) else 74  # sysexits' EX_IOERR
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def _import_torch() -> None:
    """Import torch with Ctrl-C and SIGTERM held back until it is in place: interrupted inside
    its import, torch is left half initialised, and what follows (the interrupt's own report,
    or the interpreter's exit) fails with an unrelated error or aborts."""
    from .files import signals_deferred

    with signals_deferred():
        import torch  # noqa: F401


def _machine_failure(err: BaseException) -> str | None:
    """One line for a failure of the machine under a command, or None for anything else: a
    file that could not be read or written (the run folder removed or unwritable during a run),
    or memory that could not be allocated (settings too large for this machine)."""
    if isinstance(err, OSError):
        where = f" ({err.filename})" if err.filename else ""
        return f"the file system refused: {err.strerror or err}{where}"
    text = str(err)
    import torch

    out_of_memory = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)  # < 2.5
    if isinstance(err, out_of_memory) or "can't allocate memory" in text:
        asked = re.search(r"allocate (\d+) bytes", text)
        what = (f"one tensor of {int(asked.group(1)) / 2**30:,.1f} GiB could not be allocated"
                if asked else " ".join(text.split("\n")[0].split()))
        return (f"out of memory: {what} (the settings ask for more memory than this machine "
                "has: use smaller sizes)")
    return None


class Terminated(KeyboardInterrupt):
    """SIGTERM received: the command stops as on Ctrl-C (exit status 143)."""


def _terminate(signum, frame):
    raise Terminated


def _resumable(args: argparse.Namespace, prog: str) -> str:
    """For a training command whose run folder holds a checkpoint: how to continue it."""
    from .training.checkpoint import CHECKPOINT, checkpoint_step

    out = getattr(args, "out", None)
    if not hasattr(args, "resume") or out is None or not (Path(out) / CHECKPOINT).is_file():
        return ""
    step = checkpoint_step(Path(out) / CHECKPOINT)
    return (f"; the run continues from its checkpoint{'' if step is None else f' of step {step}'}"
            f" with `{prog} --out {out} --resume`")
