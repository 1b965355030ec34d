"""Training gradients of residual blocks and set flows against the exact log-likelihood's.

The exact reference differentiates log N(f(x)) + log|det J_f(x)| with J_f from
torch.autograd.functional.jacobian (float64, small N D); the stochastic estimators must match
it in expectation (mean over independent draws, within 4.5 standard errors), the exact mode
to rounding.
"""

import pytest
import torch

from flowattn.branches import LipschitzMLP
from flowattn.branches.mlp import frozen_power_iteration
from flowattn.flows import InvertibleResidual, LogDetOptions, set_flow
from flowattn.flows.base import standard_normal_log_prob

DT = torch.float64


def _flat_grads(loss, params):
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return torch.cat([torch.zeros_like(p).flatten() if g is None else g.flatten()
                      for g, p in zip(grads, params, strict=True)])


def exact_log_prob(transform, x):
    """log N(f(x)) + log|det J_f(x)| per set, with the Jacobian of the whole map, by autograd."""
    out = []
    for b in range(x.shape[0]):
        def f(s):
            return transform(s.unsqueeze(0))[0].squeeze(0)

        jac = torch.autograd.functional.jacobian(f, x[b], create_graph=True)
        m = x[b].numel()
        z = f(x[b]).unsqueeze(0)
        out.append(standard_normal_log_prob(z).squeeze(0)
                   + torch.linalg.slogdet(jac.reshape(m, m))[1])
    return torch.stack(out)


def _block(logdet):
    torch.manual_seed(0)
    branch = LipschitzMLP(2, 8, coeff=0.9).double()
    with torch.no_grad():  # a strong branch: large higher-order terms of the log-det series
        for p in branch.parameters():
            p.mul_(1.5)
    return InvertibleResidual(branch, logdet=logdet).train()


def _data(b=2, n=3, d=2, seed=1):
    return 0.5 * torch.randn(b, n, d, dtype=DT, generator=torch.Generator().manual_seed(seed))


def test_exact_mode_gradients_of_a_block_equal_the_exact_log_likelihood_gradients():
    block = _block(LogDetOptions("exact"))
    params = [p for p in block.parameters() if p.requires_grad]
    x = _data()
    with frozen_power_iteration():
        z, logdet = block(x)
        got = _flat_grads((standard_normal_log_prob(z) + logdet).sum(), params)
        want = _flat_grads(exact_log_prob(block, x).sum(), params)
    assert torch.allclose(got, want, atol=1e-10, rtol=1e-8)
    assert want.abs().max() > 0.1


@pytest.mark.parametrize("grad", ["neumann", "backprop"])
def test_expected_roulette_gradient_of_a_block_equals_the_exact_gradient(grad):
    gen = torch.Generator().manual_seed(2)
    block = _block(LogDetOptions("roulette", grad=grad, n_exact_terms=1, roulette_param=0.4,
                                 roulette_lengths="sample", n_samples=2, generator=gen))
    params = [p for p in block.parameters() if p.requires_grad]
    x = _data(b=1)
    copies = 64  # one batch = 64 independent draws (lengths per set)
    with frozen_power_iteration():
        want = _flat_grads(exact_log_prob(block, x).sum(), params)
        draws = []
        for _ in range(40):
            z, logdet = block(x.repeat(copies, 1, 1))
            draws.append(_flat_grads((standard_normal_log_prob(z) + logdet).mean(), params))
    draws = torch.stack(draws)
    mean, se = draws.mean(0), draws.std(0) / draws.shape[0] ** 0.5
    assert ((mean - want).abs() < 4.5 * se + 1e-9).all(), ((mean - want).abs() / se).max()
    assert (se < 0.1 * want.abs().max()).all()  # the test can see a wrong gradient


def test_expected_set_flow_gradient_equals_the_exact_log_likelihood_gradient():
    gen = torch.Generator().manual_seed(3)
    torch.manual_seed(3)
    flow = set_flow(2, blocks=1, heads=1, hidden=8, logdet=LogDetOptions(
        "roulette", n_exact_terms=1, roulette_lengths="sample", n_samples=2, generator=gen,
    )).double()
    x = _data(b=1, n=3, seed=4)
    flow.train().log_prob(x.repeat(4, 1, 1) + 0.1 * _data(4, 3, 2, seed=5))  # ActNorm init
    params = [p for p in flow.parameters() if p.requires_grad]
    with frozen_power_iteration():
        want = _flat_grads(exact_log_prob(flow.transform, x).sum(), params)
        draws = [_flat_grads(flow.log_prob(x.repeat(64, 1, 1)).mean(), params)
                 for _ in range(30)]
    draws = torch.stack(draws)
    mean, se = draws.mean(0), draws.std(0) / draws.shape[0] ** 0.5
    assert ((mean - want).abs() < 4.5 * se + 1e-9).all(), (mean - want).abs().max()
    assert want.abs().max() > 0.1
