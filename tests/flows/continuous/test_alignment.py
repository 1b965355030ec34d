"""Base draws aligned to their data for flow matching: the assignment against the exact optimum,
the orthogonal map against random ones, equivariance, padding, and the property that makes the
loss valid: under data whose law is invariant, the aligned draws are still standard normal."""

import itertools
import math

import pytest
import torch
from scipy.optimize import linear_sum_assignment  # the exact optimum (scipy is in [test])

from flowattn.errors import InputError
from flowattn.flows import CNF, EGNNField, SetFlow
from flowattn.flows.continuous.alignment import align, assignment


def randn(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def centred(x):
    return x - x.mean(dim=1, keepdim=True)


def total(cost, perm):
    return cost.gather(2, perm.unsqueeze(-1)).sum(dim=(1, 2))


def orthogonal(count, dim, seed):
    q, r = torch.linalg.qr(randn(count, dim, dim, seed=seed))
    return q * torch.sign(torch.diagonal(r, dim1=1, dim2=2)).unsqueeze(1)  # Haar on O(D)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_small_assignments_are_the_exact_optimum(n):
    cost = torch.cdist(randn(50, n, 3, seed=n), randn(50, n, 3, seed=10 + n)).square()
    perm = assignment(cost)
    brute = torch.stack([total(cost, torch.tensor(p).expand(50, n))
                         for p in itertools.permutations(range(n))]).amin(dim=0)
    torch.testing.assert_close(total(cost, perm), brute)


@pytest.mark.parametrize("n", [6, 13, 30])
def test_larger_assignments_are_permutations_no_exchange_improves(n):
    cost = torch.cdist(randn(40, n, 3, seed=n), randn(40, n, 3, seed=10 + n)).square()
    perm = assignment(cost)
    assert torch.equal(perm.sort(dim=1).values, torch.arange(n).expand(40, n))
    now = total(cost, perm)
    for i, j in itertools.combinations(range(n), 2):  # every exchange of two targets
        swapped = perm.clone()
        swapped[:, [i, j]] = perm[:, [j, i]]
        assert bool((total(cost, swapped) >= now - 1e-9).all())
    # and close to the optimum of the linear assignment problem (measured: 0.7-4.6 % above)
    best = torch.tensor([float(c[linear_sum_assignment(c.numpy())].sum())
                         for c in cost], dtype=torch.float64)
    assert bool((now >= best - 1e-9).all())
    assert float((now / best - 1).mean()) < 0.06


def test_alignment_only_permutes_and_turns_the_draws():
    x, z = centred(randn(20, 7, 3, seed=1)), centred(randn(20, 7, 3, seed=2))
    moved = align(z, x)
    assert torch.equal(moved.sort(dim=1).values, z.sort(dim=1).values)  # rows reordered
    turned = align(z, x, rotations=True)
    # the same points up to one orthogonal map and an order: sorted norms and distances agree
    torch.testing.assert_close(turned.norm(dim=-1).sort(dim=1).values,
                               z.norm(dim=-1).sort(dim=1).values)
    torch.testing.assert_close(torch.cdist(turned, turned).flatten(1).sort(dim=1).values,
                               torch.cdist(z, z).flatten(1).sort(dim=1).values)
    torch.testing.assert_close(turned.mean(dim=1), torch.zeros(20, 3, dtype=torch.float64))
    cost = (x - z).square().sum(dim=(1, 2))
    assert bool((moved.sub(x).square().sum(dim=(1, 2)) <= cost + 1e-12).all())
    assert bool((turned.sub(x).square().sum(dim=(1, 2))
                 <= moved.sub(x).square().sum(dim=(1, 2)) + 1e-12).all())


def test_permutation_alignment_reaches_the_closest_order_of_small_sets():
    x, z = randn(30, 4, 3, seed=21), randn(30, 4, 3, seed=22)
    moved = align(z, x)
    closest = torch.stack([(z[:, list(p)] - x).square().sum(dim=(1, 2))
                           for p in itertools.permutations(range(4))]).amin(dim=0)
    torch.testing.assert_close((moved - x).square().sum(dim=(1, 2)), closest)
    assert float(closest.mean()) < 0.7 * float((z - x).square().sum(dim=(1, 2)).mean())


def test_the_orthogonal_map_is_the_best_one_for_the_chosen_order():
    x, z = centred(randn(10, 6, 3, seed=3)), centred(randn(10, 6, 3, seed=4))
    turned = align(z, x, rotations=True)
    best = turned.sub(x).square().sum(dim=(1, 2))
    for seed in range(40):  # no other orthogonal map of the aligned draws comes closer
        q = orthogonal(10, 3, seed=100 + seed)
        assert bool((best <= (turned @ q).sub(x).square().sum(dim=(1, 2)) + 1e-10).all())
    # and the map is a real improvement over the order alone
    ordered = align(z, x, rotations=False, iterations=1)
    assert float(best.mean()) < 0.8 * float(ordered.sub(x).square().sum(dim=(1, 2)).mean())


def test_alignment_is_equivariant_under_joint_permutations_and_orthogonal_maps():
    x, z = centred(randn(8, 5, 2, seed=5)), centred(randn(8, 5, 2, seed=6))
    turned = align(z, x, rotations=True)
    perm = torch.tensor([3, 0, 4, 2, 1])
    torch.testing.assert_close(align(z[:, perm], x[:, perm], rotations=True), turned[:, perm])
    q = orthogonal(1, 2, seed=7)[0]
    torch.testing.assert_close(align(z @ q, x @ q, rotations=True), turned @ q)


def test_padded_elements_stay_in_place_and_pair_with_padding_only():
    x, z = centred(randn(6, 7, 3, seed=8)), randn(6, 7, 3, seed=9)
    mask = torch.ones(6, 7, dtype=torch.bool)
    mask[:, 4:] = False
    mask[0, 2:] = False
    z = torch.where(mask.unsqueeze(-1), z, 0.0)
    turned = align(z, x, mask, rotations=True)
    assert bool((turned[~mask] == 0).all())
    alone = align(z[1:, :4], x[1:, :4], rotations=True)  # the padding changes nothing
    torch.testing.assert_close(turned[1:, :4], alone)


def test_aligned_draws_stay_standard_normal_under_invariant_data():
    # data: one fixed configuration under a uniform permutation and a Haar orthogonal map, an
    # invariant law; draws: N(0, I) on the zero-centre-of-mass subspace. The aligned draws sit
    # close to their data, yet their marginal law is the base: covariance P (x) I with
    # P = I - 11^T / n. With the data fixed (a law that is not invariant) it is not.
    n, dim, count = 4, 2, 40000
    shape = centred(torch.tensor([[[0.0, 0.0], [1.5, 0.2], [0.3, 1.1], [2.0, 1.4]]],
                                 dtype=torch.float64))
    generator = torch.Generator().manual_seed(11)
    perms = torch.argsort(torch.rand(count, n, generator=generator), dim=1)
    x = shape.expand(count, n, dim).gather(1, perms.unsqueeze(-1).expand(count, n, dim))
    x = x @ orthogonal(count, dim, seed=12)
    z = centred(torch.randn(count, n, dim, generator=generator, dtype=torch.float64))
    aligned = align(z, x, rotations=True)
    projector = torch.kron(torch.eye(n) - 1.0 / n, torch.eye(dim)).double()

    def covariance(sample):
        flat = sample.reshape(count, -1)
        return flat.T @ flat / count

    assert (covariance(aligned) - projector).abs().max() < 0.04
    assert aligned.mean(dim=0).abs().max() < 0.03
    # fourth moments too: each coordinate's kurtosis is a Gaussian's 3
    variance = aligned.square().mean(dim=0)
    assert (aligned.pow(4).mean(dim=0) / variance.square() - 3).abs().max() < 0.15
    # the draws did move towards their data: the test would see a biased alignment
    assert float((aligned - x).square().sum(dim=(1, 2)).mean()) < \
        0.5 * float((z - x).square().sum(dim=(1, 2)).mean())
    fixed = align(z, shape.expand(count, n, dim), rotations=True)
    assert (covariance(fixed) - projector).abs().max() > 0.2


def test_matching_with_alignment_is_matching_on_the_aligned_draws():
    torch.manual_seed(0)
    cnf = CNF(EGNNField(2, hidden=8, layers=2).double())
    x, z = centred(randn(5, 4, 2, seed=1)), centred(randn(5, 4, 2, seed=2))
    t = torch.rand(5, dtype=torch.float64)
    for alignment, rotations in (("permutation", False), ("euclidean", True)):
        torch.testing.assert_close(cnf.matching_loss(x, noise=z, times=t, alignment=alignment),
                                   cnf.matching_loss(x, noise=align(z, x, rotations=rotations),
                                                     times=t))
    assert not torch.allclose(cnf.matching_loss(x, noise=z, times=t, alignment="euclidean"),
                              cnf.matching_loss(x, noise=z, times=t))
    with pytest.raises(InputError, match="alignment must be one of"):
        cnf.matching_loss(x, noise=z, alignment="rotation")
    with pytest.raises(InputError, match="inputs must be"):
        CNF(EGNNField(2, hidden=8, layers=2)).matching_loss(torch.randn(5, 8),
                                                            alignment="permutation")


def test_euclidean_alignment_needs_an_isotropic_standardisation():
    flow = SetFlow(CNF(EGNNField(2, hidden=8, layers=2)), dim=2, zero_com=True)
    x = torch.randn(64, 4, 2) * torch.tensor([1.0, 3.0])
    flow.standardise(x)
    with pytest.raises(InputError, match="isotropic=True"):
        flow.matching_loss(x, alignment="euclidean")
    flow.standardise(x, isotropic=True)
    scale = flow.standardisation.log_scale
    assert torch.equal(scale, scale[:1].expand(2))
    rms = centred(x.double()).square().mean().sqrt()
    assert math.isclose(float(-scale[0]), float(rms.log()), rel_tol=1e-6)
    assert flow.matching_loss(x, alignment="euclidean").shape == (64,)
