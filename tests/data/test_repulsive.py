"""flowattn.data.repulsive: repelling points, their exact normaliser, marginal and sampler."""

import math

import pytest
import torch

from flowattn.data import (
    load_dataset,
    repulsive_log_normaliser,
    repulsive_sets,
    repulsive_sets_iid_log_prob,
    repulsive_sets_log_prob,
)
from flowattn.errors import InputError

SETTINGS = {"sigma": 1.0, "length": 0.4, "strength": 1.0}


def _mean_and_error(values):
    values = values.double()
    return values.mean().item(), values.std().item() / math.sqrt(values.numel())


def _grid(lo, hi, step, dims):
    axis = torch.arange(lo, hi + step / 2, step, dtype=torch.float64)
    return torch.cartesian_prod(*[axis] * dims).reshape(-1, dims), step**dims


def _unnormalised(x, sigma, length, strength):
    """prod_i N(x_i; 0, sigma^2) prod_{i<j} (1 - a exp(-d^2 / 2 l^2)), written out directly."""
    n, dim = x.shape[-2:]
    value = torch.distributions.Normal(0.0, sigma).log_prob(x).sum((-2, -1)).exp()
    for i in range(n):
        for j in range(i + 1, n):
            d2 = (x[..., i, :] - x[..., j, :]).pow(2).sum(-1)
            value = value * (1 - strength * torch.exp(-d2 / (2 * length**2)))
    return value


@pytest.mark.parametrize("dim, sigma, length, strength", [(1, 1.0, 0.4, 1.0), (2, 0.7, 0.5, 0.6),
                                                          (3, 1.3, 0.9, 1.0)])
def test_normaliser_of_two_points_has_its_closed_form(dim, sigma, length, strength):
    z = math.exp(repulsive_log_normaliser(2, dim, sigma, length, strength))
    assert math.isclose(z, 1 - strength * (1 + 2 * sigma**2 / length**2) ** (-dim / 2),
                        rel_tol=1e-12)


@pytest.mark.parametrize("n, dim, step", [
    (3, 1, 0.1), pytest.param(2, 2, 0.2, marks=pytest.mark.slow)])
def test_density_integrates_to_one_on_a_grid(n, dim, step):
    # 6 sd on each side; a step of at most l / 2 makes the Riemann sum of these smooth
    # integrands exact to far below the tolerance
    grid, cell = _grid(-6.0, 6.0, step, n * dim)
    x = grid.view(-1, n, dim)
    total = repulsive_sets_log_prob(x, None, **SETTINGS).exp().sum().item() * cell
    assert abs(total - 1) < 1e-8
    # and the density is the product it is defined by, divided by Z
    z = _unnormalised(x, **SETTINGS).sum().item() * cell
    assert math.isclose(z, math.exp(repulsive_log_normaliser(n, dim, **SETTINGS)), rel_tol=1e-8)


@pytest.mark.parametrize("dim", [1, 2])
def test_normaliser_of_six_points_matches_monte_carlo(dim):
    # Z_6 = E[prod phi] under i.i.d. N(0, sigma^2 I) points, the rejection sampler's acceptance
    g = torch.Generator().manual_seed(0)
    x = torch.randn(400_000, 6, dim, dtype=torch.float64, generator=g)
    weights = _unnormalised(x, **SETTINGS) / torch.distributions.Normal(0.0, 1.0).log_prob(
        x).sum((-2, -1)).exp()
    mean, error = _mean_and_error(weights)
    z = math.exp(repulsive_log_normaliser(6, dim, **SETTINGS))
    assert abs(mean - z) < 4 * error and error < 0.03 * z, (mean, error, z)


@pytest.mark.parametrize("n", [2, 3])
def test_iid_density_is_the_exact_one_point_marginal(n):
    # integrate the other points out of the joint density on a grid, point by point
    step = 0.1
    rest, cell = _grid(-6.0, 6.0, step, n - 1)
    for x1 in (-2.1, -0.3, 0.0, 0.8, 3.5):
        x = torch.cat([torch.full((rest.shape[0], 1), x1, dtype=torch.float64), rest], 1)
        marginal = repulsive_sets_log_prob(x[..., None], None, **SETTINGS).exp().sum() * cell
        same = torch.full((1, n, 1), x1, dtype=torch.float64)  # n copies: n log p̄(x1)
        ours = repulsive_sets_iid_log_prob(same, None, **SETTINGS) / n
        assert math.isclose(ours.item(), marginal.log().item(), rel_tol=0, abs_tol=1e-8)


def test_one_point_marginal_of_six_points_integrates_to_one():
    grid, cell = _grid(-7.0, 7.0, 0.02, 1)
    for dim in (1, 2):
        if dim == 2:
            grid, cell = _grid(-6.0, 6.0, 0.1, 2)
        # sets of one repeated point: iid_log_prob / 6 is log p̄_6 of that point
        x = grid[:, None, :].expand(-1, 6, dim)
        log_marginal = repulsive_sets_iid_log_prob(x, None, **SETTINGS) / 6
        assert abs(log_marginal.exp().sum().item() * cell - 1) < 1e-8


