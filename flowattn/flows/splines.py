r"""Monotone rational-quadratic splines with identity tails, computed without branches on the data.

The spline of Durkan et al. (2019, Neural Spline Flows, §3) on [-B, B] with K bins: knots
x_0 = -B < x_1 < ... < x_K = B and y_0 = -B < ... < y_K = B, slopes δ_k > 0 at the knots with
δ_0 = δ_K = 1, so that the identity outside [-B, B] joins it with a continuous derivative. In bin
k, with s_k = (y_{k+1} - y_k) / (x_{k+1} - x_k) and θ = (x - x_k) / (x_{k+1} - x_k),

.. math:: y = y_k + (y_{k+1} - y_k)\,
          \frac{s_k θ^2 + δ_k θ(1 - θ)}{s_k + (δ_{k+1} + δ_k - 2 s_k)\, θ(1 - θ)},

.. math:: \frac{dy}{dx} = s_k^2\,
          \frac{δ_{k+1} θ^2 + 2 s_k θ(1 - θ) + δ_k (1 - θ)^2}
               {\big[s_k + (δ_{k+1} + δ_k - 2 s_k)\, θ(1 - θ)\big]^2},

and the inverse solves the quadratic in θ for its root in [0, 1]. The unconstrained parameters
are those of nflows' ``unconstrained_rational_quadratic_spline`` (bin widths and heights by a
softmax with a floor, inner slopes by a softplus with a floor), and the values are the same.

nflows selects the inputs inside the interval with boolean indexing, checks the interval by
reading a minimum and a maximum back and asserts the inverse's discriminant: a shape that
depends on the data and up to four host synchronisations a call, which on a GPU stall the
stream and under ``torch.compile`` break the graph. Here every input goes through the same
operations (the spline is evaluated at the input clamped to [-B, B], and the identity is
selected outside), so a flow of spline layers compiles into whole graphs and runs without
reading anything back.

Examples:
    >>> w, h, d = torch.zeros(5, 8), torch.zeros(5, 8), torch.zeros(5, 7)
    >>> x = torch.linspace(-4.0, 4.0, 5)
    >>> y, logabsdet = rational_quadratic(x, w, h, d, bound=3.0)
    >>> x_back, _ = rational_quadratic(y, w, h, d, bound=3.0, inverse=True)
    >>> bool(torch.allclose(x_back, x, atol=1e-5))
    True
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from nflows.transforms.splines.rational_quadratic import (
    DEFAULT_MIN_BIN_HEIGHT,
    DEFAULT_MIN_BIN_WIDTH,
    DEFAULT_MIN_DERIVATIVE,
)
from torch import Tensor

__all__ = ["UNIT_SLOPE", "rational_quadratic"]

# the unconstrained slope whose softplus gives slope 1 (the ends' slope, as nflows pads them)
UNIT_SLOPE = math.log(math.expm1(1 - DEFAULT_MIN_DERIVATIVE))


def rational_quadratic(
    inputs: Tensor,
    widths: Tensor,
    heights: Tensor,
    derivatives: Tensor,
    bound: float,
    inverse: bool = False,
) -> tuple[Tensor, Tensor]:
    """The spline (or its inverse) at ``inputs`` and log |dy/dx| there; the identity, with
    log-slope 0, outside [-``bound``, ``bound``].

    Arguments:
        inputs: any shape S.
        widths, heights: unnormalised bin widths and heights, shape S + (K,).
        derivatives: unnormalised slopes at the K - 1 inner knots, shape S + (K - 1,).
        bound: B, the half-width of the spline's interval (in both x and y).
        inverse: evaluate the inverse spline; its log-slope is that of the inverse map.

    Returns:
        The outputs and the log-slopes, both of shape S.
    """
    inside = (inputs >= -bound) & (inputs <= bound)
    x = inputs.clamp(-bound, bound)
    x_knots, x_sizes = _knots(widths, bound, DEFAULT_MIN_BIN_WIDTH)
    y_knots, y_sizes = _knots(heights, bound, DEFAULT_MIN_BIN_HEIGHT)
    slopes = DEFAULT_MIN_DERIVATIVE + F.softplus(F.pad(derivatives, (1, 1), value=UNIT_SLOPE))

    # the bin: how many inner knots lie at or below the input (on the side it is given on)
    knots = y_knots if inverse else x_knots
    index = (x.unsqueeze(-1) >= knots[..., 1:-1]).sum(dim=-1, keepdim=True)

    def at(values: Tensor) -> Tensor:
        return values.gather(-1, index).squeeze(-1)

    x_k, width, y_k, height = at(x_knots), at(x_sizes), at(y_knots), at(y_sizes)
    slope = height / width
    d_k, d_k1 = at(slopes[..., :-1]), at(slopes[..., 1:])
    curvature = d_k + d_k1 - 2 * slope

    if inverse:  # θ from the quadratic, the root in [0, 1]
        t = x - y_k
        a = t * curvature + height * (slope - d_k)
        b = height * d_k - t * curvature
        c = -slope * t
        discriminant = (b * b - 4 * a * c).clamp_min(0)  # >= 0 but for rounding
        theta = (2 * c) / (-b - discriminant.sqrt())
    else:
        theta = (x - x_k) / width
    mixed = theta * (1 - theta)
    denominator = slope + curvature * mixed
    numerator = slope**2 * (d_k1 * theta**2 + 2 * slope * mixed + d_k * (1 - theta) ** 2)
    logslope = numerator.log() - 2 * denominator.log()
    if inverse:
        outputs, logslope = theta * width + x_k, -logslope
    else:
        outputs = y_k + height * (slope * theta**2 + d_k * mixed) / denominator
    outputs = torch.where(inside, outputs, inputs)
    return outputs, torch.where(inside, logslope, torch.zeros_like(logslope))


def _knots(unnormalised: Tensor, bound: float, floor: float) -> tuple[Tensor, Tensor]:
    """The K + 1 knots on [-B, B] (ends exact) and the K bin sizes from unnormalised sizes."""
    bins = unnormalised.shape[-1]
    sizes = floor + (1 - floor * bins) * torch.softmax(unnormalised, dim=-1)
    inner = 2 * bound * torch.cumsum(sizes, dim=-1)[..., :-1] - bound
    ends = torch.full_like(inner[..., :1], bound)
    knots = torch.cat([-ends, inner, ends], dim=-1)
    return knots, knots[..., 1:] - knots[..., :-1]
