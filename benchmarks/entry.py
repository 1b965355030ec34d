"""How the benchmark scripts start and stop: a thread count checked by argparse, and flowattn's
refusals (a bad size, norm or data set name) as one line and the library's exit status instead
of a traceback, as the ``flowattn`` command gives them."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from flowattn.errors import FlowattnError

__all__ = ["positive_int", "run_main"]


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (``--threads 0`` or ``-1`` reached torch, which raised).

    Examples:
        >>> positive_int("4")
        4
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def run_main(main: Callable[[], int | None]) -> None:
    """Run a script's ``main`` and exit with its status; a :class:`FlowattnError` is printed as
    ``script: error: message`` and exits with the error's status (2 for refused input), an
    interrupt with 130."""
    name = Path(sys.argv[0]).name
    try:
        status = main()
    except FlowattnError as err:
        print(f"{name}: error: {err.line()}", file=sys.stderr)  # as the flowattn command does
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(status or 0)
