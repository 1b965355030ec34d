"""Importance-sampling statistics: Kish ESS, the self-normalised mean and log Z, with errors."""

import math

import pytest
import torch

from flowattn.errors import InputError, NonFiniteError
from flowattn.importance import (
    event_kl,
    kish_ess,
    log_mean_weight,
    normalised_weights,
    self_normalised_mean,
)


def test_kish_ess_of_equal_weights_is_one_whatever_their_scale():
    for level in (-1000.0, 0.0, 700.0):
        assert kish_ess(torch.full((50,), level, dtype=torch.float64)).item() == pytest.approx(1)


def test_kish_ess_of_one_dominant_weight_is_one_over_n():
    log_w = torch.full((40,), -1e4, dtype=torch.float64)
    log_w[7] = 3.0
    assert kish_ess(log_w).item() == pytest.approx(1 / 40)
    log_w[:7] = -math.inf  # zero weights count as draws that carry nothing
    assert kish_ess(log_w).item() == pytest.approx(1 / 40)


def test_kish_ess_of_two_levels_matches_its_formula():
    w = torch.tensor([1.0, 1.0, 4.0], dtype=torch.float64)
    assert kish_ess(w.log()).item() == pytest.approx(36 / (3 * 18))


def _gaussian_replicates(replicates, n, generator):
    """Draws from q = N(0, 1) and log weights towards p = N(0.5, 0.8^2), unnormalised."""
    x = torch.randn(replicates, n, generator=generator, dtype=torch.float64)
    log_w = -(x - 0.5).pow(2) / (2 * 0.8**2) + x.pow(2) / 2
    return x, log_w


def test_self_normalised_mean_and_its_error_cover_a_gaussian_target_mean_at_95_percent():
    g = torch.Generator().manual_seed(0)
    x, log_w = _gaussian_replicates(400, 400, g)
    z = []
    for xr, lw in zip(x, log_w, strict=True):
        mean, error = self_normalised_mean(lw, xr)
        z.append(((mean - 0.5) / error).item())
    z = torch.tensor(z)
    coverage = (z.abs() < 1.96).double().mean().item()
    assert 0.92 <= coverage <= 0.98, coverage  # 95 % ± 2.7 binomial standard deviations
    assert 0.85 < z.std().item() < 1.15  # the errors are neither too small nor too large


def test_log_mean_weight_and_its_error_cover_the_normaliser_of_a_gaussian():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(400, 400, generator=g, dtype=torch.float64)  # q = N(0, 1)
    sigma = 0.8  # γ(x) = exp(-x^2 / (2 σ^2)), Z = √(2π) σ
    log_w = -x.pow(2) / (2 * sigma**2) + x.pow(2) / 2 + 0.5 * math.log(2 * math.pi)
    truth = 0.5 * math.log(2 * math.pi) + math.log(sigma)
    z = torch.tensor([((lz - truth) / err).item()
                      for lz, err in map(log_mean_weight, log_w)])
    coverage = (z.abs() < 1.96).double().mean().item()
    assert 0.92 <= coverage <= 0.98, coverage


def test_normalised_weights_sum_to_one_and_ignore_a_common_shift():
    log_w = torch.tensor([800.0, 801.0, 799.0], dtype=torch.float64)
    w = normalised_weights(log_w)
    assert w.sum().item() == pytest.approx(1)
    torch.testing.assert_close(w, normalised_weights(log_w - 800))


@pytest.mark.parametrize("bad,error,match", [
    (torch.tensor([0.0, float("nan")]), NonFiniteError, "NaN"),
    (torch.tensor([0.0, float("inf")]), NonFiniteError, r"\+Inf"),
    (torch.full((3,), -float("inf")), NonFiniteError, "every log weight"),
    (torch.zeros(2, 2), InputError, r"1-D tensor, got \(2, 2\)"),
    (torch.zeros(0), InputError, "non-empty"),
    (torch.zeros(3, dtype=torch.long), InputError, "floating point"),
])
def test_bad_log_weights_are_refused_with_a_message_naming_them(bad, error, match):
    with pytest.raises(error, match=match):
        kish_ess(bad)


def test_self_normalised_mean_refuses_values_of_another_shape_or_nan_where_weighted():
    with pytest.raises(InputError, match=r"shape \(3,\), got \(2,\)"):
        self_normalised_mean(torch.zeros(3), torch.zeros(2))
    with pytest.raises(NonFiniteError, match="values"):
        self_normalised_mean(torch.zeros(2), torch.tensor([1.0, float("nan")]))
    # where the weight is zero the value does not matter (an infinite energy, say)
    mean, _ = self_normalised_mean(torch.tensor([0.0, -math.inf]),
                                   torch.tensor([2.0, math.inf]))
    assert mean.item() == 2.0


def test_log_mean_weight_needs_two_weights():
    with pytest.raises(InputError, match="at least 2"):
        log_mean_weight(torch.zeros(1))


# --- kl of an event: the data-processing lower bound -------------------------------------------


@pytest.mark.parametrize("p, q", [(0.1, 0.7), (0.9, 0.2), (0.5, 0.5), (0.0, 0.3), (1.0, 0.6)])
def test_event_kl_is_the_kl_of_two_bernoulli_laws(p, q):
    exact = torch.distributions.kl_divergence(
        torch.distributions.Bernoulli(probs=torch.tensor(p, dtype=torch.float64)),
        torch.distributions.Bernoulli(probs=torch.tensor(q, dtype=torch.float64)))
    assert event_kl(p, q) == pytest.approx(float(exact), rel=1e-12, abs=1e-15)


def test_event_kl_bounds_the_kl_of_two_gaussians_from_below_and_nearly_meets_it():
    # KL(N(0, 1) || N(2, 1)) = 2; events {x > t} reduce both laws to Bernoulli laws
    normal = torch.distributions.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0)
    kl = 2.0
    bounds = []
    for t in torch.linspace(-3, 5, 81, dtype=torch.float64):
        p = float(1 - normal.cdf(t))
        q = float(1 - normal.cdf(t - 2))
        bounds.append(event_kl(p, q))
    assert max(bounds) <= kl
    assert max(bounds) >= 0.55 * kl  # the threshold at the midpoint keeps 0.57 of it


def test_event_kl_edge_cases_and_bad_input():
    assert event_kl(0.0, 0.0) == 0.0 and event_kl(1.0, 1.0) == 0.0
    assert event_kl(0.2, 0.0) == math.inf and event_kl(0.2, 1.0) == math.inf
    assert event_kl(0.0, 0.5) == pytest.approx(math.log(2))
    for p, q in ((-0.1, 0.5), (0.5, 1.5), (math.nan, 0.5)):
        with pytest.raises(InputError, match="probability"):
            event_kl(p, q)


def test_the_mean_of_counts_and_indicators_is_not_rounded_to_an_integer():
    # the normalised weights were cast to the values' integer dtype: every weight became 0
    mean, error = self_normalised_mean(torch.zeros(3), torch.tensor([1, 2, 3]))
    assert mean.item() == pytest.approx(2.0) and error.item() > 0
    mean, _ = self_normalised_mean(torch.zeros(3), torch.tensor([True, False, True]))
    assert mean.item() == pytest.approx(2 / 3)
