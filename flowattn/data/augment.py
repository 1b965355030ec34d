r"""Data augmentation for sets whose density is invariant under rotations and reflections.

A particle system's Boltzmann density depends only on the distances between its particles, so
rotating and reflecting a configuration about its centre of mass leaves its density unchanged:
x_i -> x̄ + (x_i - x̄) Q with Q in O(D). A flow that is not equivariant under O(D) (a coupling
flow, whose splines act on Cartesian coordinates) has to learn that symmetry from the data;
drawing a fresh Q for every set each time it is used shows it every orientation, and since the
rotated sets follow the same distribution, maximum likelihood on them still targets the data's
density. Only use it where that invariance holds.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import InputError

__all__ = ["random_orthogonal", "rotate_sets"]


def random_orthogonal(count: int, dim: int, generator: torch.Generator | None = None,
                      dtype: torch.dtype = torch.float64) -> Tensor:
    r"""``count`` matrices (count, dim, dim) drawn from the Haar measure on O(dim).

    With G a standard Gaussian matrix and G = Q R its QR factorisation, Q diag(sign(diag R)) is
    Haar-distributed on O(dim) (Mezzadri 2007, "How to generate random matrices from the
    classical compact groups"); Q alone is not, because the factorisation fixes the signs of
    R's diagonal by its own convention. Proper rotations and reflections come with equal
    probability.

    Examples:
        >>> q = random_orthogonal(4, 3, torch.Generator().manual_seed(0))
        >>> bool(torch.allclose(q @ q.transpose(1, 2), torch.eye(3, dtype=q.dtype)))
        True
        >>> sorted({round(d) for d in torch.linalg.det(q).tolist()}) in ([-1], [1], [-1, 1])
        True
    """
    if count < 0 or dim < 1:
        raise InputError(f"need count >= 0 and dim >= 1, got count={count}, dim={dim}")
    gaussian = torch.randn(count, dim, dim, generator=generator, dtype=dtype)
    q, r = torch.linalg.qr(gaussian)
    return q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)


def rotate_sets(x: Tensor, mask: Tensor | None, q: Tensor) -> Tensor:
    r"""Each set of ``x`` (B, N, D) rotated about the centroid of its present elements by its
    own orthogonal ``q`` (B, D, D): x_i -> x̄ + (x_i - x̄) Q. Padded elements are left as they are.

    Distances between the elements of a set, and its centroid, do not change.

    Examples:
        >>> x = torch.tensor([[[0.0, 0.0], [2.0, 0.0]]])
        >>> quarter = torch.tensor([[[0.0, 1.0], [-1.0, 0.0]]])
        >>> rotate_sets(x, None, quarter).tolist()
        [[[1.0, -1.0], [1.0, 1.0]]]
    """
    if q.shape != (x.shape[0], x.shape[-1], x.shape[-1]):
        raise InputError(f"q must have shape {(x.shape[0], x.shape[-1], x.shape[-1])}, got "
                         f"{tuple(q.shape)}")
    q = q.to(device=x.device, dtype=x.dtype)
    if mask is None:
        centre = x.mean(dim=1, keepdim=True)
        return centre + (x - centre) @ q
    w = mask.to(x.dtype).unsqueeze(-1)
    centre = (x * w).sum(dim=1, keepdim=True) / w.sum(dim=1, keepdim=True).clamp_min(1)
    return torch.where(mask.unsqueeze(-1), centre + (x - centre) @ q, x)
