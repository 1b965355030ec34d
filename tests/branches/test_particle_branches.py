"""Properties every particle branch shares: E(n) equivariance, the centre of mass, padding, and a
closed-form Jacobian (symmetric, equal to autograd) whose log-det and gradients match the VJP path.

Run for the pair interaction (RadialInteraction) and the many-body one (NeighbourhoodInteraction)
with weights large enough that their certificates scale them down.
"""

import pytest
import torch

from flowattn.branches import NeighbourhoodInteraction, RadialInteraction
from flowattn.flows.logdet import exact_logdet, jacobian_logdet
from flowattn.lipschitz import jacobian


def radial():
    torch.manual_seed(0)
    g = RadialInteraction(0.9, basis=16, r_max=4.0).double()
    with torch.no_grad():
        g.weight.normal_(0.0, 3.0)
    return g


def many_body():
    torch.manual_seed(0)
    g = NeighbourhoodInteraction(0.9, channels=4, hidden=6, r_max=3.0).double()
    with torch.no_grad():
        g.linear.normal_(0.0, 3.0)
        g.out_weight.normal_(0.0, 3.0)
        g.in_weight.mul_(2.0)
    return g


BRANCHES = pytest.mark.parametrize("make", [radial, many_body], ids=["radial", "many-body"])


def randn(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@BRANCHES
def test_equivariant_to_rotations_translations_permutations_and_keeps_the_centre(make):
    g = make()
    x = randn(2, 6, 3)
    q, _ = torch.linalg.qr(randn(3, 3, seed=2))
    shift = randn(1, 1, 3, seed=3)
    perm = torch.randperm(6, generator=torch.Generator().manual_seed(4))
    y = g(x)
    torch.testing.assert_close(g(x @ q.T + shift), y @ q.T)
    torch.testing.assert_close(g(x[:, perm]), y[:, perm])
    torch.testing.assert_close(y.sum(1), torch.zeros(2, 3, dtype=torch.float64))


@BRANCHES
def test_padding_is_ignored(make):
    g = make()
    x = randn(1, 5, 2)
    mask = torch.tensor([[True, True, True, False, False]])
    y = g(x, mask)
    torch.testing.assert_close(y[:, :3], g(x[:, :3]))
    assert y[:, 3:].abs().max() == 0


@BRANCHES
def test_closed_form_jacobian_matches_autograd_with_padding_and_is_symmetric(make):
    g = make()
    x = randn(2, 5, 3)
    mask = torch.tensor([[True] * 5, [True, True, True, False, False]])
    jac = g.jacobian(x, mask)
    for b in range(2):
        ref = jacobian(lambda z, b=b: g(z[None], mask[b : b + 1])[0], x[b])
        torch.testing.assert_close(jac[b].reshape(15, 15), ref, atol=1e-12, rtol=0)
        torch.testing.assert_close(ref, ref.T, atol=1e-12, rtol=0)


@BRANCHES
@pytest.mark.parametrize("zero_com", [False, True])
def test_closed_form_logdet_and_its_gradients_equal_the_vjp_path(make, zero_com):
    g = make()
    x = randn(3, 5, 2, seed=5)
    mask = torch.tensor([[True] * 5, [True] * 4 + [False], [True, True, False, False, False]])
    if zero_com:
        w = mask[..., None].double()
        x = (x - (x * w).sum(1, keepdim=True) / w.sum(1, keepdim=True)) * w
    x.requires_grad_(True)
    closed = jacobian_logdet(g.jacobian(x, mask), mask, zero_com)
    vjp = exact_logdet(g(x, mask), x, mask, "full", zero_com, create_graph=True)
    torch.testing.assert_close(closed, vjp, atol=1e-12, rtol=0)
    params = [x, *g.parameters()]
    grads = [torch.autograd.grad(v.sum(), params, retain_graph=True) for v in (closed, vjp)]
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)
