"""The ``flowattn repro`` command: run a reproduction and write its figure, table and numbers."""

from __future__ import annotations

import argparse
from typing import Any

from ..training.cli import seed
from . import REPRODUCTIONS, run_reproduction

__all__ = ["add_repro_subparsers", "describe"]


def add_repro_subparsers(subparsers) -> None:
    """Register ``repro NAME [--full | --quick] [--out DIR] [--seed S] [--threads T]``."""
    listing = "; ".join(f"{r.name} ({r.paper})" for r in REPRODUCTIONS.values())
    p = subparsers.add_parser(
        "repro",
        help="reproduce a figure or table of Kim et al. (2021)",
        description="Reproduce an experiment of Kim, Papamakarios & Mnih, 'The Lipschitz "
        f"constant of self-attention' (ICML 2021): {listing}; 'all' runs each in turn. Writes "
        "NAME.png, NAME.csv and NAME.json to --out (NAME with - as _, e.g. "
        "bound_tightness.png). The default grid is sized for a laptop CPU (minutes); --full "
        "uses the paper's settings where they are known.",
    )
    p.add_argument(
        "repro_command",
        metavar="NAME",
        choices=(*REPRODUCTIONS, "all"),
        help=f"one of: {', '.join(REPRODUCTIONS)}, all",
    )
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--full",
        dest="grid",
        action="store_const",
        const="full",
        help="the paper's grid (slow on a CPU)",
    )
    size.add_argument(
        "--quick",
        dest="grid",
        action="store_const",
        const="quick",
        help="a tiny grid that runs in seconds (a smoke test, not a result)",
    )
    p.add_argument(
        "--out", default="repro", metavar="DIR", help="output folder (default: %(default)s)"
    )
    p.add_argument("--seed", type=seed, help="replace the grid's seed")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    p.set_defaults(grid="default", handler=_run)


def _run(args: argparse.Namespace) -> int:
    from ..training.device import set_threads

    set_threads(args.threads)
    names = list(REPRODUCTIONS) if args.repro_command == "all" else [args.repro_command]
    for name in names:
        result = run_reproduction(name, grid=args.grid, out=args.out, seed=args.seed)
        for line in describe(result):
            print(line)
    return 0


def describe(result: Any) -> list[str]:
    """Human-readable lines: what ran, the headline numbers, the files written."""
    repro = REPRODUCTIONS[result.name]
    lines = [
        f"{result.name} ({repro.paper}, {result.grid} grid, {result.seconds:.1f} s): "
        f"{repro.description}"
    ]
    for key, value in result.summary.items():
        if _is_scalar(value):
            lines.append(f"  {key}: {_fmt(value)}")
        elif isinstance(value, dict) and all(
            _is_scalar(v) or isinstance(v, list) for v in value.values()
        ):
            lines.append(f"  {key}: " + ", ".join(f"{k}={_fmt(v)}" for k, v in value.items()))
    for kind, path in result.files.items():
        lines.append(f"  {kind}: {path}")
    return lines


def _is_scalar(value) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _fmt(value) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
