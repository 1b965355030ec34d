"""Mixed precision: branches under torch.autocast (bfloat16 on CPU), log-dets in float32."""

import copy

import pytest
import torch

from flowattn.branches import LipschitzMLP
from flowattn.branches.mlp import frozen_power_iteration
from flowattn.errors import InputError
from flowattn.flows import InvertibleResidual, LogDetOptions, set_flow

BF16 = dict(device_type="cpu", dtype=torch.bfloat16)


def _seeded():
    return LogDetOptions("roulette", grad="neumann", generator=torch.Generator().manual_seed(0))


def _reseed(flow):
    for block in flow.modules():
        if isinstance(block, InvertibleResidual):
            block.logdet_options = _seeded()


@pytest.mark.parametrize("seed", [0, 1])
def test_bf16_autocast_training_log_prob_is_float32_close_and_its_gradients_agree(seed):
    torch.manual_seed(seed)
    flow = set_flow(dim=4, blocks=2, heads=2)
    x = torch.randn(32, 6, 4)
    flow.log_prob(x)  # ActNorm's initialisation
    reference = copy.deepcopy(flow)
    _reseed(flow)
    _reseed(reference)  # the same probes and roulette lengths in both
    exact = reference.log_prob(x)
    exact.mean().backward()
    with torch.autocast(**BF16):
        mixed = flow.log_prob(x)
    mixed.mean().backward()
    assert mixed.dtype == torch.float32 and torch.isfinite(mixed).all()
    # bfloat16 keeps 8 bits: the branches err by ~4e-3 relative, the log-density by ~5e-4
    assert ((mixed - exact).abs() / exact.abs()).max() < 3e-3
    g_mixed = torch.cat([p.grad.flatten() for p in flow.parameters() if p.grad is not None])
    g_exact = torch.cat([p.grad.flatten() for p in reference.parameters() if p.grad is not None])
    assert torch.isfinite(g_mixed).all()
    assert torch.nn.functional.cosine_similarity(g_mixed, g_exact, dim=0) > 0.99


@pytest.mark.parametrize("method", ["exact", "roulette"])
def test_bf16_autocast_mlp_block_logdet_is_accumulated_in_float32(method):
    torch.manual_seed(2)
    block = InvertibleResidual(LipschitzMLP(2, [64, 64], coeff=0.9))
    x = 2 * torch.randn(256, 1, 2)
    results = []
    for autocast in (True, False):
        block.logdet_options = LogDetOptions("exact") if method == "exact" else _seeded()
        with torch.no_grad(), frozen_power_iteration(), torch.autocast(**BF16, enabled=autocast):
            results.append(block(x))
    (y, mixed), (y32, exact) = results
    assert y.dtype == mixed.dtype == torch.float32
    assert (mixed - exact).abs().max() < 2e-3  # per set, with |log-det| ~ 1e-2 here
    assert (y - y32).abs().max() < 2e-2


def test_inverse_under_autocast_solves_in_float32_and_converges():
    torch.manual_seed(3)
    flow = set_flow(dim=4, blocks=2, heads=2)
    x = torch.randn(16, 6, 4)
    flow.log_prob(x)
    flow.eval()
    with torch.no_grad(), torch.autocast(**BF16):
        z = flow.transform_to_noise(x)  # the branches in bfloat16
        x_back = flow.transform.inverse(z)[0]  # solved in float32: converges
        samples = flow.sample(8, set_size=5, generator=torch.Generator().manual_seed(0))
    assert x_back.dtype == torch.float32 and torch.isfinite(samples).all()
    assert (x_back - x).abs().max() < 2e-2  # the forward's bfloat16 rounding, nothing more


def test_half_precision_flows_are_refused_with_the_supported_way():
    flow = set_flow(dim=2, blocks=1, heads=1)
    x = torch.randn(3, 4, 2)
    with pytest.raises(InputError, match="torch.autocast"):
        copy.deepcopy(flow).half().log_prob(x.half())
    with pytest.raises(InputError, match="parameters are torch.bfloat16"):
        copy.deepcopy(flow).bfloat16().log_prob(x)
    with pytest.raises(InputError, match="torch.autocast"):
        copy.deepcopy(flow).half().sample(2, set_size=3)
    with pytest.raises(InputError, match="x has dtype torch.bfloat16"):
        flow.log_prob(x.bfloat16())
    block = InvertibleResidual(LipschitzMLP(2, 8), logdet=LogDetOptions("exact")).half()
    with pytest.raises(InputError, match="torch.autocast"):
        block(x.half())
    with pytest.raises(InputError, match="torch.autocast"):
        block.inverse(x.half())
