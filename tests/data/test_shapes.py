"""flowattn.data.shapes: shape-mixture sets, their exact density, sampler and i.i.d. baseline."""

import math

import pytest
import torch

from flowattn.data import (
    SHAPES,
    load_dataset,
    shape_sets,
    shape_sets_iid_log_prob,
    shape_sets_log_joint,
    shape_sets_log_prob,
)
from flowattn.data.shapes import DEFAULT_SHAPES
from flowattn.errors import InputError


def _mean_and_error(values):
    values = values.double()
    return values.mean().item(), values.std().item() / math.sqrt(values.numel())


def test_density_equals_the_mixture_of_shapes_it_defines():
    scale = 0.25
    data = shape_sets(6, min_size=2, max_size=5, scale=scale,
                      generator=torch.Generator().manual_seed(0))
    x = data.x.double()
    ours = shape_sets_log_prob(x, data.mask, DEFAULT_SHAPES, scale)
    radius = math.sqrt(2 * (1 - scale**2))
    for b in range(len(data)):
        points = x[b, data.mask[b]]
        per_shape = []
        for name in DEFAULT_SHAPES:
            m, start = SHAPES[name]
            blobs = []
            for j in range(m):
                angle = 2 * math.pi * (start + j / m)
                centre = torch.tensor([radius * math.cos(angle), radius * math.sin(angle)],
                                      dtype=torch.float64)
                normal = torch.distributions.Normal(centre, scale)
                blobs.append(normal.log_prob(points).sum(-1) - math.log(m))
            per_point = torch.logsumexp(torch.stack(blobs), 0)  # log p_k(x_i)
            per_shape.append(per_point.sum() - math.log(len(DEFAULT_SHAPES)))
        expected = torch.logsumexp(torch.stack(per_shape), 0)
        assert math.isclose(ours[b].item(), expected.item(), rel_tol=1e-12)


def test_every_shape_has_mean_zero_and_identity_covariance():
    for name in SHAPES:
        data = shape_sets(20_000, min_size=1, max_size=1, shapes=[name], scale=0.2,
                          generator=torch.Generator().manual_seed(1))
        points = data.x[:, 0].double()
        torch.testing.assert_close(points.mean(0), torch.zeros(2, dtype=torch.float64),
                                   atol=0.03, rtol=0)
        torch.testing.assert_close(points.T.cov(), torch.eye(2, dtype=torch.float64),
                                   atol=0.04, rtol=0)


def _grid(lo, hi, step, dims):
    axis = torch.arange(lo, hi + step / 2, step, dtype=torch.float64)
    return torch.cartesian_prod(*[axis] * dims), step**dims


def test_density_of_one_point_integrates_to_one():
    scale = 0.3
    points, cell = _grid(-3.2, 3.2, 0.05, 2)
    one = shape_sets_log_prob(points[:, None, :], None, DEFAULT_SHAPES, scale).exp().sum()
    assert abs(one.item() * cell - 1) < 1e-6


@pytest.mark.slow
def test_density_of_two_points_integrates_to_one():
    scale = 0.3
    # two points: a 4-D grid (step 2 scale / 3: the Riemann sum of a Gaussian is then exact to
    # ~1e-19, and the tails beyond 3.0, 5.5 sd past the outermost blobs, hold < 1e-7)
    grid, cell = _grid(-3.0, 3.0, 0.2, 4)
    total = sum(shape_sets_log_prob(chunk.view(-1, 2, 2), None, DEFAULT_SHAPES, scale)
                .exp().sum().item() for chunk in grid.split(100_000))
    assert abs(total * cell - 1) < 1e-5


