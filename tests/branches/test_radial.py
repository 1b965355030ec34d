"""RadialInteraction: certified bound vs Jacobian norms, tightness, blocks and flows.

Equivariance, padding and the closed-form Jacobian: tests/branches/test_particle_branches.py.
"""

import math

import pytest
import torch

from flowattn.branches import RadialInteraction
from flowattn.flows import InvertibleResidual, LogDetOptions, set_flow
from flowattn.lipschitz import jacobian, jacobian_norm, lipschitz_lower_bound

EXACT = LogDetOptions("exact")


def make(seed=0, coeff=0.9, scale=1.0, uniform=False):
    torch.manual_seed(seed)
    g = RadialInteraction(coeff, basis=16, r_max=4.0).double()
    with torch.no_grad():
        if uniform:
            g.weight.fill_(1.0)
        else:
            g.weight.normal_(0.0, scale)
    return g


def randn(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bound_dominates_optimised_jacobian_norm(seed):
    g = make(seed)
    bound = g.lipschitz_bound().item()
    assert bound <= 0.9 + 1e-12
    lower, _ = lipschitz_lower_bound(lambda x: g(x[None])[0], (5, 2), p=2, restarts=3, steps=60,
                                     generator=torch.Generator().manual_seed(seed))
    assert 0 < lower <= bound


def test_bound_is_tight_for_a_uniform_interaction():
    """Two points whose distance sits where psi' is flat: ||J|| = psi'(d) ~ the bound."""
    g = make(uniform=True)
    x = torch.tensor([[0.0, 0.0], [2.0, 0.0]], dtype=torch.float64)
    norm = float(jacobian_norm(lambda z: g(z[None])[0], x, p=2))
    assert norm >= 0.97 * g.lipschitz_bound().item()


def test_jacobian_is_symmetric_and_psi_integrates_its_derivative():
    g = make()
    x = randn(4, 3)
    jac = jacobian(lambda z: g(z[None])[0], x)
    torch.testing.assert_close(jac, jac.T)
    d = torch.linspace(0, 6, 6001, dtype=torch.float64)
    w = g.effective_weight()
    dpsi = (w * torch.exp(-((d[:, None] - g.centres) ** 2) / (2 * g.width**2))).sum(-1)
    integral = torch.cumulative_trapezoid(dpsi, d)
    torch.testing.assert_close(g.psi(d[1:]), integral, atol=1e-6, rtol=0)


def test_invertible_residual_round_trip_and_exact_logdet_in_zero_com_mode():
    block = InvertibleResidual(make(scale=3.0), logdet=EXACT, zero_com=True).eval()
    x = randn(3, 4, 2)
    x = x - x.mean(1, keepdim=True)
    y, logdet = block(x)
    x_back, _ = block.inverse(y)
    torch.testing.assert_close(x_back, x, atol=1e-8, rtol=0)
    torch.testing.assert_close(y.sum(1), torch.zeros(3, 2, dtype=torch.float64))
    # log-det on the (n - 1) D subspace: eigenvalues of I + J restricted to zero-mean vectors
    basis = torch.linalg.qr(torch.eye(4, dtype=torch.float64) - 0.25)[0][:, :3].contiguous()
    proj = torch.kron(basis, torch.eye(2, dtype=torch.float64))  # (8, 6)
    for b in range(3):
        jac = jacobian(lambda z, b=b: block(z[None])[0][0], x[b])
        restricted = proj.T @ jac @ proj
        assert abs(torch.linalg.slogdet(restricted)[1] - logdet[b]) < 1e-8


def test_radial_set_flow_and_errors():
    flow = set_flow(2, blocks=2, heads=1, interaction="radial", zero_com=True, norm="2",
                    logdet=EXACT).double().eval()
    x = randn(3, 4, 2)
    assert torch.isfinite(flow.log_prob(x)).all()
    perm = torch.tensor([2, 0, 3, 1])
    torch.testing.assert_close(flow.log_prob(x[:, perm]), flow.log_prob(x))
    with pytest.raises(ValueError, match="coeff"):
        RadialInteraction(coeff=1.0)
    with pytest.raises(ValueError, match="causal"):
        make()(randn(1, 3, 2), causal=True)
    assert math.isclose(make().bump_sum_bound, math.sqrt(2 * math.pi), rel_tol=2e-4)


def test_closed_form_makes_the_exact_path_feasible_for_larger_sets():
    block = InvertibleResidual(make(), logdet=LogDetOptions("auto"), zero_com=True)
    assert block._exact_feasible(40, 3)  # 120 dimensions: beyond the VJP path's 64
    assert not block._exact_feasible(200, 3)
    x = randn(2, 40, 3)
    x = x - x.mean(1, keepdim=True)
    block.eval()
    _, logdet = block(x)
    jac = block.branch.jacobian(x)
    from flowattn.flows.logdet import jacobian_logdet

    torch.testing.assert_close(logdet, jacobian_logdet(jac, None, True))
