"""Density estimation on sets: test NLL, training and sampling time per data set and flow.

Variants: ``resflow`` (the residual flow ``flowattn sets fit`` trains by default: contractive
attention with equivariant linear layers, or the data set's own defaults, e.g. radial blocks on
particles and ``repulsive-sets``), ``attention`` and ``radial`` (the residual flow with that
interaction, whatever the data's defaults), ``linear`` (attention left out: elements interact
only through the equivariant linear maps), ``iid`` (no interaction at all: the i.i.d.-points
baseline), ``no-location``
(``resflow`` without the spline flow of each set's centroid), ``attention-splines``,
``linear-splines`` and ``iid-splines`` (8 blocks with an element-wise spline coupling each,
``--splines``; attention with 2 heads), ``lifted-splines`` (the same with lifted attention,
``--attention-width 16`` and 4 heads), ``cnf`` (continuous flow with
an L2-attention field), ``coupling`` (set-coupling layers), ``small``, ``medium`` and ``large``
(the ``--preset`` settings) and ``nflows-maf``: the flattened baseline
(:mod:`flowattn.sets.baseline`), an nflows masked rational-quadratic autoregressive flow on the
N D vector of a set, trained on a fresh random element order per batch for the wall-clock time
of the flowattn variant run before it on the same data (or ``--baseline-seconds``), keeping its
best validation state, and scored on the same test split under its symmetrisation over
``--orders`` random element orders. Sets of several sizes are skipped for it (a flow on vectors
has one length; the row says so). Every run uses the same budget and seed; the table reports
NLL per degree of freedom next to the true value where it is known (synthetic sets) or the
published reference (DW4: 7.48 per configuration for the E(n)-equivariant flow; LJ13: the
~16.9 floor), and, for synthetic sets, the best NLL of any model of i.i.d. elements (the exact
one-element marginal applied to every element): what a flow gains below it comes from
interactions.

    python benchmarks/sets.py                                     # synthetic sets, all variants
    python benchmarks/sets.py --data shape-sets shape-sets-varsize repulsive-sets \
        --variants resflow linear iid                             # sets that need interactions
    python benchmarks/sets.py --data dw4 --num-train 100000 --steps 4000 --variants resflow
    python benchmarks/sets.py --data shape-sets --variants large nflows-maf  # side by side
    python benchmarks/sets.py --data shape-sets --variants large nflows-maf \
        --symmetry reflections                          # both averaged over mirror images
    python benchmarks/sets.py --data repulsive-sets \
        --variants attention linear iid resflow nflows-maf   # resflow: radial, its default
    python benchmarks/sets.py --data shape-sets \
        --variants attention-splines linear-splines iid-splines nflows-maf
    python benchmarks/sets.py --quick
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from entry import positive_int, run_main

from flowattn.data import DATASETS, load_dataset
from flowattn.sets import SetsRunConfig, fit, load_flow

REFERENCE_NLL = {"dw4": 7.48, "lj13": 16.9}  # per configuration, E-NF convention
VARIANTS = {
    "resflow": {"flow": "resflow"},
    "attention": {"flow": "resflow", "interaction": "attention"},
    "radial": {"flow": "resflow", "interaction": "radial"},
    "linear": {"flow": "resflow", "interaction": "linear"},
    "iid": {"flow": "resflow", "interaction": "none"},
    "no-location": {"flow": "resflow", "location": False},
    # residual flows with an element-wise spline coupling in each of 8 blocks (--splines)
    "attention-splines": {"flow": "resflow", "interaction": "attention", "splines": True,
                          "blocks": 8, "heads": 2},
    "linear-splines": {"flow": "resflow", "interaction": "linear", "splines": True, "blocks": 8},
    "iid-splines": {"flow": "resflow", "interaction": "none", "splines": True, "blocks": 8},
    # the same with lifted attention: 4 heads among 16 learnt features of each element
    "lifted-splines": {"flow": "resflow", "interaction": "attention", "splines": True,
                       "blocks": 8, "heads": 4, "attention_width": 16},
    "cnf": {"flow": "cnf"},
    "coupling": {"flow": "coupling"},
    "small": {"preset": "small"},
    "medium": {"preset": "medium"},
    "large": {"preset": "large"},
    "nflows-maf": {},  # the flattened baseline: run_baseline
}
BASELINE = "nflows-maf"


def sampling_ms_per_set(run: Path, data_name: str, count: int = 500) -> float:
    flow, record = load_flow(run)
    test = load_dataset(data_name)["test"] if not data_name.endswith(".npz") else None
    set_size = record["data"]["set_size"]
    mask = None if test is None or test.mask is None else test.mask[:count]
    start = time.perf_counter()
    flow.sample(count, set_size, mask, torch.Generator().manual_seed(0))
    return 1e3 * (time.perf_counter() - start) / count


def best_iid_nll(data_name: str, seed: int) -> float:
    """NLL per set of the test split under the best i.i.d.-elements density (nan if unknown)."""
    if data_name not in DATASETS:
        return float("nan")
    test = load_dataset(data_name, {"train": 1, "val": 1}, seed=seed)["test"]  # same test split
    nll = test.mean_iid_nll()
    return float("nan") if nll is None else nll


def run_baseline(data: str, seconds: float, num_train: int | None, seed: int,
                 orders: int, reflections: bool = False) -> dict:
    """The flattened nflows baseline on ``data``: trained for ``seconds``, scored on the test
    split (NLL per set), with its training time and sampling cost; with ``reflections``,
    trained on mirrored sets and scored by its average over the mirror images too."""
    from flowattn.sets.baseline import FlattenedSettings, fit_flattened, flattened_nll

    sizes = None if num_train is None else {"train": num_train}
    splits = load_dataset(data, sizes, seed=seed)
    settings = FlattenedSettings(reflections=reflections)
    flow, info = fit_flattened(splits["train"], seconds, settings, seed=seed, val=splits["val"])
    test = splits.get("test", splits["val"])
    nll = flattened_nll(flow, test, orders=orders, seed=seed, reflections=reflections)
    start = time.perf_counter()
    with torch.no_grad():
        flow.sample(500)
    sample_ms = 1e3 * (time.perf_counter() - start) / 500
    for step, seconds_so_far, val_nll in info["history"]:
        print(f"  {BASELINE} {data}: step {step}, {seconds_so_far:.0f} s, val NLL "
              f"{val_nll:.3f} nats/set", flush=True)
    true_nll = test.mean_true_nll()
    return {"test_nll": nll, "train_seconds": info["train_seconds"], "steps": info["steps"],
            "best_step": info["best_step"], "sample_ms": sample_ms, "true_nll": true_nll,
            "dims": test.set_size * test.dim}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", nargs="+", default=["gaussian-sets", "cluster-sets"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--steps", type=int, help="optimiser steps of every flowattn variant "
                        "(default: its own, 1500 but for the presets)")
    parser.add_argument("--num-train", type=int)
    parser.add_argument("--blocks", type=int)
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--baseline-seconds", type=float, help="training time of nflows-maf "
                        "(default: the train_seconds of the variant before it on the data)")
    parser.add_argument("--orders", type=int, default=10, help="random element orders "
                        "nflows-maf averages its density over at test time")
    parser.add_argument("--symmetry", choices=("none", "reflections"), default="none",
                        help="reflections: every flowattn variant with symmetry reflections "
                        "(the density averaged over the mirror images through the coordinate "
                        "axes, trained on mirrored sets), and nflows-maf trained and scored "
                        "the same way; only for data whose density those reflections keep")
    parser.add_argument("--quick", action="store_true", help="30 steps, small training split")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    steps, num_train = (30, 500) if args.quick else (args.steps, args.num_train)
    print(f"{steps or 'default'} steps per run, torch {torch.__version__}, "
          f"{args.threads} thread(s)")
    print("| data | flow | test NLL / dim | true or reference / dim | best i.i.d. / dim "
          "| gap / dim | test NLL / set | train s | sampling ms / set |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for data in args.data:
        seconds = args.baseline_seconds
        for variant in args.variants:
            if variant == BASELINE:
                print(baseline_row(data, seconds, num_train, args), flush=True)
                continue
            settings = {"data": data, "num_train": num_train, "symmetry": args.symmetry,
                        **VARIANTS[variant]}
            if steps:
                settings["steps"] = steps
            if args.blocks:
                settings["blocks"] = args.blocks
            config = SetsRunConfig.build(settings)
            with tempfile.TemporaryDirectory() as tmp:
                summary = fit(config, tmp, progress=False, plots=False, tensorboard=False)
                sample_ms = sampling_ms_per_set(Path(tmp), data)
            seconds = args.baseline_seconds or summary["train_seconds"]
            per_dim = summary["test_nll_per_dim"]
            iid = float("nan")
            if "true_nll_per_dim" in summary:
                target = summary["true_nll_per_dim"]
                dims = summary["true_nll"] / target  # degrees of freedom per set
                iid = best_iid_nll(data, config.train.seed) / dims
            elif data in REFERENCE_NLL:
                target = REFERENCE_NLL[data] * per_dim / summary["test_nll"]
            else:
                target = float("nan")
            print(f"| {data} | {variant} | {per_dim:.4f} | {target:.4f} | {iid:.4f} "
                  f"| {per_dim - target:+.4f} | {summary['test_nll']:.3f} "
                  f"| {summary['train_seconds']:.0f} | {sample_ms:.2f} |", flush=True)


def baseline_row(data: str, seconds: float | None, num_train: int | None,
                 args: argparse.Namespace) -> str:
    """The table row of the flattened baseline (or why it was skipped)."""
    if seconds is None:
        raise SystemExit(f"{BASELINE} on {data}: give --baseline-seconds or run a flowattn "
                         "variant before it (its training time is the baseline's budget)")
    if load_dataset(data, {"train": 2, "val": 1, "test": 1})["train"].mask is not None:
        return (f"| {data} | {BASELINE} | skipped: sets of several sizes (a flow on vectors "
                "has one length) | | | | | | |")
    result = run_baseline(data, seconds, num_train, 0, args.orders,
                          args.symmetry == "reflections")
    per_set, dims = result["test_nll"], result["dims"]
    true = result["true_nll"]
    target = float("nan") if true is None else true / dims
    iid = best_iid_nll(data, 0) / dims
    return (f"| {data} | {BASELINE} ({result['steps']} steps, best at {result['best_step']}) "
            f"| {per_set / dims:.4f} | {target:.4f} | {iid:.4f} | {per_set / dims - target:+.4f} "
            f"| {per_set:.3f} | {result['train_seconds']:.0f} | {result['sample_ms']:.2f} |")


if __name__ == "__main__":
    run_main(main)
