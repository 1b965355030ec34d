"""Command-line pieces every training command shares: run options, config printing, reports.

No torch import here: parsers are built from these without loading torch.
"""

from __future__ import annotations

import argparse
import json
import math
import os

from .config import RunConfig, from_sources, given_flags, print_config

__all__ = ["add_run_arguments", "print_run_config", "run_summary_lines", "is_main_process",
           "json_line"]


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
                       help="print every setting (defaults, --config, flags) and exit")
    group.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                       help="progress bar (default: on)")
    group.add_argument("--tensorboard", action=argparse.BooleanOptionalAction, default=True,
                       help="TensorBoard events in the run folder (default: on)")
    group.add_argument("--json", action="store_true",
                       help="end with the summary as one JSON line")


def print_run_config(config_class: type[RunConfig], args: argparse.Namespace) -> int:
    """Print the settings a run with these arguments would use; exit status 0."""
    config = from_sources(config_class, args.config, given_flags(args, config_class))
    print(print_config(config, args.print_config).rstrip())
    return 0


def is_main_process() -> bool:
    """False on every process but the first of a ``torchrun`` launch."""
    return int(os.environ.get("RANK", "0")) == 0


def run_summary_lines(summary: dict) -> list[str]:
    """The lines a command prints for a diverged or already finished run."""
    if summary.get("finished"):
        return [f"the run in {summary['out']} already finished at step {summary['step']}; "
                "nothing to do (resume with a larger --steps to train on)"]
    if summary["diverged"]:
        div = summary["divergence"]
        loss = div.get("loss")
        shown = "nan" if loss is None or not math.isfinite(loss) else f"{loss:.4f}"
        return [f"diverged: {div['reason']} at step {div['step']} (loss {shown}); the "
                f"checkpoint in {summary['out']} keeps the last good state"]
    return []


def _finite(value):
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN
    return value


def json_line(payload: dict) -> str:
    """``payload`` as one line of strict JSON (non-finite numbers become null)."""
    return json.dumps(_finite(payload), allow_nan=False, default=str)
