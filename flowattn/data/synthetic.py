"""Exchangeable set data sets whose density is known in closed form.

Both have dependent elements (a shared latent per set), so a model that treats the elements
as independent cannot reach the true NLL: what attention adds is measurable.

* ``gaussian_sets``: x_i = mu + sigma eps_i, mu ~ N(0, tau^2 I), eps_i ~ N(0, I). Each coordinate
  of a set of n elements is N(0, sigma^2 I_n + tau^2 11^T), so, with s = sum_i y_i,
  log p = -1/2 [ (||y||^2 - tau^2 s^2 / (sigma^2 + n tau^2)) / sigma^2
                 + (n - 1) log sigma^2 + log(sigma^2 + n tau^2) + n log 2 pi ].
* ``cluster_sets``: a set picks one of K centres m_k (uniformly, on a circle of radius r) and its
  n elements are i.i.d. N(m_k, s^2 I): p(X) = 1/K sum_k prod_i N(x_i; m_k, s^2 I). Set sizes vary
  uniformly in [n_min, n_max]; densities are conditional on the size.

The best density of i.i.d. elements (``iid_log_prob``) is the product of the exact one-element
marginals: N(0, (sigma^2 + tau^2) I) for ``gaussian_sets``, 1/K sum_k N(m_k, s^2 I) for
``cluster_sets``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..errors import InputError
from ..validation import check_count
from .sets import SetData, size_mask

__all__ = ["gaussian_sets", "cluster_sets", "gaussian_sets_log_prob", "cluster_sets_log_prob"]

LOG_2PI = math.log(2 * math.pi)


def _weights(x: Tensor, mask: Tensor | None) -> Tensor:
    if mask is None:
        return torch.ones(x.shape[:2], dtype=x.dtype, device=x.device)
    return mask.to(x.dtype)


def gaussian_sets_log_prob(x: Tensor, mask: Tensor | None, sigma: float, tau: float) -> Tensor:
    """Exact log-density of ``gaussian_sets`` data, shape (M,)."""
    w = _weights(x, mask)
    n = w.sum(1)
    xw = x * w[..., None]
    sq = xw.pow(2).sum((1, 2))
    s2 = xw.sum(1).pow(2).sum(-1)  # sum over coordinates of (sum_i y_i)^2
    quad = (sq - tau**2 * s2 / (sigma**2 + n * tau**2)) / sigma**2
    dim = x.shape[-1]
    logdet = dim * ((n - 1) * math.log(sigma**2) + torch.log(sigma**2 + n * tau**2))
    return -0.5 * (quad + logdet + n * dim * LOG_2PI)


def gaussian_sets(
    num_sets: int,
    set_size: int = 8,
    dim: int = 2,
    sigma: float = 0.5,
    tau: float = 1.5,
    generator: torch.Generator | None = None,
) -> SetData:
    """Sets of ``set_size`` points sharing a Gaussian random offset (see the module docstring)."""
    for name, value in (("num_sets", num_sets), ("set_size", set_size), ("dim", dim)):
        check_count(value, name)
    mu = tau * torch.randn(num_sets, 1, dim, generator=generator)
    x = mu + sigma * torch.randn(num_sets, set_size, dim, generator=generator)

    def true_log_prob(x: Tensor, mask: Tensor | None) -> Tensor:
        return gaussian_sets_log_prob(x, mask, sigma, tau)

    def iid_log_prob(x: Tensor, mask: Tensor | None) -> Tensor:
        return gaussian_sets_log_prob(x, mask, math.sqrt(sigma**2 + tau**2), 0.0)

    meta = {"set_size": set_size, "dim": dim, "sigma": sigma, "tau": tau}
    return SetData(x, None, "gaussian-sets", true_log_prob=true_log_prob, meta=meta,
                   iid_log_prob=iid_log_prob)


def _centres(clusters: int, radius: float, dim: int) -> Tensor:
    angle = 2 * math.pi * torch.arange(clusters, dtype=torch.float64) / clusters
    centres = torch.zeros(clusters, dim, dtype=torch.float64)
    centres[:, 0], centres[:, 1] = radius * angle.cos(), radius * angle.sin()
    return centres


def cluster_sets_log_prob(
    x: Tensor, mask: Tensor | None, clusters: int, radius: float, scale: float
) -> Tensor:
    """Exact log-density of ``cluster_sets`` data given each set's size, shape (M,)."""
    w = _weights(x, mask)
    centres = _centres(clusters, radius, x.shape[-1]).to(x)
    sq = (x[:, None] - centres[None, :, None]).pow(2).sum(-1)  # (M, K, N)
    n = w.sum(1)
    per_cluster = -0.5 * (sq * w[:, None]).sum(-1) / scale**2  # (M, K)
    norm = -n * x.shape[-1] * (math.log(scale) + 0.5 * LOG_2PI)
    return torch.logsumexp(per_cluster, dim=1) - math.log(clusters) + norm


def cluster_sets(
    num_sets: int,
    min_size: int = 3,
    max_size: int = 8,
    dim: int = 2,
    clusters: int = 4,
    radius: float = 3.0,
    scale: float = 0.5,
    generator: torch.Generator | None = None,
) -> SetData:
    """Variable-size sets around one of ``clusters`` centres (see the module docstring)."""
    for name, value in (("num_sets", num_sets), ("min_size", min_size), ("max_size", max_size),
                        ("clusters", clusters)):
        check_count(value, name)
    if min_size > max_size:
        raise InputError(f"min_size={min_size} exceeds max_size={max_size}")
    if dim < 2:
        raise InputError(f"cluster_sets needs dim >= 2 (centres lie on a circle), got {dim}")
    k = torch.randint(clusters, (num_sets,), generator=generator)
    centres = _centres(clusters, radius, dim).float()[k]
    x = centres[:, None] + scale * torch.randn(num_sets, max_size, dim, generator=generator)
    sizes = torch.randint(min_size, max_size + 1, (num_sets,), generator=generator)
    mask = size_mask(sizes, max_size)
    x = x * mask[..., None]

    def true_log_prob(x: Tensor, mask: Tensor | None) -> Tensor:
        return cluster_sets_log_prob(x, mask, clusters, radius, scale)

    def iid_log_prob(x: Tensor, mask: Tensor | None) -> Tensor:
        # each element alone is a one-element set of the same mixture
        flat = x.reshape(-1, 1, x.shape[-1])
        per_element = cluster_sets_log_prob(flat, None, clusters, radius, scale).view(x.shape[:2])
        return (per_element * _weights(x, mask)).sum(1)

    meta = {"min_size": min_size, "max_size": max_size, "dim": dim, "clusters": clusters,
            "radius": radius, "scale": scale}
    return SetData(x, mask, "cluster-sets", true_log_prob=true_log_prob, meta=meta,
                   iid_log_prob=iid_log_prob)
