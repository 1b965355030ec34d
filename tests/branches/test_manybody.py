"""NeighbourhoodInteraction: gradient of its potential, certified bound, many-body coupling.

Equivariance, padding and the closed-form Jacobian: tests/branches/test_particle_branches.py.
"""

import math

import pytest
import torch

from flowattn.branches import NeighbourhoodInteraction
from flowattn.flows import InvertibleResidual, LogDetOptions, set_flow
from flowattn.lipschitz import lipschitz_lower_bound

EXACT = LogDetOptions("exact")


def make(seed=0, coeff=0.9, channels=4, hidden=6, strength=1.0):
    torch.manual_seed(seed)
    g = NeighbourhoodInteraction(coeff, channels=channels, hidden=hidden, r_max=3.0).double()
    with torch.no_grad():  # far from the small initial weights, so the bound is active
        g.linear.normal_(0.0, strength)
        g.out_weight.normal_(0.0, strength)
        g.in_weight.mul_(2.0)
    return g


def randn(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def potential(g, x, mask=None):
    """U(X) = (1/2) sum_i F(s_i), written out independently of the module's closed forms."""
    present = torch.ones(x.shape[:2], dtype=x.dtype) if mask is None else mask.to(x.dtype)
    n = present.sum(1)[:, None, None]
    rho = ((x[:, :, None] - x[:, None, :]).pow(2).sum(-1) + g.width**2).sqrt()
    pair = present[:, :, None] * present[:, None, :] * (1 - torch.eye(x.shape[1]))
    shells = [(-((rho - mu) / g.width) ** 2 / 2).exp() for mu in g.centres]
    s = torch.stack([(phi * pair / n).sum(2) for phi in shells], -1)
    f = s @ g.linear + torch.tanh(s @ g.in_weight.T + g.in_bias) @ g.out_weight
    return 0.5 * (f * present).sum()


def test_branch_is_the_scaled_gradient_of_its_potential():
    g = make()
    x = randn(3, 5, 2).requires_grad_(True)
    mask = torch.tensor([[True] * 5, [True, True, True, False, False], [True] * 4 + [False]])
    (grad,) = torch.autograd.grad(potential(g, x, mask), x)
    torch.testing.assert_close(g(x, mask), g.scale() * grad * mask[..., None], atol=1e-12, rtol=0)


@pytest.mark.parametrize(("seed", "n"), [(0, 2), (1, 4), (2, 7)])
def test_bound_dominates_optimised_jacobian_norm(seed, n):
    g = make(seed, strength=3.0)
    bound = g.lipschitz_bound().item()
    assert math.isclose(bound, 0.9, rel_tol=1e-9)  # the weights are large: scaled down to coeff
    lower, _ = lipschitz_lower_bound(lambda x: g(x[None])[0], (n, 2), p=2, restarts=3, steps=60,
                                     generator=torch.Generator().manual_seed(seed))
    assert 0 < lower <= bound


def test_bound_is_nearly_attained_by_a_linear_embedding_of_one_shell():
    """F(s) = v s_c on the outermost shell: two points at rho = mu_c reach ||Hess U|| =
    (v / w^2)(1 - w^2 / mu_c^2), within 2 % of the bound."""
    g = make(channels=8)
    with torch.no_grad():
        g.out_weight.zero_()
        g.linear.zero_()
        g.linear[-1] = 5.0
    mu = float(g.centres[-1])
    x = torch.tensor([[[0.0, 0.0], [math.sqrt(mu**2 - g.width**2), 0.0]]], dtype=torch.float64)
    norm = torch.linalg.matrix_norm(g.jacobian(x).detach().reshape(4, 4), 2).item()
    bound = g.lipschitz_bound().item()
    assert norm <= bound
    assert math.isclose(norm, bound * (1 - g.width**2 / mu**2), rel_tol=1e-9)
    assert norm >= 0.97 * bound


def test_shell_sum_constants_bound_their_sums():
    from flowattn.branches import manybody

    rho = torch.linspace(0.0, 12.0, 24001, dtype=torch.float64)
    centres = torch.linspace(0.0, 10.0, 11, dtype=torch.float64)
    u = rho[:, None] - centres
    hessians = manybody._hessian_profile(u).sum(1).max().item()
    gradients = manybody._gradient_profile(u).sum(1).max().item()
    assert hessians <= manybody._HESSIAN_SUM <= hessians + 1e-3
    assert gradients <= manybody._GRADIENT_SUM <= gradients + 1e-3


def test_a_pair_feels_a_third_element_unlike_a_pair_interaction():
    """dg_0/dx_1 changes when x_2 moves: zero for any sum of pair terms, not here."""
    from flowattn.branches import RadialInteraction

    def coupling(branch, third):
        x = torch.tensor([[[0.0, 0.0], [1.0, 0.0], third]], dtype=torch.float64)
        return branch.jacobian(x)[0, 0, :, 1, :]

    radial = RadialInteraction(0.9, basis=8).double()
    near, far = [0.5, 0.8], [1.0, 2.0]
    torch.testing.assert_close(coupling(radial, near), coupling(radial, far))
    g = make()
    assert (coupling(g, near) - coupling(g, far)).abs().max() > 1e-3 * g.jacobian(
        torch.tensor([[[0.0, 0.0], [1.0, 0.0], near]], dtype=torch.float64)).abs().max()


def test_invertible_residual_round_trip_in_zero_com_mode():
    block = InvertibleResidual(make(strength=3.0), logdet=EXACT, zero_com=True).eval()
    x = randn(3, 4, 2)
    x = x - x.mean(1, keepdim=True)
    y, _ = block(x)
    x_back, _ = block.inverse(y)
    torch.testing.assert_close(x_back, x, atol=1e-8, rtol=0)
    torch.testing.assert_close(y.sum(1), torch.zeros(3, 2, dtype=torch.float64))


def test_set_flow_with_many_body_blocks_and_errors():
    flow = set_flow(2, blocks=2, heads=1, interaction="radial", manybody=True, zero_com=True,
                    norm="2", logdet=EXACT).double().eval()
    assert sum(isinstance(m, NeighbourhoodInteraction) for m in flow.modules()) == 2
    x = randn(3, 4, 2)
    assert torch.isfinite(flow.log_prob(x)).all()
    perm = torch.tensor([2, 0, 3, 1])
    torch.testing.assert_close(flow.log_prob(x[:, perm]), flow.log_prob(x))
    with pytest.raises(ValueError, match="coeff"):
        NeighbourhoodInteraction(coeff=1.0)
    with pytest.raises(ValueError, match="channels"):
        NeighbourhoodInteraction(channels=1)
    with pytest.raises(ValueError, match="causal"):
        make()(randn(1, 3, 2), causal=True)
    with pytest.raises(ValueError, match="manybody"):
        set_flow(2, blocks=1, heads=1, interaction="attention", manybody=True)


def test_unit_bounds_hold_over_the_range_of_the_counts():
    """tau_m and kappa_m dominate tanh' and |tanh''| at counts sampled from [0, 1]^C."""
    g = make(seed=3)
    with torch.no_grad():
        g.in_bias.mul_(3.0)  # some units pushed off-centre, where the interval bound bites
    slope, curvature = g._unit_bounds()
    s = torch.rand(20000, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    corners = torch.cartesian_prod(*[torch.tensor([0.0, 1.0], dtype=torch.float64)] * 4)
    t = torch.tanh(torch.cat([s, corners]) @ g.in_weight.T + g.in_bias)
    assert ((1 - t * t) <= slope + 1e-12).all()
    assert ((2 * t.abs() * (1 - t * t)) <= curvature + 1e-12).all()
    assert (slope < 0.99).any() and (curvature < 0.76).any()  # and they do bite
