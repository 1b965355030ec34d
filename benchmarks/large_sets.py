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
gradient keeps a few of them per block), so the sizes run from small to large and a size whose
peak, scaled as N² from the largest size measured, exceeds ``--max-memory-gib`` is skipped
instead of run (the machine may be shared). a + c N² is fitted to the peaks of the sizes whose
(N, N) matrix of one set holds at least 32 MiB (N >= 2897): glibc's malloc serves such blocks by
mmap and returns them to the system when they are freed, so the resident size follows the live
tensors; smaller blocks come from its heap, which keeps freed memory, and their peaks vary with
the order of allocations (all sizes are fitted when fewer than two are that large). The fit
gives the largest N that fits in ``--target-gib`` (24 GiB by default). Prints a Markdown table
and writes ``--json``.

    python benchmarks/large_sets.py                               # N = 1000 2000 5000 10000
    python benchmarks/large_sets.py --sizes 1000 2000 3000 --batch 2 --max-memory-gib 8
    python benchmarks/large_sets.py --sizes 500 --steps 1 --json /tmp/small.json  # smoke test
    python benchmarks/large_sets.py --references --sizes 1000      # yardsticks of the test NLL
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

from entry import positive_int, run_main

#: named model settings of ``flowattn sets fit``; one more interaction is one more entry
VARIANTS: dict[str, dict] = {
    "attention": {"flow": "resflow", "interaction": "attention"},
    # the same flow with induced-point attention (16 inducing points per head): O(N M)
    "induced": {"flow": "resflow", "interaction": "attention", "inducing_points": 16},
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
    from flowattn.training.loop import adamw

    torch.set_num_threads(threads)
    baseline = _peak_mib()
    config = SetsRunConfig.build({"data": DATA, "set_size": n, "batch_size": batch,
                                  "num_train": max(64, batch * (steps + 1)), "seed": seed,
                                  **VARIANTS[variant]})
    task = SetsTask(config, Distributed.join("cpu"), plots=False)
    task.initialise()
    model, cfg = task.model, config.train
    optimiser = adamw(model, cfg.lr, (cfg.beta1, cfg.beta2), cfg.weight_decay)
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


def reference_nlls(n: int, seed: int) -> dict:
    """Two yardsticks for the NLL per dimension of the test split (the one ``fit`` scores).

    ``gaussian``: one 3-D Gaussian fitted to every training point (the points i.i.d.).
    ``surface_known``: the density of the points given each set's own surface, to first order
    in sigma / curvature radius: area-uniform on a surface of area A (sphere 4 pi a²,
    torus 4 pi² a b, open cylinder 4 pi a b) times N(0, sigma²) across it,
    -log p(x) = log A + d² / (2 sigma²) + log(2 pi sigma²) / 2 with d the distance to the surface.
    A model must also find the surface from the set (a handful of parameters per N points),
    so this is a bound it can approach at large N, not a truth it can pass.
    """
    import torch

    from flowattn.data import load_dataset, surface_distance

    splits = load_dataset(DATA, {"train": 200, "val": 1, "test": 100}, seed=seed, set_size=n)
    train = splits["train"].x.double().reshape(-1, 3)
    test = splits["test"]
    x = test.x.double()
    gaussian = torch.distributions.MultivariateNormal(train.mean(0), torch.cov(train.T))
    surfaces, sigma = test.meta["surfaces"], test.meta["noise"]
    kind, (a, b) = surfaces["kind"], surfaces["params"].double().unbind(1)
    area = torch.where(kind == 0, 4 * math.pi * a**2,
                       torch.where(kind == 1, 4 * math.pi**2 * a * b, 4 * math.pi * a * b))
    d = surface_distance(x, surfaces["kind"], surfaces["params"].double(),
                         surfaces["rotation"].double())
    known = area.log()[:, None] + d**2 / (2 * sigma**2) + 0.5 * math.log(2 * math.pi * sigma**2)
    return {"n": n, "gaussian": -gaussian.log_prob(x).mean().item() / 3,
            "surface_known": known.mean().item() / 3}


#: the smallest N whose (N, N) float32 matrix of one set is served by mmap (32 MiB)
MMAP_N = 2897


def growth(variant: str) -> int:
    """The power of N in a variant's memory: 2 for full attention (its (N, N) matrices), 1 for
    induced-point attention ((N, M) matrices)."""
    return 1 if VARIANTS[variant].get("inducing_points") else 2


def fit_memory(points: list[tuple[int, float]], power: int = 2) -> tuple[float, float]:
    """Least-squares (a, c) of peak MiB = a + c N^power over the points with N >= ``MMAP_N``
    (all points if fewer than two are; c N^power alone from one point)."""
    import torch

    large = [p for p in points if p[0] >= MMAP_N]
    points = large if len(large) >= 2 else points
    ns = torch.tensor([p[0] for p in points], dtype=torch.float64)
    mib = torch.tensor([p[1] for p in points], dtype=torch.float64)
    if len(points) == 1:
        return 0.0, float(mib[0] / ns[0] ** power)
    design = torch.stack([torch.ones_like(ns), ns**power], 1)
    a, c = torch.linalg.lstsq(design, mib[:, None]).solution[:, 0].tolist()
    return a, c


def scaled_mib(points: list[tuple[int, float]], n: int, power: int = 2) -> float:
    """The peak of the largest size measured, scaled as N^power: the estimate that decides a
    skip."""
    n0, mib = max(points)
    return mib * (n / n0) ** power


def largest_n(fit: tuple[float, float], mib: float, power: int = 2) -> int:
    """The largest N whose fitted peak a + c N^power is at most ``mib`` (-1 if c <= 0)."""
    a, c = fit
    return int(((mib - a) / c) ** (1 / power)) if c > 0 and mib > a else -1


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
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-memory-gib", type=float, default=8.0, help="skip a size whose "
                        "predicted peak exceeds this (default: %(default)s)")
    parser.add_argument("--target-gib", type=float, default=24.0, help="report the largest N "
                        "predicted to fit in this much memory (default: %(default)s)")
    parser.add_argument("--json", default="large_sets.json", help="results file")
    parser.add_argument("--references", action="store_true", help="print the NLL per "
                        "dimension of the test split under a fitted Gaussian and given each "
                        "set's surface (reference_nlls) for --sizes, and stop")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.batch < 1 or args.steps < 1 or args.threads < 1:
        parser.error("--batch, --steps and --threads must be positive")
    if args.references:
        for n in args.sizes:
            ref = reference_nlls(n, args.seed)
            print(f"N = {n}: test NLL / dim of a fitted Gaussian {ref['gaussian']:.4f}, given "
                  f"each set's surface {ref['surface_known']:.4f}")
        return
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
            predicted = scaled_mib(points, n, growth(variant)) if points else None
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
            fit = fit_memory(points, growth(variant))
            used = [n for n, _ in points if n >= MMAP_N]
            fits[variant] = {"a_mib": fit[0], "c_mib": fit[1], "power": growth(variant),
                             "sizes": used if len(used) >= 2 else [n for n, _ in points],
                             "largest_n": largest_n(fit, 1024 * args.target_gib,
                                                    growth(variant))}
    for variant, fit in fits.items():
        power = "²" if fit["power"] == 2 else ""
        print(f"{variant}: peak MiB ≈ {fit['a_mib']:.0f} + {fit['c_mib']:.4g} N{power} (fitted "
              "to N = "
              f"{', '.join(map(str, fit['sizes']))}); largest N within {args.target_gib:g} GiB: "
              f"{fit['largest_n']}")
    Path(args.json).write_text(json.dumps({"batch": args.batch, "threads": args.threads,
                                           "steps": args.steps, "torch": torch.__version__,
                                           "results": results, "memory_fit": fits},
                                          indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    run_main(main)
