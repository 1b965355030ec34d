"""Side by side with E-NF: the residual flow and the EGNN continuous flow under E-NF's budget.

Satorras et al. (E(n) Equivariant Normalizing Flows, NeurIPS 2021) train on DW4 and LJ13 with a
number of epochs that depends on the size of the training split, validate every few epochs and
report the test NLL at the best validation epoch (``main_dw4_lj13.py``, ``--sweep_n_data``).
This script trains two flows on the same built-in split with that budget and that selection
rule (``keep_best``) and prints one table:

* ``resflow``: the library's defaults for the data set (monotone radial and many-body residual
  blocks), with E-NF's batch size, number of steps and validation cadence in place of its own;
* ``cnf``: E-NF's model in flowattn, a CNF whose field is an ``EGNNField`` (3 layers of width
  32 with attention gates), Hutchinson's trace while training, Adam 5e-4 with a cosine decay to
  5e-5, dopri5 at tolerance 1e-4, gradients by the adjoint ODE as E-NF's (its memory does not
  grow with the solver's steps: backpropagating through them took the LJ13 run past 23 GB by
  step 232, its solves then some 100 field evaluations long); its validation and test NLLs
  take the trace as E-NF's do (``--eval-divergence enf``): exact on DW4, Hutchinson's (one
  probe per configuration, unbiased, its noise in the reported error) on LJ13, where the
  exact trace would cost some 32 hours of validations on one CPU core;
* ``matching``: the same CNF trained by flow matching (``objective: matching``: one field
  evaluation per configuration and step, no solve), Adam 1e-3 with a cosine decay to 1e-4;
  its NLLs are the ODE's, as the others'. ``--matching-steps`` gives it its own number of
  steps (a budget of time rather than of epochs: a matching step costs a few milliseconds);
  ``--alignment euclidean`` pairs each configuration with a base draw permuted and turned
  towards it (equivariant flow matching).

Every run is an ordinary ``flowattn sets fit`` run folder under ``--out`` (checkpoints every
``--checkpoint-every`` steps): running the command again resumes unfinished runs exactly and
reads finished ones, so a long comparison can be done in several sittings, and a run can also
be continued alone with ``flowattn sets fit --out DIR --resume``.

    python benchmarks/enf.py --data dw4 --num-train 1000             # 3000 steps each
    python benchmarks/enf.py --data dw4 --num-train 1000 --models resflow
    python benchmarks/enf.py --data dw4 --num-train 100 --quick      # a smoke run
    python benchmarks/enf.py --data dw4 --num-train 100000 --models matching  # E-NF budget
    python benchmarks/enf.py --data dw4 --num-train 100000 --models matching \
        --alignment euclidean --matching-lr 0.002   # aligned draws, a higher rate
    python benchmarks/enf.py --data lj13 --num-train 10000 --models cnf --device cuda
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from entry import positive_int, run_main

from flowattn.sets.train import fit
from flowattn.training.metrics import read_metrics

# E-NF's sweep (main_dw4_lj13.py): training configurations -> (epochs, validation every so
# many epochs, batch size)
BUDGETS = {
    "dw4": {100: (1000, 20, 100), 1000: (300, 5, 100), 10000: (50, 1, 100),
            100000: (6, 1, 100)},
    "lj13": {10: (500, 10, 10), 100: (1000, 25, 100), 1000: (300, 5, 100),
             10000: (50, 1, 100)},
}
CNF = {"flow": "cnf", "divergence": "hutchinson", "lr": 5e-4, "min_lr": 5e-5, "warmup": 100,
       "ode_tol": 1e-4, "adjoint": True}
MATCHING = {"flow": "cnf", "objective": "matching", "lr": 1e-3, "min_lr": 1e-4, "warmup": 100,
            "ode_tol": 1e-4}
MODELS = {"resflow": {}, "cnf": CNF, "matching": MATCHING}
# the trace in E-NF's reported NLLs (main_dw4_lj13.py: exact for DW4 only)
ENF_EVAL_DIVERGENCE = {"dw4": "exact", "lj13": "hutchinson"}


def budget(data: str, num_train: int) -> dict:
    """E-NF's steps, batch size and validation cadence for ``num_train`` configurations."""
    if num_train not in BUDGETS[data]:
        raise SystemExit(f"E-NF's sweep has no {data} run with {num_train} training "
                         f"configurations; choose one of {sorted(BUDGETS[data])}")
    epochs, every, batch = BUDGETS[data][num_train]
    per_epoch = math.ceil(num_train / batch)
    return {"steps": epochs * per_epoch, "batch_size": batch, "eval_every": every * per_epoch}


def run(name: str, flags: dict, out: Path) -> dict:
    resume = (out / "checkpoint.pt").exists()
    print(f"{name}: {'resuming' if resume else 'starting'} {out}", flush=True)
    return fit(out=out, resume=resume, flags=None if resume else flags, plots=False)


def best_validation(out: Path) -> tuple[float, int]:
    """The lowest validation NLL (nats per configuration) and its step."""
    records = [r for r in read_metrics(out / "metrics.jsonl") if r["split"] == "val"]
    best = min(records, key=lambda r: r["loss"])
    return best["nll"], best["step"]


