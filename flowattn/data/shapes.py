"""Sets of points drawn i.i.d. from one of several planar shapes: only the arrangement tells.

A set picks a shape k with probability 1/K, and its n points are drawn independently from that
shape, an equal-weight mixture of m_k isotropic Gaussians N(c_kj, s^2 I) whose centres c_kj are
the vertices of a regular m_k-gon of radius r = sqrt(2 (1 - s^2)) (Gaussian-mixture shapes have
an exact density). Every regular polygon with m >= 3 vertices has mean 0 and second moment
(1/m) sum_j c_kj c_kj^T = r^2 / 2 I, so every shape has mean 0 and covariance exactly I: the
centroid and any linear statistic of a set look alike for all shapes, and only how the points are
arranged (a ring, a triangle, an inverted triangle, a square) tells which shape drew them.

Exact log-density of a set of n present points (given n; the sizes are uniform on
[min_size, max_size] and independent of the shape):

    log p(X) = logsumexp_k [ -log K + sum_i log p_k(x_i) ],
    log p_k(x) = logsumexp_j [ -log m_k - ||x - c_kj||^2 / (2 s^2) ] - log(2 pi s^2).

The best density of i.i.d. points is the product of the exact one-point marginal, the mixture
over shapes averaged with the shape weights, p̄(x) = (1/K) sum_k p_k(x):

    log q_iid(X) = sum_i log p̄(x_i),

and E[log p - log q_iid] (the multi-information of the set) is what interactions can win.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ..errors import InputError
from .sets import SetData, check_names, size_mask

__all__ = ["SHAPES", "shape_sets", "shape_sets_log_prob", "shape_sets_iid_log_prob",
           "shape_sets_log_joint"]

LOG_2PI = math.log(2 * math.pi)

# name -> (number of vertices, angle of the first vertex in turns)
SHAPES: dict[str, tuple[int, float]] = {
    "ring": (12, 0.0),
    "triangle": (3, 0.25),
    "triangle-down": (3, 0.75),
    "square": (4, 0.125),
    "pentagon": (5, 0.25),
    "hexagon": (6, 0.0),
}
DEFAULT_SHAPES = ("ring", "triangle", "triangle-down", "square")


def shape_sets(
    num_sets: int,
    min_size: int = 8,
    max_size: int = 8,
    shapes: Sequence[str] = DEFAULT_SHAPES,
    scale: float = 0.2,
    generator: torch.Generator | None = None,
) -> SetData:
    """Sets of ``min_size``..``max_size`` points in R² from one of several centred shapes.

    Each set picks a shape uniformly, then its points independently (see the module docstring
    for the density). With ``min_size < max_size`` the sizes are uniform on that range and the
    sets are padded with zeros and masked; ``true_log_prob`` is the density given the size.

    Arguments:
        num_sets: number of sets M.
        min_size: fewest points in a set (>= 1).
        max_size: most points in a set, the padded length N.
        shapes: names from :data:`SHAPES` (a regular polygon of Gaussian blobs; ``ring`` is a
            12-gon whose blobs overlap).
        scale: standard deviation s of each blob, in (0, 1); the polygon radius is
            sqrt(2 (1 - s²)), so every shape has covariance I.
        generator: seeded random numbers.

    Returns:
        :class:`SetData` with ``true_log_prob`` and ``iid_log_prob`` (the best density of
        i.i.d. points), both exact.

    Raises:
        InputError: a size below 1 or ``min_size > max_size``, an unknown or repeated shape,
            ``scale`` outside (0, 1).

    Examples:
        >>> data = shape_sets(2000, generator=torch.Generator().manual_seed(0))
        >>> data.x.shape
        torch.Size([2000, 8, 2])
        >>> true_nll, iid_nll = data.mean_true_nll(), data.mean_iid_nll()
        >>> round(true_nll, 1), round(iid_nll, 1)  # nats per set: interactions are worth 4.1
        (10.1, 14.2)
    """
    _check(num_sets, min_size, max_size, shapes, scale)
    shapes = tuple(shapes)
    table, counts = _centre_table(shapes, scale)  # (K, m_max, 2), (K,)
    k = torch.randint(len(shapes), (num_sets,), generator=generator)
    u = torch.rand(num_sets, max_size, generator=generator)
    vertex = (u * counts[k][:, None]).long().clamp(max=table.shape[1] - 1)
    centres = table[k[:, None], vertex].float()  # (M, N, 2)
    x = centres + scale * torch.randn(num_sets, max_size, 2, generator=generator)
    mask = None
    if min_size < max_size:
        sizes = torch.randint(min_size, max_size + 1, (num_sets,), generator=generator)
        mask = size_mask(sizes, max_size)
        x = x * mask[..., None]

    def true_log_prob(x: Tensor, mask: Tensor | None) -> Tensor:
        return shape_sets_log_prob(x, mask, shapes, scale)

    def iid_log_prob(x: Tensor, mask: Tensor | None) -> Tensor:
        return shape_sets_iid_log_prob(x, mask, shapes, scale)

    meta = {"min_size": min_size, "max_size": max_size, "shapes": list(shapes), "scale": scale}
    return SetData(x, mask, "shape-sets", true_log_prob=true_log_prob, meta=meta,
                   iid_log_prob=iid_log_prob)


def shape_sets_log_prob(
    x: Tensor, mask: Tensor | None, shapes: Sequence[str] = DEFAULT_SHAPES, scale: float = 0.2
) -> Tensor:
    """Exact log-density of ``shape_sets`` data given each set's size, shape (M,).

    log p(X) = logsumexp_k [log w_k + sum_i log p_k(x_i)] with w_k = 1/K (module docstring).

    Examples:
        >>> x = torch.zeros(1, 3, 2)  # three points at the centre: unlikely for every shape
        >>> shape_sets_log_prob(x, None).item() < -20
        True
    """
    return torch.logsumexp(shape_sets_log_joint(x, mask, shapes, scale), dim=1)


def shape_sets_log_joint(
    x: Tensor, mask: Tensor | None, shapes: Sequence[str] = DEFAULT_SHAPES, scale: float = 0.2
) -> Tensor:
    """log w_k + log p_k(X) for every shape k, shape (M, K): the set and its shape jointly.

    Normalised over k (a softmax over the last axis) these are the posterior probabilities of
    the shapes given the set; their mean under the data is w_k = 1/K.

    Examples:
        >>> g = torch.Generator().manual_seed(0)
        >>> triangles = shape_sets(100, shapes=["triangle"], generator=g)
        >>> posterior = shape_sets_log_joint(triangles.x, None).softmax(1)  # default shapes
        >>> [round(p, 3) for p in posterior.mean(0).tolist()]  # ring, triangle, down, square
        [0.003, 0.997, 0.0, 0.0]
    """
    _check(1, 1, 1, shapes, scale)
    per_point = _log_prob_per_point(x, shapes, scale)  # (M, N, K)
    if mask is not None:
        per_point = per_point * mask[..., None].to(per_point.dtype)
    return per_point.sum(1) - math.log(len(shapes))


def shape_sets_iid_log_prob(
    x: Tensor, mask: Tensor | None, shapes: Sequence[str] = DEFAULT_SHAPES, scale: float = 0.2
) -> Tensor:
    """Log-density of the sets as i.i.d. points from the exact one-point marginal, shape (M,).

    log q_iid(X) = sum_i log p̄(x_i), p̄ = (1/K) sum_k p_k: the best a model of independent
    points can do (its expected log-likelihood is highest at the true marginal, by Gibbs'
    inequality).

    Examples:
        >>> data = shape_sets(1000, generator=torch.Generator().manual_seed(1))
        >>> better = shape_sets_log_prob(data.x, None) > shape_sets_iid_log_prob(data.x, None)
        >>> round(better.float().mean().item(), 3)  # the true density wins on most sets
        0.876
    """
    _check(1, 1, 1, shapes, scale)
    per_point = torch.logsumexp(_log_prob_per_point(x, shapes, scale), dim=2)
    per_point = per_point - math.log(len(shapes))  # (M, N)
    if mask is not None:
        per_point = per_point * mask.to(per_point.dtype)
    return per_point.sum(1)


def _log_prob_per_point(x: Tensor, shapes: Sequence[str], scale: float) -> Tensor:
    """log p_k(x_i) for every point and shape, shape (M, N, K)."""
    if x.dim() != 3 or x.shape[-1] != 2:
        raise InputError(f"shape sets are (M, N, 2) point sets, got shape {tuple(x.shape)}")
    table, counts = _centre_table(tuple(shapes), scale)
    table, counts = table.to(x), counts.to(x.device)
    sq = (x[:, :, None, None, :] - table).pow(2).sum(-1)  # (M, N, K, m_max)
    log_blob = -0.5 * sq / scale**2 - counts.to(x.dtype).log()[:, None]
    present = torch.arange(table.shape[1], device=x.device)[None] < counts[:, None]  # (K, m)
    log_blob = log_blob.masked_fill(~present, float("-inf"))
    return torch.logsumexp(log_blob, dim=-1) - LOG_2PI - 2 * math.log(scale)


def _centre_table(shapes: tuple[str, ...], scale: float) -> tuple[Tensor, Tensor]:
    """Vertices of every shape, padded to (K, m_max, 2) in float64, and the vertex counts."""
    radius = math.sqrt(2 * (1 - scale**2))
    counts = torch.tensor([SHAPES[name][0] for name in shapes])
    table = torch.zeros(len(shapes), int(counts.max()), 2, dtype=torch.float64)
    for k, name in enumerate(shapes):
        m, start = SHAPES[name]
        angle = 2 * math.pi * (start + torch.arange(m, dtype=torch.float64) / m)
        table[k, :m, 0], table[k, :m, 1] = radius * angle.cos(), radius * angle.sin()
    return table, counts


def _check(num_sets: int, min_size: int, max_size: int, shapes: Sequence[str],
           scale: float) -> None:
    if num_sets < 1:
        raise InputError(f"num_sets must be positive, got {num_sets}")
    if min_size < 1 or max_size < min_size:
        raise InputError(f"set sizes need 1 <= min_size <= max_size, got min_size={min_size}, "
                         f"max_size={max_size}")
    check_names(shapes, sorted(SHAPES), "shapes", "shape")
    if not 0 < scale < 1:
        raise InputError(f"scale must lie in (0, 1) (shapes have unit variance), got {scale}")
