"""Stacked vector-Jacobian products of tied L2 attention, against per-matrix ones: time ratios.

A log-det asks an attention branch for its vector-Jacobian products in stacks: the exact
log-det of a set of N elements in D dimensions takes all N D basis vectors at once, and every
vector of the stack meets the same attention matrices P^h. ``L2MHA.linearise`` moves the stack
into the rows (or columns) of one batched product (``_each_times``, ``_times_each``); before, it
multiplied each vector's matrices separately, a batch S times larger of tiny products. This
script times the same work both ways (``stacked``: the library; ``per-matrix``: those two
helpers replaced by the broadcasting products they stand for, the code before them) in
interleaved rounds in one process, checks that both give the same values (to float32 rounding)
and prints the medians and their ratio:

* the training step (log-density of a batch, forward and backward) of the residual flow with
  element-wise splines and contractive attention of ``benchmarks/sets.py``'s
  ``attention-splines`` variant at the shape of ``shape-sets`` (64 sets of 8 points in 2-D, so
  16 basis vectors), with 24 blocks as in its longest runs (``--blocks``), untrained weights;
* one ``ContractiveL2MHA`` product alone on that shape's stack (16 vectors, 64 x 8 x 2, 2 heads),
  forward and backward, as the log-det differentiates it;
* one product without a stack (a Hutchinson probe: 4 sets of N = 512, D = 16, 2 heads), where
  both ways run the same code (a check that nothing else moved; its ratio is noise).

    python benchmarks/linearise.py --threads 1
    python benchmarks/linearise.py --quick        # one round, 4 blocks
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time
from collections.abc import Callable
from unittest import mock

import torch
from machine import cpu_name

from flowattn.attention import ContractiveL2MHA
from flowattn.attention import l2 as l2_module
from flowattn.sets import SetsRunConfig, build_flow

SETTINGS = {"flow": "resflow", "interaction": "attention", "splines": True, "heads": 2}


def per_matrix() -> contextlib.ExitStack:
    """The products as before the stacked helpers: each vector's matrices multiplied apart
    (matmul broadcasting the shared operand over the stack)."""
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(l2_module, "_each_times", lambda w, a: w @ a))
    stack.enter_context(mock.patch.object(
        l2_module, "_times_each",
        lambda a, w: l2_module._times_narrow(a, w) if w.shape[-1] < a.shape[-2] else a @ w))
    return stack


def flow_step(blocks: int, device: str) -> Callable[[], torch.Tensor]:
    """A training step of the spline-and-attention residual flow; returns the input's gradient.
    Each step starts from the same state (the Lipschitz MLPs' power iterations move theirs at
    every training call), so that the two ways can be compared value for value."""
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=3, help="calls timed per round")
    parser.add_argument("--blocks", type=int, default=24, help="blocks of the flow")
    parser.add_argument("--threads", type=int, help="intra-op threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="one round, 4 blocks")
    args = parser.parse_args()
    for name in ("rounds", "repeats", "blocks"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    rounds, repeats = (1, 1) if args.quick else (args.rounds, args.repeats)
    blocks = 4 if args.quick else args.blocks
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else cpu_name()
    print(f"device: {args.device} ({name}), threads: {torch.get_num_threads()}, "
          f"torch {torch.__version__}, {rounds} interleaved round(s) of {repeats} call(s)\n")
    cases = [(f"training step: splines + attention flow, {blocks} blocks, 64 x 8 x 2",
              flow_step(blocks, args.device)),
             ("product: 16 vectors, 64 x 8 x 2, 2 heads", product(64, 8, 2, 2, 16, args.device)),
             ("product: no stack, 4 x 512 x 16, 2 heads", product(4, 512, 16, 2, 1, args.device))]
    print("| work | stacked, ms | per-matrix, ms | stacked / per-matrix | same values |")
    print("| --- | ---: | ---: | ---: | --- |")
    for label, run in cases:
        times: dict[str, list[float]] = {"stacked": [], "per-matrix": []}
        results = {}
        for mode, context in (("stacked", contextlib.nullcontext), ("per-matrix", per_matrix)):
            with context():
                results[mode] = run()  # warm-up, and the values compared
        for _ in range(rounds):
            for mode, context in (("stacked", contextlib.nullcontext), ("per-matrix", per_matrix)):
                with context():
                    start = time.perf_counter()
                    for _ in range(repeats):
                        run()
                    if args.device.startswith("cuda"):
                        torch.cuda.synchronize()
                    times[mode].append((time.perf_counter() - start) / repeats * 1e3)
        stacked, before = (statistics.median(times[m]) for m in ("stacked", "per-matrix"))
        same = torch.allclose(results["stacked"], results["per-matrix"], rtol=1e-4, atol=1e-6)
        print(f"| {label} | {stacked:.1f} | {before:.1f} | {stacked / before:.2f} | "
              f"{'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
