"""log Z by annealed importance sampling and entropy floors, against exact values."""

import math

import pytest
import torch

from flowattn.data import dw4_energy
from flowattn.data.partition import (
    AnnealingOptions,
    annealed_log_partition,
    entropy_floor,
    harmonic_log_partition,
)
from flowattn.errors import InputError
from flowattn.flows.base import sample_standard_normal, standard_normal_log_prob


def harmonic(stiffness):
    """E = k/2 Σ_{i<j} ||x_i - x_j||^2."""
    def energy(x):
        diff = x.unsqueeze(-2) - x.unsqueeze(-3)
        return 0.25 * stiffness * diff.pow(2).sum((-3, -2, -1))
    return energy


def test_harmonic_log_partition_is_the_normaliser_of_the_flows_zero_com_base():
    # with k n = 1 the Boltzmann density is the base of a zero-CoM set flow, N(0, I) on V:
    # -E - log Z must equal its log-density, constant included
    n, dim = 5, 3
    x = sample_standard_normal((7, n, dim), zero_com=True,
                               generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    log_p = -harmonic(1 / n)(x) - harmonic_log_partition(n, dim, 1 / n)
    torch.testing.assert_close(log_p, standard_normal_log_prob(x, zero_com=True))


def test_harmonic_log_partition_matches_quadrature_in_the_orthonormal_coordinate():
    # two particles on a line: x = (u, -u) / √2 with u the orthonormal coordinate of V
    u = torch.linspace(-12, 12, 200_001, dtype=torch.float64)
    x = torch.stack([u, -u], -1).unsqueeze(-1) / math.sqrt(2)
    z = torch.trapezoid(torch.exp(-harmonic(0.7)(x)), u)
    assert math.log(z) == pytest.approx(harmonic_log_partition(2, 1, 0.7), abs=1e-9)


@pytest.mark.parametrize("n,dim,stiffness", [(4, 2, 1.0), (3, 3, 0.2)])
def test_ais_log_partition_of_a_harmonic_system_is_within_its_error(n, dim, stiffness):
    options = AnnealingOptions(chains=500, stages=200, pilot_chains=100)
    est = annealed_log_partition(harmonic(stiffness), n, dim, options,
                                 torch.Generator().manual_seed(0))
    truth = harmonic_log_partition(n, dim, stiffness)
    assert 0 < est.log_z_error < 0.1
    assert abs(est.log_z - truth) < 3 * est.log_z_error, (est.log_z, truth, est.log_z_error)
    # the weighted final states give E_p[E] = d / 2 (equipartition)
    assert abs(est.mean_energy - (n - 1) * dim / 2) < 3 * est.mean_energy_error


def test_ais_log_partition_of_a_bimodal_pair_potential_matches_quadrature():
    # the DW4 pair potential between two particles on a line: two wells in d = √2 |u|
    u = torch.linspace(-15, 15, 300_001, dtype=torch.float64)
    x = torch.stack([u, -u], -1).unsqueeze(-1) / math.sqrt(2)
    truth = math.log(torch.trapezoid(torch.exp(-dw4_energy(x)), u))
    options = AnnealingOptions(chains=1000, stages=200, base_scale=3.0, pilot_chains=100)
    est = annealed_log_partition(dw4_energy, 2, 1, options, torch.Generator().manual_seed(0))
    assert abs(est.log_z - truth) < 3 * est.log_z_error, (est.log_z, truth, est.log_z_error)
    assert est.log_z_error < 0.05


def test_entropy_floor_of_a_gaussian_system_is_its_differential_entropy():
    n, dim = 3, 2
    d = (n - 1) * dim
    g = torch.Generator().manual_seed(2)
    x = sample_standard_normal((4000, n, dim), zero_com=True, generator=g,
                               dtype=torch.float64)
    energy = harmonic(1 / n)  # p = N(0, I) on V: entropy d/2 (1 + log 2π)
    est = annealed_log_partition(energy, n, dim, AnnealingOptions(chains=200, stages=20), g)
    floor = entropy_floor(energy, x, est, block=10)
    truth = d / 2 * (1 + math.log(2 * math.pi))
    assert abs(floor.nll - truth) < 3 * floor.error
    assert floor.nll_per_dim == pytest.approx(floor.nll / d)
    assert floor.error == pytest.approx(math.hypot(floor.mean_energy_error, est.log_z_error))


def test_entropy_floor_refuses_configurations_of_another_system_or_a_bad_block():
    est = annealed_log_partition(harmonic(1.0), 3, 2, AnnealingOptions(chains=10, stages=2))
    with pytest.raises(InputError, match="6 degrees of freedom, log Z was estimated for 4"):
        entropy_floor(harmonic(1.0), torch.zeros(10, 4, 2), est)
    with pytest.raises(InputError, match="block=3"):
        entropy_floor(harmonic(1.0), torch.zeros(10, 3, 2), est, block=3)


@pytest.mark.parametrize("changes,match", [
    ({"chains": 1}, "chains must be an integer >= 2"),
    ({"stages": 0}, "stages must be an integer >= 1"),
    ({"base_scale": 0.0}, "base_scale must be positive"),
    ({"acceptance": 1.0}, r"acceptance must lie in \(0, 1\)"),
])
def test_bad_annealing_options_are_refused_naming_the_setting(changes, match):
    with pytest.raises(InputError, match=match):
        AnnealingOptions(**changes)


def test_entropy_floor_error_counts_correlated_blocks_once():
    # every configuration repeated 5 times (a chain that did not move): the batch means over
    # blocks of 5 give the error of the 40 distinct configurations, not of 200 draws
    g = torch.Generator().manual_seed(3)
    distinct = sample_standard_normal((40, 3, 2), zero_com=True, generator=g,
                                      dtype=torch.float64)
    x = distinct.repeat_interleave(5, 0)
    energy = harmonic(1 / 3)
    est = annealed_log_partition(energy, 3, 2, AnnealingOptions(chains=10, stages=2))
    floor = entropy_floor(energy, x, est, block=5)
    e = energy(distinct)
    assert floor.mean_energy_error == pytest.approx((e.std() / math.sqrt(40)).item())


def test_ais_log_z_error_covers_the_truth_at_95_percent_over_independent_runs():
    g = torch.Generator().manual_seed(0)
    truth = harmonic_log_partition(3, 2, 1.0)
    options = AnnealingOptions(chains=100, stages=10, pilot_chains=20)
    z = []
    for _ in range(200):
        est = annealed_log_partition(harmonic(1.0), 3, 2, options, g)
        z.append((est.log_z - truth) / est.log_z_error)
    z = torch.tensor(z)
    coverage = (z.abs() < 1.96).double().mean().item()
    assert 0.92 <= coverage <= 0.98, coverage  # 95 % ± 2.6 binomial standard deviations
    assert 0.8 < z.std().item() < 1.2
