"""Large point clouds: time and peak memory of the set flow's training step and evaluation per N.

For every set size N (``--sizes``) and model variant (``--variants``, named settings of
``flowattn sets fit`` in :data:`VARIANTS`), a fresh subprocess builds the run exactly as
``flowattn sets fit --data surface-clouds --set-size N`` does (:class:`flowattn.sets.SetsTask`:
data, flow from :mod:`flowattn.sets.config`, standardisation, ActNorm initialisation on one
batch) and measures

* a training step as the loop takes it: the batch's NLL per dimension with the Russian-roulette
  log-det estimator and its Neumann gradient (the default for N D > 64), backward, gradient
  clipping and an AdamW step on ``--batch`` sets; the median of ``--steps`` steps after one
  warm-up step;
* the evaluation NLL of ``--batch`` test sets, with the standard error of its estimated log-dets,
  as ``flowattn sets eval`` computes it (:func:`flowattn.sets.train.evaluate`), and its time;
* peak resident memory: ``ru_maxrss`` of the subprocess minus its value after the imports.

Peak memory grows as O(N²) (attention holds B H N² weights per block, and the roulette
gradient keeps a few of them per block), so the sizes run from small to large, a quadratic
a + b N + c N² is fitted to the peaks measured so far, and a size predicted above
``--max-memory-gib`` is skipped instead of run (the machine may be shared); the fit gives the
largest N that fits in ``--target-gib`` (24 GiB by default). Prints a Markdown table and writes
``--json``.

    python benchmarks/large_sets.py                               # N = 1000 2000 5000 10000
    python benchmarks/large_sets.py --sizes 1000 2000 3000 --batch 2 --max-memory-gib 8
    python benchmarks/large_sets.py --sizes 500 --steps 1 --json /tmp/small.json  # smoke test
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

#: named model settings of ``flowattn sets fit``; one more interaction is one more entry
VARIANTS: dict[str, dict] = {
    "attention": {"flow": "resflow", "interaction": "attention"},
}
DATA = "surface-clouds"


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def measure(n: int, batch: int, variant: str, steps: int, threads: int, seed: int) -> dict:
    """One size in this process: the training-step and evaluation times, NLL and peak memory."""
    import torch

    from flowattn.sets import SetsRunConfig
    from flowattn.sets.train import SetsTask, evaluate
    from flowattn.training.distributed import Distributed
    from flowattn.training.loop import parameter_groups

    torch.set_num_threads(threads)
    baseline = _peak_mib()
    config = SetsRunConfig.build({"data": DATA, "set_size": n, "batch_size": batch,
                                  "num_train": max(64, batch * (steps + 1)), "seed": seed,
                                  **VARIANTS[variant]})
    task = SetsTask(config, Distributed.join("cpu"), plots=False)
    task.initialise()
    model, cfg = task.model, config.train
    optimiser = torch.optim.AdamW(parameter_groups(model, cfg.weight_decay), lr=cfg.lr,
                                  betas=(cfg.beta1, cfg.beta2))
    generator = torch.Generator().manual_seed(seed)
    model.train()
    times, losses = [], []
    for _ in range(steps + 1):  # the first step warms up
        start = time.perf_counter()
        objective, reported, _ = task.loss(task.forward_module, task.batch(generator, task.dist))
        optimiser.zero_grad(set_to_none=True)
        objective.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or math.inf)
        optimiser.step()
        losses.append(float(reported))
        times.append(time.perf_counter() - start)
    train_peak = _peak_mib() - baseline
    test = task.test_data.subset(torch.arange(min(batch, len(task.test_data))))
    start = time.perf_counter()
    result = evaluate(task.flow, test, batch_size=batch)
    eval_seconds = time.perf_counter() - start
    methods = {m.logdet_options.method for m in model.modules() if hasattr(m, "logdet_options")}
    return {"n": n, "batch": batch, "variant": variant, "threads": threads,
            "step_seconds": statistics.median(times[1:]), "step_times": times,
            "train_losses": losses, "eval_seconds": eval_seconds,
            "nll_per_dim": result["nll_per_dim"], "nll_per_dim_se": result["nll_per_dim_se"],
            "logdet": result["logdet"], "eval_sets": result["num_sets"],
            "train_logdet": sorted(methods),
            "train_peak_mib": train_peak, "peak_mib": _peak_mib() - baseline,
            "baseline_mib": baseline}


def fit_memory(points: list[tuple[int, float]]) -> tuple[float, float, float]:
    """Least-squares (a, b, c) of peak MiB = a + b N + c N² (fewer terms for fewer points:
    c N² from one point, a + c N² from two)."""
    import torch

    ns = torch.tensor([p[0] for p in points], dtype=torch.float64)
    mib = torch.tensor([p[1] for p in points], dtype=torch.float64)
    columns = {1: [ns**2], 2: [torch.ones_like(ns), ns**2]}.get(
        len(points), [torch.ones_like(ns), ns, ns**2])
    coef = torch.linalg.lstsq(torch.stack(columns, 1), mib[:, None]).solution[:, 0].tolist()
    if len(points) == 1:
        return 0.0, 0.0, coef[0]
    if len(points) == 2:
        return coef[0], 0.0, coef[1]
    return coef[0], coef[1], coef[2]


def predict_mib(fit: tuple[float, float, float], n: float) -> float:
    a, b, c = fit
    return a + b * n + c * n * n


def largest_n(fit: tuple[float, float, float], mib: float) -> int:
    """The largest N whose predicted peak is at most ``mib`` (the quadratic's positive root)."""
    a, b, c = fit
    if c <= 0:
        return -1
    return int((-b + math.sqrt(b * b - 4 * c * (a - mib))) / (2 * c))


def run_one(args: argparse.Namespace, n: int, variant: str) -> dict:
    """:func:`measure` in a fresh subprocess, so that its peak memory is this size's alone."""
    command = [sys.executable, __file__, "--worker", "--sizes", str(n), "--variants", variant,
               "--batch", str(args.batch), "--steps", str(args.steps),
               "--threads", str(args.threads), "--seed", str(args.seed)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"n": n, "variant": variant, "error": f"exit {done.returncode}: {tail[0]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def row(r: dict) -> str:
    if "error" in r or "skipped" in r:
        return f"| {r['variant']} | {r['n']} | {r.get('error') or r['skipped']} | | | |"
    return (f"| {r['variant']} | {r['n']} | {r['step_seconds']:.2f} | {r['eval_seconds']:.1f} "
            f"| {r['nll_per_dim']:.4f} ± {r['nll_per_dim_se']:.5f} | {r['peak_mib']:.0f} "
            f"({r['train_peak_mib']:.0f}) |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 2000, 5000, 10000])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--batch", type=int, default=2, help="sets per training step and "
                        "evaluated sets (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=3, help="timed training steps after one "
                        "warm-up step (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-memory-gib", type=float, default=8.0, help="skip a size whose "
                        "predicted peak exceeds this (default: %(default)s)")
    parser.add_argument("--target-gib", type=float, default=24.0, help="report the largest N "
                        "predicted to fit in this much memory (default: %(default)s)")
    parser.add_argument("--json", default="large_sets.json", help="results file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.batch < 1 or args.steps < 1 or args.threads < 1:
        parser.error("--batch, --steps and --threads must be positive")
    if args.worker:
        print(json.dumps(measure(args.sizes[0], args.batch, args.variants[0], args.steps,
                                 args.threads, args.seed)))
        return
    import torch

    print(f"{DATA}, B = {args.batch} sets, {args.threads} thread(s), torch {torch.__version__}; "
          f"median of {args.steps} training steps after a warm-up")
    print("| variant | N | step s | eval s | test NLL / dim ± SE | peak MiB (training) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    results, fits = [], {}
    for variant in args.variants:
        points: list[tuple[int, float]] = []
        for n in sorted(args.sizes):
            predicted = predict_mib(fit_memory(points), n) if points else None
            if predicted is not None and predicted > 1024 * args.max_memory_gib:
                r = {"n": n, "variant": variant, "predicted_mib": predicted,
                     "skipped": f"skipped: predicted {predicted / 1024:.1f} GiB > "
                     f"{args.max_memory_gib:g} GiB"}
            else:
                r = run_one(args, n, variant)
                if "peak_mib" in r:
                    points.append((n, r["peak_mib"]))
            results.append(r)
            print(row(r), flush=True)
        if points:
            fit = fit_memory(points)
            fits[variant] = {"a_mib": fit[0], "b_mib": fit[1], "c_mib": fit[2],
                             "largest_n": largest_n(fit, 1024 * args.target_gib)}
    for variant, fit in fits.items():
        print(f"{variant}: peak MiB ≈ {fit['a_mib']:.0f} + {fit['b_mib']:.3g} N + "
              f"{fit['c_mib']:.3g} N²; largest N within {args.target_gib:g} GiB: "
              f"{fit['largest_n']}")
    Path(args.json).write_text(json.dumps({"batch": args.batch, "threads": args.threads,
                                           "steps": args.steps, "torch": torch.__version__,
                                           "results": results, "memory_fit": fits},
                                          indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
