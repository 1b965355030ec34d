"""Entropy floors of the particle systems' test splits: log Z by AIS plus the mean test energy.

The floor is the NLL a perfect model scores on the test split, in the set flows' convention
(nats per configuration on the zero-centre-of-mass subspace): mean energy + log Z. Each seed is
an independent annealing run, so the spread between seeds checks the stated errors.

    python benchmarks/particles.py                        # dw4 and lj13, seeds 0 and 1
    python benchmarks/particles.py --data dw4 --seeds 0   # one system, one run
    python benchmarks/particles.py --quick                # few stages: a smoke test

Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import time

import torch
from entry import run_main

from flowattn.data.partition import FLOOR_SETTINGS, system_floor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", nargs="+", default=["dw4", "lj13"],
                        choices=sorted(FLOOR_SETTINGS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--chains", type=int, help="annealing chains (default: the system's)")
    parser.add_argument("--stages", type=int, help="annealing stages (default: the system's)")
    parser.add_argument("--quick", action="store_true", help="100 stages, 200 chains")
    args = parser.parse_args()
    torch.set_num_threads(1)
    chains, stages = (200, 100) if args.quick else (args.chains, args.stages)
    print(f"torch {torch.__version__}, 1 thread")
    print()
    print("| system | seed | chains × stages | log Z (AIS) | AIS ESS | AIS mean energy | "
          "test mean energy | floor (nats/config) | floor (nats/dim) | time |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.data:
        for seed in args.seeds:
            start = time.perf_counter()
            floor = system_floor(name, chains=chains, stages=stages, seed=seed)
            seconds = time.perf_counter() - start
            z = floor.partition
            settings = FLOOR_SETTINGS[name]
            shape = f"{chains or settings.chains} × {stages or settings.stages}"
            print(f"| {name} | {seed} | {shape} | {z.log_z:.3f} ± {z.log_z_error:.3f} | "
                  f"{z.ess:.3f} | {z.mean_energy:.2f} ± {z.mean_energy_error:.2f} | "
                  f"{floor.mean_energy:.3f} ± {floor.mean_energy_error:.3f} | "
                  f"**{floor.nll:.3f} ± {floor.error:.3f}** | {floor.nll_per_dim:.4f} | "
                  f"{seconds:.0f} s |", flush=True)


if __name__ == "__main__":
    run_main(main)
