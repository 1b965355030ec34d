"""Benchmarks of the residual-flow machinery: estimators, memory, inverses, training-step speed.

Run from the repository root:

    python benchmarks/resflow.py            # full settings
    python benchmarks/resflow.py --quick    # small settings, a minute or so on 2 CPU cores
    python benchmarks/resflow.py --sections training --reference /path/to/residual-flows
    python benchmarks/resflow.py --sections training set --before /path/to/older/flowattn
    python benchmarks/resflow.py --sections set-reference --reference /path/to/residual-flows
    python benchmarks/resflow.py --sections particles --before /path/to/older/flowattn
    python benchmarks/resflow.py --sections compiled-sets --threads 1

Every section prints a Markdown table. Sections can be selected with --sections.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import math
import os
import statistics
import sys
import time
import weakref

import torch
from entry import positive_int, run_main
from torch import nn

from flowattn.attention import ContractiveL2MHA
from flowattn.branches import LipschitzMLP
from flowattn.flows.inverse import anderson_inverse, fixed_point_inverse
from flowattn.flows.logdet import LogDetOptions, exact_logdet, roulette_logdet, series_logdet
from flowattn.flows.residual import InvertibleResidual
from flowattn.validation import check_sets, trusted_inputs


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
def load_before(path: str):
    """An older flowattn checkout at ``path``, imported as the package ``flowattn_before``."""
    root = os.path.join(path, "flowattn")
    spec = importlib.util.spec_from_file_location(
        "flowattn_before", os.path.join(root, "__init__.py"), submodule_search_locations=[root]
    )
    package = importlib.util.module_from_spec(spec)
    sys.modules["flowattn_before"] = package
    spec.loader.exec_module(package)
    return package


def _entry(package: str):
    """Check the data once and run the blocks trusting them, as ``SetFlow`` does (an older
    flowattn without ``trusted_inputs`` checks in every block)."""
    validation = importlib.import_module(f"{package}.validation")
    trusted = getattr(validation, "trusted_inputs", None)
    if trusted is None:
        return lambda x: contextlib.nullcontext()

    def enter(x):
        validation.check_sets(x.unsqueeze(1))
        return trusted()

    return enter


def _our_model(memory_efficient: bool, package: str = "flowattn"):
    flows = importlib.import_module(f"{package}.flows")
    branches = importlib.import_module(f"{package}.branches")
    blocks = [
        flows.InvertibleResidual(
            branches.LipschitzMLP(2, [64, 64], coeff=0.9, per_layer_coeff=True),
            logdet=flows.LogDetOptions("roulette", n_exact_terms=2, n_samples=1, grad="neumann",
                                       memory_efficient=memory_efficient,
                                       generator=torch.Generator().manual_seed(0)),
        )
        for _ in range(8)
    ]
    model = nn.ModuleList(blocks).train()
    entry = _entry(package)

    def log_prob(x):
        h, total = x, x.new_zeros(x.shape[0])
        with entry(x):
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


def time_steps(configs, data, steps: int, warmup: int = 3) -> dict[str, list[float]]:
    """Seconds per training step (Adam) of each (name, model, log_prob), interleaved step by
    step so that every configuration sees the same load on a shared machine."""
    opts = [torch.optim.Adam(m.parameters(), lr=1e-3) for _, m, _ in configs]
    times = {name: [] for name, _, _ in configs}
    for step in range(steps + warmup):
        for (name, _, log_prob), opt in zip(configs, opts, strict=True):
            t0 = time.perf_counter()
            loss = -log_prob(data).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step >= warmup:
                times[name].append(time.perf_counter() - t0)
    return times


def step_table(times: dict[str, list[float]], baseline: str) -> None:
    """Median and minimum per configuration; ratios to ``baseline``: of the medians, and the
    median of the step-by-step ratios (the steps were interleaved)."""
    base = times[baseline]
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        paired = statistics.median(a / b for a, b in zip(ts, base, strict=True))
        rows.append([name, fmt(med * 1e3, 3), fmt(min(ts) * 1e3, 3),
                     fmt(med / statistics.median(base), 3), fmt(paired, 3)])
    table(["implementation", "median ms/step", "min ms/step", f"median / {baseline}",
           f"median of step ratios to {baseline}"], rows)


def bench_training_step(quick: bool, reference: str | None = None,
                        before: str | None = None, steps: int | None = None) -> None:
    print("### Training step: 8 blocks, 2-64-64-2 LipschitzMLP (LipSwish, coeff 0.9 per layer), "
          "batch 512, 2-D data, roulette + Neumann gradient, float32\n")
    steps = steps or (10 if quick else 50)
    torch.manual_seed(0)
    configs = [("flowattn", *_our_model(False)), ("flowattn, memory_efficient", *_our_model(True))]
    if before:
        load_before(before)
        configs.append(("flowattn before", *_our_model(False, "flowattn_before")))
    if reference:
        configs.append(("Residual Flows reference code", *_reference_model(reference)))
    times = time_steps(configs, torch.randn(512, 2), steps)
    step_table(times, "Residual Flows reference code" if reference else "flowattn")


# ------------------------------------------------------------------------------ set flow step
def _set_model(package: str = "flowattn"):
    flows = importlib.import_module(f"{package}.flows")
    torch.manual_seed(0)
    logdet = flows.LogDetOptions("roulette", n_exact_terms=2, grad="neumann",
                                 generator=torch.Generator().manual_seed(0))
    flow = flows.set_flow(dim=3, blocks=4, heads=1, logdet=logdet).train()
    return flow, flow.log_prob


def bench_set_step(quick: bool, before: str | None = None, steps: int | None = None) -> None:
    print("### Set-flow training step: set_flow(dim=3, blocks=4, heads=1) (ActNorm, equivariant "
          "linear, ContractiveL2MHA and LipschitzMLP residuals), 64 sets of N=32, roulette + "
          "Neumann gradient, float32\n")
    steps = steps or (5 if quick else 30)
    torch.manual_seed(1)
    data = torch.randn(64, 32, 3)
    configs = [("flowattn", *_set_model())]
    if before:
        load_before(before)
        configs.append(("flowattn before", *_set_model("flowattn_before")))
    for _, _, log_prob in configs:
        log_prob(data)  # ActNorm's data-dependent initialisation
    times = time_steps(configs, data, steps, warmup=2)
    step_table(times, "flowattn before" if before else "flowattn")


# ------------------------------------------------------------------------------ particle step
PARTICLES = {"dw4": (4, 2), "lj13": (13, 3), "lj55": (55, 3)}


def _particle_model(system: str, package: str = "flowattn"):
    """The flow that ``flowattn sets fit --data SYSTEM`` trains (the system's own defaults: radial
    and many-body residuals with closed-form Jacobians, exact log-det), and its batch size."""
    config = importlib.import_module(f"{package}.sets.config")
    settings = config.SetsRunConfig.build(config.SetsRunConfig.nest({"data": system}))
    n, d = PARTICLES[system]
    torch.manual_seed(0)
    flow = config.build_flow(settings.flow, d, n, True).train()
    return flow, flow.log_prob, settings.train.batch_size


def bench_particle_step(quick: bool, before: str | None = None, steps: int | None = None,
                        systems: tuple[str, ...] = tuple(PARTICLES)) -> None:
    print("### Particle-flow training step: the flow and batch size of `flowattn sets fit --data "
          "SYSTEM` (radial + many-body residuals, closed-form Jacobians, exact log-det), "
          "zero-centre-of-mass Gaussian configurations, float32\n")
    if before:
        load_before(before)
    for system in systems:
        print(f"{system}:\n")
        flow, log_prob, batch = _particle_model(system)
        configs = [("flowattn", flow, log_prob)]
        if before:
            configs.append(("flowattn before", *_particle_model(system, "flowattn_before")[:2]))
        n, d = PARTICLES[system]
        torch.manual_seed(1)
        data = torch.randn(batch, n, d)
        data = data - data.mean(1, keepdim=True)
        for _, model, _ in configs:
            model.standardise(data)
        count = steps or (2 if quick else 10 if n > 20 else 30)
        times = time_steps(configs, data, count, warmup=2)
        step_table(times, "flowattn before" if before else "flowattn")


#: what the compile section times: the flows ``flowattn sets fit`` trains for these settings
#: (on shape-sets the flow's own density, which a training step scores: ``symmetry: none``)
COMPILE_CASES = {
    "dw4": ("dw4", {"data": "dw4"}),
    "lj13": ("lj13", {"data": "lj13"}),
    "shape-sets-8": ("shape-sets, attention + splines, 8 blocks",
                     {"data": "shape-sets", "splines": True, "blocks": 8,
                      "symmetry": "none"}),
    "shape-sets-24": ("shape-sets, attention + splines, 24 blocks (the namesake flow)",
                      {"data": "shape-sets", "splines": True, "blocks": 24,
                       "symmetry": "none"}),
    "shape-sets-coupling": ("shape-sets, `--preset large` (12 set-coupling layers)",
                            {"data": "shape-sets", "preset": "large",
                             "symmetry": "none"}),
}


def _compile_case(settings: dict):
    """The flow ``sets fit`` builds for ``settings``, standardised and initialised on a batch of
    its training data (eagerly, as the task does), and the batch."""
    from flowattn.data import load_dataset
    from flowattn.sets.config import SetsRunConfig, build_flow

    config = SetsRunConfig.build(settings)
    train = load_dataset(config.data.data, None, seed=0)["train"]
    torch.manual_seed(0)
    flow = build_flow(config.flow, train.dim, train.set_size, train.zero_com).train()
    flow.standardise(train.x, train.mask)
    batch = train.x[: config.train.batch_size]
    flow.log_prob(batch)
    return flow, batch


def bench_compiled_sets(quick: bool, steps: int | None = None,
                        cases: list[str] | None = None) -> None:
    print("### Set-flow training step compiled: `SetFlow.compiled_log_prob()` (each layer "
          "through torch.compile, inductor) against the same flow eager, as `flowattn sets fit` "
          "trains it with and without `--compile`, a batch of training sets, float32\n")
    for key in cases or list(COMPILE_CASES):
        name, settings = COMPILE_CASES[key]
        eager, batch = _compile_case(settings)
        twin, _ = _compile_case(settings)
        compiled = twin.compiled_log_prob()
        torch._dynamo.utils.counters.clear()
        t0 = time.perf_counter()
        loss = -compiled(batch).mean()
        loss.backward()
        counters = torch._dynamo.utils.counters
        print(f"{name}: compilation (first step, forward and backward): "
              f"{time.perf_counter() - t0:.1f} s, {counters['stats']['unique_graphs']} graphs, "
              f"{sum(counters['graph_break'].values())} graph breaks\n")
        count = steps or (3 if quick else 10 if batch.shape[1] > 8 else 30)
        times = time_steps([("eager", eager, eager.log_prob), ("compiled", twin, compiled)],
                           batch, count, warmup=2)
        step_table(times, "eager")


# ------------------------------------------------------------------------------ set, reference
SET_REFERENCE = "Residual Flows reference code"


def _attention_branch() -> ContractiveL2MHA:
    return ContractiveL2MHA(dim=3, heads=1, coeff=0.9)


class AutogradBranch(nn.Module):
    """A branch without its closed-form ``linearise``: the block then takes autograd VJPs of
    its output (and a double backward for the Neumann gradient)."""

    def __init__(self, branch: nn.Module):
        super().__init__()
        self.branch = branch
        self.norm = branch.norm

    def forward(self, x, mask=None, causal=False):
        return self.branch(x, mask, causal)

    def lipschitz_bound(self, n):
        return self.branch.lipschitz_bound(n)


def _our_attention_flow(blocks: int = 4, generator: torch.Generator | None = None,
                        closed_form: bool = True):
    """``blocks`` InvertibleResidual blocks with ContractiveL2MHA(3, 1, 0.9) branches, with the
    set section's log-det options; the data checked once, then the blocks trust them.
    ``closed_form=False`` hides the branch's ``linearise`` (autograd products)."""
    generator = torch.Generator().manual_seed(0) if generator is None else generator
    logdet = LogDetOptions("roulette", n_exact_terms=2, grad="neumann", generator=generator)
    wrap = (lambda b: b) if closed_form else AutogradBranch
    model = nn.ModuleList(
        InvertibleResidual(wrap(_attention_branch()), logdet=logdet) for _ in range(blocks)
    ).train()

    def log_prob(x):
        h, total = x, x.new_zeros(x.shape[0])
        with _checked_sets(x):
            for block in model:
                h, ld = block(h)
                total = total + ld
        return _set_base_log_prob(h) + total

    return model, log_prob


