"""Where a set lies: an invertible map of its centroid, conditioned on its size.

Tied-weight L2 attention cannot model a set's location. Its logits
-||x_i W^Q - x_j W^Q||^2 / sqrt(d) do not change when the whole set moves, x_i -> x_i + t, and
its rows of attention weights sum to one, so the branch moves by t W^V W^O: every attention
residual (and every equivariant linear map) is *affine* along the translation direction. A
distribution of sets whose location is multimodal (objects at a few places, point clouds of
several classes) needs a non-linear map of the centroid, and pointwise MLPs reach it only
through the positions of single elements. :class:`SetLocation` supplies it directly.
"""

from __future__ import annotations

import math

import torch
from nflows.transforms import (
    ActNorm as VectorActNorm,
)
from nflows.transforms import (
    CompositeTransform,
    MaskedPiecewiseRationalQuadraticAutoregressiveTransform,
    RandomPermutation,
    Transform,
)
from torch import Tensor

from ..errors import InputError
from ..validation import check_sets, present_weights
from .geometry import mask_from_context

__all__ = ["SetLocation", "size_features"]


def size_features(n: Tensor) -> Tensor:
    """Context of the centroid flow for sets of ``n`` present elements, shape (B, 2).

    The centroid of n exchangeable elements fluctuates on a scale proportional to 1/sqrt(n),
    so the flow sees (1/sqrt(n), log n).
    """
    n = n.clamp_min(1)
    return torch.stack([n.rsqrt(), n.log()], dim=-1)


def _spline_flow(dim: int, layers: int, hidden: int, bins: int, tail_bound: float) -> Transform:
    steps: list[Transform] = [VectorActNorm(dim)]
    for _ in range(layers):
        steps.append(
            MaskedPiecewiseRationalQuadraticAutoregressiveTransform(
                features=dim,
                hidden_features=hidden,
                context_features=2,
                num_bins=bins,
                tails="linear",
                tail_bound=tail_bound,
            )
        )
        if dim > 1:
            steps.append(RandomPermutation(dim))
    return CompositeTransform(steps)


class SetLocation(Transform):
    r"""Moves every element of a set by the same amount, a learned function of the centroid.

    With x̄ = (1/n) sum_i x_i over the n present elements and f an invertible map of R^D that
    may depend on n,

        y_i = x_i + f(x̄; n) - x̄,

    so ȳ = f(x̄; n) and the deviations x_i - x̄ are kept. The Jacobian of the whole map on
    R^{nD} is I + (1 ⊗ I_D)(J_f - I)(1ᵀ ⊗ I_D)/n, and the matrix determinant lemma gives

        log|det J| = log|det J_f(x̄)|,

    a D x D determinant that f (an nflows transform) computes exactly. The inverse is exact too:
    x̄ = f^{-1}(ȳ; n) and x_i = y_i - ȳ + x̄. The map is permutation-equivariant, so a flow
    built with it stays exchangeable.

    By default f is an affine ActNorm followed by ``layers`` masked autoregressive
    rational-quadratic splines (Durkan et al. 2019, Neural Spline Flows, §3) conditioned on
    :func:`size_features` of n, with random permutations of the D coordinates between them.
    Padded elements (``mask`` False) pass through unchanged.

    Not for particle systems in zero-centre-of-mass mode, where the centroid is fixed at 0.

    Arguments:
        dim: feature width D.
        layers: spline layers of the default f.
        hidden: hidden width of their autoregressive networks.
        bins: spline bins.
        tail_bound: the splines act on [-B, B] (after the ActNorm); identity outside.
        transform: a custom f, an nflows transform of (B, D) with ``context`` the (B, 2)
            size features; replaces the default.

    Examples:
        >>> loc = SetLocation(2)
        >>> x = torch.randn(3, 5, 2)
        >>> y, logdet = loc(x)
        >>> x_again, _ = loc.inverse(y)
        >>> bool(torch.allclose(x, x_again, atol=1e-5)), tuple(logdet.shape)
        (True, (3,))
    """

    def __init__(
        self,
        dim: int,
        layers: int = 2,
        hidden: int = 32,
        bins: int = 8,
        tail_bound: float = 4.0,
        transform: Transform | None = None,
    ) -> None:
        super().__init__()
        if dim < 1 or layers < 1 or hidden < 1 or bins < 1:
            raise InputError(
                f"dim, layers, hidden and bins must be positive, got {dim}, {layers}, "
                f"{hidden}, {bins}"
            )
        if not (math.isfinite(tail_bound) and tail_bound > 0):
            raise InputError(f"tail_bound must be positive, got {tail_bound}")
        self.dim = dim
        self.centroid_flow = transform or _spline_flow(dim, layers, hidden, bins, tail_bound)

    def _centroid(self, x: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        w = present_weights(x, mask).unsqueeze(-1)
        n = w.sum(dim=(1, 2))  # check_sets has ruled out empty sets
        return (x * w).sum(dim=1) / n.unsqueeze(-1), n, w

    def _move(self, x: Tensor, context, direction: str) -> tuple[Tensor, Tensor]:
        mask = mask_from_context(context, x)
        mask = check_sets(x, mask, dim=self.dim)
        centre, n, w = self._centroid(x, mask)
        features = size_features(n)
        flow = self.centroid_flow if direction == "forward" else self.centroid_flow.inverse
        new_centre, logdet = flow(centre, context=features)
        shift = (new_centre - centre).unsqueeze(1) * w
        return x + shift, logdet

    def forward(self, inputs: Tensor, context=None) -> tuple[Tensor, Tensor]:
        return self._move(inputs, context, "forward")

    def inverse(self, inputs: Tensor, context=None) -> tuple[Tensor, Tensor]:
        return self._move(inputs, context, "inverse")