def test_iid_density_is_the_one_point_marginal():
    # for one point the set density is the marginal; for more, the product of marginals
    x = torch.randn(50, 5, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    marginal = shape_sets_log_prob(x.reshape(-1, 1, 2), None).view(50, 5)
    torch.testing.assert_close(shape_sets_iid_log_prob(x, None), marginal.sum(1))


def test_samples_satisfy_the_stein_identity_of_the_density():
    # E_p[x . grad log p(x)] = -(number of coordinates), by integration by parts: wrong blob
    # scales or positions in the sampler move the mean away from it
    data = shape_sets(4000, min_size=4, max_size=10, generator=torch.Generator().manual_seed(3))
    x = data.x.double().requires_grad_(True)
    (grad,) = torch.autograd.grad(shape_sets_log_prob(x, data.mask).sum(), x)
    statistic = (x.detach() * grad).sum((1, 2)) + 2 * data.sizes().double()
    mean, error = _mean_and_error(statistic)
    assert abs(mean) < 4 * error, (mean, error)
    assert error < 0.5  # strong enough to see a blob scale 5% off (mean ~ 1.5)


def test_samples_pick_each_shape_with_its_weight():
    # E_p[p(k | X)] = w_k = 1/K exactly, for a sampler that draws the shapes as the density says
    data = shape_sets(4000, min_size=2, max_size=6, generator=torch.Generator().manual_seed(4))
    posterior = shape_sets_log_joint(data.x.double(), data.mask).softmax(1)
    for k in range(len(DEFAULT_SHAPES)):
        mean, error = _mean_and_error(posterior[:, k])
        assert abs(mean - 0.25) < 4 * error + 1e-3, (k, mean, error)


def test_density_is_permutation_invariant_and_ignores_padding():
    data = shape_sets(30, min_size=3, max_size=9, generator=torch.Generator().manual_seed(5))
    x = data.x.double()
    perm = torch.randperm(9, generator=torch.Generator().manual_seed(6))
    for log_prob in (shape_sets_log_prob, shape_sets_iid_log_prob):
        reference = log_prob(x, data.mask)
        torch.testing.assert_close(log_prob(x[:, perm], data.mask[:, perm]), reference)
        junk = x + 50.0 * (~data.mask[..., None])
        torch.testing.assert_close(log_prob(junk, data.mask), reference)


def test_padded_sets_have_the_density_of_the_set_alone_given_its_size():
    data = shape_sets(40, min_size=4, max_size=10, generator=torch.Generator().manual_seed(7))
    sizes = data.sizes()
    assert sizes.min() >= 4 and sizes.max() <= 10
    assert bool((data.x[~data.mask] == 0).all())  # padding is zeroed
    x = data.x.double()
    padded = shape_sets_log_prob(x, data.mask)
    padded_iid = shape_sets_iid_log_prob(x, data.mask)
    for b in range(len(data)):
        alone = x[b : b + 1, data.mask[b]]
        assert math.isclose(padded[b].item(), shape_sets_log_prob(alone, None).item(),
                            rel_tol=1e-12)
        assert math.isclose(padded_iid[b].item(), shape_sets_iid_log_prob(alone, None).item(),
                            rel_tol=1e-12)


def test_variable_sizes_are_uniform_on_their_range():
    sizes = shape_sets(7000, min_size=4, max_size=10,
                       generator=torch.Generator().manual_seed(8)).sizes()
    counts = torch.bincount(sizes, minlength=11)[4:].double()
    assert counts.min() > 850 and counts.max() < 1150  # 1000 each, sd ~29


@pytest.mark.parametrize("name", ["shape-sets", "shape-sets-varsize"])
def test_best_iid_nll_is_clearly_above_the_true_nll(name):
    test = load_dataset(name, {"train": 1, "val": 1})["test"]
    gain = test.iid_log_prob(test.x, test.mask) - test.true_log_prob(test.x, test.mask)
    mean, error = _mean_and_error(-gain)  # per set: iid NLL - true NLL
    dims = 2 * test.sizes().double().mean().item()
    assert mean / dims > 0.15 and mean > 10 * error
    assert test.mean_iid_nll() - test.mean_true_nll() == pytest.approx(mean, rel=1e-5)


def test_sets_are_reproducible_from_the_seed():
    def make(seed):
        g = torch.Generator().manual_seed(seed)
        return shape_sets(50, min_size=3, max_size=8, generator=g)

    a, b, c = make(9), make(9), make(10)
    assert torch.equal(a.x, b.x) and torch.equal(a.mask, b.mask)
    assert not torch.equal(a.x, c.x)
    first, second = (load_dataset("shape-sets-varsize", {"train": 20, "val": 5, "test": 5})
                     for _ in range(2))
    for split in first:
        assert torch.equal(first[split].x, second[split].x)
        assert first[split].name == f"shape-sets-varsize/{split}"


@pytest.mark.parametrize("kwargs, message", [
    ({"num_sets": 0}, "num_sets must be positive, got 0"),
    ({"min_size": 0}, "min_size=0"),
    ({"min_size": 5, "max_size": 4}, "min_size=5, max_size=4"),
    ({"shapes": ["ring", "star"]}, "unknown shape 'star'"),
    ({"shapes": ["ring", "ring"]}, "must not repeat"),
    ({"shapes": []}, "non-empty list"),
    ({"shapes": "ring"}, "non-empty list"),
    ({"scale": 1.0}, "scale must lie in \\(0, 1\\).*got 1.0"),
    ({"scale": 0.0}, "got 0.0"),
])
def test_bad_parameters_raise_an_input_error_naming_them(kwargs, message):
    settings = {"num_sets": 4, **kwargs}
    with pytest.raises(InputError, match=message):
        shape_sets(settings.pop("num_sets"), **settings)


def test_points_that_are_not_planar_are_refused():
    with pytest.raises(InputError, match=r"\(M, N, 2\).*\(3, 4, 3\)"):
        shape_sets_log_prob(torch.zeros(3, 4, 3), None)