def _checked_sets(x):
    """Check a batch of sets once, then trust it (as ``SetFlow.log_prob`` does)."""
    check_sets(x)
    return trusted_inputs()


def _set_base_log_prob(z):
    """log N(z; 0, I) summed over the N D coordinates of each set, (B,)."""
    return -0.5 * (z**2).sum(dim=(1, 2)) - 0.5 * z[0].numel() * math.log(2 * math.pi)


class TrustedBranch(nn.Module):
    """A flowattn branch as the Residual Flows code calls it, tensor in and tensor out, run
    inside ``trusted_inputs`` as ``InvertibleResidual`` runs its branch (the data are checked
    once where they enter, for both implementations)."""

    def __init__(self, branch: nn.Module):
        super().__init__()
        self.branch = branch

    def forward(self, x):
        with trusted_inputs():
            return self.branch(x)


def _reference_attention_flow(path: str, blocks: int = 4, neumann: bool = True):
    """The same blocks in the Residual Flows code: its ``iResBlock`` (geometric roulette with 2
    exact terms, one probe, Neumann gradient, no gradient in the forward pass) around the same
    ContractiveL2MHA branch. iResBlock flattens each sample, x.view(B, -1), for its probes and
    traces, so on (B, N, D) its log-det is over all N D coordinates."""
    sys.path.insert(0, path)
    import resflows.layers as layers  # noqa: PLC0415

    model = layers.SequentialFlow([
        layers.iResBlock(TrustedBranch(_attention_branch()), n_dist="geometric", n_samples=1,
                         neumann_grad=neumann, grad_in_forward=False)
        for _ in range(blocks)
    ]).train()

    def log_prob(x):
        with _checked_sets(x):
            z, delta = model(x, x.new_zeros(x.shape[0], 1))
        return _set_base_log_prob(z) - delta.squeeze(1)

    return model, log_prob


