"""Every certificate against optimised Jacobians at random weight scales and settings.

The tightness study (``bound_tightness.py``) measures the certificates of tied L2 attention at
Glorot weights, where every weight matrix has a spectral norm near 1. A bound that takes a
weight to the wrong power (Theorem 3.2's printed 2-norm bound has ||W^{Q,h}||^2 where its
proof gives the fourth power) holds there and fails once the weights carry their scale
elsewhere. This script draws, for every certified map of the library, random widths, heads,
set sizes, norms, calls (plain, masked, causal) and options (logit offsets at random values,
the orthogonal parametrisation), multiplies every weight matrix by its own factor
10^U(-1.5, 1.5), and compares the certificate with the largest Jacobian norm an optimiser finds
(``flowattn.lipschitz.lipschitz_lower_bound``, float64, started at input scales spread
around the one where attention is informative). Contractive modules are checked against
their coefficient. It exits with status 1 if a certificate is ever below a measured norm.

    python benchmarks/certificate_audit.py                  # 40 trials per family (~10 min)
    python benchmarks/certificate_audit.py --trials 5       # a quick pass
    python benchmarks/certificate_audit.py --families l2 contractive-l2 --trials 100
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch
from entry import positive_int, run_main
from machine import cpu_name

from flowattn.attention import (
    L2MHA,
    ContractiveInducedL2MHA,
    ContractiveL2MHA,
    ContractiveScaledCosineMHA,
    InducedL2MHA,
    ScaledCosineMHA,
)
from flowattn.branches import (
    LiftedL2MHA,
    LipschitzMLP,
    NeighbourhoodInteraction,
    RadialInteraction,
)
from flowattn.lipschitz import lipschitz_lower_bound
from flowattn.lm import LMConfig, TransformerLM

# One trial: the map on one set (N, D) -> (N, D'), its certificate, the norm, a description
# and the set's shape (N, D)
Trial = tuple[Callable[[torch.Tensor], torch.Tensor], float, str | int, str, tuple[int, int]]


def scale_weights(module: torch.nn.Module, rng: random.Random) -> None:
    """Multiply every weight matrix by its own factor 10^U(-1.5, 1.5); set logit offsets'
    parameters to N(0, 5^2) draws (anywhere between their floor and their caps)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "offset_logit" in name or "position_logit" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(
                    rng.randrange(2**31)), dtype=p.dtype) * 5.0)
            elif p.dim() >= 2:
                p.mul_(10.0 ** rng.uniform(-1.5, 1.5))


def one_set(module, n: int, call: str, rng: random.Random, dim: int):
    """The module as a map of one set of ``n`` present elements: plain, causal, or among
    padding (present elements at random slots of a set of n + 2, the padding far away)."""
    if call == "plain":
        return lambda z: module(z[None])[0]
    if call == "causal":
        return lambda z: module(z[None], causal=True)[0]
    slots = n + 2
    present = sorted(rng.sample(range(slots), n))
    absent = [i for i in range(slots) if i not in present]
    mask = torch.zeros(1, slots, dtype=torch.bool)
    mask[0, present] = True
    pad = torch.randn(len(absent), dim, dtype=torch.float64,
                      generator=torch.Generator().manual_seed(rng.randrange(2**31))) * 50

    def f(z):
        full = torch.zeros(slots, dim, dtype=z.dtype)
        full = full.index_put((torch.tensor(present),), z)
        full = full.index_put((torch.tensor(absent),), pad)
        return module(full[None], mask)[0][present]

    return f