def nfe(out: Path) -> str:
    """Mean field evaluations per forward solve over the last 10 % of training (CNF trained by
    likelihood), or of the last validation's solve (trained by matching, which solves only
    there)."""
    records = read_metrics(out / "metrics.jsonl")
    validations = [r for r in records if r["split"] == "val" and "nfe" in r]
    records = [r for r in records if "nfe_forward" in r]
    if not records:
        return f"{validations[-1]['nfe']} (validation)" if validations else "—"
    tail = records[-max(1, len(records) // 10):]
    return f"{sum(r['nfe_forward'] for r in tail) / len(tail):.0f}"


def record(path: Path, summaries: dict) -> None:
    """Write ``summaries`` (model label -> run summary) into the split's JSON file, keeping the
    entries of models run by earlier invocations: a run of one model does not drop the rest."""
    kept = json.loads(path.read_text()) if path.exists() else {}
    kept.update(summaries)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(kept, indent=2, default=str) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", choices=sorted(BUDGETS), default="dw4")
    parser.add_argument("--num-train", type=int, default=1000)
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--matching-steps", type=int, default=None,
                        help="steps of the matching model (default: E-NF's budget, as the others)")
    parser.add_argument("--matching-lr", type=float, default=None,
                        help="the matching model's learning rate, decayed to a tenth (default: "
                        "1e-3)")
    parser.add_argument("--alignment", choices=("none", "permutation", "euclidean"),
                        default="none", help="the matching model's base draws moved towards "
                        "their configurations (euclidean: permuted and turned)")
    parser.add_argument("--eval-divergence", choices=("enf", "exact", "hutchinson"),
                        default="enf", help="the continuous flows' trace in validation and "
                        "test NLLs (enf: E-NF's, exact on dw4 and Hutchinson's on lj13; a run "
                        "resumed from its folder keeps its own)")
    parser.add_argument("--val-sets", type=int, default=1000, help="E-NF: 1000")
    parser.add_argument("--checkpoint-every", type=int, default=250)
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--device", default="cpu", help="where every model trains and is "
                        "scored: cpu, cuda, cuda:N or auto (a run resumed from its folder keeps "
                        "its own)")
    parser.add_argument("--out", type=Path, default=Path("runs/enf"))
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 20 steps, validation every 10, 100 validation sets")
    args = parser.parse_args()
    steps = budget(args.data, args.num_train)
    if args.quick:
        steps = {**steps, "steps": 20, "eval_every": 10}
        args.val_sets = 100
    common = {"data": args.data, "num_train": args.num_train, "val_sets": args.val_sets,
              "keep_best": True, "checkpoint_every": args.checkpoint_every,
              "threads": args.threads, "device": args.device, **steps}
    divergence = args.eval_divergence
    if divergence == "enf":
        divergence = ENF_EVAL_DIVERGENCE[args.data]
    rows = []
    for name in args.models:
        flags = {**common, **MODELS[name]}
        if flags.get("flow") == "cnf":
            flags["eval_divergence"] = divergence
        variant = []  # the matching model's own settings, in its folder name and its label
        if name == "matching" and args.matching_steps is not None and not args.quick:
            flags["steps"] = args.matching_steps
            variant.append(f"s{args.matching_steps}")
        if name == "matching" and args.matching_lr is not None:
            flags.update(lr=args.matching_lr, min_lr=args.matching_lr / 10)
            variant.append(f"lr{args.matching_lr:g}")
        if name == "matching" and args.alignment != "none":
            flags["alignment"] = args.alignment
            variant.append(args.alignment)
        out = args.out / "-".join([f"{args.data}-{args.num_train}-{name}", *variant])
        label = f"{name} ({'-'.join(variant)})" if variant else name
        summary = run(label, flags, out)
        rows.append((label, out, summary))
    if "matching" in args.models and args.matching_steps is not None and not args.quick:
        print(f"\nmatching: {args.matching_steps} steps", end="")
    print(f"\n{args.data}, {args.num_train} training configurations: {steps['steps']} steps of "
          f"batch {steps['batch_size']}, validation every {steps['eval_every']} steps on "
          f"{args.val_sets} configurations, test NLL of the best validation state (± its "
          "standard error over the test configurations); continuous flows scored with the "
          f"{divergence} trace\n")
    print("| model | best validation (step) | test NLL | test configurations | "
          "training time | field evaluations per solve (end) | parameters |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, out, s in rows:
        val, step = best_validation(out)
        se = s.get("test_nll_sampling_se")  # absent from summaries written before it existed
        error = "" if se is None else f" ± {se:.3f}"
        print(f"| {name} | {val:.3f} ({step}) | **{s['test_nll']:.3f}**{error} | "
              f"{s['test_sets']} | "
              f"{s['train_seconds'] / 60:.0f} min | {nfe(out)} | {s['params']:,} |")
    record(args.out / f"{args.data}-{args.num_train}.json", {name: s for name, _, s in rows})


if __name__ == "__main__":
    run_main(main)
