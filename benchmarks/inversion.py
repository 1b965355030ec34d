"""Inverses with and without frozen certificates: the time of one inversion, as a ratio.

An iterative inverse calls its branch tens of times with the same weights. Inside
:func:`flowattn.attention.frozen_certificates` (which the inverse enters) each contractive
attention module evaluates its certificate once per set size instead of at every call. This
script times the same inversions with the context replaced by a no-op (``afresh``, the code
before it existed), in interleaved rounds in one process, checks that both give the same
result bit for bit, and prints the median times and their ratio:

* the invertible language model's ``invert_hidden_states`` (today's ``--invertible``
  defaults, width 128, 4 layers, nanoGPT's batch of 12 x 64 characters, untrained weights);
* one ``InvertibleResidual(ContractiveL2MHA)`` block of a set flow (16 sets of N = 32, D = 16,
  H = 4, coefficient 0.9, the flows' default solver).

    python benchmarks/inversion.py --threads 1
    python benchmarks/inversion.py --quick        # one short round
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from machine import cpu_name

from flowattn.attention import ContractiveL2MHA
from flowattn.flows import InvertibleResidual, inverse, residual
from flowattn.lm.config import LMConfig
from flowattn.lm.invertible import invert_hidden_states
from flowattn.lm.model import build_model


@contextlib.contextmanager
def afresh():
    """The inverses as before :func:`frozen_certificates`: every call evaluates its bound."""
    saved = inverse.frozen_certificates, residual.frozen_certificates
    inverse.frozen_certificates = residual.frozen_certificates = contextlib.nullcontext
    try:
        yield
    finally:
        inverse.frozen_certificates, residual.frozen_certificates = saved


def language_model(device: str):
    torch.manual_seed(0)
    model = build_model(LMConfig(vocab_size=65, block_size=64, layers=4, dim=128,
                                 invertible=True)).to(device).eval()
    idx = torch.randint(0, 65, (12, 64), device=device)
    with torch.no_grad():
        h, _ = model.hidden_states(model.embed(idx))
    return lambda: invert_hidden_states(model, h)


def set_block(device: str):
    torch.manual_seed(0)
    block = InvertibleResidual(ContractiveL2MHA(16, 4, coeff=0.9)).to(device).eval()
    y = torch.randn(16, 32, 16, device=device)
    return lambda: block.inverse(y)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, help="intra-op threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="one round")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rounds = 1 if args.quick else args.rounds
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else cpu_name()
    print(f"device: {args.device} ({name}), threads: {torch.get_num_threads()}, "
          f"torch {torch.__version__}, {rounds} interleaved round(s)\n")
    print("| inverse | frozen certificates, s | afresh, s | frozen / afresh | same result |")
    print("| --- | ---: | ---: | ---: | --- |")
    for label, build in (("invertible LM, 4 layers, 12 x 64", language_model),
                         ("InvertibleResidual(ContractiveL2MHA), 16 x 32 x 16", set_block)):
        run = build(args.device)
        times: dict[str, list[float]] = {"frozen": [], "afresh": []}
        results = {}
        for _ in range(rounds):
            for mode, context in (("frozen", contextlib.nullcontext), ("afresh", afresh)):
                with torch.no_grad(), context():
                    start = time.perf_counter()
                    results[mode] = run()
                    if args.device.startswith("cuda"):
                        torch.cuda.synchronize()
                    times[mode].append(time.perf_counter() - start)
        frozen, fresh = (statistics.median(times[m]) for m in ("frozen", "afresh"))
        same = torch.equal(results["frozen"], results["afresh"])
        print(f"| {label} | {frozen:.3f} | {fresh:.3f} | {frozen / fresh:.2f} | "
              f"{'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
