"""Lifted attention: its product certificate against measured Jacobian norms (both ways), the
contractive wrapper, masks, permutations, and the set flow that uses it."""

import pytest
import torch

from flowattn.branches import ContractiveLiftedL2MHA, LiftedL2MHA
from flowattn.errors import InputError
from flowattn.flows import InvertibleResidual, LogDetOptions, set_flow
from flowattn.lipschitz import jacobian, jacobian_norm, lipschitz_lower_bound

D64 = torch.float64


def _mixed_jacobian_norm(f, x: torch.Tensor) -> float:
    """||J_f(x)||_{2,inf} of a map of one set x (N, D)."""
    return float(jacobian_norm(lambda y: f(y[None])[0], x, "2,inf"))


def _linearised(module: LiftedL2MHA, lift: float, read: float) -> LiftedL2MHA:
    """One head of width D = W = 1, unit attention weights, lift and read-out weights ``lift``
    and ``read``, and a lift bias of 10: LipSwish is then nearly linear (slope 1 / 1.1) where
    the elements lie, and the certificate's factors are nearly attained."""
    with torch.no_grad():
        module.lift.weight.fill_(lift)
        module.lift.bias.fill_(10.0)
        module.read.weight.fill_(read)
        for w in (module.attention.w_q, module.attention.w_v, module.attention.w_o):
            w.fill_(1.0)
    return module


@pytest.mark.parametrize("dim,width,heads", [(2, 8, 2), (2, 16, 4), (3, 12, 3)])
def test_lifted_certificate_is_never_exceeded(dim, width, heads):
    torch.manual_seed(0)
    f = LiftedL2MHA(dim, width, heads).to(D64)
    n = 6
    bound = float(f.lipschitz_bound(n).detach())
    gen = torch.Generator().manual_seed(1)
    for scale in (0.1, 1.0, 5.0):
        x = scale * torch.randn(n, dim, dtype=D64, generator=gen)
        assert _mixed_jacobian_norm(f, x) <= bound * (1 + 1e-9)
    best, _ = lipschitz_lower_bound(lambda x: f(x[None])[0], (n, dim), p="2,inf", restarts=3,
                                    steps=60, generator=gen)
    assert best <= bound * (1 + 1e-9)


@pytest.mark.parametrize("lift,read", [(1.0, 1.0), (3.0, 1.0), (1.0, 3.0)])
def test_lifted_certificate_is_within_a_stated_factor_where_its_factors_are_attained(lift, read):
    # unit attention weights and a linear regime of LipSwish: the certificate is
    # lift * read * 1.09984 / 1.1 times the inner attention's, and inputs reach 1/1.45 of it
    # (the inner core's own factor, 1.18-1.32, times 1.1 for the slope 1 / 1.1 of LipSwish);
    # the scaled lift and read-out catch a certificate that leaves either factor out
    f = _linearised(LiftedL2MHA(1, 1, 1).to(D64), lift, read)
    n = 8
    bound = float(f.lipschitz_bound(n).detach())
    best, _ = lipschitz_lower_bound(lambda x: f(x[None])[0], (n, 1), p="2,inf", restarts=6,
                                    steps=150, generator=torch.Generator().manual_seed(0))
    assert bound / 1.6 <= best <= bound * (1 + 1e-9)


def test_contractive_lifted_attention_is_a_contraction_and_inverts():
    torch.manual_seed(0)
    f = ContractiveLiftedL2MHA(2, heads=4, coeff=0.9, width=16).to(D64)
    assert float(f.lipschitz_bound(7).detach()) == pytest.approx(0.9)
    gen = torch.Generator().manual_seed(2)
    for scale in (0.5, 3.0):
        x = scale * torch.randn(7, 2, dtype=D64, generator=gen)
        assert _mixed_jacobian_norm(f, x) <= 0.9 * (1 + 1e-9)
    block = InvertibleResidual(f, logdet=LogDetOptions("exact")).eval()
    x = torch.randn(3, 7, 2, dtype=D64, generator=gen)
    y, logdet = block(x)
    back, _ = block.inverse(y)
    assert torch.allclose(back, x, atol=1e-8)
    exact = torch.stack([torch.linalg.slogdet(
        torch.eye(14, dtype=D64) + jacobian(lambda v: f(v.reshape(1, 7, 2)).reshape(-1),
                                            xi.reshape(-1)))[1] for xi in x])
    assert torch.allclose(logdet, exact, atol=1e-10)


def test_lifted_attention_is_equivariant_and_ignores_padding():
    torch.manual_seed(0)
    f = ContractiveLiftedL2MHA(2, heads=2, coeff=0.9, width=8).to(D64)
    x = torch.randn(2, 5, 2, dtype=D64)
    perm = torch.tensor([3, 0, 4, 1, 2])
    assert torch.allclose(f(x)[:, perm], f(x[:, perm]), atol=1e-12)
    mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    y = f(x, mask)
    assert torch.equal(y[1, 3:], torch.zeros(2, 2, dtype=D64))
    other = x.clone()
    other[1, 3:] = 100.0  # padded elements: any value, same outputs
    assert torch.allclose(f(other, mask), y, atol=1e-12)
    assert torch.allclose(y[1, :3], f(x[1:, :3])[0], atol=1e-12)  # as the unpadded set


def test_lifted_attention_refuses_bad_settings():
    with pytest.raises(InputError, match="must divide width"):
        LiftedL2MHA(2, 10, 4)
    with pytest.raises(InputError, match="mixed norm"):
        LiftedL2MHA(2, 8, 2).lipschitz_bound(4, "inf")
    with pytest.raises(InputError, match="'2,inf' only"):
        ContractiveLiftedL2MHA(2, 2, width=8).lipschitz_bound(4, 2)
    with pytest.raises(InputError, match="attention_width"):
        set_flow(2, 1, 2, attention_width=8, interaction="linear")
    with pytest.raises(InputError, match="attention_width"):
        set_flow(2, 1, 2, attention_width=8, zero_com=True)


def test_set_flow_with_lifted_attention_is_exchangeable():
    torch.manual_seed(0)
    flow = set_flow(2, 2, 4, attention_width=8, splines=True, location=True,
                    logdet=LogDetOptions("exact")).to(D64).eval()
    branches = [m for m in flow.modules() if isinstance(m, ContractiveLiftedL2MHA)]
    assert len(branches) == 2
    x = torch.randn(4, 6, 2, dtype=D64)
    perm = torch.randperm(6)
    assert torch.allclose(flow.log_prob(x), flow.log_prob(x[:, perm]), atol=1e-9)