def draw(family: str, rng: random.Random) -> Trial:
    """One random trial of ``family``."""
    heads = rng.choice([1, 2])
    dim = heads * rng.choice([1, 2, 3])
    n = rng.randint(1, 6)
    if family in ("l2", "contractive-l2"):
        norm = rng.choice(["inf", 2, "2,inf"])
        offsets = rng.choice([(0.0, 0.0)] * 3 + [(3.0, 0.0), (0.0, 3.0), (3.0, 3.0)])
        call = rng.choice(["plain", "mask", "causal"])
        if family == "l2":
            method = "thm3.2" if norm != "2,inf" and offsets == (0.0, 0.0) and rng.random() < 0.5 \
                else "tight"
            parametrization = rng.choice(["raw", "orthogonal"])
            module = L2MHA(dim, heads, self_offset=offsets[0], position_bias=offsets[1],
                           parametrization=parametrization).double()
            scale_weights(module, rng)
            bound = float(module.lipschitz_bound(n, norm, method=method,
                                                 causal=call == "causal").detach())
            label = f"{method}, {parametrization}"
        else:
            module = ContractiveL2MHA(dim, heads, norm=norm, self_offset=offsets[0],
                                      position_bias=offsets[1]).double()
            scale_weights(module, rng)
            bound, label = module.coeff, "coeff"
        what = f"{label}, offsets {offsets}"
    elif family in ("cosine", "contractive-cosine"):
        norm = rng.choice(["inf", 2])
        call = rng.choice(["plain", "mask", "causal"])
        if family == "cosine":
            module = ScaledCosineMHA(dim, heads).double()
            scale_weights(module, rng)
            bound = float(module.lipschitz_bound(n, norm).detach())
        else:
            module = ContractiveScaledCosineMHA(dim, heads, norm=norm).double()
            scale_weights(module, rng)
            bound = module.coeff
        what = ""
    elif family in ("induced", "contractive-induced"):
        norm, call = "2,inf", rng.choice(["plain", "mask"])
        inducing = rng.randint(1, 4)
        if family == "induced":
            module = InducedL2MHA(dim, heads, inducing).double()
            scale_weights(module, rng)
            bound = float(module.lipschitz_bound(n).detach())
        else:
            module = ContractiveInducedL2MHA(dim, heads, inducing=inducing).double()
            scale_weights(module, rng)
            bound = module.coeff
        what = f"M = {inducing}"
    elif family == "lifted":
        norm, call = "2,inf", rng.choice(["plain", "mask", "causal"])
        width = heads * rng.choice([2, 4])
        module = LiftedL2MHA(dim, width, heads).double()
        scale_weights(module, rng)
        bound, what = float(module.lipschitz_bound(n).detach()), f"W = {width}"
    elif family in ("lm-attention", "lm-feed-forward"):
        # a block of the invertible language model: its two branches against the constants
        # lipschitz_bounds reports (attention in its own norm over a causal sequence,
        # feed-forward in the 2-norm per token), with or without weighted residuals
        norm = rng.choice(["inf", "2,inf"])
        weighted = rng.random() < 0.5
        config = LMConfig(vocab_size=5, block_size=6, layers=1, dim=dim * 2, heads=heads,
                          invertible=True, contractive_norm=norm, weighted_residual=weighted,
                          self_offset=rng.choice([0.0, 2.0]), position_bias=0.0)
        model = TransformerLM(config).double().eval()
        scale_weights(model, rng)
        block = model.blocks[0]
        if weighted:
            with torch.no_grad():
                block.alpha_attn.uniform_(-1.5, 1.5)
                block.alpha_ff.uniform_(-1.5, 1.5)
        attn_bound, ff_bound = model.lipschitz_bounds(n)[0]
        dim *= 2
        if family == "lm-attention":
            call, bound = "causal", attn_bound
            module = block.attention_branch
        else:
            norm, call, bound, n = 2, "plain", ff_bound, 1
            module = block.ff_branch
        what = "weighted residual" if weighted else ""
    elif family in ("mlp", "radial", "manybody"):
        norm, call = 2, "plain"
        if family == "mlp":
            module = LipschitzMLP(dim, hidden=rng.choice([4, 16])).double()
        else:
            dim = rng.choice([2, 3])
            module = (RadialInteraction() if family == "radial"
                      else NeighbourhoodInteraction()).double()
        scale_weights(module, rng)
        module.eval()
        bound, what = float(torch.as_tensor(module.lipschitz_bound(n)).detach()), ""
    else:
        raise SystemExit(f"unknown family {family!r}")
    if isinstance(module, torch.nn.Module):  # (a branch of the language model is a method)
        module.eval()
    # a branch of the language model is causal by construction: called plain
    f = one_set(module, n, "plain" if family.startswith("lm-") else call, rng, dim)
    shape = f"D={dim} N={n}" if family in ("mlp", "radial", "manybody") else \
        f"D={dim} H={heads} N={n}"
    return f, bound, norm, f"{shape} {norm} {call} {what}".strip(), (n, dim)


