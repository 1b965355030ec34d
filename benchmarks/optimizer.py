"""The optimiser's step, fused against the per-tensor loop, in the training step of each model.

``flowattn.training.loop.adamw`` builds AdamW with the fused kernel (one pass over every tensor)
wherever torch has it for the parameters' device; torch's default on the CPU is a loop over the
tensors. This script times both side by side in one process, on the same models and batches:
for each model two copies with the same initial weights, one per optimiser, stepped in turn
(forward, backward, gradient clipping at 1, optimiser step), so that a changing machine load
hits both alike. It prints the median time of the optimiser step alone and of the whole training
step, per implementation, and the ratio fused / per-tensor; and the median time of the update of
a moving average of the parameters (``--ema``, :mod:`flowattn.training.average`) after the fused
step, with its share of that step.

Models: set flows on ``shape-sets`` (the default residual flow, the ``large`` preset's coupling
flow), the DW4 default (radial residual flow) and the character LMs of ``benchmarks/lm.py``
(dot product, contractive L2, invertible; nanoGPT's CPU configuration, random tokens).

    python benchmarks/optimizer.py --threads 1
    python benchmarks/optimizer.py --threads 1 --models sets-large lm-dp --rounds 10
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch
from entry import positive_int, run_main
from lm import NANOGPT, VARIANTS  # the LM benchmark's configurations
from machine import cpu_name

from flowattn.lm.config import LMConfig, LMRunConfig
from flowattn.lm.model import build_model
from flowattn.sets.config import SetsRunConfig
from flowattn.sets.train import SetsTask
from flowattn.training.average import ParameterAverage
from flowattn.training.distributed import Distributed
from flowattn.training.loop import parameter_groups

# the flow's own density, which a training step scores (shape-sets' default mirror average is
# for validation and test; a step with it is the same step on mirrored sets)
SETS = {"sets-default": {"data": "shape-sets", "symmetry": "none"},
        "sets-large": {"data": "shape-sets", "preset": "large", "symmetry": "none"},
        "dw4-default": {"data": "dw4"}}
LMS = {"lm-dp": "dp", "lm-contractive-l2": "contractive-l2", "lm-invertible": "invertible"}


def sets_model(name: str) -> tuple[torch.nn.Module, Callable]:
    """A set flow as ``flowattn sets fit`` builds it, and a closure computing its loss on the
    next training batch (the same sequence of batches for every copy)."""
    config = SetsRunConfig.build(SETS[name])
    task = SetsTask(config, Distributed(0, 1, torch.device("cpu")), plots=False)
    task.initialise()
    generator = torch.Generator().manual_seed(0)
    batches = [task.batch(generator, task.dist) for _ in range(4)]

    def loss(module: torch.nn.Module, i: int) -> torch.Tensor:
        x, mask = batches[i % len(batches)]
        return -module.log_prob(x, mask).mean()

    return task.flow, loss


def lm_model(name: str) -> tuple[torch.nn.Module, Callable]:
    base = {"device": "cpu", "seed": 0, **NANOGPT}
    network = LMRunConfig.build({**base, **VARIANTS[LMS[name]]}).network
    model = build_model(LMConfig(vocab_size=65, **network.to_dict()))
    generator = torch.Generator().manual_seed(0)
    shape = (NANOGPT["batch_size"], NANOGPT["block_size"])
    batches = [(torch.randint(65, shape, generator=generator),
                torch.randint(65, shape, generator=generator)) for _ in range(4)]

    def loss(module: torch.nn.Module, i: int) -> torch.Tensor:
        idx, targets = batches[i % len(batches)]
        return module(idx, targets)[1]["loss"]

    return model, loss


def step(model, optimizer, loss, i: int, average: ParameterAverage | None = None
         ) -> tuple[float, float, float]:
    """(whole step, optimiser step, update of the average) in seconds; the whole step does not
    count the average's update."""
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    loss(model, i).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    middle = time.perf_counter()
    optimizer.step()
    end = time.perf_counter()
    if average is not None:
        average.update(i + 1)
    return end - start, end - middle, time.perf_counter() - end


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = [*SETS, *LMS]
    parser.add_argument("--models", nargs="+", default=names, choices=names)
    parser.add_argument("--rounds", type=int, default=6, help="rounds of steps per model")
    parser.add_argument("--steps", type=int, default=4, help="steps per round and optimiser")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch threads")
    parser.add_argument("--ema", type=float, default=0.999,
                        help="decay of the moving average timed after the fused step")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {cpu_name()}")
    rows = []
    for name in args.models:
        torch.manual_seed(0)
        model, loss = sets_model(name) if name in SETS else lm_model(name)
        twin = copy.deepcopy(model)
        runs = {}
        for label, net, fused in (("per-tensor", model, False), ("fused", twin, True)):
            optimizer = torch.optim.AdamW(parameter_groups(net, 0.0), lr=1e-4, fused=fused)
            average = ParameterAverage(net, args.ema) if fused else None
            runs[label] = (net, optimizer, average, [], [], [])
        for net, optimizer, average, *_ in runs.values():  # warm-up
            step(net, optimizer, loss, 0, average)
        for r in range(args.rounds):
            for net, optimizer, average, whole, alone, averaging in runs.values():
                for s in range(args.steps):
                    total, opt, avg = step(net, optimizer, loss, r * args.steps + s, average)
                    whole.append(total)
                    alone.append(opt)
                    averaging.append(avg)
        tensors = sum(1 for p in model.parameters() if p.requires_grad)
        med = {label: tuple(1e3 * statistics.median(v) for v in values)
               for label, (_, _, _, *values) in runs.items()}
        rows.append((name, tensors, med))
        print(f"{name}: {tensors} tensors; optimiser {med['per-tensor'][1]:.2f} -> "
              f"{med['fused'][1]:.2f} ms; step {med['per-tensor'][0]:.1f} -> "
              f"{med['fused'][0]:.1f} ms; average {med['fused'][2]:.2f} ms", flush=True)
    print()
    print("| model | tensors | optimiser, per-tensor (ms) | fused (ms) | fused / per-tensor "
          "| step, per-tensor (ms) | fused (ms) | fused / per-tensor | average's update (ms) "
          "| update / fused step |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, tensors, med in rows:
        (wl, ol, _), (wf, of, af) = med["per-tensor"], med["fused"]
        print(f"| {name} | {tensors} | {ol:.2f} | {of:.2f} | {of / ol:.2f} | {wl:.1f} | "
              f"{wf:.1f} | {wf / wl:.2f} | {af:.2f} | {af / wf:.3f} |")
    return 0


if __name__ == "__main__":
    run_main(main)
