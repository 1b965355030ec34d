"""Density estimation on sets: test NLL, training and sampling time per data set and flow.

Variants: ``resflow`` (contractive attention residual flow with equivariant linear layers),
``linear`` (the same without attention: elements interact only through the equivariant linear
maps), ``iid`` (no interaction at all: the i.i.d.-points baseline), ``no-location``
(``resflow`` without the spline flow of each set's centroid) and ``cnf`` (continuous flow with
an L2-attention field). Every run uses the same budget and seed; the table reports NLL per
degree of freedom next to the true value where it is known (synthetic sets) or the published
reference (DW4: 7.48 per configuration for the E(n)-equivariant flow; LJ13: the ~16.9 floor),
and, for synthetic sets, the best NLL of any model of i.i.d. elements (the exact one-element
marginal applied to every element): what a flow gains below it comes from interactions.

    python benchmarks/sets.py                                     # synthetic sets, all variants
    python benchmarks/sets.py --data shape-sets shape-sets-varsize repulsive-sets \
        --variants resflow linear iid                             # sets that need interactions
    python benchmarks/sets.py --data dw4 --num-train 100000 --steps 4000 --variants resflow
    python benchmarks/sets.py --quick
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from flowattn.data import DATASETS, load_dataset
from flowattn.sets import SetsRunConfig, fit, load_flow

REFERENCE_NLL = {"dw4": 7.48, "lj13": 16.9}  # per configuration, E-NF convention
VARIANTS = {
    "resflow": {"flow": "resflow"},
    "linear": {"flow": "resflow", "interaction": "linear"},
    "iid": {"flow": "resflow", "interaction": "none"},
    "no-location": {"flow": "resflow", "location": False},
    "cnf": {"flow": "cnf"},
}


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", nargs="+", default=["gaussian-sets", "cluster-sets"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--num-train", type=int)
    parser.add_argument("--blocks", type=int)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="30 steps, small training split")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    steps, num_train = (30, 500) if args.quick else (args.steps, args.num_train)
    print(f"{steps} steps per run, torch {torch.__version__}, {args.threads} thread(s)")
    print("| data | flow | test NLL / dim | true or reference / dim | best i.i.d. / dim "
          "| gap / dim | test NLL / set | train s | sampling ms / set |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for data in args.data:
        for variant in args.variants:
            settings = {"data": data, "steps": steps, "num_train": num_train,
                        **VARIANTS[variant]}
            if args.blocks:
                settings["blocks"] = args.blocks
            config = SetsRunConfig.build(settings)
            with tempfile.TemporaryDirectory() as tmp:
                summary = fit(config, tmp, progress=False, plots=False, tensorboard=False)
                sample_ms = sampling_ms_per_set(Path(tmp), data)
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


if __name__ == "__main__":
    main()
