"""Tests for rotation augmentation: Haar-distributed O(D) matrices, rotations of sets about
their centroids, and the training batches of `sets fit --augment rotations`."""

import math

import pytest
import torch

from flowattn.data import random_orthogonal, rotate_sets
from flowattn.errors import InputError
from flowattn.sets.config import SetsRunConfig
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
                                  "batch_size": 16, "blocks": 1, "augment": augment})
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
