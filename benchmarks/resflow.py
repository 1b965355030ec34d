"""Benchmarks of the residual-flow machinery: estimators, memory, inverses, training-step speed.

Run from the repository root:

    python benchmarks/resflow.py            # full settings
    python benchmarks/resflow.py --quick    # small settings, a minute or so on 2 CPU cores
    python benchmarks/resflow.py --sections training --reference /path/to/residual-flows

Every section prints a Markdown table. Sections can be selected with --sections.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import weakref

import torch
from torch import nn

from flowattn.attention import ContractiveL2MHA
from flowattn.branches import LipschitzMLP
from flowattn.flows.inverse import anderson_inverse, fixed_point_inverse
from flowattn.flows.logdet import LogDetOptions, exact_logdet, roulette_logdet, series_logdet
from flowattn.flows.residual import InvertibleResidual


class NearLinearBranch(nn.Module):
    """g(x) = c tanh(vec(x) A), A symmetric with eigenvalues in [-1, -0.2]: Lip(g) = c, and near
    x = 0 the Jacobian has an eigenvalue close to -c (the slowest case for fixed-point steps and
    a large log-det)."""

    def __init__(self, n: int, d: int, c: float, seed: int = 0, dtype=torch.float64):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        m = n * d
        a = torch.randn(m, m, generator=gen, dtype=torch.float64)
        _, vecs = torch.linalg.eigh(a + a.T)
        eig = -torch.linspace(0.2, 1.0, m, dtype=torch.float64)
        self.register_buffer("a", (vecs @ torch.diag(eig) @ vecs.T).to(dtype))
        self.c = c

    def forward(self, x, mask=None, causal=False):
        return self.c * torch.tanh(x.reshape(x.shape[0], -1) @ self.a).reshape(x.shape)

    def lipschitz_bound(self, n):
        return self.c


def table(headers, rows):
    print("| " + " | ".join(headers) + " |")
    print("|" + "|".join(" --- " for _ in headers) + "|")
    for row in rows:
        print("| " + " | ".join(str(v) for v in row) + " |")
    print()


def fmt(x, digits=4):
    return f"{x:.{digits}g}"


# ------------------------------------------------------------------------------ estimators
def bench_estimators(quick: bool) -> None:
    print("### Log-det estimators: bias, standard deviation and time per call\n")
    reps = 40 if quick else 200
    B, N, D = 32, 8, 4
    cases = [
        ("ContractiveL2MHA c=0.9", ContractiveL2MHA(D, 2, coeff=0.9, fused=False).double()),
        ("near-linear c=0.9", NearLinearBranch(N, D, 0.9)),
    ]
    for name, branch in cases:
        torch.manual_seed(0)
        x = torch.randn(B, N, D, dtype=torch.float64) * (0.3 if "near" in name else 1.0)
        x.requires_grad_(True)
        gx = branch(x)
        t0 = time.perf_counter()
        exact = exact_logdet(gx, x)
        t_exact = (time.perf_counter() - t0) / B
        print(f"{name}: N={N}, D={D}, {B} sets, {reps} calls per row; mean |exact log-det| = "
              f"{fmt(exact.abs().mean().item())}, exact path {fmt(t_exact * 1e3)} ms per set\n")
        rows = []
        gen = torch.Generator().manual_seed(1)
        configs = [("series", k, "-") for k in ([1, 2, 4, 8] if quick else [1, 2, 4, 8, 16, 32])]
        configs += [("roulette geometric(0.5)", n, lens) for n in (1, 2) for lens in ("batch",
                    "sample")]
        configs += [("roulette poisson(2)", 2, "batch")]
        for method, terms, lens in configs:
            draws, times, nterms = [], [], []
            for _ in range(reps):
                t0 = time.perf_counter()
                if method == "series":
                    est = series_logdet(gx, x, terms, generator=gen)
                else:
                    dist = "geometric" if "geometric" in method else "poisson"
                    param = 0.5 if dist == "geometric" else 2.0
                    est = roulette_logdet(gx, x, terms, distribution=dist, param=param,
                                          lengths=lens, generator=gen)
                times.append(time.perf_counter() - t0)
                draws.append(est.detach())
            draws = torch.stack(draws)  # (reps, B)
            err = draws - exact.detach()
            bias = err.mean(0).abs().mean().item()
            se = (draws.std(0) / reps**0.5).mean().item()
            std = draws.std(0).mean().item()
            batch_mean_std = (draws.mean(1)).std().item()
            rows.append([method, terms, lens, fmt(bias), fmt(se), fmt(std), fmt(batch_mean_std),
                         fmt(statistics.median(times) / B * 1e3)])
            del nterms
        table(["estimator", "terms / exact terms", "lengths", "mean abs bias", "its std. error",
               "std per set", "std of batch mean", "ms per set"], rows)


# ------------------------------------------------------------------------------ memory
class SavedTensorMeter:
    """Peak bytes of tensors saved for backward (the memory of autograd graphs) while active."""

    def __init__(self):
        self.live = 0
        self.peak = 0
        self._seen = {}

    def _release(self, key, nbytes):
        if self._seen.pop(key, None) is not None:
            self.live -= nbytes

    def pack(self, t):
        key = (t.untyped_storage().data_ptr(), id(t))
        nbytes = t.untyped_storage().nbytes()
        if key not in self._seen:
            self._seen[key] = nbytes
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._release, key, nbytes)
        return t

    @staticmethod
    def unpack(t):
        return t


def bench_memory(quick: bool) -> None:
    print("### Peak autograd memory of a training step against the number of series terms\n")
    print("Bytes of tensors saved for backward (peak while the step runs), one residual block "
          "with a ContractiveL2MHA branch, B=64, N=16, D=16, float32, series estimator.\n")
    torch.manual_seed(0)
    branch = ContractiveL2MHA(16, 4, coeff=0.9, fused=False)
    x = torch.randn(64, 16, 16)
    rows = []
    for terms in ([1, 4, 16] if quick else [1, 2, 4, 8, 16, 32]):
        row = [terms]
        for grad, me in (("backprop", False), ("neumann", False), ("neumann", True)):
            logdet = LogDetOptions("series", n_terms=terms, grad=grad, memory_efficient=me,
                                   generator=torch.Generator().manual_seed(0))
            block = InvertibleResidual(branch, logdet=logdet)
            meter = SavedTensorMeter()
            t0 = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
                y, ld = block(x)
                loss = (y**2).mean() - ld.mean()
                loss.backward()
            elapsed = time.perf_counter() - t0
            branch.zero_grad()
            row += [fmt(meter.peak / 2**20, 3), fmt(elapsed * 1e3, 3)]
        rows.append(row)
    table(["terms", "backprop MiB", "backprop ms", "Neumann MiB", "Neumann ms",
           "Neumann + memory-efficient MiB", "Neumann + memory-efficient ms"], rows)


# ------------------------------------------------------------------------------ inverse
def bench_inverse(quick: bool) -> None:
    print("### Inverse: branch evaluations per set to reach tol 1e-6\n")
    rows = []
    B = 32 if quick else 128
    for c in (0.9, 0.97):
        cases = [
            ("near-linear (N=4, D=3)", NearLinearBranch(4, 3, c), 0.5, (B, 4, 3)),
            ("ContractiveL2MHA (N=16, D=8)", ContractiveL2MHA(8, 2, coeff=c).double(), 1.0,
             (B, 16, 8)),
            ("LipschitzMLP 2-64-64-2", LipschitzMLP(2, [64, 64], coeff=c).double().eval(), 1.0,
             (B, 1, 2)),
        ]
        for name, branch, scale, shape in cases:
            torch.manual_seed(1)
            with torch.no_grad():
                x = scale * torch.randn(*shape, dtype=torch.float64)
                y = x + branch(x)

                def g(z, m, branch=branch):
                    return branch(z, m)

                out = []
                for solver in (fixed_point_inverse, anderson_inverse):
                    t0 = time.perf_counter()
                    xr, stats = solver(g, y, tol=1e-6, max_iter=10000, return_stats=True)
                    out.append((stats["evaluations"] / shape[0], time.perf_counter() - t0,
                                (xr - x).abs().max().item()))
            rows.append([c, name, fmt(out[0][0]), fmt(out[1][0]), fmt(out[0][0] / out[1][0], 3),
                         fmt(out[0][2], 2), fmt(out[1][2], 2)])
    table(["coeff", "branch", "fixed-point evals", "Anderson evals", "ratio",
           "fixed-point max error", "Anderson max error"], rows)


# ------------------------------------------------------------------------------ training step
def _our_model(memory_efficient: bool) -> nn.Module:
    blocks = [
        InvertibleResidual(
            LipschitzMLP(2, [64, 64], coeff=0.9, per_layer_coeff=True),
            logdet=LogDetOptions("roulette", n_exact_terms=2, n_samples=1, grad="neumann",
                                 memory_efficient=memory_efficient,
                                 generator=torch.Generator().manual_seed(0)),
        )
        for _ in range(8)
    ]
    model = nn.ModuleList(blocks).train()

    def log_prob(x):
        h, total = x, x.new_zeros(x.shape[0])
        for block in model:
            h, ld = block(h)
            total = total + ld
        return -0.5 * (h**2).sum(-1) - math.log(2 * math.pi) + total

    return model, log_prob


def _reference_model(path: str):
    """The same network in the Residual Flows code (Chen et al. 2019), imported from ``path``."""
    sys.path.insert(0, path)
    import resflows.layers as layers  # noqa: PLC0415
    import resflows.layers.base as base_layers  # noqa: PLC0415

    def nnet():
        mods = []
        for a, b in zip([2, 64, 64], [64, 64, 2], strict=True):
            mods.append(base_layers.Swish())
            mods.append(base_layers.get_linear(a, b, coeff=0.9, n_iterations=5, atol=None,
                                               rtol=None, domain=2, codomain=2,
                                               zero_init=(b == 2)))
        return nn.Sequential(*mods)

    model = layers.SequentialFlow([
        layers.iResBlock(nnet(), n_dist="geometric", n_samples=1, neumann_grad=True,
                         grad_in_forward=False)
        for _ in range(8)
    ]).train()

    def log_prob(x):
        z, delta = model(x, x.new_zeros(x.shape[0], 1))
        return (-0.5 * (z**2).sum(1, keepdim=True) - math.log(2 * math.pi) - delta).squeeze(1)

    return model, log_prob


def bench_training_step(quick: bool, reference: str | None = None) -> None:
    print("### Training step: 8 blocks, 2-64-64-2 LipschitzMLP (LipSwish, coeff 0.9 per layer), "
          "batch 512, 2-D data, roulette + Neumann gradient, float32\n")
    steps = 10 if quick else 50
    torch.manual_seed(0)
    configs = [("flowattn", *_our_model(False)), ("flowattn, memory_efficient", *_our_model(True))]
    if reference:
        configs.append(("Residual Flows reference code", *_reference_model(reference)))
    opts = [torch.optim.Adam(m.parameters(), lr=1e-3) for _, m, _ in configs]
    data = torch.randn(512, 2)
    times = {name: [] for name, _, _ in configs}
    for step in range(steps + 3):
        # interleave the models so that they see the same load on a shared machine
        for (name, _, log_prob), opt in zip(configs, opts, strict=True):
            t0 = time.perf_counter()
            loss = -log_prob(data).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step >= 3:
                times[name].append(time.perf_counter() - t0)
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts) * 1e3
        rows.append([name, fmt(med, 3), fmt(min(ts) * 1e3, 3), fmt(med / 39.0, 3)])
    table(["implementation", "median ms/step", "min ms/step", "median / 39 ms"], rows)


SECTIONS = {
    "estimators": bench_estimators,
    "memory": bench_memory,
    "inverse": bench_inverse,
    "training": bench_training_step,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small settings")
    parser.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--reference", default=None,
                        help="path holding the Residual Flows package `resflows`, timed alongside")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"device cpu, quick={args.quick}\n")
    for name in args.sections:
        if name == "training":
            bench_training_step(args.quick, args.reference)
        else:
            SECTIONS[name](args.quick)


if __name__ == "__main__":
    main()
