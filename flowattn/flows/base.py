"""Base densities for sets and sequences: a standard normal per present element.

Two conventions are supported:

* the full space: every present element is a draw from N(0, I_D), so a set of n elements has
  log p(z) = -||z||^2 / 2 - n D / 2 log(2 pi);
* the zero-centre-of-mass subspace used for particle systems (E(n)-equivariant flows,
  Satorras et al. 2021): the prior is N(0, I) restricted to {z : sum_i z_i = 0}, a space of
  dimension (n - 1) D, so log p(z) = -||z||^2 / 2 - (n - 1) D / 2 log(2 pi).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..validation import present_weights
from .geometry import subtract_mean

__all__ = ["standard_normal_log_prob", "sample_standard_normal", "set_dims"]


def set_dims(z: Tensor, mask: Tensor | None = None, zero_com: bool = False) -> Tensor:
    """Degrees of freedom per set: n D, or (n - 1) D in the zero-centre-of-mass subspace."""
    n = present_weights(z, mask).sum(dim=1)
    if zero_com:
        n = n - 1
    return n * z.shape[-1]


def standard_normal_log_prob(
    z: Tensor, mask: Tensor | None = None, zero_com: bool = False
) -> Tensor:
    """log N(z; 0, I) summed over the present elements of each set, shape (B,).

    With ``zero_com=True`` the density is that of the standard normal on the
    (n - 1) D-dimensional zero-centre-of-mass subspace (``z`` is assumed to lie in it).
    """
    sq = (z.pow(2) * present_weights(z, mask).unsqueeze(-1)).sum(dim=(1, 2))
    return -0.5 * sq - 0.5 * set_dims(z, mask, zero_com) * math.log(2 * math.pi)


def sample_standard_normal(
    shape: tuple[int, int, int],
    mask: Tensor | None = None,
    zero_com: bool = False,
    generator: torch.Generator | None = None,
    device=None,
    dtype=None,
) -> Tensor:
    """Draw (B, N, D) base samples; padded elements are zero.

    With ``zero_com=True`` the draw is projected onto the zero-centre-of-mass subspace, which
    gives exactly the standard normal on that subspace (an orthogonal projection of an isotropic
    Gaussian).
    """
    z = torch.randn(shape, generator=generator, device=device, dtype=dtype)
    if mask is not None:
        z = z * mask.to(z.dtype).unsqueeze(-1)
    if zero_com:
        z = subtract_mean(z, mask)
    return z