def check_set_reference_logdets(path: str, draws: int = 2000) -> None:
    """Both implementations estimate the same exact log-det: one block with the same branch
    weights on 4 sets of N = 4, D = 3 in float64, ``draws`` training-mode estimates each, against
    the exact value (flowattn's exact path). The reference's Neumann estimator returns the value
    of its gradient surrogate, sum_k (-1)^k c_k v^T J^(k+1) v (no 1/(k+1)), which is not a log-det
    estimate; its plain estimator (``neumann_grad=False``) is, and is shown as well."""
    torch.manual_seed(3)
    ours, _ = _our_attention_flow(1, torch.Generator().manual_seed(5))
    ours = ours.double()
    x = torch.randn(4, 4, 3, dtype=torch.float64)
    with torch.no_grad():
        exact = InvertibleResidual(ours[0].branch, logdet=LogDetOptions("exact")).train()(x)[1]
    import numpy as np  # noqa: PLC0415  (the reference draws its lengths from numpy)

    np.random.seed(5)
    rows = []
    for name, neumann in (("flowattn (Neumann gradient)", None),
                          (f"{SET_REFERENCE}, neumann_grad=False", False),
                          (f"{SET_REFERENCE}, neumann_grad=True", True)):
        if neumann is None:
            block = ours[0]
        else:
            block = _reference_attention_flow(path, 1, neumann)[0].double().chain[0]
            block.nnet.branch.load_state_dict(ours[0].branch.state_dict())
        est = []
        for _ in range(draws):
            if neumann is None:
                est.append(block(x)[1].detach())
            else:
                est.append(-block(x, x.new_zeros(4, 1))[1].detach().squeeze(1))
        est = torch.stack(est)
        mean, se = est.mean(0), est.std(0) / draws**0.5
        rows.append([name] + [f"{m:.4f} ± {s:.4f}" for m, s in zip(mean.tolist(), se.tolist(),
                                                                       strict=True)])
    rows.append(["exact"] + [f"{v:.4f}" for v in exact.tolist()])
    print(f"Log-det of one block (the same weights) on 4 sets of N=4, D=3, float64, training "
          f"mode: mean ± standard error of {draws} roulette estimates, and the exact value\n")
    table(["estimate", "set 1", "set 2", "set 3", "set 4"], rows)


