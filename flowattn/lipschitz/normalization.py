"""Lipschitz constants of the normalisation layers: LayerNorm (Kim et al. 2021, App. N) and
LipsFormer's CenterNorm (exact)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..errors import InputError
from ..validation import check_count
from .checks import norm_name

__all__ = ["layernorm_lipschitz_bound", "centernorm_lipschitz_bound"]


def layernorm_lipschitz_bound(
    weight: Tensor | None, dim: int, eps: float, norm: str | int = "inf"
) -> Tensor:
    """Certified Lipschitz bound of LayerNorm(x) = gamma * (x - mu) / sqrt(sigma^2 + eps) + beta.

    * inf-norm (Kim et al. 2021, App. N, eq. after (39)): eps^{-1/2} max|gamma| (D^2 - 2) / D.
    * 2-norm: the Jacobian is (sigma^2 + eps)^{-1/2} diag(gamma) P with P symmetric, eigenvalues
      0 (along 1), eps / (sigma^2 + eps) (along x - mu) and 1 elsewhere, so
      ||J||_2 <= eps^{-1/2} max|gamma|.

    For D = 1 the output is constant and the bound is 0.
    """
    norm = norm_name(norm)
    check_count(dim, "dim")
    if not (math.isfinite(eps) and eps > 0):
        raise InputError(f"LayerNorm's eps must be a finite number > 0 for a bound, got {eps}")
    gamma = torch.ones(()) if weight is None else weight.detach().abs().max()
    if dim == 1:
        return torch.zeros_like(gamma)
    scale = gamma * eps**-0.5
    return scale * (dim**2 - 2) / dim if norm == "inf" else scale


def centernorm_lipschitz_bound(weight: Tensor | None, dim: int, norm: str | int = "inf") -> Tensor:
    """Lipschitz constant of CenterNorm(x) = gamma * D/(D-1) (x - mean x) + beta (LipsFormer).

    The Jacobian diag(gamma) D/(D-1) (I - 11^T/D) is constant, so these values are exact:
    2-norm D/(D-1) max|gamma| (the centring projection has norm 1); inf-norm 2 max|gamma|
    (each row of I - 11^T/D has absolute sum 2(D-1)/D).
    """
    norm = norm_name(norm)
    if dim < 2:
        raise InputError(f"CenterNorm needs D >= 2, got D={dim}")
    gamma = torch.ones(()) if weight is None else weight.detach().abs().max()
    return 2 * gamma if norm == "inf" else gamma * dim / (dim - 1)
