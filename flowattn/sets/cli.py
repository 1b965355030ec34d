"""``flowattn sets fit | eval | sample | floor``: density estimation on sets from the command line.

The parsers are built without importing torch (``--help`` answers at once); each command
imports what it runs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..errors import DataError, InputError
from ..training.cli import (
    add_run_arguments,
    add_threads,
    counted,
    is_main_process,
    json_line,
    print_run_config,
    run_summary_lines,
    seed,
)
from ..training.config import add_arguments, from_sources, given_flags
from .config import SetsRunConfig, check_applicable

__all__ = ["add_sets_subparsers"]


def _fit(args: argparse.Namespace) -> int:
    flags = given_flags(args, SetsRunConfig)
    if not args.resume:  # settings typed for a flow that would not read them
        check_applicable(flags, from_sources(SetsRunConfig, args.config, flags))
    if args.print_config:  # (what training would refuse, it refuses too)
        return print_run_config(SetsRunConfig, args, "sets")
    from ..training.loop import EXIT_DIVERGED
    from .train import fit

    summary = fit(out=args.out, resume=args.resume, file=args.config,
                  flags=flags, progress=args.progress,
                  tensorboard=args.tensorboard)
    if not is_main_process():
        return EXIT_DIVERGED if summary["diverged"] else 0
    lines = run_summary_lines(summary)
    if not summary["diverged"] and not summary.get("finished"):
        split = summary.get("test_split", "test")
        name = "test NLL" if split == "test" else f"{split} NLL (the data have no test split)"
        line = (f"{name}: {summary['test_nll']:.4f} nats/set, "
                f"{summary['test_nll_per_dim']:.4f} nats/dim "
                f"({counted(summary['test_sets'], 'set')}, "
                f"{_logdet_note(summary.get('test_logdet'), summary.get('test_nll_per_dim_se'))}"
                f"{_sampling_note(summary.get('test_nll_per_dim_sampling_se'))})")
        if "true_nll" in summary:
            line += (f"; true NLL: {summary['true_nll']:.4f} nats/set, "
                     f"{summary['true_nll_per_dim']:.4f} nats/dim")
        lines.append(line)
        lines += [f"plot: {path}" for path in summary.get("plots", [])]
        lines.append(f"checkpoint and metrics: {summary['out']}")
    for line in lines:
        print(line)
    if args.json:
        print(json_line(summary))
    return EXIT_DIVERGED if summary["diverged"] else 0


def _logdet_note(logdet: str | None, se: float | None) -> str:
    """How the reported NLL's log-determinants were computed, with the standard error."""
    if logdet == "exact":
        return "exact log-det"
    if se is None:
        return "estimated log-det, standard error unknown"
    # large sets reach errors far below 1e-4 per dimension: print their digits, not 0.0000
    value = f"{se:.4f}" if se == 0 or se >= 1e-4 else f"{se:.1e}"
    return f"estimated log-det, standard error {value} nats/dim"


def _sampling_note(se: float | None) -> str:
    """The standard error of the mean over the scored sets, or nothing for a single set."""
    return "" if se is None else f"; sampling error {se:.4f} nats/dim over the sets"


def _load(args: argparse.Namespace):
    """The run's flow on ``--device`` (checked first), with ``--threads`` set."""
    from ..training.device import resolve_device, set_threads
    from .train import load_flow

    device = resolve_device(args.device)
    set_threads(args.threads)
    return (*load_flow(args.checkpoint, device), device)


