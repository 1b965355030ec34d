"""Evaluation log-dets of a set flow: the exact path against probes to a standard error.

For each set shape (N, D) a 2-block attention set flow (float32, untrained weights, ActNorm
initialised on the batch) scores one batch in evaluation mode twice: with the exact log-det
(every N D <= ``eval_exact_max_dim``) and with the series drawn until the standard error is
``eval_max_error`` per degree of freedom (``eval_exact_max_dim=0``). It prints the wall time,
the NLL per dimension of each, and the largest standard error per dimension of a set.

    python benchmarks/eval_logdet.py                     # N D = 80, 256, 256, 512
    python benchmarks/eval_logdet.py --shape 64 2 --sets 32
    python benchmarks/eval_logdet.py --shape 128 2 --sets 256 --only exact   # + peak memory
"""

from __future__ import annotations

import argparse
import resource
import time

import torch
from entry import positive_int, run_main

from flowattn.flows import LogDetOptions, set_flow
from flowattn.flows.residual import InvertibleResidual


def score(n: int, d: int, sets: int, exact: bool) -> tuple[float, float, float]:
    torch.manual_seed(0)
    options = LogDetOptions(eval_exact_max_dim=10**6 if exact else 0)
    flow = set_flow(d, blocks=2, heads=1, logdet=options)
    x = torch.randn(sets, n, d, generator=torch.Generator().manual_seed(1))
    flow.train().log_prob(x)  # ActNorm initialisation
    flow.eval()
    start = time.perf_counter()
    with torch.no_grad():
        log_prob = flow.log_prob(x)
    seconds = time.perf_counter() - start
    variance = torch.zeros(sets, dtype=torch.float64)
    for block in flow.modules():
        if isinstance(block, InvertibleResidual) and block.logdet_variance is not None:
            variance += block.logdet_variance.double()
    return seconds, float(-log_prob.mean()) / (n * d), float(variance.sqrt().max()) / (n * d)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=2, action="append", metavar=("N", "D"))
    parser.add_argument("--sets", type=int, default=64)
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--only", choices=("exact", "probes"),
                        help="one path, one shape: then the peak resident memory is its own")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shapes = args.shape or [(40, 2), (128, 2), (32, 8), (256, 2)]
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.sets} sets per batch")
    if args.only:
        n, d = shapes[0]
        seconds, nll, se = score(n, d, args.sets, exact=args.only == "exact")
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
        print(f"N={n} D={d} {args.only}: {seconds:.2f} s, nll/dim {nll:.4f}, "
              f"max se/dim {se:.4f}, peak resident memory {peak:.2f} GiB")
        return
    print("   N   D  N*D | exact: s  nll/dim | probes: s  nll/dim  max se/dim")
    for n, d in shapes:
        t_exact, nll_exact, _ = score(n, d, args.sets, exact=True)
        t_est, nll_est, se = score(n, d, args.sets, exact=False)
        print(f"{n:4d} {d:3d} {n * d:4d} | {t_exact:8.2f} {nll_exact:8.4f} | "
              f"{t_est:9.2f} {nll_est:8.4f} {se:11.4f}")


if __name__ == "__main__":
    run_main(main)
