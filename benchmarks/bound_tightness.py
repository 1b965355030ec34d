"""How tight is Theorem 3.2? The certificate vs Jacobian norms at random and optimised inputs.

For tied L2MHA with random (Glorot) weights, prints per set size N: the certificate, the
largest Jacobian norm over random inputs, and the best lower bound found by the App. H
optimisation, with the ratio certificate / lower bound.

    python benchmarks/bound_tightness.py            # N in {2, 4, 8, 16}, D = 4, H = 2
    python benchmarks/bound_tightness.py --quick
"""

from __future__ import annotations

import argparse

import torch

from flowattn.attention import L2MHA
from flowattn.lipschitz import jacobian_norm, lipschitz_lower_bound


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=4)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--restarts", type=int, default=10)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.restarts, args.steps = [2, 4], 2, 20
    torch.manual_seed(0)
    module = L2MHA(args.dim, args.heads).double()

    def one_set(x):
        return module(x[None])[0]

    print(f"L2MHA D={args.dim} H={args.heads}, Glorot weights (seed 0), float64; "
          f"{args.restarts} restarts x {args.steps} Adam steps (lr 0.1)")
    print("| N | norm | certificate | max over 20 random inputs | optimised lower bound "
          "| certificate / lower bound |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    g = torch.Generator().manual_seed(1)
    for n in args.sizes:
        for p in ("inf", 2):
            bound = module.lipschitz_bound(n, p).item()
            random_best = max(
                jacobian_norm(one_set, torch.randn(n, args.dim, generator=g,
                                                   dtype=torch.float64), p).item()
                for _ in range(20)
            )
            lower, _ = lipschitz_lower_bound(one_set, (n, args.dim), p, args.restarts,
                                             args.steps, generator=g)
            print(f"| {n} | {p} | {bound:.3f} | {random_best:.3f} | {lower:.3f} "
                  f"| {bound / lower:.1f} |")


if __name__ == "__main__":
    main()
