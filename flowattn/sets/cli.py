"""``flowattn sets fit | eval | sample``: density estimation on sets from the command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from ..data import load_dataset, load_npz, save_npz
from ..errors import DataError, RunError
from ..flows.builders import INTERACTIONS
from .config import SetsConfig

__all__ = ["add_sets_subparsers", "main"]


def _fit(args: argparse.Namespace) -> int:
    from .train import fit

    config = SetsConfig.from_file(args.config) if args.config else SetsConfig()
    overrides = {"data": args.data, "flow": args.flow, "steps": args.steps,
                 "batch_size": args.batch_size, "device": args.device, "seed": args.seed,
                 "num_train": args.num_train, "interaction": args.interaction,
                 "blocks": args.blocks}
    config = config.updated(**overrides)
    if args.threads is not None:
        if args.threads < 1:
            raise RunError(f"--threads must be positive, got {args.threads}")
        torch.set_num_threads(args.threads)
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise RunError("--device cuda was requested but no CUDA device is available")
    print(f"fitting a {config.flow} flow to {config.data} for {config.steps} steps -> {args.out}")
    summary = fit(config, args.out, resume=args.resume, progress=not args.no_progress)
    if "test_nll" not in summary:  # a non-main distributed process
        return 0
    line = (f"test NLL: {summary['test_nll']:.4f} nats/set, "
            f"{summary['test_nll_per_dim']:.4f} nats/dim ({summary['test_sets']} sets)")
    if "true_nll" in summary:
        line += (f"; true NLL: {summary['true_nll']:.4f} nats/set, "
                 f"{summary['true_nll_per_dim']:.4f} nats/dim")
    print(line)
    for path in summary.get("plots", []):
        print(f"plot: {path}")
    print(f"checkpoint and metrics: {args.out}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from .train import evaluate, load_flow

    flow, record = load_flow(args.checkpoint, args.device)
    data = load_npz(args.data) if args.data.endswith(".npz") else load_dataset(args.data)["test"]
    spec = record["data"]
    if data.dim != spec["dim"]:
        raise DataError(f"{args.data}: elements have D={data.dim}, the model was fitted to "
                        f"D={spec['dim']}")
    data.zero_com = spec["zero_com"]
    result = evaluate(flow, data)
    result["convention"] = "E-NF (zero centre of mass)" if spec["zero_com"] else "full space"
    print(f"NLL: {result['nll']:.4f} nats/set, {result['nll_per_dim']:.4f} nats/dim "
          f"over {result['num_sets']} sets ({result['convention']})")
    if args.json:
        print(json.dumps(result))
    return 0


def _sample(args: argparse.Namespace) -> int:
    from .train import load_flow

    flow, record = load_flow(args.checkpoint, args.device)
    set_size = args.set_size or record["data"]["set_size"]
    if args.num < 1 or set_size < 1:
        raise RunError(f"--num and --set-size must be positive, got {args.num}, {set_size}")
    out = Path(args.out)
    if not out.parent.is_dir():
        raise RunError(f"cannot write {out}: folder {out.parent} does not exist")
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    with torch.no_grad():
        x = flow.sample(args.num, set_size, None, generator)
    if not torch.isfinite(x).all():
        raise RunError("sampling produced non-finite values")
    save_npz(out, x)
    print(f"wrote {args.num} sets of {set_size} elements to {out}")
    return 0


def add_sets_subparsers(subparsers) -> None:
    """Register ``sets`` and its subcommands on a top-level ``subparsers`` object."""
    sets = subparsers.add_parser("sets", help="density estimation on sets")
    commands = sets.add_subparsers(dest="sets_command", required=True)

    fit = commands.add_parser("fit", help="fit a flow to a collection of sets")
    fit.add_argument("--data", help="built-in data set (gaussian-sets, cluster-sets, dw4, "
                     "lj13) or a .npz file with x (M, N, D) and optional mask (M, N)")
    fit.add_argument("--flow", choices=["resflow", "cnf"])
    fit.add_argument("--interaction", choices=["auto", *INTERACTIONS],
                     help="how elements interact in a resflow: contractive L2 attention, "
                     "radial (E(n)-equivariant pairwise, for particles), or the baselines "
                     "linear and none (default auto: radial for particle data, else attention)")
    fit.add_argument("--blocks", type=int, help="residual blocks")
    fit.add_argument("--out", default="runs/sets", help="output folder (default runs/sets)")
    fit.add_argument("--config", help="JSON file of settings (see SetsConfig)")
    fit.add_argument("--steps", type=int)
    fit.add_argument("--batch-size", type=int)
    fit.add_argument("--num-train", type=int, help="size of a built-in training split")
    fit.add_argument("--device", help="cpu or cuda")
    fit.add_argument("--seed", type=int)
    fit.add_argument("--threads", type=int, help="intra-op CPU threads (default: torch's); on "
                     "a busy machine 1 avoids OpenMP waits on the small kernels of set flows")
    fit.add_argument("--resume", action="store_true", help="continue the run in --out")
    fit.add_argument("--no-progress", action="store_true", help="no progress bar")
    fit.set_defaults(handler=_fit)

    ev = commands.add_parser("eval", help="deterministic NLL of sets under a fitted flow")
    ev.add_argument("--checkpoint", required=True, help="a run folder written by fit")
    ev.add_argument("--data", required=True, help=".npz file (or a built-in name: its test split)")
    ev.add_argument("--device", default="cpu")
    ev.add_argument("--json", action="store_true", help="end with a JSON line of the results")
    ev.set_defaults(handler=_eval)

    sample = commands.add_parser("sample", help="draw new sets by inverting a fitted flow")
    sample.add_argument("--checkpoint", required=True)
    sample.add_argument("--num", type=int, required=True)
    sample.add_argument("--set-size", type=int)
    sample.add_argument("--out", required=True, help="output .npz file")
    sample.add_argument("--seed", type=int, default=0)
    sample.add_argument("--device", default="cpu")
    sample.set_defaults(handler=_sample)


def run_handler(args: argparse.Namespace) -> int:
    """Run a parsed command; known failures become one line on stderr and exit status 2."""
    try:
        return args.handler(args)
    except (DataError, RunError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flowattn")
    add_sets_subparsers(parser.add_subparsers(dest="command", required=True))
    return run_handler(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