def _eval(args: argparse.Namespace) -> int:
    from ..data import DATASETS, load_dataset, load_npz
    from ..training.run import data_fingerprint
    from .train import evaluate

    if args.batch_size < 1:
        raise InputError(f"--batch-size must be >= 1, got {args.batch_size}")
    flow, record, device = _load(args)
    if args.divergence != "auto":
        _set_eval_divergence(flow, args.divergence, record)
    if args.symmetry != "auto":
        flow.symmetry = args.symmetry
    if args.data not in DATASETS and (args.data.endswith(".npz") or Path(args.data).exists()):
        data = load_npz(args.data)
    else:  # a built-in name (before a file or folder of that name, as for fit): its test
        # split; the fitted run's own (its seed and set size)
        fitted, own = record["config"], record["config"].data.data == args.data
        data = load_dataset(args.data, seed=fitted.train.seed if own else 0,
                            set_size=fitted.data.set_size if own else None)["test"]
    spec = record["data"]
    if data.dim != spec["dim"]:
        raise DataError(f"{args.data}: elements have D={data.dim}, the model was fitted to "
                        f"D={spec['dim']}")
    data.zero_com = spec["zero_com"]
    if data.zero_com and data.set_size < 2:
        raise DataError(f"{args.data}: sets of one element have no degrees of freedom in the "
                        "zero-centre-of-mass space the model was fitted in")
    result = evaluate(flow, data, batch_size=args.batch_size, device=device,
                      progress=not args.no_progress)
    result["convention"] = "E-NF (zero centre of mass)" if spec["zero_com"] else "full space"
    result["density"] = ("mirror average" if flow.symmetry == "reflections"
                         else "the flow's own")
    mirrored = (f"; the mirror average over the {2 ** data.dim} reflections through the axes"
                if flow.symmetry == "reflections" else "")
    print(f"NLL: {result['nll']:.4f} nats/set, {result['nll_per_dim']:.4f} nats/dim "
          f"over {counted(result['num_sets'], 'set')} ({result['convention']}{mirrored}; "
          f"{_logdet_note(result['logdet'], result['nll_per_dim_se'])}"
          f"{_sampling_note(result['nll_per_dim_sampling_se'])})")
    fitted_to = (record.get("data_fingerprint") or {}).get("sha256")
    if fitted_to is not None and Path(args.data).is_file() and \
            data_fingerprint(args.data)["sha256"] == fitted_to:
        print(f"note: {args.data} is the file the run was fitted to: these sets include its "
              "training sets (the NLL fit reports is of the held-out tenth alone)")
    if args.json:
        print(json.dumps(result))
    return 0


def _set_eval_divergence(flow, divergence: str, record: dict) -> None:
    """Score a continuous flow with ``divergence`` ("exact" or "hutchinson") instead of the
    run's own choice; anything else has no divergence to choose."""
    for cnf in _solvers(flow, record):
        cnf.eval_divergence = divergence


def _solvers(flow, record: dict) -> list:
    """The continuous flows in ``flow``, or a one-line error for a flow without a trace."""
    from ..flows.continuous.cnf import CNF

    solvers = [m for m in flow.modules() if isinstance(m, CNF)]
    if not solvers:
        raise InputError(f"--divergence chooses a continuous flow's trace; {record['path']} "
                         f"holds a {record['config'].flow.flow} flow (its log-dets are its own)")
    return solvers


