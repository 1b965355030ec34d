"""The set flow's standardisation and robust initialisations: any offset and scale of the data.

A set flow must give the same model to data in any units: a fixed affine standardisation from
the training data (with its exact log-det) and ActNorms whose data-dependent initialisation is
finite for a constant feature, one set or one element.
"""

import math

import pytest
import torch

from flowattn.errors import InputError
from flowattn.flows import ActNorm, LogDetOptions, SetLocation, set_flow
from flowattn.flows.layers import feature_moments

DT = torch.float64
EXACT = LogDetOptions("exact")


def randn(*shape, seed=0, dtype=DT):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def flow_pair(zero_com=False, seed=0):
    """Two copies of one flow (float64, evaluation mode), for the same data in two units."""
    torch.manual_seed(seed)
    kwargs = dict(zero_com=zero_com, norm="2" if zero_com else "inf", logdet=EXACT)
    a = set_flow(2, blocks=1, heads=1, **kwargs).double()
    b = set_flow(2, blocks=1, heads=1, **kwargs).double()
    b.load_state_dict(a.state_dict())
    return a.eval(), b.eval()


@pytest.mark.parametrize("zero_com", [False, True])
def test_log_likelihood_of_rescaled_and_shifted_data_differs_by_exactly_n_d_log_scale(zero_com):
    x = randn(32, 5, 2)
    if zero_com:
        x = x - x.mean(1, keepdim=True)
    scale, offset = 7.0, 0.0 if zero_com else 1e6
    a, b = flow_pair(zero_com)
    a.standardise(x)
    b.standardise(scale * x + offset)
    gap = a.log_prob(x) - b.log_prob(scale * x + offset)
    dims = (5 - zero_com) * 2  # n D, or (n - 1) D on the zero-centre-of-mass subspace
    assert torch.allclose(gap, torch.full_like(gap, dims * math.log(scale)), atol=1e-7, rtol=0)


def test_standardisation_logdet_is_that_of_the_affine_map():
    x = 3 * randn(16, 4, 2, seed=1) + torch.tensor([5.0, -2.0], dtype=DT)
    a, plain = flow_pair(seed=1)
    a.standardise(x)
    mean = x.reshape(-1, 2).mean(0)
    std = x.reshape(-1, 2).std(0, unbiased=False)
    expected = plain.log_prob((x - mean) / std) - 4 * torch.log(std).sum()
    assert torch.allclose(a.log_prob(x), expected, atol=1e-10, rtol=0)
    # and the stored values are the data's moments
    assert torch.allclose(a.standardisation.shift, -mean)
    assert torch.allclose(a.standardisation.log_scale, -torch.log(std))


def test_sampling_maps_back_to_the_data_units_and_agrees_with_log_prob():
    x = 0.5 * randn(64, 4, 2, seed=2) + 1e3
    a, plain = flow_pair(seed=2)
    a.standardise(x)
    g1, g2 = (torch.Generator().manual_seed(3) for _ in range(2))
    with torch.no_grad():
        samples, log_prob = a.sample_and_log_prob(8, 4, generator=g1)
        unit = plain.sample(8, 4, generator=g2)
        std, mean = a.standardisation.log_scale.neg().exp(), -a.standardisation.shift
        assert torch.allclose(samples, unit * std + mean, atol=1e-8, rtol=0)
        assert torch.allclose(a.log_prob(samples), log_prob, atol=1e-6)
    assert (samples.mean() - 1e3).abs() < 5  # in the units of the data


def test_standardisation_is_frozen_and_the_identity_until_set():
    a, _ = flow_pair()
    assert not list(a.standardisation.parameters())  # buffers: no optimiser sees them
    assert all(p.requires_grad for p in a.parameters())
    assert float(a.standardisation.log_scale.abs().max()) == 0.0
    a.train()
    a.log_prob(randn(4, 3, 2) * 10 + 3)  # training mode: the standardisation stays as it is
    assert float(a.standardisation.shift.abs().max()) == 0.0


def test_a_constant_feature_keeps_unit_scale_and_the_flow_stays_finite():
    x = randn(8, 5, 2, seed=4, dtype=torch.float32)
    x[..., 1] = 3.0
    mean, std = feature_moments(x)
    assert std[1] == 1.0 and mean[1] == pytest.approx(3.0)
    torch.manual_seed(0)
    flow = set_flow(2, blocks=1, heads=1, location=True)
    flow.standardise(x)
    lp = flow.train().log_prob(x)  # data-dependent ActNorm initialisations on constant data
    assert torch.isfinite(lp).all()


@pytest.mark.parametrize("offset", [0.0, 1e6])
def test_actnorm_initialisation_is_finite_for_constant_features_and_single_elements(offset):
    act = ActNorm(3)
    x = randn(1, 1, 3, seed=5, dtype=torch.float32) + offset  # one element: no spread at all
    y, logdet = act(x)
    assert torch.isfinite(y).all() and torch.isfinite(logdet).all()
    assert float(act.log_scale.detach().abs().max()) == 0.0 and float(y.detach().abs().max()) < 0.1
    act = ActNorm(2)
    x = randn(4, 6, 2, seed=6, dtype=torch.float32) + offset
    x[..., 0] = 2.5 + offset  # a constant coordinate, at any offset
    y, _ = act(x)
    assert float(act.log_scale[0].detach()) == 0.0 and torch.isfinite(y).all()
    other = y[..., 1].detach()
    assert float((other.std() - 1).abs()) < 0.05  # the other coordinate is standardised


def test_actnorm_standardises_a_tiny_but_real_spread():
    x = 1e-9 * randn(8, 5, 2, seed=7)  # a small scale is a scale, not a constant
    act = ActNorm(2).double()
    y, _ = act(x)
    assert (y.reshape(-1, 2).std(0, unbiased=False) - 1).abs().max() < 1e-6


def test_centroid_flow_initialises_on_a_batch_of_one_set():
    layer = SetLocation(2).train()
    x = randn(1, 4, 2, seed=8, dtype=torch.float32) + 1e3
    y, logdet = layer(x)
    assert torch.isfinite(y).all() and torch.isfinite(logdet).all()
    back, _ = layer.eval().inverse(y)
    assert (back - x).abs().max() < 1e-3


def test_zero_com_sets_of_one_element_are_refused_with_a_clear_error():
    flow = set_flow(2, blocks=1, heads=1, zero_com=True, norm="2", interaction="linear")
    with pytest.raises(InputError, match="set 0 has 1 element"):
        flow.log_prob(torch.zeros(3, 1, 2))
    mask = torch.tensor([[True, True, True], [True, False, False]])
    with pytest.raises(InputError, match="set 1 has 1 element"):
        flow.log_prob(torch.randn(2, 3, 2), mask)
