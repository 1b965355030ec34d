"""EquivariantLinear: exact log-det, closed-form inverse, equivariance, masks, zero-COM mode."""

import torch

from flowattn.flows import EquivariantLinear, LogDetOptions
from flowattn.lipschitz import jacobian


def make(dim=3, zero_com=False, seed=0):
    torch.manual_seed(seed)
    layer = EquivariantLinear(dim, zero_com).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.5)
    return layer


def randn(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_logdet_equals_brute_force_jacobian():
    layer = make()
    x = randn(2, 4, 3)
    _, logdet = layer(x)
    for b in range(2):
        jac = jacobian(lambda z: layer(z[None])[0][0], x[b])
        assert abs(torch.linalg.slogdet(jac)[1] - logdet[b]) < 1e-10


def test_inverse_round_trips_both_ways():
    layer = make()
    x = randn(5, 6, 3)
    y, logdet = layer(x)
    x_back, inv_logdet = layer.inverse(y)
    torch.testing.assert_close(x_back, x, rtol=0, atol=1e-12)
    torch.testing.assert_close(inv_logdet, -logdet)
    torch.testing.assert_close(layer(layer.inverse(x)[0])[0], x, rtol=0, atol=1e-12)


def test_permuting_the_set_permutes_the_output():
    layer = make()
    x = randn(2, 5, 3)
    perm = torch.randperm(5, generator=torch.Generator().manual_seed(0))
    y, logdet = layer(x)
    y_perm, logdet_perm = layer(x[:, perm])
    torch.testing.assert_close(y_perm, y[:, perm])
    torch.testing.assert_close(logdet_perm, logdet)


def test_padded_batch_matches_each_set_alone():
    layer = make()
    x = randn(2, 5, 3)
    mask = torch.tensor([[True] * 5, [True, True, True, False, False]])
    y, logdet = layer(x, context=mask)
    alone, alone_logdet = layer(x[1:, :3])
    torch.testing.assert_close(y[1, :3], alone[0])
    torch.testing.assert_close(logdet[1], alone_logdet[0])
    torch.testing.assert_close(y[1, 3:], x[1, 3:])  # padding passes through
    torch.testing.assert_close(layer.inverse(y, context=mask)[0], x)


def test_zero_com_mode_keeps_the_subspace_and_its_logdet():
    layer = make(dim=2, zero_com=True)
    n, d = 4, 2
    x = randn(1, n, d)
    x = x - x.mean(1, keepdim=True)
    y, logdet = layer(x)
    assert y.sum(1).abs().max() < 1e-12
    # orthonormal basis of {sum_i x_i = 0} in R^{n d}
    centre = torch.eye(n, dtype=torch.float64) - 1.0 / n
    basis_n = torch.linalg.svd(centre)[0][:, : n - 1].contiguous()
    basis = torch.kron(basis_n, torch.eye(d, dtype=torch.float64))  # (n d, (n-1) d)
    jac = jacobian(lambda z: layer(z[None])[0][0], x[0])
    restricted = basis.T @ jac @ basis
    assert abs(torch.linalg.slogdet(restricted)[1] - logdet[0]) < 1e-10


def test_iid_baseline_density_factorises_over_elements_and_the_others_do_not():
    from flowattn.flows import set_flow

    x = randn(3, 5, 2, seed=7)
    for interaction, factorises in (("none", True), ("linear", False), ("attention", False)):
        torch.manual_seed(0)
        flow = set_flow(2, 2, 1, hidden=8, interaction=interaction,
                        logdet=LogDetOptions("exact")).double()
        flow.log_prob(randn(16, 5, 2, seed=8))  # data-dependent ActNorm initialisation
        with torch.no_grad():  # make the interaction non-trivial
            for p in flow.parameters():
                p.add_(0.3 * torch.randn_like(p))
        flow.eval()
        joint = flow.log_prob(x)
        alone = flow.log_prob(x.reshape(15, 1, 2)).reshape(3, 5).sum(1)
        assert torch.allclose(joint, alone, atol=1e-9) == factorises, interaction