def _sample(args: argparse.Namespace) -> int:
    import torch

    from ..data import save_npz
    from ..errors import NonFiniteError
    from ..files import check_output_file
    from ..progress import progress_batches

    if args.num < 1:
        raise InputError(f"--num must be positive, got {args.num}")
    if args.set_size is not None and args.set_size < 1:
        raise InputError(f"--set-size must be positive, got {args.set_size}")
    if args.batch_size is not None and args.batch_size < 1:
        raise InputError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.divergence is not None and not args.energy:
        raise InputError("--divergence chooses the trace of the log-density that --energy "
                         "weights; without --energy no log-density is computed")
    if args.energy and args.num < 2:
        raise InputError(f"--energy needs --num >= 2 (an error needs two weights), got "
                         f"{args.num}")
    out = check_output_file(args.out, ".npz")
    flow, record, device = _load(args)
    fitted = record["config"].data.data  # a built-in name, or the data file's path
    if out.exists() and out.resolve() == Path(fitted).resolve():
        raise InputError(f"--out {out} is the data file this run was fitted to: the samples "
                         "would overwrite it (and the run could no longer resume or be "
                         "checked against it); write them to another file")
    set_size = args.set_size or record["data"]["set_size"]
    _check_samples_fit(args.num, set_size, record["data"]["dim"], device)
    if args.energy:
        return _sample_weighted(args, flow, record, device, out)
    counts = record["data"].get("size_counts") if args.set_size is None else None
    generator = torch.Generator(device=device).manual_seed(args.seed)
    masks = None if counts is None else _size_masks(args.num, counts, generator)
    with torch.no_grad():
        x = torch.cat([flow.sample(len(batch), set_size,
                                   None if masks is None else
                                   masks[batch.start:batch.stop], generator)
                       for batch in progress_batches(args.num, args.batch_size or SAMPLE_BATCH,
                                                     "sampling", not args.no_progress, "set")])
    if masks is not None:
        x = x.masked_fill(~masks.unsqueeze(-1), 0.0)  # the padding holds zeros
    if not torch.isfinite(x).all():
        raise NonFiniteError("sampling produced non-finite values")
    save_npz(out, x, masks)
    smallest, largest = (set_size, set_size) if masks is None else \
        (int(masks.sum(1).min()), int(masks.sum(1).max()))
    if masks is None:
        sizes = counted(set_size, "element")
        if record["data"].get("variable_size") and args.set_size is None:
            sizes += (" (the largest training size: this run's checkpoint records no size "
                      "distribution; --set-size chooses one)")
    else:
        sizes = (f"{smallest}-{largest} elements (sizes drawn as often as in training; "
                 "written with a mask)")
    print(f"wrote {counted(args.num, 'set')} of {sizes} to {out}")
    if args.json:
        print(json.dumps({"out": str(out), "num": args.num, "set_size": set_size,
                          "dim": int(x.shape[-1]), "dtype": str(x.dtype).removeprefix("torch."),
                          "masked": masks is not None, "min_size": smallest,
                          "max_size": largest}))
    return 0


def _size_masks(num: int, counts: list[int], generator):
    """Masks of ``num`` sets whose sizes are drawn from the training split's: n elements with
    probability counts[n - 1] / sum(counts), the first n positions present."""
    import torch

    from ..data.sets import size_mask

    weights = torch.tensor(counts, dtype=torch.float64, device=generator.device)
    sizes = torch.multinomial(weights, num, replacement=True, generator=generator) + 1
    return size_mask(sizes, len(counts))


#: below this many effective samples (or annealing chains) the reweighted estimates and their
#: errors are reported with a warning
MIN_EFFECTIVE = 30
#: sets drawn at a time by ``sets sample`` (and scored, with --energy, by most flows)
SAMPLE_BATCH = 1000
#: with --energy, a continuous flow scored with the exact trace takes batches of about this
#: many vector-Jacobian products per field evaluation (N D per configuration)
EXACT_TRACE_PRODUCTS = 512


