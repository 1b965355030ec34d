"""Forward + backward time of the attention modules, as ratios to dot-product attention.

Every module is timed in the same process, in interleaved rounds (so slow drifts of the machine
hit all of them alike), and the median per call is reported next to its ratio to DotProductMHA.

The rows "direct SDPA" time the same module with its attention kernel,
:func:`flowattn.attention.kernels.attend`, replaced by a direct call of
:func:`torch.nn.functional.scaled_dot_product_attention` -- the first-order path as it was
before ``attend`` made every module differentiable to any order -- so that what ``attend``
costs on the fused path is measured in the same process. The row "output divided" times
``ContractiveL2MHA`` dividing F's output by its bound, as before c / bound was taken into
F's output weights W^O (where one bound holds for the whole call). The rows "SVD norms" time the
contractive modules with the certificate's spectral norms from the SVD, as before
:func:`flowattn.lipschitz.spectral_norm_exact` took them from a symmetric eigensolver.
``--second-order`` times a gradient-of-gradient step instead (a Jacobian penalty), against
PyTorch's composite ("math") SDPA backend, the only twice-differentiable kernel before
``attend``.

    python benchmarks/attention.py                 # CPU, both default shapes
    python benchmarks/attention.py --device cuda   # on a GPU
    python benchmarks/attention.py --threads 1     # one intra-op thread
    python benchmarks/attention.py --quick         # a fast smoke run
    python benchmarks/attention.py --second-order  # grad of grad: attend vs the math backend
    python benchmarks/attention.py --shape 4 32 32 4  # one shape of your own (B, N, D, H)
"""

from __future__ import annotations

import argparse
import statistics
from contextlib import ExitStack
from unittest import mock

import torch
import torch.nn.functional as F
from entry import positive_int, run_main
from machine import cpu_name
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils import benchmark

from flowattn.attention import L2MHA, ContractiveL2MHA, DotProductMHA, dot_product, l2
from flowattn.attention.contractive import ContractiveAttention
from flowattn.lipschitz import lambertw, norms

SHAPES = [(32, 128, 128, 8), (8, 512, 256, 8)]  # (B, N, D, H)


class Patched(torch.nn.Module):
    """``module`` run with the name ``name`` in ``namespace`` (its kernel ``attend`` by
    default) replaced by ``kernel``."""

    def __init__(self, module, namespace, kernel, context=None, name="attend"):
        super().__init__()
        self.module, self.namespace, self.kernel, self.context = module, namespace, kernel, context
        self.name = name

    def forward(self, x):
        with ExitStack() as stack:
            stack.enter_context(mock.patch.object(self.namespace, self.name, self.kernel))
            if self.context is not None:
                stack.enter_context(self.context())
            return self.module(x)


class _W0ThroughIterations:
    """Lambert W_0 differentiated through its Halley iterations, as before
    :func:`flowattn.lipschitz.lambertw0` had its closed-form derivative (same values)."""

    halley = staticmethod(lambertw._LambertW0.forward)

    @staticmethod
    def apply(x, iterations):
        return _W0ThroughIterations.halley(x, iterations)  # traced by autograd


def svd_norm(w: torch.Tensor) -> torch.Tensor:
    """The certificate's spectral norms from the SVD, as before
    :func:`flowattn.lipschitz.spectral_norm_exact` used a symmetric eigensolver (same values)."""
    return torch.linalg.matrix_norm(w, ord=2)


def math_backend():
    return sdpa_kernel([SDPBackend.MATH])


def modules(dim: int, heads: int, second_order: bool) -> dict[str, torch.nn.Module]:
    dp, fused = DotProductMHA(dim, heads), L2MHA(dim, heads, fused=True)
    lm = ContractiveL2MHA(dim, heads, norm="2,inf", self_offset=4.0, position_bias=4.0)
    contractive = ContractiveL2MHA(dim, heads)
    sdpa = F.scaled_dot_product_attention
    if second_order:  # before attend(): the math backend, the only twice-differentiable one
        return {
            "DotProductMHA": dp,
            "DotProductMHA, math SDPA": Patched(dp, dot_product, sdpa, math_backend),
            "L2MHA fused": fused,
            "L2MHA fused, math SDPA": Patched(fused, l2, sdpa, math_backend),
        }
    return {
        "DotProductMHA": dp,
        "DotProductMHA, direct SDPA": Patched(dp, dot_product, sdpa),
        "L2MHA fused": fused,
        "L2MHA fused, direct SDPA": Patched(fused, l2, sdpa),
        "L2MHA reference": L2MHA(dim, heads, fused=False),
        "ContractiveL2MHA": contractive,
        "ContractiveL2MHA, SVD norms": Patched(
            contractive, norms, svd_norm, name="spectral_norm_exact"),
        # as before c / bound went into W^O: F's output divided by the bound
        "ContractiveL2MHA, output divided": Patched(
            contractive, ContractiveL2MHA, ContractiveAttention._divided, name="_divided"),
        # the language model's settings: logit offsets (their certificate's constant is
        # W_0 of the offsets' weighted count, differentiated every step) and the mixed norm
        "ContractiveL2MHA, LM": lm,
        "ContractiveL2MHA, LM, W0 through its iterations": Patched(
            lm, lambertw, _W0ThroughIterations, name="_LambertW0"),
        "ContractiveL2MHA, LM, SVD norms": Patched(
            lm, norms, svd_norm, name="spectral_norm_exact"),
    }


