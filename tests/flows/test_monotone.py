"""MonotoneResidual and its inverse layer: x + g(x), inverses, log-dets, gradients, spectrum."""

import math

import pytest
import torch

from flowattn.branches import RadialInteraction
from flowattn.errors import InverseNotConverged
from flowattn.flows import (
    InverseMonotoneResidual,
    InverseOptions,
    InvertibleResidual,
    LogDetOptions,
    MonotoneResidual,
    set_flow,
)
from flowattn.flows.monotone import _Recentred
from flowattn.lipschitz import jacobian, lipschitz_lower_bound

EXACT = LogDetOptions("exact")


def make(seed=0, coeff=0.9, max_slope=5.0, scale=3.0):
    torch.manual_seed(seed)
    g = RadialInteraction(coeff, basis=16, r_max=4.0, max_slope=max_slope).double()
    with torch.no_grad():
        g.weight.normal_(0.0, scale)
    return g


def randn(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


MASK = torch.tensor([[True] * 5, [True] * 3 + [False] * 2, [True] * 4 + [False]])


def centred(x, mask):
    w = mask[..., None].double()
    return (x - (x * w).sum(1, keepdim=True) / w.sum(1, keepdim=True)) * w


@pytest.mark.parametrize("zero_com", [False, True])
def test_block_is_x_plus_g_and_inverts(zero_com):
    g = make()
    block = MonotoneResidual(g, logdet=EXACT, zero_com=zero_com,
                             inverse=InverseOptions(tol=1e-11, max_iter=5000)).eval()
    x = 1.5 * randn(3, 5, 2)
    x = centred(x, MASK) if zero_com else x * MASK[..., None]
    y, logdet = block(x, context=MASK)
    torch.testing.assert_close(y, x + g(x, MASK), atol=1e-12, rtol=0)
    x_back, logdet_inv = block.inverse(y, context=MASK)
    torch.testing.assert_close(x_back, x, atol=1e-9, rtol=0)
    torch.testing.assert_close(logdet_inv, -logdet, atol=1e-9, rtol=0)


def test_logdet_is_exact():
    g = make()
    block = MonotoneResidual(g, logdet=EXACT).eval()
    x = 1.5 * randn(3, 5, 2)
    with torch.no_grad():
        _, logdet = block(x, context=MASK)
    for b in range(3):
        k = int(MASK[b].sum())
        jac = jacobian(lambda z: z + g(z[None])[0], x[b, :k])
        assert math.isclose(float(logdet[b]), float(torch.linalg.slogdet(jac)[1]), abs_tol=1e-10)


def test_expansion_reaches_max_slope_beyond_any_contractive_block():
    """Uniform weights, two points where psi' is flat: the top eigenvalue is ~ u = 5 > 1."""
    g = make()
    with torch.no_grad():
        g.weight.fill_(10.0)  # scaled down to sup psi' = 5
    x = torch.tensor([[[0.0, 0.0], [2.0, 0.0]]], dtype=torch.float64)
    top = torch.linalg.eigvalsh(g.jacobian(x).detach().reshape(4, 4)).max().item()
    assert 0.97 * 5.0 <= top <= g.spectrum()[1].item() + 1e-12


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_certified_spectrum_contains_every_eigenvalue(seed):
    g = make(seed)
    lower, upper = (t.item() for t in g.spectrum())
    assert lower <= 0.9 + 1e-12 and upper <= 5.0 + 1e-12
    x = 2.0 * randn(400, 4, 2, seed=seed)
    eig = torch.linalg.eigvalsh(g.jacobian(x).reshape(400, 8, 8))
    assert eig.min() >= -lower - 1e-12 and eig.max() <= upper + 1e-12


def test_recentred_branch_is_contractive_with_its_closed_form_jacobian():
    g = make()
    h = _Recentred(g)
    bound = h.lipschitz_bound().item()
    lower, upper = (t.item() for t in g.spectrum())
    assert math.isclose(bound, (upper + lower) / (upper - lower + 2))
    x = randn(2, 5, 3)
    mask = MASK[:2]
    jac = h.jacobian(x, mask)
    for b in range(2):
        ref = jacobian(lambda z, b=b: h(z[None], mask[b : b + 1])[0], x[b])
        torch.testing.assert_close(jac[b].reshape(15, 15), ref, atol=1e-12, rtol=0)
    lower_est, _ = lipschitz_lower_bound(lambda z: h(z[None])[0], (4, 2), p=2, restarts=3,
                                         steps=60, generator=torch.Generator().manual_seed(0))
    assert lower_est <= bound < 1


def test_errors():
    with pytest.raises(ValueError, match="not contractive"):
        InvertibleResidual(make(max_slope=3.0))  # monotone branches need the monotone block
    with pytest.raises(ValueError, match="spectrum"):
        MonotoneResidual(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="causal"):
        MonotoneResidual(make(), causal=True)
    with pytest.raises(ValueError, match="max_slope"):
        RadialInteraction(max_slope=0.0)


def test_monotone_set_flow_samples_and_scores_consistently():
    flow = set_flow(2, blocks=2, heads=1, interaction="radial", radial_max_slope=4.0,
                    zero_com=True, norm="2", logdet=EXACT,
                    inverse=InverseOptions(tol=1e-10)).double().eval()
    assert sum(isinstance(m, MonotoneResidual) for m in flow.modules()) == 2
    with torch.no_grad():
        for m in flow.modules():
            if isinstance(m, RadialInteraction):
                m.weight.normal_(0.0, 3.0, generator=torch.Generator().manual_seed(5))
    x, log_prob = flow.sample_and_log_prob(64, set_size=4,
                                           generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(flow.log_prob(x), log_prob, atol=1e-7, rtol=0)
    perm = torch.tensor([2, 0, 3, 1])
    torch.testing.assert_close(flow.log_prob(x[:, perm]), log_prob, atol=1e-7, rtol=0)


@pytest.mark.parametrize("zero_com", [False, True])
def test_inverse_block_inverts_the_monotone_map_with_exact_logdet(zero_com):
    g = make()
    layer = InverseMonotoneResidual(g, zero_com=zero_com)
    x = 1.5 * randn(3, 5, 2)
    x = centred(x, MASK) if zero_com else x * MASK[..., None]
    z, logdet = layer(x, context=MASK)
    torch.testing.assert_close(z + g(z, MASK), x, atol=1e-10, rtol=0)
    x_back, logdet_back = layer.inverse(z, context=MASK)
    torch.testing.assert_close(x_back, x, atol=1e-10, rtol=0)
    torch.testing.assert_close(logdet, -logdet_back, atol=1e-10, rtol=0)
    if not zero_com:
        jac = jacobian(lambda v: layer(v[None])[0][0], x[0].detach())
        assert math.isclose(logdet[0].item(), torch.linalg.slogdet(jac)[1].item(), abs_tol=1e-9)


def test_inverse_block_has_the_implicit_function_gradients():
    g = make()
    layer = InverseMonotoneResidual(g)
    x = (1.5 * randn(2, 4, 2)).requires_grad_(True)

    def loss(v):
        z, logdet = layer(v)
        return (z.sin() ** 2).sum() + logdet.sum()

    grad_x, grad_w = torch.autograd.grad(loss(x), [x, g.weight])
    eps = 1e-6
    with torch.no_grad():
        for i in (0, 5, 11):
            g.weight[i] += eps
            up = loss(x)
            g.weight[i] -= 2 * eps
            down = loss(x)
            g.weight[i] += eps
            assert math.isclose(grad_w[i].item(), (up - down).item() / (2 * eps), abs_tol=1e-6)
        shift = torch.zeros_like(x)
        shift[1, 2, 0] = eps
        numeric = (loss(x + shift) - loss(x - shift)).item() / (2 * eps)
        assert math.isclose(grad_x[1, 2, 0].item(), numeric, abs_tol=1e-6)


def test_inverse_block_converges_in_float32_and_reports_failure():
    g = make().float()
    layer = InverseMonotoneResidual(g)
    x = 1.5 * randn(4, 5, 2).float()
    z, _ = layer(x)
    assert (z + g(z) - x).abs().max() < 1e-4
    with pytest.raises(InverseNotConverged):
        InverseMonotoneResidual(make().double(), max_iter=1)(1.5 * randn(4, 5, 2))
    with pytest.raises(ValueError, match="jacobian"):
        InverseMonotoneResidual(torch.nn.Linear(2, 2))


def test_alternating_flow_and_its_settings():
    flow = set_flow(2, blocks=2, heads=1, interaction="radial", radial_max_slope=4.0,
                    radial_inverse=True, zero_com=True, norm="2", logdet=EXACT,
                    inverse=InverseOptions(tol=1e-11)).double().eval()
    kinds = [type(m) for m in flow.transform._transforms]
    assert MonotoneResidual in kinds and InverseMonotoneResidual in kinds
    x, log_prob = flow.sample_and_log_prob(32, set_size=4,
                                           generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(flow.log_prob(x), log_prob, atol=1e-7, rtol=0)
    with pytest.raises(ValueError, match="radial_max_slope"):
        set_flow(2, blocks=2, heads=1, interaction="radial", radial_inverse=True)
    from flowattn.errors import ConfigError
    from flowattn.sets import SetsRunConfig

    with pytest.raises(ConfigError, match="radial_max_slope"):
        SetsRunConfig.build({"radial_inverse": True})


def test_a_branch_without_closed_form_jacobian_uses_the_vjp_path():
    from flowattn.flows.geometry import subtract_mean

    class Stretch(torch.nn.Module):
        """g(x) = 2 P x: eigenvalues 2 on the centred directions, inside [-0.5, 3]."""

        norm = "2"

        def spectrum(self):
            return torch.tensor(0.5), torch.tensor(3.0)

        def forward(self, x, mask=None, causal=False):
            return 2.0 * subtract_mean(x, mask)

    block = MonotoneResidual(Stretch(), logdet=EXACT, inverse=InverseOptions(tol=1e-12))
    block = block.eval()
    x = randn(2, 4, 3)
    y, logdet = block(x)
    torch.testing.assert_close(y, x + 2.0 * subtract_mean(x))
    torch.testing.assert_close(logdet, torch.full((2,), 9 * math.log(3.0), dtype=torch.float64))
    torch.testing.assert_close(block.inverse(y)[0], x, atol=1e-9, rtol=0)


class _Field(torch.nn.Module):
    """A branch with a symmetric Jacobian that breaks one invariance of a monotone branch."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def spectrum(self):
        return torch.tensor(-0.5, dtype=torch.float64), torch.tensor(2.0, dtype=torch.float64)

    def forward(self, x, mask=None, causal=False):
        if self.kind == "pointwise":  # sums to zero, but is not translation-invariant
            out = 0.5 * torch.tanh(x)
            return out - out.mean(1, keepdim=True)
        return 0.5 * torch.tanh(x - x.mean(1, keepdim=True))  # invariant, but sum_i g_i != 0


@pytest.mark.parametrize("kind,message", [("pointwise", "translation-invariant"),
                                          ("offset", "sum to zero")])
def test_a_branch_without_the_invariances_is_refused_on_the_first_call(kind, message):
    block = MonotoneResidual(_Field(kind), logdet=EXACT).double()
    x = randn(2, 4, 2) + 1.0
    with pytest.raises(ValueError, match=message):
        block(x)
    with pytest.raises(ValueError, match=message):
        block.inverse(x)


def test_radial_branch_sums_to_zero_and_is_translation_invariant():
    g = make(seed=3)
    x, mask = randn(3, 5, 2, seed=4), MASK
    out = g(x, mask=mask) * mask[..., None]
    assert out.sum(1).abs().max() < 1e-12
    moved = g(x + torch.tensor([3.0, -1.5], dtype=torch.float64), mask=mask) * mask[..., None]
    assert (moved - out).abs().max() < 1e-12
    MonotoneResidual(g, logdet=EXACT).verify_branch(x, mask)  # accepted
