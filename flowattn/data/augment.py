r"""Data augmentation for sets whose density is invariant under rotations or reflections.

A particle system's Boltzmann density depends only on the distances between its particles, so
rotating and reflecting a configuration about its centre of mass leaves its density unchanged:
x_i -> x̄ + (x_i - x̄) Q with Q in O(D). A flow that is not equivariant under O(D) (a coupling
flow, whose splines act on Cartesian coordinates) has to learn that symmetry from the data;
drawing a fresh Q for every set each time it is used shows it every orientation, and since the
rotated sets follow the same distribution, maximum likelihood on them still targets the data's
density. Only use it where that invariance holds.

Some densities are invariant under a smaller group: planar shapes that look the same mirrored
left to right and upside down (``shape-sets``: its triangles swap, with equal weights) keep their
density under x_i -> x_i S for every S = diag(±1, ..., ±1), flipping coordinate axes through the
origin, but not under rotations. Drawing S for every set shows the flow each of the 2^D mirror
images; for a flow that has to learn the symmetry from a finite training set this is, in effect,
2^D times the data.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from ..errors import InputError

__all__ = ["random_orthogonal", "random_signs", "reflection_signs", "reflect_sets",
           "rotate_sets"]


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


def random_signs(count: int, dim: int, generator: torch.Generator | None = None,
                 dtype: torch.dtype = torch.float64) -> Tensor:
    r"""``count`` sign vectors (count, dim), each entry +1 or -1 with probability 1/2: the
    diagonals of matrices drawn uniformly from the 2^dim reflections through coordinate axes.

    Examples:
        >>> s = random_signs(1000, 2, torch.Generator().manual_seed(0))
        >>> sorted(set(s.flatten().tolist()))
        [-1.0, 1.0]
        >>> bool(s.mean().abs() < 0.1)
        True
    """
    if count < 0 or dim < 1:
        raise InputError(f"need count >= 0 and dim >= 1, got count={count}, dim={dim}")
    bits = torch.randint(2, (count, dim), generator=generator)
    return (2 * bits - 1).to(dtype)


MAX_REFLECTION_DIM = 10


def reflection_signs(dim: int, dtype: torch.dtype = torch.float32) -> Tensor:
    r"""All 2^dim sign vectors (2^dim, dim), the identity first: the diagonals of the
    reflections through coordinate axes, for averages over every mirror image.

    An average over them evaluates a model once per sign vector, so elements of more than
    ``MAX_REFLECTION_DIM`` = 10 coordinates (over 1024 mirror images) are refused.

    Examples:
        >>> reflection_signs(2).tolist()
        [[1.0, 1.0], [1.0, -1.0], [-1.0, 1.0], [-1.0, -1.0]]
    """
    if dim < 1:
        raise InputError(f"need dim >= 1, got dim={dim}")
    if dim > MAX_REFLECTION_DIM:
        raise InputError(f"the mirror average over every reflection through the coordinate axes "
                         f"takes 2^D passes: 2^{dim} = {2**dim:,} for elements of D = {dim} "
                         f"coordinates; it is offered up to D = {MAX_REFLECTION_DIM} "
                         f"({2**MAX_REFLECTION_DIM:,} passes): use symmetry 'none'")
    return torch.tensor(list(itertools.product((1.0, -1.0), repeat=dim)), dtype=dtype)


def reflect_sets(x: Tensor, signs: Tensor) -> Tensor:
    r"""Each set of ``x`` (B, N, D) mirrored through the origin's coordinate axes by its own
    signs (B, D): x_i -> x_i S with S = diag(signs). Padded elements (zeros) stay zeros.

    Examples:
        >>> x = torch.tensor([[[1.0, 2.0], [3.0, -4.0]]])
        >>> reflect_sets(x, torch.tensor([[-1.0, 1.0]])).tolist()
        [[[-1.0, 2.0], [-3.0, -4.0]]]
    """
    if signs.shape != (x.shape[0], x.shape[-1]):
        raise InputError(f"signs must have shape {(x.shape[0], x.shape[-1])}, got "
                         f"{tuple(signs.shape)}")
    return x * signs.to(device=x.device, dtype=x.dtype).unsqueeze(1)
