"""The training step of a set flow with attention: its speed-ups against the code before them.

Two changes make a deep flow of contractive attention blocks cheaper per step, and this script
times each, in interleaved rounds in one process, against the code before it (patched back in),
checks that every way gives the same values (to float32 rounding) and prints the medians and
their ratios:

* **stacked products** (``L2MHA.linearise``): the exact log-det asks each attention branch for
  the vector-Jacobian products of all N D basis vectors at once, and every vector meets the
  same attention matrices; they are multiplied in one batched product, the stack moved into the
  rows or columns (``_each_times``, ``_times_each``). Before: each vector's matrices apart
  (mode ``per-matrix products``: the two helpers replaced by the broadcasting products they
  stand for).
* **shared certificates** (``SetFlow``): the blocks' certificates come from one evaluation
  batched over the alike blocks (``shared_certificates``) for sets without padding. Before:
  each block evaluated its own (mode ``own certificates``).

Work timed:

* the training step (log-density of a batch, forward and backward) of the residual flow with
  element-wise splines and contractive attention of ``benchmarks/sets.py``'s
  ``attention-splines`` variant at the shape of ``shape-sets`` (64 sets of 8 points in 2-D, so
  16 basis vectors), with 24 blocks as in its longest runs (``--blocks``), untrained weights,
  in all four modes (today's, each change undone, both undone);
* one ``ContractiveL2MHA`` branch's stacked product and its backward on that shape (16 vectors,
  64 x 8 x 2, 2 heads), and one product without a stack (a Hutchinson probe: 4 sets of N = 512,
  D = 16, 2 heads), where both ways run the same code (a check that nothing else moved), each
  against ``per-matrix products``.

    python benchmarks/set_step.py --threads 1
    python benchmarks/set_step.py --quick        # one round, 4 blocks
"""

from __future__ import annotations

import argparse
import contextlib
import copy
from collections.abc import Callable
from unittest import mock

import interleaved
import torch
from entry import run_main

from flowattn.attention import ContractiveL2MHA
from flowattn.attention import l2 as l2_module
from flowattn.flows import SetFlow
from flowattn.sets import SetsRunConfig, build_flow

# the flow's own density, which a training step scores (not shape-sets' mirror average)
SETTINGS = {"flow": "resflow", "interaction": "attention", "splines": True, "heads": 2,
            "symmetry": "none"}


def per_matrix() -> contextlib.ExitStack:
    """The products as before the stacked helpers: each vector's matrices multiplied apart
    (matmul broadcasting the shared operand over the stack)."""
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(l2_module, "_each_times", lambda w, a: w @ a))
    stack.enter_context(mock.patch.object(
        l2_module, "_times_each",
        lambda a, w: l2_module._times_narrow(a, w) if w.shape[-1] < a.shape[-2] else a @ w))
    return stack


def own_certificates():
    """Every attention block of a set flow evaluating its own certificate, as before."""
    return mock.patch.object(SetFlow, "_shared_certificates",
                             lambda self, x, mask: contextlib.nullcontext())


def both_before() -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    stack.enter_context(per_matrix())
    stack.enter_context(own_certificates())
    return stack


FLOW_MODES = {"today": contextlib.nullcontext, "per-matrix products": per_matrix,
              "own certificates": own_certificates, "both as before": both_before}
PRODUCT_MODES = {"today": contextlib.nullcontext, "per-matrix products": per_matrix}


def flow_step(blocks: int, device: str) -> Callable[[], torch.Tensor]:
    """A training step of the spline-and-attention residual flow; returns the input's gradient.
    Each step starts from the same state (the Lipschitz MLPs' power iterations move theirs at
    every training call), so that the ways can be compared value for value."""
    torch.manual_seed(0)
    config = SetsRunConfig.build({"data": "shape-sets", **SETTINGS, "blocks": blocks})
    flow = build_flow(config.flow, 2, 8, False).to(device).train()
    state = copy.deepcopy(flow.state_dict())
    x = torch.randn(64, 8, 2, device=device, generator=torch.Generator(device).manual_seed(0))

    def step() -> torch.Tensor:
        flow.load_state_dict(state)
        flow.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        log_prob = flow.log_prob(xi)
        log_prob = log_prob[0] if isinstance(log_prob, tuple) else log_prob
        (grad,) = torch.autograd.grad(-log_prob.mean(), xi)
        return grad

    step.flow = flow  # for a look inside
    return step


def product(batch: int, length: int, dim: int, heads: int, vectors: int,
            device: str) -> Callable[[], torch.Tensor]:
    """One contractive attention branch's stacked product w -> w^T J and its backward."""
    torch.manual_seed(0)
    branch = ContractiveL2MHA(dim, heads, coeff=0.9).to(device)
    x = torch.randn(batch, length, dim, device=device, requires_grad=True)
    shape = (vectors, batch, length, dim) if vectors > 1 else (batch, length, dim)
    w = torch.randn(*shape, device=device)

    def step() -> torch.Tensor:
        _, vjp = branch.linearise(x)
        (grad,) = torch.autograd.grad((vjp(w) * w).sum(), x)
        return grad

    return step


def agree(result: torch.Tensor, today: torch.Tensor) -> bool:
    """The same values to float32 rounding."""
    return torch.allclose(result, today, rtol=1e-4, atol=1e-6)


def timed(run: Callable[[], torch.Tensor], modes: dict, rounds: int, repeats: int,
          device: str) -> tuple[dict[str, float], bool]:
    """Median ms per call of ``run`` in each mode (interleaved rounds), and whether every mode
    gave today's values."""
    return interleaved.timed(run, modes, rounds, repeats, device, agree)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    interleaved.add_timing_arguments(parser, rounds=7, repeats=3)
    parser.add_argument("--blocks", type=int, default=24, help="blocks of the flow")
    parser.add_argument("--quick", action="store_true", help="one round, 4 blocks")
    args = parser.parse_args()
    rounds, repeats = interleaved.start(parser, args, ("rounds", "repeats", "blocks"))
    blocks = 4 if args.quick else args.blocks
    cases = [(f"training step: splines + attention flow, {blocks} blocks, 64 x 8 x 2",
              flow_step(blocks, args.device), FLOW_MODES),
             ("product: 16 vectors, 64 x 8 x 2, 2 heads",
              product(64, 8, 2, 2, 16, args.device), PRODUCT_MODES),
             ("product: no stack, 4 x 512 x 16, 2 heads",
              product(4, 512, 16, 2, 1, args.device), PRODUCT_MODES)]
    names = list(FLOW_MODES)
    print("| work | " + " | ".join(f"{m}, ms" for m in names) + " | same values |")
    print("| --- | " + " | ".join("---:" for _ in names) + " | --- |")
    for label, run, modes in cases:
        medians, same = timed(run, modes, rounds, repeats, args.device)
        cells = [f"{medians[m]:.1f}" + ("" if m == "today" else
                                        f" ({medians['today'] / medians[m]:.2f})")
                 if m in medians else "" for m in names]
        print(f"| {label} | " + " | ".join(cells) + f" | {'yes' if same else 'NO'} |")
    print("\n(in brackets: today's time over that mode's; below 1, today's is faster)")


if __name__ == "__main__":
    run_main(main)
