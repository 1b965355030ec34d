"""The E(n)-equivariant field of the particle flows: its speed-ups against the code before them.

``EGNNField`` (E-NF's dynamics) spends its time on (B, N, N, H) tensors of pair features. Two
changes make a forward and backward pass cheaper, and this script times each, in interleaved
rounds in one process, against the code before it (patched back in), checks that every way
gives the same values and gradients (to float32 rounding: within 10⁻⁴ of each tensor's
norm) and prints the medians and their ratios:

* **split first map**: the message MLP's first linear map of
  [h_i, h_j, |x_i - x_j|^2, |z_i - z_j|^2] is evaluated as (W_i h_i + b) + W_j h_j + W_ds [d; s],
  products of (B, N, H) tensors broadcast over the pairs. Before (mode ``concatenated``): the
  (B, N, N, 2H + 2) concatenation and its product, the largest tensors of a layer.
* **passes of at most 16 MB** (on the CPU): the sets of a call go through the layers in groups
  whose pair tensors stay within ``PAIR_BYTES``. A block above glibc's mmap threshold (at most
  32 MB) is mapped from the operating system at every allocation and returned at every free, so
  every elementwise pass over it pays its page faults. Before (mode ``one pass``): every set of
  the call at once.

Cases: E-NF's batch of 100 configurations for DW4 (N = 4), LJ13 (N = 13) and LJ55 (N = 55),
LJ13's evaluation batch of 1000, and LJ55 at the residual flows' batch of 32; the field of
``benchmarks/enf.py`` (width 32, 3 layers), untrained weights, one time per set (as flow
matching trains), the sum of squares of the field backpropagated to the weights and positions.

    python benchmarks/egnn.py --threads 1
    python benchmarks/egnn.py --quick        # one round, small cases
"""

from __future__ import annotations

import argparse
import contextlib
from unittest import mock

import interleaved
import torch
from entry import run_main

from flowattn import passes
from flowattn.flows import EGNNField
from flowattn.flows.continuous import egnn as egnn_module

CASES = [("DW4", 100, 4), ("LJ13", 100, 13), ("LJ13, evaluation", 1000, 13), ("LJ55", 100, 55),
         ("LJ55", 32, 55)]
QUICK_CASES = [("DW4", 100, 4), ("LJ13", 100, 13)]


def concatenated(layer, h, dist_sq, start_sq):
    """The first message map as before: the linear map of the concatenated pair features."""
    n = h.shape[1]
    return layer.message[0](torch.cat([h[:, :, None].expand(-1, -1, n, -1),
                                       h[:, None, :].expand(-1, n, -1, -1),
                                       dist_sq, start_sq], dim=-1))


def split_map_undone() -> contextlib.AbstractContextManager:
    return mock.patch.object(egnn_module._EquivariantLayer, "_first_message_layer",
                             concatenated)


def one_pass() -> contextlib.AbstractContextManager:
    return mock.patch.object(passes, "PAIR_BYTES", 2**62)


def both_before() -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    stack.enter_context(split_map_undone())
    stack.enter_context(one_pass())
    return stack


MODES = {"today": contextlib.nullcontext, "concatenated": split_map_undone,
         "one pass": one_pass, "both as before": both_before}


def case(batch: int, n: int, device: str):
    """One forward and backward of the field; returns the field and the gradients."""
    torch.manual_seed(0)
    field = EGNNField(3).to(device)
    with torch.no_grad():  # a field that moves the particles, as a trained one does
        for layer in field.layers:
            layer.displacement[-1].weight.normal_(0.0, 0.1)
    z = torch.randn(batch, n, 3, device=device)
    t = torch.rand(batch, device=device)

    def run():
        positions = z.clone().requires_grad_()
        out = field(t, positions)
        grads = torch.autograd.grad(out.square().sum(), [positions, *field.parameters()],
                                    allow_unused=True)
        return [out.detach(), *(g for g in grads if g is not None)]

    return run


def agree(result: list[torch.Tensor], today: list[torch.Tensor]) -> bool:
    """The same field and gradients to float32 rounding, relative to each tensor's norm
    (sums over up to 10^5 pairs)."""
    return all(torch.linalg.vector_norm(a - b) <= 1e-4 * torch.linalg.vector_norm(b)
               for a, b in zip(result, today, strict=True))


def timed(run, rounds: int, repeats: int, device: str) -> tuple[dict[str, float], bool]:
    """Median ms per call of each mode over interleaved rounds, and whether all agree."""
    return interleaved.timed(run, MODES, rounds, repeats, device, agree)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    interleaved.add_timing_arguments(parser, rounds=5, repeats=2)
    parser.add_argument("--quick", action="store_true", help="one round, DW4 and LJ13 only")
    args = parser.parse_args()
    rounds, repeats = interleaved.start(parser, args)
    print("| field, forward and backward | " + " | ".join(f"{m}, ms" for m in MODES)
          + " | same values |")
    print("| --- | " + " | ".join("---:" for _ in MODES) + " | --- |")
    for label, batch, n in QUICK_CASES if args.quick else CASES:
        medians, same = timed(case(batch, n, args.device), rounds, repeats, args.device)
        cells = [f"{medians[m]:.1f}" + ("" if m == "today" else
                                        f" ({medians['today'] / medians[m]:.2f})")
                 for m in MODES]
        print(f"| {label}: {batch} x {n} x 3 | " + " | ".join(cells)
              + f" | {'yes' if same else 'NO'} |")
    print("\n(in brackets: today's time over that mode's; below 1, today's is faster)")


if __name__ == "__main__":
    run_main(main)