def energy_batch_size(flow, dims: int, divergence: str = "exact") -> int:
    """Configurations scored at a time by ``sets sample --energy`` unless ``--batch-size``
    says: :data:`SAMPLE_BATCH`, or for a continuous flow whose log-density takes the exact
    trace (``divergence``; N D vector-Jacobian products per configuration and field
    evaluation, every configuration of a batch solved together)
    :data:`EXACT_TRACE_PRODUCTS` // (N D).

    Measured on one CPU core: an LJ13 flow (N D = 39) took about 5 s per configuration in
    batches of 10 and over 10 s in batches of 100; a DW4 flow (N D = 8) the same 0.12-0.13 s
    in batches of 10, 100 and 1000.
    """
    from ..flows.continuous.cnf import CNF

    if divergence == "exact" and any(isinstance(m, CNF) for m in flow.modules()):
        return max(1, EXACT_TRACE_PRODUCTS // dims)
    return SAMPLE_BATCH


def _particle_system(record: dict):
    """The built-in particle system a checkpoint's flow was fitted to, or a one-line error."""
    from ..data import PARTICLE_SYSTEMS

    source = record["config"].data.data
    if source not in PARTICLE_SYSTEMS or not record["data"]["zero_com"]:
        known = ", ".join(sorted(PARTICLE_SYSTEMS))
        raise DataError(f"--energy needs a flow fitted to a built-in particle system "
                        f"({known}); this one was fitted to {source!r}, whose energy is "
                        "unknown")
    return PARTICLE_SYSTEMS[source]


def _check_samples_fit(num: int, set_size: int, dim: int, device) -> None:
    """Refuse a draw whose sets would not fit in memory before drawing any: they are held
    together (on ``device``, then as the written array on the host), 4 bytes a number each."""
    import torch

    from ..training.memory import available_memory, byte_amount

    needed = 2 * num * set_size * dim * 4
    for where in {device, torch.device("cpu")}:
        free = available_memory(where)
        if free is not None and needed > free:
            raise InputError(f"{counted(num, 'set')} of {counted(set_size, 'element')} in "
                             f"R^{dim} take {byte_amount(needed)} as they are drawn and "
                             f"written, and {byte_amount(free)} is available ({where}): "
                             "draw fewer or smaller sets per call (--num, --set-size; calls "
                             "with other --seed values draw other sets)")


def _sample_weighted(args: argparse.Namespace, flow, record: dict, device, out: Path) -> int:
    import numpy as np
    import torch

    from ..files import atomic_write
    from .boltzmann import boltzmann_sample, boltzmann_summary

    system = _particle_system(record)
    if args.set_size is not None and args.set_size != system.particles:
        raise InputError(f"--set-size {args.set_size} with --energy: {system.name} has "
                         f"{system.particles} particles")
    flow = flow.double()  # weights in float64: exp(-E) / q spans many nats
    divergence = args.divergence or "exact"  # boltzmann_sample sets it on the solvers
    if args.divergence is not None:  # refused for flows without a trace, as by eval
        _solvers(flow, record)
    if divergence == "hutchinson":
        print("log q with Hutchinson's trace (one probe per configuration): unbiased, but the "
              "weights exp(-E - log q) are not; the ESS and reweighted estimates below carry "
              "that bias")
    generator = torch.Generator(device=device).manual_seed(args.seed)
    batch_size = args.batch_size or energy_batch_size(flow, system.particles * system.dim,
                                                      divergence)
    sample = boltzmann_sample(flow, system.energy, args.num, system.particles, generator,
                              batch_size=batch_size, progress=not args.no_progress,
                              divergence=divergence)
    arrays = {name: getattr(sample, name).cpu().numpy()
              for name in ("x", "log_w", "energy", "log_q")}
    atomic_write(out, lambda handle: np.savez(handle, **arrays))
    summary = boltzmann_summary(sample)
    print(f"wrote {args.num} configurations of {system.name} to {out}, with log importance "
          "weights log_w = -E - log q, energy and log_q")
    print(f"Kish ESS: {summary['ess']:.4f} of the samples ({summary['ess_samples']:.1f} of "
          f"{args.num})")
    print(f"mean energy: {summary['mean_energy']:.3f} ± {summary['mean_energy_error']:.3f} "
          f"reweighted (self-normalised, delta-method error); "
          f"{summary['sample_mean_energy']:.3f} unweighted")
    print(f"log Z: {summary['log_z']:.3f} ± {summary['log_z_error']:.3f} (mean weight)")
    print(f"pairs closer than {summary['hard_core']}: in {summary['close_pairs']:.2%} of the "
          f"samples; reweighted {summary['close_pairs_reweighted']:.2%} ± "
          f"{summary['close_pairs_reweighted_error']:.2%}")
    print(f"so the test NLL is at least {summary['close_pairs_kl']:.3f} nats above the entropy "
          "floor (KL >= kl(p(close) || q(close)))")
    if summary["ess_samples"] < MIN_EFFECTIVE:
        print(f"warning: only {summary['ess_samples']:.1f} effective samples: the reweighted "
              "estimates and their errors are unreliable")
    if args.json:
        print(json.dumps({"system": system.name, "out": str(out), **summary}))
    return 0


def _floor(args: argparse.Namespace) -> int:
    from ..data.partition import system_floor
    from ..training.device import set_threads

    for flag, value, least in (("--chains", args.chains, 2), ("--stages", args.stages, 1)):
        if value is not None and value < least:
            raise InputError(f"{flag} must be >= {least}, got {value}")
    set_threads(args.threads)
    floor = system_floor(args.data, chains=args.chains, stages=args.stages, seed=args.seed,
                         progress=not args.no_progress)
    z = floor.partition
    print(f"{args.data}: log Z = {z.log_z:.3f} ± {z.log_z_error:.3f} (AIS, {z.chains} chains, "
          f"ESS {z.ess:.3f}; weighted mean energy {z.mean_energy:.3f} ± "
          f"{z.mean_energy_error:.3f})")
    print(f"test split: mean energy {floor.mean_energy:.3f} ± {floor.mean_energy_error:.3f} "
          f"over {floor.configurations} configurations")
    print(f"entropy floor: {floor.nll:.3f} ± {floor.error:.3f} nats/configuration, "
          f"{floor.nll_per_dim:.4f} nats/dim (E-NF convention)")
    effective = z.ess * z.chains
    if effective < MIN_EFFECTIVE:
        print(f"warning: only {effective:.1f} effective chains: log Z, the floor and their "
              "errors are unreliable (more --chains or --stages)")
    if args.json:
        print(json.dumps({"data": args.data, "nll": floor.nll, "error": floor.error,
                          "nll_per_dim": floor.nll_per_dim, "mean_energy": floor.mean_energy,
                          "mean_energy_error": floor.mean_energy_error, "log_z": z.log_z,
                          "log_z_error": z.log_z_error, "ess": z.ess,
                          "ais_mean_energy": z.mean_energy,
                          "ais_mean_energy_error": z.mean_energy_error}))
    return 0


def add_sets_subparsers(subparsers) -> None:
    """Register ``sets`` and its commands ``fit``, ``eval``, ``sample`` and ``floor``."""
    sets = subparsers.add_parser("sets", help="density estimation on sets",
                                 description="Fit flows to collections of sets, score sets "
                                 "under them and sample new ones.")
    commands = sets.add_subparsers(dest="sets_command", metavar="COMMAND", required=True)

    fit = commands.add_parser(
        "fit", help="fit a flow to a collection of sets",
        description="Fit a flow to sets and report the test NLL. Settings come from the "
        "defaults, then --config FILE (JSON or YAML), then the flags; --print-config shows "
        "them all.")
    add_run_arguments(fit, default_out="runs/sets")
    add_arguments(fit, SetsRunConfig)
    fit.set_defaults(handler=_fit)

    ev = commands.add_parser(
        "eval", help="deterministic NLL of sets under a fitted flow",
        description="Score sets under a flow fitted by 'flowattn sets fit': the NLL per set and "
        "per dimension, with the log-det exact where N D allows it, otherwise estimated with "
        "its standard error; the same number fit reports for its test split.")
    _add_checkpoint(ev)
    ev.add_argument("--data", required=True, help=".npz file (or a built-in name: its test "
                    "split, the one the run was scored on if it was fitted to that data set)")
    ev.add_argument("--batch-size", type=int, default=256, help="sets per batch (default: "
                    "%(default)s)")
    ev.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (default: "
                    "%(default)s)")
    add_threads(ev)
    ev.add_argument("--divergence", choices=("auto", "exact", "hutchinson"), default="auto",
                    help="continuous flows: the trace in the log-det (auto: the run's "
                    "eval_divergence; hutchinson: one probe per set, far cheaper for large "
                    "N D, its noise in the sampling error; default: %(default)s)")
    ev.add_argument("--symmetry", choices=("auto", "none", "reflections"), default="auto",
                    help="the density scored: the flow's own (none), or its average over the "
                    "2^D mirror images through the coordinate axes (reflections; a density "
                    "for any flow, better for data whose density those reflections keep); "
                    "auto: the run's own symmetry (default: %(default)s)")
    ev.add_argument("--no-progress", action="store_true", help="no report of the sets scored "
                    "(a bar on a terminal, a line a minute in a log)")
    ev.add_argument("--json", action="store_true", help="end with a JSON line of the results")
    ev.set_defaults(handler=_eval)

    sample = commands.add_parser(
        "sample", help="draw new sets by inverting a fitted flow",
        description="Draw sets from a flow fitted by 'flowattn sets fit' (base draws mapped "
        "through the flow's inverse) and write them to an .npz file: x (K, N, D), and a mask "
        "(K, N) for sets of several sizes.")
    _add_checkpoint(sample)
    sample.add_argument("--num", type=int, required=True, help="number of sets to draw")
    sample.add_argument("--set-size", type=int, help="elements per set (default: the training "
                        "sets' size; for sets of several sizes, sizes drawn as often as they "
                        "were in training, written with a mask)")
    sample.add_argument("--out", required=True, help="output .npz file")
    sample.add_argument("--seed", type=seed, default=0, help="seed of the base draws (and of "
                        "the set sizes drawn; default: %(default)s)")
    sample.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (default: "
                        "%(default)s)")
    sample.add_argument("--energy", action="store_true", help="particle systems (dw4, lj13, "
                        "lj55): also write log importance weights -E - log q and report the "
                        "ESS and reweighted estimates (all in float64, x too: the flow is "
                        "evaluated in float64 for them; without --energy x is in the flow's "
                        "own precision)")
    sample.add_argument("--divergence", choices=("exact", "hutchinson"), help="with "
                        "--energy, a continuous flow's trace in log q (default: exact, "
                        "whatever the run scores with; hutchinson: one probe, affordable for "
                        "large systems, but the weights exp(-E - log q) are then biased)")
    sample.add_argument("--json", action="store_true", help="end with a JSON line of what "
                        "was written (with --energy, of the estimates)")
    add_threads(sample)
    sample.add_argument("--batch-size", type=int, help="sets drawn (and, with --energy, "
                        "scored) at a time (default: 1000; with --energy, a continuous flow "
                        "scored with the exact trace: 512 // (N D), e.g. 13 for LJ13)")
    sample.add_argument("--no-progress", action="store_true", help="no report of the sets "
                        "drawn (a bar on a terminal, a line a minute in a log)")
    sample.set_defaults(handler=_sample)

    floor = commands.add_parser(
        "floor", help="entropy floor of a particle system's test split",
        description="The NLL a perfect model scores on the test split of dw4 or lj13: its mean "
        "energy plus log Z by annealed importance sampling, with standard errors (on the "
        "CPU).")
    floor.add_argument("--data", required=True,
                       help="dw4 or lj13 (lj55 has no annealing settings yet)")
    floor.add_argument("--chains", type=int, help="annealing chains (default: the system's)")
    floor.add_argument("--stages", type=int, help="annealing stages (default: the system's)")
    floor.add_argument("--seed", type=seed, default=0, help="seed of the annealing chains "
                       "(default: %(default)s)")
    add_threads(floor)
    floor.add_argument("--no-progress", action="store_true", help="no progress bars")
    floor.add_argument("--json", action="store_true", help="end with a JSON line of the results")
    floor.set_defaults(handler=_floor)


def _add_checkpoint(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, metavar="RUN",
                        help="a run folder written by fit (or its checkpoint file)")
