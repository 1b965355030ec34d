"""The invertible permutation-equivariant linear map of sets (DeepSets, Zaheer et al. 2017)."""

from __future__ import annotations

import torch
from nflows.transforms import Transform
from torch import Tensor, nn

from ..validation import check_sets
from .geometry import mask_from_context

__all__ = ["EquivariantLinear"]


class _LUMatrix(nn.Module):
    """A D x D matrix W = L (U + diag(exp s)), invertible by construction, starting at I."""

    def __init__(self, dim: int):
        super().__init__()
        self.lower = nn.Parameter(torch.zeros(dim, dim))
        self.upper = nn.Parameter(torch.zeros(dim, dim))
        self.log_diag = nn.Parameter(torch.zeros(dim))

    def factors(self) -> tuple[Tensor, Tensor]:
        eye = torch.eye(self.log_diag.shape[0], dtype=self.lower.dtype, device=self.lower.device)
        lower = torch.tril(self.lower, -1) + eye
        upper = torch.triu(self.upper, 1) + torch.diag(self.log_diag.exp())
        return lower, upper

    def matrix(self) -> Tensor:
        lower, upper = self.factors()
        return lower @ upper

    def log_abs_det(self) -> Tensor:
        return self.log_diag.sum()

    def solve_right(self, y: Tensor) -> Tensor:
        """x with x W = y, for rows x (any leading shape)."""
        lower, upper = self.factors()
        # x L U = y  <=>  U^T L^T x^T = y^T
        flat = y.reshape(-1, y.shape[-1]).transpose(0, 1)
        z = torch.linalg.solve_triangular(upper.transpose(0, 1), flat, upper=False)
        x = torch.linalg.solve_triangular(lower.transpose(0, 1), z, upper=True,
                                          unitriangular=True)
        return x.transpose(0, 1).reshape(y.shape)


class EquivariantLinear(Transform):
    r"""y_i = (x_i - \bar x) A + \bar x C, with \bar x the mean of the present elements.

    This is the general permutation-equivariant linear map x_i -> x_i A + \bar x B of DeepSets
    (Zaheer et al. 2017, Lemma 3) written with C = A + B: A acts on each element's deviation
    from the set mean (an (n - 1) D-dimensional subspace) and C on the mean (D dimensions), so

    .. math:: \log|\det J| = (n - 1) \log|\det A| + \log|\det C|,

    and the inverse is closed-form, x_i = (y_i - \bar y) A^{-1} + \bar y C^{-1}. A and C are
    LU-parameterised with positive diagonals (invertible by construction) and start at the
    identity. It gives a set flow the cheap global coupling that a contractive attention block,
    limited by its certified bound, can only approximate in many steps. In zero-centre-of-mass
    mode the mean is zero and only A acts; the log-det is then the one on the subspace.
    Padded elements (``context`` = mask) pass through unchanged.

    Arguments:
        dim: feature width D.
        zero_com: the data live in the zero-centre-of-mass subspace.

    Examples:
        >>> layer = EquivariantLinear(2)
        >>> x = torch.randn(3, 5, 2)
        >>> y, logdet = layer(x)
        >>> torch.allclose(layer.inverse(y)[0], x, atol=1e-6)
        True
    """

    def __init__(self, dim: int, zero_com: bool = False):
        super().__init__()
        self.dim, self.zero_com = dim, zero_com
        self.deviation = _LUMatrix(dim)
        self.mean = None if zero_com else _LUMatrix(dim)

    def _split(self, x: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        w = torch.ones(x.shape[:2], dtype=x.dtype, device=x.device) if mask is None else (
            mask.to(x.dtype))
        n = w.sum(1)
        mean = (x * w[..., None]).sum(1, keepdim=True) / n[:, None, None]
        return mean, w[..., None], n

    def _logdet(self, n: Tensor) -> Tensor:
        logdet = (n - 1) * self.deviation.log_abs_det()
        if self.mean is not None:
            logdet = logdet + self.mean.log_abs_det()
        return logdet

    def forward(self, inputs: Tensor, context=None) -> tuple[Tensor, Tensor]:
        mask = check_sets(inputs, mask_from_context(context, inputs), self.dim, "inputs")
        mean, w, n = self._split(inputs, mask)
        y = (inputs - mean) @ self.deviation.matrix()
        if self.mean is not None:
            y = y + mean @ self.mean.matrix()
        y = w * y + (1 - w) * inputs
        return y, self._logdet(n)

    def inverse(self, inputs: Tensor, context=None) -> tuple[Tensor, Tensor]:
        mask = check_sets(inputs, mask_from_context(context, inputs), self.dim, "inputs")
        mean, w, n = self._split(inputs, mask)
        x = self.deviation.solve_right(inputs - mean)
        if self.mean is not None:
            x = x + self.mean.solve_right(mean)
        x = w * x + (1 - w) * inputs
        return x, -self._logdet(n)
