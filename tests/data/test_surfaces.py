"""flowattn.data.surfaces: point clouds on random rotated surfaces, and the set_size setting."""

import math

import pytest
import torch

from flowattn.data import (
    SIZED_DATASETS,
    SURFACES,
    load_dataset,
    random_rotations,
    surface_clouds,
    surface_distance,
)
from flowattn.errors import ConfigError, InputError
from flowattn.sets.config import SIZED_DATA, SetsRunConfig


def _clouds(num_sets=12, set_size=400, seed=0, **kwargs):
    return surface_clouds(num_sets, set_size, generator=torch.Generator().manual_seed(seed),
                          **kwargs)


def test_shapes_and_every_surface_kind_drawn():
    data = _clouds(30, 200)
    assert data.x.shape == (30, 200, 3) and data.x.dtype == torch.float32
    assert data.mask is None and data.true_log_prob is None
    surfaces = data.meta["surfaces"]
    assert surfaces["kind"].shape == (30,) and surfaces["params"].shape == (30, 2)
    assert surfaces["rotation"].shape == (30, 3, 3)
    assert set(surfaces["kind"].tolist()) == {0, 1, 2}


def test_same_seed_same_clouds_other_seed_other_clouds():
    first, again, other = _clouds(seed=3), _clouds(seed=3), _clouds(seed=4)
    assert torch.equal(first.x, again.x)
    for key in ("kind", "params", "rotation"):
        assert torch.equal(first.meta["surfaces"][key], again.meta["surfaces"][key])
    assert not torch.allclose(first.x, other.x)


@pytest.mark.parametrize("kind", SURFACES)
def test_distance_to_the_surface_is_half_normal_at_the_noise_scale(kind):
    # |N(0, sigma^2)|: E[d^2] = sigma^2, median 0.6745 sigma, 90% quantile 1.6449 sigma; the
    # curvature changes these by O(sigma / radius) = 3% at most
    noise = 0.02
    data = _clouds(20, 1000, kinds=[kind], noise=noise)
    d = surface_distance(data.x.double(), **data.meta["surfaces"]) / noise
    assert abs(d.pow(2).mean().item() - 1) < 0.05
    assert abs(d.median().item() - 0.6745) < 0.03
    assert abs(d.quantile(0.9).item() - 1.6449) < 0.05


def test_torus_points_are_area_uniform_more_on_the_outer_half():
    # area element (a + b cos t) dt dp: P(cos t > 0) = 1/2 + b / (pi a), not 1/2
    data = _clouds(200, 500, kinds=["torus"], noise=1e-4)
    surfaces = data.meta["surfaces"]
    local = data.x.double() @ surfaces["rotation"].double()  # R^T x
    a, b = surfaces["params"].double().unbind(1)
    outer = (local[..., :2].norm(dim=-1) > a[:, None]).double().mean(1)
    expected = 0.5 + b / (math.pi * a)
    error = (outer - expected).mean().item()
    assert abs(error) < 0.01, error


def test_cylinder_heights_and_sphere_points_are_uniform():
    cyl = _clouds(100, 500, kinds=["cylinder"], noise=1e-4)
    local = cyl.x.double() @ cyl.meta["surfaces"]["rotation"].double()
    half = cyl.meta["surfaces"]["params"][:, 1].double()
    h = local[..., 2] / half[:, None]  # uniform on [-1, 1]: E[h] = 0, E[h^2] = 1/3
    assert abs(h.mean().item()) < 0.01
    assert abs(h.pow(2).mean().item() - 1 / 3) < 0.01
    assert h.abs().max().item() < 1.01
    sph = _clouds(100, 500, kinds=["sphere"], noise=1e-4)
    u = sph.x.double() / sph.x.double().norm(dim=-1, keepdim=True)
    assert u.mean(dim=(0, 1)).abs().max().item() < 0.01
    assert (u.pow(2).mean(dim=(0, 1)) - 1 / 3).abs().max().item() < 0.01