def bench_set_reference(quick: bool, reference: str | None = None,
                        steps: int | None = None) -> None:
    print("### Set-flow training step against the Residual Flows code: 4 residual blocks with "
          "ContractiveL2MHA(dim=3, heads=1, coeff=0.9) branches, 64 sets of N=32, D=3, "
          "geometric roulette (2 exact terms) + Neumann gradient, float32\n")
    steps = steps or (10 if quick else 50)
    torch.manual_seed(0)
    configs = [("flowattn", *_our_attention_flow()),
               ("flowattn, autograd products", *_our_attention_flow(closed_form=False))]
    if reference:
        check_set_reference_logdets(reference, 200 if quick else 2000)
        configs.append((SET_REFERENCE, *_reference_attention_flow(reference)))
    torch.manual_seed(1)
    data = torch.randn(64, 32, 3)
    times = time_steps(configs, data, steps)
    step_table(times, SET_REFERENCE if reference else "flowattn")


# ------------------------------------------------------------------------------ torch.compile
def bench_compile(quick: bool, steps: int | None = None) -> None:
    print("### torch.compile: the residual-flow training step (as above) compiled against eager\n")
    steps = steps or (10 if quick else 50)
    torch.manual_seed(0)
    eager = _our_model(False)
    model, log_prob = _our_model(False)
    compiled = torch.compile(log_prob)
    data = torch.randn(512, 2)
    t0 = time.perf_counter()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(3):  # compiles, then one recompilation with a dynamic number of terms
        loss = -compiled(data).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"compilation (first 3 steps): {time.perf_counter() - t0:.1f} s\n")
    times = time_steps([("eager", *eager), ("torch.compile", model, compiled)], data, steps)
    step_table(times, "eager")