def test_samples_have_the_entropy_of_the_density():
    # E_p[log p] from exact samples against importance sampling from the Gaussian proposal q:
    # E_q[(p / q) log p], with p / q = prod phi / Z <= 1 / Z
    data = repulsive_sets(10_000, generator=torch.Generator().manual_seed(1))
    from_samples = repulsive_sets_log_prob(data.x.double(), None, **SETTINGS)
    mean_p, error_p = _mean_and_error(from_samples)
    x = torch.randn(400_000, 6, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    log_p = repulsive_sets_log_prob(x, None, **SETTINGS)
    log_q = torch.distributions.Normal(0.0, 1.0).log_prob(x).sum((-2, -1))
    weighted = torch.where(log_p > -math.inf, (log_p - log_q).exp() * log_p,
                           torch.zeros_like(log_p))
    mean_q, error_q = _mean_and_error(weighted)
    assert abs(mean_p - mean_q) < 4 * math.hypot(error_p, error_q), (mean_p, mean_q)
    assert math.hypot(error_p, error_q) < 0.1


def test_samples_satisfy_the_stein_identity_of_the_density():
    # E_p[x . grad log p(x)] = -(number of coordinates), by integration by parts
    data = repulsive_sets(6000, dim=2, length=0.6, generator=torch.Generator().manual_seed(3))
    x = data.x.double().requires_grad_(True)
    log_p = repulsive_sets_log_prob(x, None, sigma=1.0, length=0.6, strength=1.0)
    (grad,) = torch.autograd.grad(log_p.sum(), x)
    statistic = (x.detach() * grad).sum((1, 2)) + 12
    mean, error = _mean_and_error(statistic)
    assert abs(mean) < 4 * error and error < 0.1, (mean, error)


def test_density_is_permutation_invariant_and_masks_give_the_density_given_the_size():
    data = repulsive_sets(20, dim=2, generator=torch.Generator().manual_seed(4))
    x = data.x.double()
    perm = torch.randperm(6, generator=torch.Generator().manual_seed(5))
    for log_prob in (repulsive_sets_log_prob, repulsive_sets_iid_log_prob):
        torch.testing.assert_close(log_prob(x[:, perm], None), log_prob(x, None))
        # a padded set of n points has the density of the n points alone (Z_n, p̄_n)
        mask = torch.arange(6)[None] < torch.tensor([2, 3, 4, 5, 6] * 4)[:, None]
        junk = torch.where(mask[..., None], x, torch.full_like(x, 0.01))
        padded = log_prob(junk, mask)
        for b in range(20):
            alone = log_prob(x[b : b + 1, mask[b]], None)
            assert math.isclose(padded[b].item(), alone.item(), rel_tol=1e-12)


def test_best_iid_nll_is_clearly_above_the_true_nll():
    test = load_dataset("repulsive-sets", {"train": 1, "val": 1})["test"]
    gain = test.iid_log_prob(test.x, test.mask) - test.true_log_prob(test.x, test.mask)
    mean, error = _mean_and_error(-gain)  # per set: iid NLL - true NLL
    assert mean / 6 > 0.15 and mean > 10 * error
    assert test.meta["acceptance"] == pytest.approx(math.exp(repulsive_log_normaliser(6, 1, 1.0,
                                                                                      0.4, 1.0)))


def test_sets_are_reproducible_from_the_seed():
    a, b, c = (repulsive_sets(200, generator=torch.Generator().manual_seed(s)) for s in (6, 6, 7))
    assert torch.equal(a.x, b.x) and not torch.equal(a.x, c.x)
    first, second = (load_dataset("repulsive-sets", {"train": 20, "val": 5, "test": 5})
                     for _ in range(2))
    for split in first:
        assert torch.equal(first[split].x, second[split].x)
        assert first[split].name == f"repulsive-sets/{split}"


@pytest.mark.parametrize("kwargs, message", [
    ({"num_sets": 0}, "num_sets must be positive, got 0"),
    ({"set_size": 7}, "set_size must be between 1 and 6 .*got 7"),
    ({"set_size": 0}, "got 0"),
    ({"dim": 0}, "dim must be positive, got 0"),
    ({"sigma": -1.0}, "sigma must be positive, got -1.0"),
    ({"length": 0.0}, "length must be positive, got 0.0"),
    ({"strength": 1.5}, "strength must lie in \\(0, 1\\].*got 1.5"),
    ({"strength": 0.0}, "got 0.0"),
    ({"sigma": float("nan")}, "sigma must be positive, got nan"),
])
def test_bad_parameters_raise_an_input_error_naming_them(kwargs, message):
    settings = {"num_sets": 4, **kwargs}
    with pytest.raises(InputError, match=message):
        repulsive_sets(settings.pop("num_sets"), **settings)


def test_sets_larger_than_the_exact_normaliser_allows_are_refused():
    with pytest.raises(InputError, match="between 1 and 6.*got 8"):
        repulsive_sets_log_prob(torch.zeros(2, 8, 1), None)
