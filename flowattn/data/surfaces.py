"""Point clouds in R³: each set is N noisy points drawn area-uniformly from one random surface.

A set picks a surface kind k uniformly from ``kinds`` (sphere, torus, cylinder), draws its size
parameters uniformly from the ranges below and a rotation R uniformly (Haar measure on SO(3),
from a normalised Gaussian quaternion), then draws its N points independently:

    x_i = R s_i + sigma e_i,   s_i ~ area-uniform on the surface S_k(theta),   e_i ~ N(0, I_3).

The surfaces are centred at the origin, in their own frame (before R):

    sphere    radius a ~ U(0.6, 1.2):                 s = a u,  u uniform on the unit sphere
    torus     major a ~ U(0.6, 1.0), tube b = a U(0.2, 0.5):
              s = ((a + b cos t) cos p, (a + b cos t) sin p, b sin t),  p uniform, and t with
              density (a + b cos t) / (2 pi a) (the area element), by rejection
    cylinder  radius a ~ U(0.3, 0.7), half-height b ~ U(0.5, 1.0), open lateral surface:
              s = (a cos p, a sin p, h),  p ~ U(0, 2 pi), h ~ U(-b, b)

so every point has a density in R³ (the surface measure convolved with N(0, sigma² I)); it has
no closed form, and the data carry no ``true_log_prob``. The distance of a point to its surface,
:func:`surface_distance`, is |sigma e . n| + O(sigma² / curvature radius) for the unit normal n
at s_i: for small sigma it is distributed as the absolute value of N(0, sigma²), the half-normal.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ..errors import InputError
from .sets import SetData, check_names

__all__ = ["SURFACES", "surface_clouds", "surface_distance", "random_rotations"]

#: surface kinds, in the order of their index in ``meta["kind"]``
SURFACES = ("sphere", "torus", "cylinder")
DEFAULT_NOISE = 0.02

# kind -> ranges of its two size parameters (a, b); the torus's b is a fraction of a
_RANGES = {
    "sphere": ((0.6, 1.2), (0.0, 0.0)),
    "torus": ((0.6, 1.0), (0.2, 0.5)),
    "cylinder": ((0.3, 0.7), (0.5, 1.0)),
}


def surface_clouds(
    num_sets: int,
    set_size: int = 1000,
    kinds: Sequence[str] = SURFACES,
    noise: float = DEFAULT_NOISE,
    generator: torch.Generator | None = None,
) -> SetData:
    """``num_sets`` point clouds of ``set_size`` noisy points on random rotated surfaces in R³.

    See the module docstring for the sampling density. Each set's surface is kept in ``meta``:
    ``kind`` (M,) indices into ``kinds``, ``params`` (M, 2) its (a, b) (b is the torus's tube
    radius itself, 0 for a sphere) and ``rotation`` (M, 3, 3), so :func:`surface_distance`
    measures how far each point lies from its surface.

    Arguments:
        num_sets: number of sets M.
        set_size: points per set N (>= 1).
        kinds: names from :data:`SURFACES`, drawn with equal probability.
        noise: standard deviation sigma of the isotropic Gaussian noise, > 0 (default 0.02,
            small next to the surfaces' sizes, 0.3 to 1.2).
        generator: seeded random numbers.

    Raises:
        InputError: a non-positive count or size, an unknown or repeated kind, a noise that is
            not a positive finite number.

    Examples:
        >>> data = surface_clouds(4, set_size=500, generator=torch.Generator().manual_seed(0))
        >>> data.x.shape
        torch.Size([4, 500, 3])
        >>> distance = surface_distance(data.x, **data.meta["surfaces"])
        >>> round(distance.pow(2).mean().sqrt().item() / 0.02, 1)  # the noise, in units of sigma
        1.0
    """
    _check(num_sets, set_size, kinds, noise)
    kinds = tuple(kinds)
    g = generator
    kind = torch.randint(len(kinds), (num_sets,), generator=g)
    lows = torch.tensor([[_RANGES[name][0][0], _RANGES[name][1][0]] for name in kinds])
    highs = torch.tensor([[_RANGES[name][0][1], _RANGES[name][1][1]] for name in kinds])
    params = lows[kind] + (highs[kind] - lows[kind]) * torch.rand(num_sets, 2, generator=g)
    is_torus = torch.tensor([name == "torus" for name in kinds])[kind]
    params[:, 1] = torch.where(is_torus, params[:, 0] * params[:, 1], params[:, 1])
    rotation = random_rotations(num_sets, generator=g)
    names = torch.tensor([SURFACES.index(name) for name in kinds])[kind]  # global indices
    local = _surface_points(names, params, set_size, g)  # (M, N, 3), in each surface's frame
    x = local @ rotation.transpose(1, 2) + noise * torch.randn(num_sets, set_size, 3, generator=g)
    meta = {"set_size": set_size, "kinds": list(kinds), "noise": noise,
            "surfaces": {"kind": names, "params": params, "rotation": rotation}}
    return SetData(x, None, "surface-clouds", meta=meta)


def surface_distance(x: Tensor, kind: Tensor, params: Tensor, rotation: Tensor) -> Tensor:
    """Euclidean distance (M, N) of every point of ``x`` (M, N, 3) to its set's surface.

    ``kind`` (M,) indexes :data:`SURFACES`, ``params`` (M, 2) holds (a, b) and ``rotation``
    (M, 3, 3) the set's rotation R, as in ``surface_clouds(...).meta["surfaces"]``. In the
    surface's frame, y = R^T x, with rho = ||(y_1, y_2)||:

        sphere    | ||y|| - a |
        torus     | sqrt((rho - a)² + y_3²) - b |
        cylinder  sqrt((rho - a)² + max(|y_3| - b, 0)²)   (the open lateral surface)

    Examples:
        >>> x = torch.tensor([[[0.0, 0.0, 1.5]]])
        >>> kind, params = torch.tensor([0]), torch.tensor([[1.0, 0.0]])
        >>> surface_distance(x, kind, params, torch.eye(3)[None]).item()  # 0.5 off the sphere
        0.5
    """
    if x.dim() != 3 or x.shape[-1] != 3:
        raise InputError(f"x must be point clouds of shape (M, N, 3), got {tuple(x.shape)}")
    if kind.shape != x.shape[:1] or params.shape != (x.shape[0], 2) or \
            rotation.shape != (x.shape[0], 3, 3):
        raise InputError(f"kind (M,), params (M, 2) and rotation (M, 3, 3) must match M = "
                         f"{x.shape[0]}, got {tuple(kind.shape)}, {tuple(params.shape)} and "
                         f"{tuple(rotation.shape)}")
    y = x @ rotation.to(x)  # rows: x R, i.e. R^T x for column vectors
    a, b = params.to(x)[:, 0, None], params.to(x)[:, 1, None]
    kind = kind.to(x.device)[:, None]
    rho = y[..., :2].norm(dim=-1)
    sphere = (y.norm(dim=-1) - a).abs()
    torus = (torch.hypot(rho - a, y[..., 2]) - b).abs()
    cylinder = torch.hypot(rho - a, (y[..., 2].abs() - b).clamp_min(0))
    return torch.where(kind == 0, sphere, torch.where(kind == 1, torus, cylinder))


def random_rotations(num: int, dtype: torch.dtype = torch.float32,
                     generator: torch.Generator | None = None) -> Tensor:
    """``num`` rotation matrices (num, 3, 3), uniform on SO(3) (Haar measure).

    A standard Gaussian in R⁴ normalised is a uniform unit quaternion q, and q and -q give the
    same rotation, which is then Haar-distributed (Shoemake 1992, "Uniform random rotations").

    Examples:
        >>> r = random_rotations(5, torch.float64, torch.Generator().manual_seed(0))
        >>> eye = torch.eye(3, dtype=torch.float64).expand(5, 3, 3)
        >>> bool(torch.allclose(r @ r.transpose(1, 2), eye))  # orthogonal
        True
        >>> [round(d, 6) for d in torch.linalg.det(r).tolist()]  # proper: no reflections
        [1.0, 1.0, 1.0, 1.0, 1.0]
    """
    q = torch.randn(num, 4, dtype=dtype, generator=generator)
    w, x, y, z = (q / q.norm(dim=1, keepdim=True)).unbind(1)
    rows = [
        [1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)],
        [2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)],
        [2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)],
    ]
    return torch.stack([torch.stack(row, dim=-1) for row in rows], dim=-2)


def _surface_points(kind: Tensor, params: Tensor, n: int, g: torch.Generator | None) -> Tensor:
    """Area-uniform points (M, n, 3) on each set's surface, in its own frame."""
    m = kind.shape[0]
    a, b = params[:, 0, None], params[:, 1, None]
    # sphere: a normalised Gaussian is uniform on the unit sphere
    u = torch.randn(m, n, 3, generator=g)
    sphere = a[..., None] * u / u.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    p = 2 * math.pi * torch.rand(m, n, generator=g)
    # torus: tube angle t with density ∝ a + b cos t, by rejection against the uniform law
    t = _tube_angles(a, torch.where(kind[:, None] == 1, b, 0.0), n, g)
    ring = a + b * t.cos()
    torus = torch.stack([ring * p.cos(), ring * p.sin(), b * t.sin()], dim=-1)
    h = b * (2 * torch.rand(m, n, generator=g) - 1)
    cylinder = torch.stack([a * p.cos(), a * p.sin(), h], dim=-1)
    kind = kind[:, None, None]
    return torch.where(kind == 0, sphere, torch.where(kind == 1, torus, cylinder))


def _tube_angles(a: Tensor, b: Tensor, n: int, g: torch.Generator | None) -> Tensor:
    """Angles t (M, n) with density (a + b cos t) / (2 pi a) on [0, 2 pi), by rejection.

    A uniform t is kept with probability (a + b cos t) / (a + b) (at least 1/3 for b <= a / 2;
    b = 0, for the sets that are not tori, keeps every t);
    the rejected ones are drawn again, all at once, until none is left (a few rounds).
    """
    t = 2 * math.pi * torch.rand(a.shape[0], n, generator=g)
    keep = torch.rand(t.shape, generator=g) * (a + b) <= a + b * t.cos()
    while not bool(keep.all()):
        fresh = 2 * math.pi * torch.rand(t.shape, generator=g)
        accept = torch.rand(t.shape, generator=g) * (a + b) <= a + b * fresh.cos()
        take = ~keep & accept
        t = torch.where(take, fresh, t)
        keep = keep | take
    return t


def _check(num_sets: int, set_size: int, kinds: Sequence[str], noise: float) -> None:
    if num_sets < 1:
        raise InputError(f"num_sets must be positive, got {num_sets}")
    if set_size < 1:
        raise InputError(f"set_size must be positive, got {set_size}")
    check_names(kinds, list(SURFACES), "kinds", "surface")
    if not (math.isfinite(noise) and noise > 0):
        raise InputError(f"noise must be a positive number, got {noise}")
