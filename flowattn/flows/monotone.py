r"""Invertible blocks x + g(x) whose branch is a gradient field: only expansion is free.

If g = grad U has a symmetric Jacobian with eigenvalues in [-l, u] and l < 1, then x + g(x) is
the gradient of the strongly convex potential |x|^2 / 2 + U(x) and is invertible, however large
u is (Huang et al. 2021, "Convex potential flows"): contraction must stay bounded, expansion
need not. A contractive residual block asks for max(l, u) < 1 instead, which caps how sharply a
block can concentrate density.

The block is evaluated as a contractive residual block followed by a scaling about the centroid.
With a = (u - l + 2) / 2 and P the removal of each set's centroid,

    x + g(x) = c + a (P x + h(x)),    h(x) = (g(x) - (a - 1) P x) / a,    c = centroid of x,

and the eigenvalues of h's Jacobian lie in [(1 - a - l) / a, (1 - a + u) / a] =
[-q, q] with q = (u + l) / (u - l + 2) < 1. So h is a contractive branch for an ordinary
:class:`~flowattn.flows.InvertibleResidual` (fixed-point or Anderson inverse, every log-det
estimator), and log|det| gains (n - 1) D log a for a set of n elements in R^D.
"""

from __future__ import annotations

from typing import Any

import torch
from nflows.transforms import Transform
from torch import Tensor, nn

from flowattn.flows.base import _present, subtract_mean
from flowattn.flows.residual import InvertibleResidual, mask_from_context
from flowattn.validation import check_sets

__all__ = ["MonotoneResidual"]


def _spectrum(branch: nn.Module) -> tuple[Tensor, Tensor]:
    spectrum = getattr(branch, "spectrum", None)
    if not callable(spectrum):
        raise ValueError(f"branch {type(branch).__name__} has no spectrum() method: a monotone "
                         "block needs certified bounds on the eigenvalues of a symmetric Jacobian")
    return spectrum()


class _Recentred(nn.Module):
    """h(x) = (g(x) - (a - 1) P x) / a, contractive with Lip_2(h) <= q (module docstring)."""

    norm = "2"

    def __init__(self, branch: nn.Module) -> None:
        super().__init__()
        self.branch = branch

    def scale(self) -> Tensor:
        lower, upper = _spectrum(self.branch)
        return (upper - lower + 2) / 2

    def lipschitz_bound(self, n: int | None = None) -> Tensor:
        lower, upper = _spectrum(self.branch)
        if lower >= 1:
            return lower  # not monotone: the residual block refuses it
        return (upper + lower) / (upper - lower + 2)

    def forward(self, x: Tensor, mask: Tensor | None = None, causal: bool = False) -> Tensor:
        a = self.scale().to(x)
        return (self.branch(x, mask=mask, causal=causal) - (a - 1) * subtract_mean(x, mask)) / a

    def jacobian(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        a = self.scale().to(x)
        B, N, D = x.shape
        present = _present(x, mask)
        n = present.sum(1).clamp_min(1.0)
        same = torch.eye(N, dtype=x.dtype, device=x.device)
        centring = present[:, :, None] * (same - present[:, None, :] / n[:, None, None])
        eye = torch.eye(D, dtype=x.dtype, device=x.device)
        centring = centring[:, :, None, :, None] * eye[None, None, :, None, :]  # P, (B,N,D,N,D)
        return (self.branch.jacobian(x, mask) - (a - 1) * centring) / a


class MonotoneResidual(Transform):
    r"""y = x + g(x) for a gradient-field branch with Jacobian eigenvalues in [-l, u], l < 1.

    The branch provides ``spectrum() -> (l, u)`` (certified, for every set size) and a
    symmetric Jacobian, e.g. :class:`~flowattn.flows.RadialInteraction` with ``max_slope=u``.
    Only l must stay below 1; u sets how far one block can expand. Keyword arguments go to the
    inner :class:`~flowattn.flows.InvertibleResidual` (``logdet``, ``zero_com``, inverse
    settings, ...); its inverse iterations converge at the rate q = (u + l) / (u - l + 2).

    Example:
        >>> from flowattn.flows import RadialInteraction
        >>> branch = RadialInteraction(coeff=0.9, max_slope=3.0)
        >>> block = MonotoneResidual(branch, logdet="exact", zero_com=True).eval()
        >>> x = torch.randn(2, 4, 2)
        >>> x = x - x.mean(1, keepdim=True)
        >>> y, logdet = block(x)
        >>> bool((block.inverse(y)[0] - x).abs().max() < 1e-4)
        True
    """

    def __init__(self, branch: nn.Module, **residual_kwargs: Any) -> None:
        super().__init__()
        if residual_kwargs.get("causal"):
            raise ValueError("a monotone block needs a symmetric Jacobian: no causal mask")
        self.residual = InvertibleResidual(_Recentred(branch), **residual_kwargs)

    @property
    def branch(self) -> nn.Module:
        """The gradient-field branch g."""
        return self.residual.branch.branch

    def _scale_logdet(self, x: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
        a = self.residual.branch.scale().to(x)
        n = _present(x, mask).sum(1)
        return a, (n - 1).clamp_min(0.0) * x.shape[-1] * torch.log(a)

    def forward(self, inputs: Tensor, context=None) -> tuple[Tensor, Tensor]:
        """y = x + g(x) and log|det dy/dx| per set, shape (B,)."""
        mask = check_sets(inputs, mask_from_context(context, inputs), name="inputs")
        z, logdet = self.residual(inputs, context=context)
        a, scale_logdet = self._scale_logdet(inputs, mask)
        centroid = z - subtract_mean(z, mask)
        y = centroid + a * (z - centroid)
        return y, logdet + scale_logdet

    def inverse(self, inputs: Tensor, context=None) -> tuple[Tensor, Tensor]:
        """x with x + g(x) = inputs, and log|det dx/dy|."""
        mask = check_sets(inputs, mask_from_context(context, inputs), name="inputs")
        a, scale_logdet = self._scale_logdet(inputs, mask)
        centroid = inputs - subtract_mean(inputs, mask)
        x, logdet = self.residual.inverse(centroid + (inputs - centroid) / a, context=context)
        return x, logdet - scale_logdet
