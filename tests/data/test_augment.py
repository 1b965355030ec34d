"""Tests for rotation and reflection augmentation: Haar-distributed O(D) matrices, rotations of
sets about their centroids, mirror images through the coordinate axes, and the training batches
of `sets fit --augment rotations|reflections`."""

import math

import pytest
import torch

from flowattn.data import load_dataset, random_orthogonal, random_signs, reflect_sets, rotate_sets
from flowattn.errors import InputError
from flowattn.sets.config import MIRROR_DATA, SetsRunConfig
from flowattn.sets.train import SetsTask
from flowattn.training.distributed import Distributed


@pytest.mark.parametrize("dim", [2, 3])
def test_random_orthogonal_is_haar_on_the_orthogonal_group(dim):
    count = 20_000
    q = random_orthogonal(count, dim, torch.Generator().manual_seed(0))
    eye = torch.eye(dim, dtype=q.dtype)
    assert (q @ q.transpose(1, 2) - eye).abs().max() < 1e-12
    # Haar on O(D): every entry has mean 0 and variance 1/D (a column is uniform on the
    # sphere), and det = +1 and -1 are equally likely. QR without the sign correction puts a
    # sign convention into Q: its first column is then biased (E[Q_11] far from 0).
    se = 1 / math.sqrt(dim * count)
    assert q.mean(0).abs().max() < 5 * se
    assert (q.square().mean(0) - 1 / dim).abs().max() < 0.02
    proper = (torch.linalg.det(q) > 0).double().mean()
    assert abs(proper - 0.5) < 5 * 0.5 / math.sqrt(count)
    with pytest.raises(InputError, match="dim >= 1"):
        random_orthogonal(2, 0)


def test_rotate_sets_keeps_distances_centroids_and_padding():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 6, 3, generator=g, dtype=torch.float64) + 5.0
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[0, 4:] = False
    mask[2, 0] = False
    q = random_orthogonal(4, 3, g)
    y = rotate_sets(x, mask, q)
    for b in range(4):
        keep = mask[b]
        torch.testing.assert_close(torch.cdist(y[b, keep], y[b, keep]),
                                   torch.cdist(x[b, keep], x[b, keep]))
        torch.testing.assert_close(y[b, keep].mean(0), x[b, keep].mean(0))
        assert torch.equal(y[b, ~keep], x[b, ~keep])
        centre = x[b, keep].mean(0)
        torch.testing.assert_close(y[b, keep], centre + (x[b, keep] - centre) @ q[b])
    assert not torch.allclose(y, x)
    with pytest.raises(InputError, match="q must have shape"):
        rotate_sets(x, mask, q[:2])


def _task(augment):
    config = SetsRunConfig.build({"data": "shape-sets", "num_train": 64, "val_sets": 8,
                                  "batch_size": 16, "blocks": 1, "augment": augment,
                                  "symmetry": "none"})
    return SetsTask(config, Distributed(rank=0, world=1, device=torch.device("cpu")),
                    plots=False)


def test_augmented_batches_are_rotated_copies_of_the_same_sets():
    plain, rotated = _task("none"), _task("rotations")
    x, mask = plain.batch(torch.Generator().manual_seed(3), plain.dist)
    y, mask_y = rotated.batch(torch.Generator().manual_seed(3), rotated.dist)
    assert mask is None and mask_y is None
    assert not torch.allclose(x, y)  # rotated ...
    torch.testing.assert_close(torch.cdist(y, y), torch.cdist(x, x), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(y.mean(1), x.mean(1), rtol=1e-4, atol=1e-5)  # ... about centroids
    # without augmentation the batches are those of earlier versions (nothing else is drawn)
    again, _ = plain.batch(torch.Generator().manual_seed(3), plain.dist)
    assert torch.equal(again, x)


def test_random_signs_draw_every_reflection_equally_often():
    count = 40_000
    s = random_signs(count, 2, torch.Generator().manual_seed(0))
    assert set(s.flatten().tolist()) == {-1.0, 1.0}
    patterns = (s > 0).long() @ torch.tensor([1, 2])  # which of the 4 reflections
    share = torch.bincount(patterns, minlength=4).double() / count
    assert (share - 0.25).abs().max() < 5 * math.sqrt(0.25 * 0.75 / count)
    with pytest.raises(InputError, match="dim >= 1"):
        random_signs(2, 0)


def test_reflect_sets_mirrors_each_set_and_keeps_padding():
    x = torch.randn(3, 5, 2, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    x[1, 3:] = 0.0  # padding
    signs = torch.tensor([[-1.0, 1.0], [1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    y = reflect_sets(x, signs)
    torch.testing.assert_close(y[0], x[0] * torch.tensor([-1.0, 1.0], dtype=x.dtype))
    torch.testing.assert_close(y[2], -x[2])
    assert torch.equal(y[1, 3:], x[1, 3:])
    with pytest.raises(InputError, match="signs must have shape"):
        reflect_sets(x, signs[:2])


@pytest.mark.parametrize("name", MIRROR_DATA)
def test_shape_sets_density_is_invariant_under_the_reflections_only(name):
    # what makes --augment reflections valid on these data, and symmetry reflections their
    # default (MIRROR_DATA): log p(X S) = log p(X) for each of the four S = diag(±1, ±1); a
    # quarter turn is not a symmetry (the triangles point up and down only)
    data = load_dataset(name, seed=0)["test"]
    x, mask = data.x[:500].double(), None if data.mask is None else data.mask[:500]
    log_p = data.true_log_prob(x, mask)
    for pattern in ([-1.0, 1.0], [1.0, -1.0], [-1.0, -1.0]):
        signs = torch.tensor(pattern, dtype=x.dtype).expand(len(x), 2)
        torch.testing.assert_close(data.true_log_prob(reflect_sets(x, signs), mask), log_p)
    quarter = torch.tensor([[0.0, 1.0], [-1.0, 0.0]], dtype=x.dtype)
    assert (data.true_log_prob(x @ quarter, mask) - log_p).abs().max() > 1.0


def test_reflected_batches_are_mirror_images_of_the_same_sets():
    plain, mirrored = _task("none"), _task("reflections")
    x, _ = plain.batch(torch.Generator().manual_seed(3), plain.dist)
    y, mask = mirrored.batch(torch.Generator().manual_seed(3), mirrored.dist)
    assert mask is None
    signs = y[:, 0] / x[:, 0]  # each set's own sign pattern, the same for all its points
    assert set(signs.round().flatten().tolist()) == {-1.0, 1.0}
    torch.testing.assert_close(y, x * signs.round().unsqueeze(1))
    assert (signs.round() < 0).any(dim=1).sum() >= 8  # most of the 16 sets are mirrored