def lower_bound(f, shape: tuple[int, int], norm, rng: random.Random, restarts: int,
                steps: int) -> float:
    """The largest Jacobian norm found, over input scales 10^-3 .. 10^1 times the optimiser's
    own (so that weights scaled by up to 10^1.5 still meet inputs where attention is informative):
    X = a Z with Z optimised, and J_f(a Z) has the norm of the Jacobian of Z -> f(a Z) / a."""
    best = 0.0
    for _ in range(restarts):
        a = 10.0 ** rng.uniform(-3.0, 1.0)
        found, _ = lipschitz_lower_bound(lambda z, a=a: f(a * z) / a, shape, norm, restarts=1,
                                         steps=steps, lr=0.05,
                                         generator=torch.Generator().manual_seed(
                                             rng.randrange(2**31)))
        best = max(best, found)
    return best


FAMILIES = ("l2", "contractive-l2", "cosine", "contractive-cosine", "induced",
            "contractive-induced", "lifted", "lm-attention", "lm-feed-forward", "mlp", "radial",
            "manybody")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--trials", type=int, default=40, help="random trials per family")
    parser.add_argument("--restarts", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {cpu_name()}, {args.threads} thread(s), float64; "
          f"{args.trials} trials per family, {args.restarts} restarts x {args.steps} steps\n")
    print("| family | trials | largest measured / certificate | its trial | "
          "largest with N >= 2 | median | violations | s |")
    print("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    rows, failed = [], []
    for family in args.families:
        rng = random.Random(f"{args.seed}-{family}")
        start, ratios, worst, wider = time.perf_counter(), [], (-1.0, ""), -1.0
        for _ in range(args.trials):
            torch.manual_seed(rng.randrange(2**31))
            f, bound, norm, what, shape = draw(family, rng)
            found = lower_bound(f, shape, norm, rng, args.restarts, args.steps)
            if not math.isfinite(bound) or bound <= 0:
                failed.append(f"{family}: {what}: certificate {bound}")
                continue
            ratio = found / bound
            ratios.append(ratio)
            if ratio > worst[0]:
                worst = (ratio, what)
            if shape[0] > 1:  # one element: a linear map, where the bounds are exact
                wider = max(wider, ratio)
            if found > bound * (1 + 1e-9):
                failed.append(f"{family}: {what}: certificate {bound:.6g} below a measured "
                              f"Jacobian norm {found:.6g}")
        violations = sum(f.startswith(f"{family}:") for f in failed)
        median = sorted(ratios)[len(ratios) // 2] if ratios else math.nan
        seconds = time.perf_counter() - start
        wider = None if wider < 0 else wider  # every trial of one element
        rows.append({"family": family, "trials": args.trials, "largest": worst[0],
                     "largest_trial": worst[1], "largest_n2": wider, "median": median,
                     "violations": violations, "seconds": seconds})
        print(f"| {family} | {args.trials} | {worst[0]:.3f} | {worst[1]} | "
              f"{'-' if wider is None else f'{wider:.3f}'} | {median:.3f} | {violations} | "
              f"{seconds:.0f} |", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows, "failures": failed}, indent=1) + "\n")
    for line in failed:
        print("VIOLATION " + line)
    return 1 if failed else 0


if __name__ == "__main__":
    run_main(main)