def step(module: torch.nn.Module, x: torch.Tensor) -> None:
    module(x).sum().backward()


def second_order_step(module: torch.nn.Module, x: torch.Tensor) -> None:
    """A Jacobian penalty: || d<f(x), 1>/dx ||^2, differentiated once more."""
    (g,) = torch.autograd.grad(module(x).sum(), x, create_graph=True)
    g.pow(2).sum().backward()


def time_once(module, x, min_run_time: float, step=step) -> float:
    timer = benchmark.Timer(
        stmt="step(module, x)",
        globals={"step": step, "module": module, "x": x},
        num_threads=torch.get_num_threads(),
    )
    return timer.blocked_autorange(min_run_time=min_run_time).median


def run(shape, device, dtype, rounds, min_run_time, second_order=False) -> dict[str, float]:
    batch, length, dim, heads = shape
    torch.manual_seed(0)
    x = torch.randn(batch, length, dim, device=device, dtype=dtype, requires_grad=True)
    mods = {
        k: m.to(device=device, dtype=dtype) for k, m in modules(dim, heads, second_order).items()
    }
    one = second_order_step if second_order else step
    for m in mods.values():  # warm-up: kernels, allocator
        one(m, x)
    samples: dict[str, list[float]] = {k: [] for k in mods}
    for _ in range(rounds):
        for name, m in mods.items():
            samples[name].append(time_once(m, x, min_run_time, one))
    return {k: statistics.median(v) for k, v in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--min-run-time", type=float, default=1.0)
    parser.add_argument("--threads", type=positive_int, help="intra-op threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="one short round, small shapes")
    parser.add_argument("--shape", type=int, nargs=4, metavar=("B", "N", "D", "H"),
                        help="time this shape instead of the default ones")
    parser.add_argument("--second-order", action="store_true",
                        help="time a gradient of a gradient (Jacobian penalty) instead")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    shapes = [(4, 32, 32, 4)] if args.quick else SHAPES
    if args.shape:
        shapes = [tuple(args.shape)]
    rounds, min_run_time = (1, 0.05) if args.quick else (args.rounds, args.min_run_time)
    device_name = (
        torch.cuda.get_device_name() if args.device.startswith("cuda") else cpu_name()
    )
    print(f"device: {args.device} ({device_name}), threads: {torch.get_num_threads()}, "
          f"dtype: {args.dtype}, torch {torch.__version__}")
    what = "grad of grad" if args.second_order else "fwd+bwd"
    print(f"| (B, N, D, H) | module | ms / call ({what}) | ratio to DP |")
    print("| --- | --- | ---: | ---: |")
    before = "math SDPA" if args.second_order else "direct SDPA"
    for shape in shapes:
        times = run(shape, args.device, dtype, rounds, min_run_time, args.second_order)
        base = times["DotProductMHA"]
        for name, t in times.items():
            print(f"| {shape} | {name} | {1e3 * t:.2f} | {t / base:.2f} |")
        for name in ("DotProductMHA", "L2MHA fused"):
            ratio = times[name] / times[f"{name}, {before}"]
            print(f"| {shape} | {name}: attend / {before} | | {ratio:.2f} |")
        if not args.second_order:
            fused, ref = times["L2MHA fused"], times["L2MHA reference"]
            print(f"| {shape} | reference / fused | | {ref / fused:.2f} |")
            lm, iterated = (times["ContractiveL2MHA, LM"],
                            times["ContractiveL2MHA, LM, W0 through its iterations"])
            print(f"| {shape} | ContractiveL2MHA, LM: closed-form W0' / iterations | | "
                  f"{lm / iterated:.2f} |")
            for name in ("ContractiveL2MHA", "ContractiveL2MHA, LM"):
                ratio = times[name] / times[f"{name}, SVD norms"]
                print(f"| {shape} | {name}: eigensolver / SVD norms | | {ratio:.2f} |")
            ratio = times["ContractiveL2MHA"] / times["ContractiveL2MHA, output divided"]
            print(f"| {shape} | ContractiveL2MHA: c / bound in W^O / output divided | | "
                  f"{ratio:.2f} |")


if __name__ == "__main__":
    run_main(main)
