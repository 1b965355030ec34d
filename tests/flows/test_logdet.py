"""Tests for flowattn.flows.logdet: exact, series and roulette log-determinants and gradients."""

import math

import pytest
import torch

from flowattn.attention import ContractiveL2MHA
from flowattn.branches import LipschitzMLP
from flowattn.errors import InputError
from flowattn.flows.geometry import project
from flowattn.flows.logdet import (
    exact_logdet,
    memory_efficient_logdet,
    roulette_logdet,
    roulette_tail_probability,
    sample_roulette_lengths,
    series_logdet,
)

DT = torch.float64


class DenseBranch(torch.nn.Module):
    """g(x) = c tanh(vec(x) W + b): couples every coordinate of a set (a full Jacobian)."""

    def __init__(self, n: int, d: int, c: float = 0.5, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        w = torch.randn(n * d, n * d, generator=gen, dtype=DT)
        self.weight = torch.nn.Parameter(c * w / torch.linalg.matrix_norm(w, ord=2))
        self.bias = torch.nn.Parameter(0.1 * torch.randn(n * d, generator=gen, dtype=DT))

    def forward(self, x, mask=None, causal=False):
        return torch.tanh(x.reshape(x.shape[0], -1) @ self.weight + self.bias).reshape(x.shape)


def brute_jacobian(fn, x):
    """(B, N D, N D) Jacobians of a per-set map, one set at a time (no batched VJPs)."""
    B, N, D = x.shape
    jacs = [
        torch.autograd.functional.jacobian(lambda s: fn(s.unsqueeze(0)).squeeze(0), x[b])
        for b in range(B)
    ]
    return torch.stack(jacs).reshape(B, N * D, N * D)


def brute_logdet(fn, x):
    jac = brute_jacobian(fn, x)
    eye = torch.eye(jac.shape[-1], dtype=DT)
    return torch.linalg.slogdet(eye + jac)[1], jac


def _with_graph(fn, x):
    x = x.clone().requires_grad_(True)
    return fn(x), x


def test_exact_full_logdet_matches_brute_force_jacobian_in_any_dimension():
    torch.manual_seed(0)
    branch = DenseBranch(4, 3, c=0.8)
    x = torch.randn(5, 4, 3, dtype=DT)
    gx, xr = _with_graph(branch, x)
    ref, _ = brute_logdet(branch, x)
    assert (exact_logdet(gx, xr, chunk_size=5) - ref).abs().max() < 1e-8
    assert ref.abs().min() > 1e-2  # the test is not trivially zero


def test_exact_causal_block_path_matches_brute_force_for_causal_attention():
    torch.manual_seed(1)
    att = ContractiveL2MHA(4, 2, coeff=0.9).double()
    x = torch.randn(3, 6, 4, dtype=DT)

    def fn(z):
        return att(z, causal=True)

    ref, jac = brute_logdet(fn, x)
    blocks = jac.reshape(3, 6, 4, 6, 4)
    upper = torch.triu(torch.ones(6, 6, dtype=torch.bool), diagonal=1)
    # block lower-triangular (up to rounding: the kernel centres queries over the sequence)
    assert blocks.permute(0, 1, 3, 2, 4)[:, upper].abs().max() < 1e-14
    gx, xr = _with_graph(fn, x)
    assert (exact_logdet(gx, xr, structure="causal", chunk_size=7) - ref).abs().max() < 1e-8
    assert ref.abs().min() > 1e-3


def test_exact_pointwise_path_matches_brute_force_for_mlp():
    torch.manual_seed(2)
    mlp = LipschitzMLP(3, 16, coeff=0.9).double().eval()
    x = torch.randn(4, 5, 3, dtype=DT)
    ref, _ = brute_logdet(mlp, x)
    gx, xr = _with_graph(mlp, x)
    assert (exact_logdet(gx, xr, structure="pointwise") - ref).abs().max() < 1e-8


def test_exact_logdet_excludes_padded_elements():
    torch.manual_seed(3)
    att = ContractiveL2MHA(2, 1, coeff=0.9).double()
    x = torch.randn(2, 5, 2, dtype=DT)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    x_pad = x.clone()
    x_pad[0, 3:] = 50.0  # padded values must not matter
    for structure in ("full", "causal"):
        causal = structure == "causal"

        def fn(z, m=None, causal=causal):
            return project(att(z, m, causal), m)

        gx, xr = _with_graph(lambda z, fn=fn: fn(z, mask), x_pad)
        got = exact_logdet(gx, xr, mask, structure)
        alone = [brute_logdet(fn, x[0:1, :3])[0], brute_logdet(fn, x[1:2])[0]]
        assert (got - torch.cat(alone)).abs().max() < 1e-8


def test_exact_zero_com_logdet_is_the_determinant_on_the_subspace():
    torch.manual_seed(4)
    n, d = 4, 3
    branch = DenseBranch(n, d, c=0.7, seed=4)
    x = torch.randn(2, n, d, dtype=DT)
    x = x - x.mean(dim=1, keepdim=True)

    def fn(z):
        return project(branch(z), zero_com=True)

    gx, xr = _with_graph(fn, x)
    got = exact_logdet(gx, xr, zero_com=True)
    # orthonormal basis U of {sum_i x_i = 0} in R^(n d); the restricted Jacobian is U^T J U
    centre = torch.eye(n, dtype=DT) - 1.0 / n
    q, _ = torch.linalg.qr(torch.kron(centre, torch.eye(d, dtype=DT)))
    eigvals, eigvecs = torch.linalg.eigh(torch.kron(centre, torch.eye(d, dtype=DT)))
    basis = eigvecs[:, eigvals > 0.5]
    assert basis.shape[1] == (n - 1) * d
    jac = brute_jacobian(fn, x)
    restricted = basis.T @ jac @ basis
    ref = torch.linalg.slogdet(torch.eye((n - 1) * d, dtype=DT) + restricted)[1]
    assert (got - ref).abs().max() < 1e-8
    del q


def _mean_and_se(draws):
    return draws.mean(dim=0), draws.std(dim=0) / draws.shape[0] ** 0.5


@pytest.mark.parametrize("probe", ["rademacher", "gaussian"])
def test_truncated_series_expectation_equals_truncated_trace_sum(probe):
    torch.manual_seed(5)
    branch = DenseBranch(3, 2, c=0.9, seed=5)
    x = 0.2 * torch.randn(2, 3, 2, dtype=DT)  # near-linear regime: large traces of J^k
    jac = brute_jacobian(branch, x)
    target = torch.zeros(2, dtype=DT)
    power = torch.eye(6, dtype=DT).expand(2, 6, 6)
    for k in range(1, 3):  # E[estimate] = sum_{k<=2} (-1)^(k+1) tr(J^k) / k
        power = power @ jac
        target += (-1) ** (k + 1) * power.diagonal(dim1=1, dim2=2).sum(-1) / k
    gx, xr = _with_graph(branch, x.repeat(4000, 1, 1))
    gen = torch.Generator().manual_seed(0)
    draws = series_logdet(gx, xr, 2, n_samples=4, probe=probe, generator=gen).reshape(4000, 2)
    mean, se = _mean_and_se(draws)
    assert ((mean - target).abs() < 4 * se).all(), (mean, target, se)
    exact = brute_logdet(branch, x)[0]
    assert ((target - exact).abs() > 6 * se).all()  # the test separates biased from unbiased


@pytest.mark.parametrize(
    "distribution,param,n_exact",
    [("geometric", 0.5, 2), ("poisson", 2.0, 1), ("geometric", 0.3, 0)],
)
def test_roulette_estimator_is_unbiased_with_per_sample_lengths(distribution, param, n_exact):
    torch.manual_seed(6)
    branch = DenseBranch(3, 2, c=0.6, seed=6)
    x = torch.randn(2, 3, 2, dtype=DT)
    exact = brute_logdet(branch, x)[0]
    gx, xr = _with_graph(branch, x.repeat(3000, 1, 1))
    gen = torch.Generator().manual_seed(1)
    draws = roulette_logdet(
        gx, xr, n_exact, distribution=distribution, param=param, lengths="sample", generator=gen
    ).reshape(3000, 2)
    mean, se = _mean_and_se(draws)
    assert ((mean - exact).abs() < 4 * se).all(), (mean, exact, se)
    assert (se < 0.05).all()


def test_roulette_estimator_is_unbiased_with_per_batch_lengths():
    torch.manual_seed(7)
    branch = DenseBranch(2, 2, c=0.6, seed=7)
    x = torch.randn(1, 2, 2, dtype=DT)
    exact = brute_logdet(branch, x)[0]
    gx, xr = _with_graph(branch, x.repeat(20, 1, 1))
    gen = torch.Generator().manual_seed(2)
    # one length per call: average over calls (20 probes per call share the length)
    draws = torch.stack([roulette_logdet(gx, xr, 1, generator=gen).mean() for _ in range(300)])
    mean, se = _mean_and_se(draws)
    assert (mean - exact).abs() < 4 * se


def test_roulette_weights_and_lengths_follow_the_stated_laws():
    assert roulette_tail_probability("geometric", 0.5, 1) == 1.0
    assert roulette_tail_probability("geometric", 0.5, 3) == pytest.approx(0.25)
    assert roulette_tail_probability("poisson", 2.0, 2) == pytest.approx(1 - torch.exp(
        torch.tensor(-2.0)).item())
    # large rates: the terms lambda^j / j! are summed in logarithms (they overflowed a float)
    rate = 150.0
    direct = sum(math.exp(-rate + j * math.log(rate) - math.lgamma(j + 1)) for j in range(149))
    assert roulette_tail_probability("poisson", rate, 150) == pytest.approx(1 - direct)
    assert 0.45 < roulette_tail_probability("poisson", rate, 150) < 0.55  # the median
    with pytest.raises(InputError, match="Poisson rate"):
        sample_roulette_lengths("poisson", float("inf"), (3,))
    gen = torch.Generator().manual_seed(0)
    geo = sample_roulette_lengths("geometric", 0.5, (20000,), gen)
    assert geo.min() >= 1 and abs(geo.double().mean().item() - 2.0) < 0.05
    poi = sample_roulette_lengths("poisson", 2.0, (20000,), gen)
    assert poi.min() >= 1 and abs(poi.double().mean().item() - 3.0) < 0.05
    a = sample_roulette_lengths("geometric", 0.5, (10,), torch.Generator().manual_seed(3))
    b = sample_roulette_lengths("geometric", 0.5, (10,), torch.Generator().manual_seed(3))
    assert torch.equal(a, b)  # reproducible from a seeded generator


def _exact_grad(branch, x):
    gx, xr = _with_graph(branch, x)
    logdet = exact_logdet(gx, xr, create_graph=True)
    return torch.autograd.grad(logdet.sum(), [branch.weight, branch.bias])


@pytest.mark.parametrize("grad", ["neumann", "backprop"])
def test_roulette_gradient_is_unbiased_for_the_exact_gradient(grad):
    torch.manual_seed(8)
    branch = DenseBranch(2, 2, c=0.5, seed=8)
    x = torch.randn(1, 2, 2, dtype=DT)
    exact = torch.cat([g.flatten() for g in _exact_grad(branch, x)])
    gen = torch.Generator().manual_seed(4)
    draws = []
    for _ in range(250):
        gx, xr = _with_graph(branch, x)
        est = roulette_logdet(gx, xr, 1, grad=grad, generator=gen, create_graph=True)
        grads = torch.autograd.grad(est.sum(), [branch.weight, branch.bias])
        draws.append(torch.cat([g.flatten() for g in grads]))
    mean, se = _mean_and_se(torch.stack(draws))
    assert ((mean - exact).abs() < 4 * se + 1e-12).all()
    assert (exact.abs() > 1e-3).sum() > 5


def test_neumann_series_gradient_converges_to_exact_gradient_with_many_terms():
    torch.manual_seed(9)
    branch = DenseBranch(2, 3, c=0.4, seed=9)
    x = torch.randn(3, 2, 3, dtype=DT)
    exact = torch.cat([g.flatten() for g in _exact_grad(branch, x)])
    # Gaussian probes, many of them: the truncation bias (0.4^30) is far below the noise
    gx, xr = _with_graph(branch, x.repeat(400, 1, 1))
    est = series_logdet(gx, xr, 30, n_samples=1, probe="gaussian", grad="neumann",
                        generator=torch.Generator().manual_seed(5), create_graph=True)
    grads = torch.autograd.grad(est.sum() / 400, [branch.weight, branch.bias])
    got = torch.cat([g.flatten() for g in grads])
    assert (got - exact).abs().max() < 0.1 * exact.abs().max()


def test_exact_logdet_gradients_pass_gradcheck():
    torch.manual_seed(10)
    branch = DenseBranch(2, 2, c=0.6, seed=10)
    x = torch.randn(2, 2, 2, dtype=DT, requires_grad=True)

    def f(z, w):
        gx = torch.tanh(z.reshape(2, -1) @ w + branch.bias).reshape(z.shape)
        return exact_logdet(gx, z, create_graph=True)

    w = branch.weight.detach().clone().requires_grad_(True)
    assert torch.autograd.gradcheck(f, (x, w))

    def g(z, w):  # backprop series with a fixed probe draw is a deterministic function
        gx = torch.tanh(z.reshape(2, -1) @ w + branch.bias).reshape(z.shape)
        gen = torch.Generator().manual_seed(0)
        return series_logdet(gx, z, 4, n_samples=2, generator=gen, create_graph=True)

    assert torch.autograd.gradcheck(g, (x, w))


def test_memory_efficient_gradients_equal_plain_gradients():
    torch.manual_seed(11)
    branch = DenseBranch(3, 2, c=0.6, seed=11)
    x = torch.randn(4, 3, 2, dtype=DT, requires_grad=True)
    params = [branch.weight, branch.bias]

    def logdet_fn(gx, z, cg):
        gen = torch.Generator().manual_seed(7)
        return roulette_logdet(gx, z, 2, grad="neumann", generator=gen, create_graph=cg)

    gx, xr = branch(x), x
    y_plain = xr + gx
    ld_plain = logdet_fn(gx, xr, True)
    loss = (y_plain**2).sum() - ld_plain.mean()
    ref = torch.autograd.grad(loss, [x, *params])
    y, ld = memory_efficient_logdet(branch, x, logdet_fn, params)
    assert torch.allclose(y, y_plain) and torch.allclose(ld, ld_plain)
    got = torch.autograd.grad((y**2).sum() - ld.mean(), [x, *params])
    for a, b in zip(got, ref, strict=True):
        assert torch.allclose(a, b, atol=1e-12, rtol=1e-10)
    y, ld = memory_efficient_logdet(branch, x, logdet_fn, params)
    weights = torch.arange(4, dtype=DT)
    with pytest.raises(RuntimeError, match="same loss weight"):
        torch.autograd.grad((ld * weights).sum(), params)


def test_estimators_reject_bad_arguments():
    branch = DenseBranch(2, 2)
    x = torch.randn(2, 2, 2, dtype=DT, requires_grad=True)
    gx = branch(x)
    with pytest.raises(ValueError, match="probe"):
        series_logdet(gx, x, 2, probe="uniform")
    with pytest.raises(ValueError, match="n_terms"):
        series_logdet(gx, x, 0)
    with pytest.raises(ValueError, match="structure"):
        exact_logdet(gx, x, structure="banded")
    with pytest.raises(ValueError, match="geometric"):
        roulette_logdet(gx, x, distribution="uniform")
    with pytest.raises(ValueError, match="lengths"):
        roulette_logdet(gx, x, lengths="token")
    with pytest.raises(ValueError, match="require grad"):
        exact_logdet(gx.detach(), x.detach())
    with pytest.raises(ValueError, match="shape"):
        exact_logdet(gx, x[:1])


def test_neumann_value_is_the_honest_estimate_of_the_same_draw():
    torch.manual_seed(12)
    branch = DenseBranch(3, 2, c=0.6, seed=12)
    x = torch.randn(4, 3, 2, dtype=DT)
    values = []
    for grad in ("backprop", "neumann"):
        gx, xr = _with_graph(branch, x)
        gen = torch.Generator().manual_seed(3)
        values.append(roulette_logdet(gx, xr, 2, grad=grad, generator=gen, create_graph=True))
    assert torch.allclose(values[0], values[1], atol=1e-13)


class _ReadsInBackward(torch.autograd.Function):
    """y = tanh(x) whose backward reads a value (``.item()``): no batching rule, so batched VJPs
    cannot run; ``raise_in_backward`` replaces the backward by an error of that type."""

    raise_in_backward: type[BaseException] | None = None
    backward_calls = 0

    @staticmethod
    def forward(ctx, x):
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        _ReadsInBackward.backward_calls += 1
        if _ReadsInBackward.raise_in_backward is not None:
            raise _ReadsInBackward.raise_in_backward("out of memory (simulated)")
        (y,) = ctx.saved_tensors
        assert grad.abs().sum().item() >= 0  # a host read: no batching rule
        return grad * (1 - y * y)


def _unbatchable(x):
    return 0.5 * _ReadsInBackward.apply(x.reshape(x.shape[0], -1).flip(-1)).reshape(x.shape)


@pytest.fixture
def fresh_fallback_warning(monkeypatch):
    import flowattn.flows.geometry as geometry

    monkeypatch.setattr(geometry, "_warned_fallback", False)
    monkeypatch.setattr(_ReadsInBackward, "raise_in_backward", None)
    monkeypatch.setattr(_ReadsInBackward, "backward_calls", 0)


def test_unbatchable_backward_falls_back_with_one_warning_and_the_exact_logdet(
    fresh_fallback_warning,
):
    from flowattn.flows.geometry import BatchedVJPFallbackWarning

    torch.manual_seed(0)
    x = torch.randn(3, 4, 2, dtype=DT, requires_grad=True)
    gx = _unbatchable(x)
    with pytest.warns(BatchedVJPFallbackWarning, match="Batching rule not implemented") as rec:
        first = exact_logdet(gx, x)
        second = exact_logdet(gx, x)  # warned once per process, not per call
    assert len([w for w in rec if w.category is BatchedVJPFallbackWarning]) == 1
    jac = brute_jacobian(_unbatchable, x.detach())
    expected = torch.linalg.slogdet(jac + torch.eye(8, dtype=DT))[1]
    assert torch.allclose(first, expected, atol=1e-12)
    assert torch.equal(first, second)


@pytest.mark.parametrize("error", [torch.OutOfMemoryError, RuntimeError])
def test_batched_vjp_errors_other_than_a_missing_batching_rule_propagate(
    fresh_fallback_warning, monkeypatch, error
):
    import warnings

    monkeypatch.setattr(_ReadsInBackward, "raise_in_backward", error)
    x = torch.randn(2, 3, 2, dtype=DT, requires_grad=True)
    gx = _unbatchable(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning either
        with pytest.raises(error, match="out of memory"):
            exact_logdet(gx, x)
    assert _ReadsInBackward.backward_calls == 1  # raised by the batched call, not retried


@pytest.mark.parametrize("estimator", ["series", "roulette"])
@pytest.mark.parametrize("grad", ["neumann", "backprop"])
@pytest.mark.parametrize("n_samples", [1, 3])
def test_pointwise_blocks_give_the_same_estimate_and_gradients_as_full_products(
    estimator, grad, n_samples
):
    """With a block-diagonal Jacobian the powers may come from its D x D blocks (D products)
    instead of K products: the same random draws, the same estimate and gradients."""
    torch.manual_seed(3)
    mlp = LipschitzMLP(2, 16, coeff=0.9).double().eval()  # one fixed map for both calls
    x = torch.randn(5, 4, 2, dtype=DT, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0]] * 5, dtype=torch.bool)
    results = []
    for structure in ("full", "pointwise"):
        gx = project(mlp(x, mask), mask)
        gen = torch.Generator().manual_seed(9)
        if estimator == "series":
            ld = series_logdet(gx, x, 6, mask, n_samples, grad=grad, generator=gen,
                               create_graph=True, structure=structure)
        else:
            ld = roulette_logdet(gx, x, 3, mask, n_samples, grad=grad, generator=gen,
                                 create_graph=True, structure=structure)
        grads = torch.autograd.grad(ld.sum(), [x, *mlp.parameters()], allow_unused=True)
        results.append((ld, grads))
    (ld1, g1), (ld2, g2) = results
    assert torch.allclose(ld1, ld2, rtol=1e-12, atol=1e-14)
    for a, b in zip(g1, g2, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.allclose(a, b, rtol=1e-10, atol=1e-13)


# -- estimators on a branch whose higher-order terms are large --------------------------------
# A branch with rho(J) ~ 0.25 hides every term k >= 2 below the test's noise: a mutation of the
# weights of those terms (no 1/P(n >= k) reweighting, a flipped sign, an index shifted by one)
# would pass. These tests use a Jacobian with eigenvalues down to -0.8, where the terms of
# sum_k (-1)^(k+1) tr(J^k) / k share their sign: k = 2 alone is more than a nat and the terms
# beyond k = 4 add up to more than 0.4 (test_strong_branch_has_large_higher_order_terms).

STRONG_EIGENVALUES = (-0.8, -0.75, -0.7, -0.6, 0.3, 0.5)


class StrongLinearBranch(torch.nn.Module):
    """g(x) = vec(x) W with W symmetric, eigenvalues ``STRONG_EIGENVALUES``: log det(I + W)
    is sum log(1 + lambda), and d/dW log det(I + W) = (I + W)^-T."""

    def __init__(self, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        q, _ = torch.linalg.qr(torch.randn(6, 6, generator=gen, dtype=DT))
        lam = torch.tensor(STRONG_EIGENVALUES, dtype=DT)
        self.weight = torch.nn.Parameter(q @ torch.diag(lam) @ q.T)

    def forward(self, x, mask=None, causal=False):
        return (x.reshape(x.shape[0], -1) @ self.weight).reshape(x.shape)


def _strong_exact():
    return torch.log1p(torch.tensor(STRONG_EIGENVALUES, dtype=DT)).sum()


def _partial_sums(branch, K):
    """sum_{k<=K} (-1)^(k+1) tr(W^k) / k for K = 1..len: what a wrong weighting would give."""
    lam = torch.linalg.eigvalsh(branch.weight.detach())
    k = torch.arange(1, K + 1, dtype=DT)
    terms = ((-1.0) ** (k + 1) / k).unsqueeze(1) * lam.unsqueeze(0) ** k.unsqueeze(1)
    terms = terms.sum(1)
    return terms, terms.cumsum(0)


def test_strong_branch_has_large_higher_order_terms():
    terms, partial = _partial_sums(StrongLinearBranch(), 40)
    exact = _strong_exact()
    assert (partial[-1] - exact).abs() < 1e-3  # the series converges to the log-det
    assert terms[1].abs() > 1.0  # k = 2 (an even term): more than a nat
    assert (exact - partial[3]).abs() > 0.4  # the terms beyond k = 4


@pytest.mark.parametrize("lengths", ["sample", "batch"])
def test_roulette_is_unbiased_where_higher_terms_are_large(lengths):
    # Mutations this detects (each checked by hand): the 1/P(n >= k) weights removed, the sign
    # of the even terms flipped, the tail probability taken at k - n_exact + 1 or k - n_exact -1.
    branch = StrongLinearBranch(seed=1)
    exact = _strong_exact()
    x = torch.randn(1, 3, 2, dtype=DT)
    gen = torch.Generator().manual_seed(11)
    draws = []
    for _ in range(300 if lengths == "batch" else 1):
        gx, xr = _with_graph(branch, x.repeat(4000 if lengths == "sample" else 20, 1, 1))
        est = roulette_logdet(gx, xr, 2, n_samples=4, distribution="geometric", param=0.3,
                              lengths=lengths, generator=gen)
        draws.append(est if lengths == "sample" else est.mean().reshape(1))
    mean, se = _mean_and_se(torch.cat(draws))
    assert (mean - exact).abs() < 4 * se, (float(mean), float(exact), float(se))
    assert se < 0.1  # well below the effect of any of the mutations (> 0.5 nats)


def test_truncated_series_value_is_the_partial_sum_where_higher_terms_are_large():
    # Gaussian and Rademacher probes agree on E[v^T W^k v] = tr(W^k): the series' coefficient
    # of every term is checked against the partial sum (a sign or an index off breaks it).
    branch = StrongLinearBranch(seed=2)
    x = torch.randn(1, 3, 2, dtype=DT)
    _, partial = _partial_sums(branch, 6)
    gx, xr = _with_graph(branch, x.repeat(4000, 1, 1))
    gen = torch.Generator().manual_seed(12)
    draws = series_logdet(gx, xr, 6, n_samples=16, generator=gen)
    mean, se = _mean_and_se(draws)
    assert (mean - partial[5]).abs() < 4 * se and se < 0.015
    assert (partial[5] - partial[4]).abs() > 8 * se  # one term more or less is seen


def _strong_exact_gradient(branch):
    return torch.linalg.inv(torch.eye(6, dtype=DT) + branch.weight.detach()).T


@pytest.mark.parametrize("grad", ["neumann", "backprop"])
def test_roulette_gradient_is_unbiased_where_higher_terms_are_large(grad):
    # The Neumann series u = sum_k k c_k (J^T)^(k-1) v: a coefficient k c_k replaced by c_k,
    # or a power off by one, moves the expected gradient far beyond the noise.
    branch = StrongLinearBranch(seed=3)
    x = torch.randn(1, 3, 2, dtype=DT)
    exact = _strong_exact_gradient(branch)
    gen = torch.Generator().manual_seed(13)
    draws = []
    for _ in range(600):
        gx, xr = _with_graph(branch, x)
        est = roulette_logdet(gx, xr, 2, n_samples=4, grad=grad, param=0.3, generator=gen,
                              create_graph=True)
        draws.append(torch.autograd.grad(est.sum(), branch.weight)[0])
    mean, se = _mean_and_se(torch.stack(draws))
    # d log det / dW depends on x only through the probes: the exact gradient is (I + W)^-T
    assert ((mean - exact).abs() < 4.5 * se + 1e-12).all(), (mean - exact).abs().max()
    assert se.max() < 0.2 and exact.abs().max() > 1.0


def test_neumann_series_gradient_matches_the_truncated_gradient_where_terms_are_large():
    # E[Neumann gradient of n terms] = d/dW sum_{k<=n} c_k tr(W^k) = sum_k k c_k (W^(k-1))^T.
    branch = StrongLinearBranch(seed=4)
    x = torch.randn(1, 3, 2, dtype=DT)
    w = branch.weight.detach()
    target = torch.zeros(6, 6, dtype=DT)
    power = torch.eye(6, dtype=DT)
    for k in range(1, 7):
        target += (-1) ** (k + 1) * power.T  # k c_k = (-1)^(k+1)
        power = power @ w
    gx, xr = _with_graph(branch, x.repeat(3000, 1, 1))
    est = series_logdet(gx, xr, 6, n_samples=2, grad="neumann", probe="gaussian",
                        generator=torch.Generator().manual_seed(14), create_graph=True)
    per_set = torch.autograd.grad(est.sum() / 3000, branch.weight)[0]
    # the mean over sets of one-probe-pair gradients; its noise is below 0.05 per entry here
    assert (per_set - target).abs().max() < 0.1, (per_set - target).abs().max()
    assert (target - _strong_exact_gradient(branch)).abs().max() > 0.3  # truncation is seen


# -- evaluation: probes until the standard error is small -------------------------------------


def test_precise_series_meets_its_standard_error_and_its_error_is_honest():
    from flowattn.flows.logdet import precise_series_logdet

    branch = DenseBranch(10, 4, c=0.7, seed=20)  # N D = 40
    x = 0.3 * torch.randn(3, 10, 4, dtype=DT, generator=torch.Generator().manual_seed(20))
    exact = brute_logdet(branch, x)[0]
    values, variances = [], []
    for seed in range(10):
        gx, xr = _with_graph(branch, x)
        value, variance = precise_series_logdet(
            gx, xr, 30, generator=torch.Generator().manual_seed(seed), round_samples=8,
            max_error=4e-3)
        values.append(value)
        variances.append(variance)
    values, variances = torch.stack(values), torch.stack(variances)
    assert (variances.sqrt() <= 4e-3 * 40).all()  # the target, per degree of freedom
    # the reported variance is that of the estimate: the spread over seeds agrees with it
    ratio = values.var(0) / variances.mean(0)
    assert ((ratio > 0.15) & (ratio < 3.5)).all(), ratio
    # unbiased up to a truncation far below the noise (40 * 0.7^31 / (31 * 0.3) per set)
    assert ((values.mean(0) - exact).abs() < 4 * (variances.mean(0) / 10).sqrt()).all()


def test_precise_series_stops_at_max_samples_and_reports_the_larger_error():
    from flowattn.flows.logdet import precise_series_logdet

    branch = DenseBranch(10, 2, c=0.7, seed=21)
    x = 0.3 * torch.randn(2, 10, 2, dtype=DT, generator=torch.Generator().manual_seed(21))
    gx, xr = _with_graph(branch, x)
    _, variance = precise_series_logdet(gx, xr, 30, generator=torch.Generator().manual_seed(0),
                                        round_samples=4, max_error=0.0, max_samples=10)
    assert torch.isfinite(variance).all() and (variance > 0).all()
    with pytest.raises(ValueError, match="round_samples"):
        precise_series_logdet(gx, xr, 30, round_samples=0)