SECTIONS = {
    "estimators": bench_estimators,
    "memory": bench_memory,
    "inverse": bench_inverse,
    "training": bench_training_step,
    "set": bench_set_step,
    "particles": bench_particle_step,
    "compiled-sets": bench_compiled_sets,
    "set-reference": bench_set_reference,
    "compile": bench_compile,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small settings")
    parser.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch intra-op threads")
    parser.add_argument("--reference", default=None,
                        help="path holding the Residual Flows package `resflows`, timed alongside")
    parser.add_argument("--before", default=None,
                        help="path holding an older flowattn checkout, timed alongside")
    parser.add_argument("--compile-cases", nargs="+", choices=list(COMPILE_CASES), default=None,
                        help="the flows of the compiled-sets section (default: all)")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps of the training, set and compile sections")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"device cpu, quick={args.quick}\n")
    for name in args.sections:
        if name == "training":
            bench_training_step(args.quick, args.reference, args.before, args.steps)
        elif name == "set":
            bench_set_step(args.quick, args.before, args.steps)
        elif name == "particles":
            bench_particle_step(args.quick, args.before, args.steps)
        elif name == "compiled-sets":
            bench_compiled_sets(args.quick, args.steps, args.compile_cases)
        elif name == "set-reference":
            bench_set_reference(args.quick, args.reference, args.steps)
        elif name == "compile":
            bench_compile(args.quick, args.steps)
        else:
            SECTIONS[name](args.quick)


if __name__ == "__main__":
    run_main(main)
