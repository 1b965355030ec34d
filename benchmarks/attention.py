"""Forward + backward time of the attention modules, as ratios to dot-product attention.

Every module is timed in the same process, in interleaved rounds (so slow drifts of the machine
hit all of them alike), and the median per call is reported next to its ratio to DotProductMHA.

    python benchmarks/attention.py                 # CPU, both default shapes
    python benchmarks/attention.py --device cuda   # on a GPU
    python benchmarks/attention.py --threads 1     # one intra-op thread
    python benchmarks/attention.py --quick         # a fast smoke run
"""

from __future__ import annotations

import argparse
import platform
import statistics

import torch
from torch.utils import benchmark

from flowattn.attention import L2MHA, ContractiveL2MHA, DotProductMHA

SHAPES = [(32, 128, 128, 8), (8, 512, 256, 8)]  # (B, N, D, H)


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo where there is one, else the platform's answer."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def modules(dim: int, heads: int) -> dict[str, torch.nn.Module]:
    return {
        "DotProductMHA": DotProductMHA(dim, heads),
        "L2MHA fused": L2MHA(dim, heads, fused=True),
        "L2MHA reference": L2MHA(dim, heads, fused=False),
        "ContractiveL2MHA": ContractiveL2MHA(dim, heads),
    }


def step(module: torch.nn.Module, x: torch.Tensor) -> None:
    module(x).sum().backward()


def time_once(module, x, min_run_time: float) -> float:
    timer = benchmark.Timer(
        stmt="step(module, x)",
        globals={"step": step, "module": module, "x": x},
        num_threads=torch.get_num_threads(),
    )
    return timer.blocked_autorange(min_run_time=min_run_time).median


def run(shape, device, dtype, rounds, min_run_time) -> dict[str, float]:
    batch, length, dim, heads = shape
    torch.manual_seed(0)
    x = torch.randn(batch, length, dim, device=device, dtype=dtype, requires_grad=True)
    mods = {k: m.to(device=device, dtype=dtype) for k, m in modules(dim, heads).items()}
    for m in mods.values():  # warm-up: kernels, allocator
        step(m, x)
    samples: dict[str, list[float]] = {k: [] for k in mods}
    for _ in range(rounds):
        for name, m in mods.items():
            samples[name].append(time_once(m, x, min_run_time))
    return {k: statistics.median(v) for k, v in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--min-run-time", type=float, default=1.0)
    parser.add_argument("--threads", type=int, help="intra-op threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="one short round, small shapes")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    shapes = [(4, 32, 32, 4)] if args.quick else SHAPES
    rounds, min_run_time = (1, 0.05) if args.quick else (args.rounds, args.min_run_time)
    device_name = (
        torch.cuda.get_device_name() if args.device.startswith("cuda") else cpu_name()
    )
    print(f"device: {args.device} ({device_name}), threads: {torch.get_num_threads()}, "
          f"dtype: {args.dtype}, torch {torch.__version__}")
    print("| (B, N, D, H) | module | ms / call (fwd+bwd) | ratio to DP |")
    print("| --- | --- | ---: | ---: |")
    for shape in shapes:
        times = run(shape, args.device, dtype, rounds, min_run_time)
        base = times["DotProductMHA"]
        for name, t in times.items():
            print(f"| {shape} | {name} | {1e3 * t:.2f} | {t / base:.2f} |")
        fused, ref = times["L2MHA fused"], times["L2MHA reference"]
        print(f"| {shape} | reference / fused | | {ref / fused:.2f} |")


if __name__ == "__main__":
    main()
