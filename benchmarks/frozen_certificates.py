"""Repeated calls with fixed weights, with and without frozen certificates: time ratios.

An iterative inverse calls its branch tens of times with the same weights, and an evaluation
calls the model on many batches. Inside :func:`flowattn.attention.frozen_certificates` (which
the inverses and the evaluation functions enter) each contractive attention module
evaluates its certificate once per set size instead of at every call. This script times the
same work with the context (``frozen``) and without it (``afresh``, the code before it
existed), in interleaved rounds in one process, checks that both give the same result bit for
bit, and prints the median times and their ratio:

* the invertible language model's ``invert_hidden_states`` (today's ``--invertible``
  defaults, width 128, 4 layers, nanoGPT's batch of 12 x 64 characters, untrained weights);
* one ``InvertibleResidual(ContractiveL2MHA)`` block of a set flow (16 sets of N = 32, D = 16,
  H = 4, coefficient 0.9, the flows' default solver);
* the validation loss of the contractive and the invertible language models (untrained) on
  the first 20,000 validation characters of Tiny Shakespeare (``--data``; these rows are
  skipped, with a note, when the file is absent).

    python benchmarks/frozen_certificates.py --threads 1
    python benchmarks/frozen_certificates.py --quick        # one round
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path

import torch
from entry import positive_int, run_main
from machine import cpu_name

from flowattn.attention import ContractiveL2MHA, frozen_certificates
from flowattn.flows import InvertibleResidual, inverse, residual
from flowattn.lm import train as lm_train
from flowattn.lm.config import LMConfig
from flowattn.lm.data import load_corpus
from flowattn.lm.invertible import invert_hidden_states
from flowattn.lm.model import build_model

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare" / "input.txt"


USERS = (inverse, residual, lm_train)  # the modules that enter the context themselves


@contextlib.contextmanager
def afresh():
    """Every call evaluates its bound, as before :func:`frozen_certificates`: the context is
    replaced by a no-op where the inverses and the evaluation enter it."""
    saved = [m.frozen_certificates for m in USERS]
    for m in USERS:
        m.frozen_certificates = contextlib.nullcontext
    try:
        yield
    finally:
        for m, context in zip(USERS, saved, strict=True):
            m.frozen_certificates = context


def language_model(device: str, **settings) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LMConfig(vocab_size=65, block_size=64, layers=4, dim=128, **settings)
    return build_model(config).to(device).eval()


def lm_inverse(device: str, data: Path):
    model = language_model(device, invertible=True)
    idx = torch.randint(0, 65, (12, 64), device=device)
    with torch.no_grad():
        h, _ = model.hidden_states(model.embed(idx))
    return lambda: invert_hidden_states(model, h)


def set_block_inverse(device: str, data: Path):
    torch.manual_seed(0)
    block = InvertibleResidual(ContractiveL2MHA(16, 4, coeff=0.9)).to(device).eval()
    y = torch.randn(16, 32, 16, device=device)
    return lambda: block.inverse(y)[0]


def lm_validation(settings: dict):
    def build(device: str, data: Path):
        model = language_model(device, **settings)
        val = load_corpus(data).val[:20000]
        return lambda: torch.tensor(lm_train.evaluate(model, val, 64, 12, torch.device(device)))

    return build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=positive_int, help="intra-op threads (default: torch's)")
    parser.add_argument("--data", type=Path, default=DATA, help="Tiny Shakespeare input.txt")
    parser.add_argument("--quick", action="store_true", help="one round")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rounds = 1 if args.quick else args.rounds
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else cpu_name()
    print(f"device: {args.device} ({name}), threads: {torch.get_num_threads()}, "
          f"torch {torch.__version__}, {rounds} interleaved round(s)\n")
    cases = [("inverse: invertible LM, 4 layers, 12 x 64", lm_inverse),
             ("inverse: InvertibleResidual(ContractiveL2MHA), 16 x 32 x 16", set_block_inverse)]
    if args.data.is_file():
        cases += [("validation: contractive-l2 LM, 20,000 characters",
                   lm_validation({"attention": "contractive-l2"})),
                  ("validation: invertible LM, 20,000 characters",
                   lm_validation({"invertible": True}))]
    else:
        print(f"(no {args.data}: the validation rows are skipped; give --data)\n")
    print("| work | frozen certificates, s | afresh, s | frozen / afresh | same result |")
    print("| --- | ---: | ---: | ---: | --- |")
    for label, build in cases:
        run = build(args.device, args.data)
        times: dict[str, list[float]] = {"frozen": [], "afresh": []}
        results = {}
        for _ in range(rounds):
            for mode, context in (("frozen", frozen_certificates), ("afresh", afresh)):
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
    run_main(main)