def test_rotations_are_proper_and_uniform():
    r = random_rotations(20_000, torch.float64, torch.Generator().manual_seed(0))
    eye = torch.eye(3, dtype=torch.float64)
    assert torch.allclose(r @ r.transpose(1, 2), eye.expand_as(r), atol=1e-12)
    assert torch.allclose(torch.linalg.det(r), torch.ones(20_000, dtype=torch.float64))
    axis = r[:, :, 2]  # R e_3, uniform on the sphere: mean 0, second moment I / 3
    assert axis.mean(0).abs().max().item() < 0.02
    assert (axis.T @ axis / 20_000 - eye / 3).abs().max().item() < 0.02


def test_distance_of_points_placed_off_each_surface():
    kind = torch.tensor([0, 1, 2, 2])
    params = torch.tensor([[1.0, 0.0], [1.0, 0.25], [0.5, 1.0], [0.5, 1.0]],
                          dtype=torch.float64)
    x = torch.tensor([[[0.0, 0.0, 1.3]], [[1.0, 0.0, 0.5]], [[0.0, 0.2, 0.3]],
                      [[0.8, 0.0, 1.4]]], dtype=torch.float64)
    rotation = random_rotations(4, torch.float64, torch.Generator().manual_seed(1))
    x = x @ rotation.transpose(1, 2)  # the same points in each rotated frame
    d = surface_distance(x, kind, params, rotation)[:, 0]
    assert torch.allclose(d, torch.tensor([0.3, 0.25, 0.3, 0.5], dtype=torch.float64))


def test_set_size_reaches_the_clouds_and_defaults_to_1000():
    sizes = {"train": 3, "val": 2, "test": 2}
    assert load_dataset("surface-clouds", sizes)["train"].x.shape == (3, 1000, 3)
    splits = load_dataset("surface-clouds", sizes, set_size=50)
    assert {split: data.x.shape for split, data in splits.items()} == {
        "train": (3, 50, 3), "val": (2, 50, 3), "test": (2, 50, 3)}
    assert not torch.equal(splits["val"].x, splits["test"].x)


def test_set_size_is_refused_for_data_of_fixed_size():
    with pytest.raises(InputError, match="set_size=20 applies to surface-clouds"):
        load_dataset("shape-sets", {"train": 2, "val": 2, "test": 2}, set_size=20)
    with pytest.raises(InputError, match="set_size must be an integer >= 1, got 0"):
        load_dataset("surface-clouds", set_size=0)
    assert SIZED_DATA == SIZED_DATASETS  # the config (no torch) and the registry agree
    for data in ("shape-sets", "dw4", "mine.npz"):
        with pytest.raises(ConfigError, match=f"set_size=20 applies to surface-clouds; the "
                           f"sets of '{data}' have a fixed size") as err:
            SetsRunConfig.build({"data": data, "set_size": 20})
        assert "\n" not in str(err.value)
    config = SetsRunConfig.build({"data": "surface-clouds", "set_size": 2000})
    assert config.data.set_size == 2000
    with pytest.raises(ConfigError, match="set_size"):
        SetsRunConfig.build({"data": "surface-clouds", "set_size": 0})


def test_bad_settings_are_refused():
    with pytest.raises(InputError, match="unknown surface 'cube'"):
        surface_clouds(2, 10, kinds=["sphere", "cube"])
    with pytest.raises(InputError, match="noise must be a positive number, got 0.0"):
        surface_clouds(2, 10, noise=0.0)
    with pytest.raises(InputError, match="set_size must be positive, got 0"):
        surface_clouds(2, 0)
    with pytest.raises(InputError, match=r"shape \(M, N, 3\)"):
        surface_distance(torch.zeros(2, 5, 2), torch.zeros(2), torch.zeros(2, 2),
                         torch.eye(3).expand(2, 3, 3))

