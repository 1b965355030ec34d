"""Command-line pieces every training command shares: run options, config printing, reports.

No torch import here: parsers are built from these without loading torch.
"""

from __future__ import annotations

import argparse
import json
import os

from .config import RunConfig, from_sources, given_flags, print_config
from .metrics import json_safe

__all__ = ["add_run_arguments", "print_run_config", "run_summary_lines", "is_main_process",
           "json_line", "seed", "add_threads", "counted"]


def counted(count: int, noun: str) -> str:
    """``count`` and ``noun``, plural but for one (a regular plural: ``noun + "s"``).

    Examples:
        >>> counted(1, "set"), counted(3, "block")
        ('1 set', '3 blocks')
    """
    return f"{count:,} {noun}" + ("" if count == 1 else "s")


def add_threads(parser: argparse.ArgumentParser) -> None:
    """``--threads N``: torch's intra-op threads for a command that loads a run (evaluation,
    sampling); a training command has its own setting."""
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's; "
                        "on a shared or small machine, 1 is often much faster)")


def add_run_arguments(parser: argparse.ArgumentParser, default_out: str) -> None:
    """``--out``, ``--resume``, ``--config``, ``--print-config`` and the reporting switches."""
    group = parser.add_argument_group("run")
    group.add_argument("--out", default=default_out, metavar="DIR",
                       help="run folder: checkpoint, metrics, summary (default: %(default)s)")
    group.add_argument("--resume", action="store_true",
                       help="continue the run in --out with its stored settings; flags may "
                       "change only how long it trains and how it reports")
    group.add_argument("--config", metavar="FILE",
                       help="settings from a JSON or YAML file (flat keys, or nested by "
                       "section; --print-config lists every key); flags override it")
    group.add_argument("--print-config", nargs="?", const="yaml", choices=("yaml", "json"),
                       help="print every setting (defaults, --config, flags) and exit; checks "
                       "that need the data (a width the heads divide, say) come when a run "
                       "loads it")
    group.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                       help="progress bar (default: on)")
    group.add_argument("--tensorboard", action=argparse.BooleanOptionalAction, default=None,
                       help="TensorBoard events in the run folder (default: on; a resumed run "
                       "keeps its own choice)")
    group.add_argument("--json", action="store_true",
                       help="end with the summary as one JSON line (summary.json's "
                       "content; a finished run resumed adds finished: true)")


def seed(text: str) -> int:
    """An argparse type: a seed from 0 to 2^64 - 1, the range of a run's ``seed`` setting (and
    one ``torch.manual_seed`` takes); anything else is a usage error naming the value."""
    value = int(text)  # not an integer: argparse reports "invalid seed value"
    if not 0 <= value <= 2**64 - 1:
        raise argparse.ArgumentTypeError(f"a seed must lie between 0 and 2^64 - 1, got "
                                         f"{value}")
    return value


def print_run_config(config_class: type[RunConfig], args: argparse.Namespace,
                     kind: str) -> int:
    """Print the settings a run with these arguments would use (with ``--resume``: the stored
    ones of the run in ``--out``, with the flags that may change); exit status 0."""
    flags = given_flags(args, config_class)
    if args.resume:
        from .run import plan_run  # reads the run's checkpoint: torch

        config = plan_run(args.out, kind, config_class, resume=True, file=args.config,
                          flags=flags).config
    else:
        config = from_sources(config_class, args.config, flags)
    print(print_config(config, args.print_config).rstrip())
    return 0


def is_main_process() -> bool:
    """False on every process but the first of a ``torchrun`` launch."""
    return int(os.environ.get("RANK", "0")) == 0


def run_summary_lines(summary: dict) -> list[str]:
    """The lines a command prints for an already finished run (a diverged one has been
    reported by the training loop, once)."""
    if summary.get("finished"):
        return [f"the run in {summary['out']} already finished at step {summary['step']}; "
                "nothing to do (resume with a larger --steps to train on)"]
    return []


def json_line(payload: dict) -> str:
    """``payload`` as one line of strict JSON (non-finite numbers become null)."""
    return json.dumps(json_safe(payload), allow_nan=False, default=str)
