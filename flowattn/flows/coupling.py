r"""Exchangeable set coupling: element-wise splines conditioned on the whole set, exact log-det.

The features of every element are split into two groups, x_i = (x_i^a, x_i^b). A coupling layer
keeps every x_i^b and moves x_i^a by a monotone rational-quadratic spline whose parameters come
from a permutation-equivariant network of the b-features of the *whole set*:

.. math:: y_i^a = s\big(x_i^a;\ \theta_i(x_1^b, \dots, x_n^b)\big), \qquad y_i^b = x_i^b.

Because the parameters see no a-feature of any element, the Jacobian of the map on R^{nD} is
triangular once the coordinates are ordered (all a, then all b), and

.. math:: \log|\det J| = \sum_{i\ \mathrm{present}} \sum_{d \in a} \log s'(x_{id}; \theta_{id}),

exact and cheap; the inverse solves each spline in closed form (the b-features, hence the
parameters, are known). The conditioner is an embedding of (x_j^b, size features of n), a few
pre-norm blocks of ordinary multi-head self-attention over the present elements, and a per-element
head, so permuting the elements permutes the parameters: the layer is permutation-equivariant
and the density of a flow of such layers is exchangeable. Unlike a contractive residual block,
nothing bounds how strongly elements influence each other, and each element's map is an
arbitrary monotone spline of its own coordinate.

**Particles (zero centre of mass).** On configurations with sum_i x_i = 0 the moved coordinates
are re-centred after the spline, y_i^a = s(x_i^a) - (1/n) sum_j s(x_j^a), so the layer maps the
zero-centre-of-mass subspace onto itself. For one moved feature the map is P D on the
(n - 1)-dimensional subspace 1^perp, with D = diag(s'(x_i)) and P the centring projection. With
an orthonormal basis Q of 1^perp and u = 1/sqrt(n), [Q u] is orthogonal and the cofactor formula
for the (u, u) entry of ([Q u]^T D [Q u])^{-1} = [Q u]^T D^{-1} [Q u] gives
det(Q^T D Q) = det D * u^T D^{-1} u, so

.. math:: \log|\det J| = \sum_{d \in a} \Big[\sum_i \log s'(x_{id})
          + \log \frac{1}{n} \sum_i \frac{1}{s'(x_{id})}\Big],

still exact and cheap. The inverse finds, per set and moved feature, the shift c with
sum_i s^{-1}(y_i + c) = 0 (increasing in c; bracketed because s is the identity outside its
interval) by bisection, then x_i = s^{-1}(y_i + c).
"""

from __future__ import annotations

import math

import torch
from nflows.transforms import CompositeTransform, Transform
from torch import Tensor, nn

from ..attention import DotProductMHA
from ..errors import InputError
from ..validation import check_deferred, present_weights, trusted_inputs
from .geometry import checked_inputs, full_precision, subtract_mean
from .layers import ActNorm, EquivariantLinear, SetLocation, size_features
from .setflow import SetFlow
from .splines import UNIT_SLOPE, rational_quadratic

__all__ = ["SetCoupling", "coupling_flow", "coupling_stack"]



class SetCoupling(Transform):
    r"""A coupling layer of sets: x_i^a moved by a spline conditioned on all x_j^b.

    References:
        Durkan et al., "Neural Spline Flows", NeurIPS 2019, §3 (rational-quadratic splines);
        Dinh et al., "Density estimation using Real NVP", ICLR 2017, §3.3 (coupling layers);
        Lee et al., "Set Transformer", ICML 2019 (attention conditioners on sets).

    With the features split as a = {d : d % 2 == parity} and b the rest,

        y_i^a = s(x_i^a; theta_i(x_1^b, ..., x_n^b)),   y_i^b = x_i^b,

    and log|det J| = sum over present i and d in a of log s'(x_id). The spline s acts on
    [-tail_bound, tail_bound] with ``bins`` bins and is the identity outside (linear tails); the
    layer starts as the identity (zero-initialised head). Padded elements (``context`` = mask)
    pass through unchanged, enter neither the conditioner nor the log-det.

    Arguments:
        dim: feature width D (at least 2).
        parity: which features move: those with d % 2 == parity.
        hidden: width of the conditioner.
        blocks: attention blocks of the conditioner; 0 gives an element-wise coupling (each
            element's parameters from its own b-features only; elements then meet only through
            the other layers of a flow).
        heads: attention heads (must divide ``hidden``).
        bins: spline bins.
        tail_bound: the spline's interval is [-tail_bound, tail_bound].
        zero_com: particle mode: inputs have sum_i x_i = 0 and so do outputs (the moved
            coordinates are re-centred; the log-det is that of the map on the subspace).

    Examples:
        >>> layer = SetCoupling(2, parity=0)
        >>> x = torch.randn(3, 5, 2)
        >>> y, logdet = layer(x)
        >>> bool(torch.allclose(y, x, atol=1e-5)), bool(logdet.abs().max() < 1e-5)  # identity
        (True, True)
        >>> x_back, _ = layer.inverse(y)
        >>> bool(torch.allclose(x_back, x, atol=1e-5))
        True
    """

    def __init__(
        self,
        dim: int,
        parity: int = 0,
        hidden: int = 64,
        blocks: int = 2,
        heads: int = 1,
        bins: int = 8,
        tail_bound: float = 5.0,
        zero_com: bool = False,
    ) -> None:
        super().__init__()
        if dim < 2:
            raise InputError(f"SetCoupling splits the features of an element in two: it needs "
                             f"dim >= 2, got dim={dim}")
        if parity not in (0, 1):
            raise InputError(f"parity must be 0 or 1, got {parity}")
        if hidden < 1 or blocks < 0 or bins < 1:
            raise InputError(f"hidden and bins must be positive and blocks >= 0, got hidden="
                             f"{hidden}, blocks={blocks}, bins={bins}")
        if heads < 1 or hidden % heads != 0:
            raise InputError(f"heads={heads} must divide the conditioner width hidden={hidden}")
        if not (math.isfinite(tail_bound) and tail_bound > 0):
            raise InputError(f"tail_bound must be positive, got {tail_bound}")
        self.dim, self.bins, self.tail_bound = dim, bins, float(tail_bound)
        self.zero_com = bool(zero_com)
        moved = [d for d in range(dim) if d % 2 == parity]
        kept = [d for d in range(dim) if d % 2 != parity]
        self.register_buffer("moved", torch.tensor(moved), persistent=False)
        self.register_buffer("kept", torch.tensor(kept), persistent=False)
        self.conditioner = _Conditioner(len(kept), len(moved), hidden, blocks, heads, bins)

    def _spline_parameters(self, x: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """Unnormalised widths, heights and inner derivatives, each (B, N, |a|, ...)."""
        params = self.conditioner(x[..., self.kept], mask).to(x.dtype)
        k = self.bins
        return params[..., :k], params[..., k:2 * k], params[..., 2 * k:]

    def _couple(self, inputs: Tensor, context, inverse: bool) -> tuple[Tensor, Tensor]:
        mask = checked_inputs(inputs, context, self, self.dim)
        w = present_weights(inputs, mask).unsqueeze(-1)
        x = inputs if mask is None else inputs * w  # padded values never enter
        with trusted_inputs():  # checked here, once
            widths, heights, derivatives = self._spline_parameters(x, mask)
        check_deferred(inputs, "SetCoupling", widths, heights, derivatives)
        with full_precision(x):  # the spline and its log-det in the data's precision
            def spline(values: Tensor, inverse: bool) -> tuple[Tensor, Tensor]:
                return rational_quadratic(values, widths, heights, derivatives,
                                          self.tail_bound, inverse)

            moved = x[..., self.moved]
            if self.zero_com and inverse:
                moved = moved + self._centring_shift(moved, spline, w)
            moved, logabsdet = spline(moved, inverse)
            logdet = (logabsdet * w).sum(dim=(1, 2))
            if self.zero_com:
                n = w.sum(dim=1, keepdim=True)
                moved = subtract_mean(moved, mask)  # padded entries are restored below
                # log (1/n) sum_i 1/s'(x_i) per moved feature; the inverse's is the negative
                # of the forward's at its output, where log s' = -logabsdet
                sign = 1.0 if inverse else -1.0
                terms = (sign * logabsdet).masked_fill(w == 0, float("-inf"))
                correction = (torch.logsumexp(terms, dim=1) - n.squeeze(1).log()).sum(dim=-1)
                logdet = logdet - correction if inverse else logdet + correction
            y = x.index_copy(-1, self.moved, moved)
            if mask is not None:
                y = torch.where(mask.unsqueeze(-1), y, inputs)
            return y, logdet

    def _centring_shift(self, y: Tensor, spline, w: Tensor, iterations: int = 64) -> Tensor:
        """c (B, 1, |a|) with sum_i w_i s^{-1}(y_i + c) = 0, by bisection.

        s^{-1}(v) - v lies in [-2 B, 2 B] for every v (B = tail_bound: inside the interval both
        are in [-B, B], outside the spline is the identity), so the root lies within 2 B of
        minus the mean of y; the sum is increasing in c. The bisection runs without a graph;
        one Newton step from its result, c - h(c) / h'(c), leaves the value where it is (h(c) is
        0 to rounding) and gives c the derivative of the implicit function, dc = -dh / h'.
        """
        n = w.sum(dim=1, keepdim=True)
        mean = (y * w).sum(dim=1, keepdim=True) / n
        lo = -mean - 2 * self.tail_bound - 1
        hi = -mean + 2 * self.tail_bound + 1
        with torch.no_grad():
            for _ in range(iterations):
                mid = (lo + hi) / 2
                above = (spline(y + mid, True)[0] * w).sum(dim=1, keepdim=True) > 0
                lo, hi = torch.where(above, lo, mid), torch.where(above, mid, hi)
        c = (lo + hi) / 2
        values, logslope = spline(y + c, True)
        h = (values * w).sum(dim=1, keepdim=True)
        slope = (logslope.exp() * w).sum(dim=1, keepdim=True)
        return c - h / slope

    def forward(self, inputs: Tensor, context=None) -> tuple[Tensor, Tensor]:
        return self._couple(inputs, context, inverse=False)

    def inverse(self, inputs: Tensor, context=None) -> tuple[Tensor, Tensor]:
        return self._couple(inputs, context, inverse=True)


def coupling_flow(
    dim: int,
    layers: int = 8,
    hidden: int = 64,
    blocks: int = 2,
    heads: int = 1,
    bins: int = 8,
    tail_bound: float = 5.0,
    location: bool = True,
    linear: bool = True,
    zero_com: bool = False,
) -> SetFlow:
    r"""An exchangeable flow of set-coupling layers with exact log-det and inverse.

    Data side first: an optional :class:`~flowattn.flows.SetLocation` (a spline flow of the
    centroid), then ``layers`` times ActNorm -> :class:`~flowattn.flows.EquivariantLinear`
    (optional) -> :class:`SetCoupling`, the moved features alternating between layers (for
    D = 2: the first coordinate, then the second). Every layer is permutation-equivariant with
    an exact log-det, so log p(x[:, perm]) = log p(x) exactly. With ``zero_com`` (particles) the
    flow lives on the zero-centre-of-mass subspace: no SetLocation, ActNorms without shift,
    equivariant maps without the mean term and re-centred couplings; it is then invariant to
    permutations and translations but not to rotations.

    Arguments:
        dim: feature width D (at least 2).
        layers: coupling layers.
        hidden: conditioner width of every :class:`SetCoupling`.
        blocks: attention blocks of every conditioner (0: element-wise couplings).
        heads: attention heads (must divide ``hidden``).
        bins: spline bins.
        tail_bound: the splines act on [-tail_bound, tail_bound].
        location: start with a :class:`~flowattn.flows.SetLocation` (not with ``zero_com``).
        linear: an :class:`~flowattn.flows.EquivariantLinear` before every coupling (it also
            rotates the features, so that the split differs from layer to layer).
        zero_com: particle mode (zero centre of mass, the E-NF convention of
            :class:`~flowattn.flows.SetFlow`).

    Examples:
        >>> flow = coupling_flow(2, layers=2, hidden=8).eval()
        >>> x = torch.randn(4, 6, 2)
        >>> perm = torch.randperm(6)
        >>> bool(torch.allclose(flow.log_prob(x), flow.log_prob(x[:, perm]), atol=1e-5))
        True
    """
    if location and zero_com:
        raise InputError("location=True models the centroid, which zero_com fixes at 0")
    steps: list[Transform] = [SetLocation(dim)] if location else []
    steps += coupling_stack(dim, layers, hidden, blocks, heads, bins, tail_bound, linear,
                            zero_com)
    return SetFlow(CompositeTransform(steps), dim, zero_com=zero_com)


def coupling_stack(
    dim: int,
    layers: int,
    hidden: int = 64,
    blocks: int = 2,
    heads: int = 1,
    bins: int = 8,
    tail_bound: float = 5.0,
    linear: bool = True,
    zero_com: bool = False,
) -> list[Transform]:
    """The layers of :func:`coupling_flow` after its SetLocation: ``layers`` times ActNorm ->
    EquivariantLinear (if ``linear``) -> :class:`SetCoupling`, the moved features alternating
    from the first coordinate on; to put after other transforms of a flow.

    Examples:
        >>> [type(t).__name__ for t in coupling_stack(2, 1, hidden=8)]
        ['ActNorm', 'EquivariantLinear', 'SetCoupling']
    """
    if layers < 1:
        raise InputError(f"layers must be >= 1, got {layers}")
    steps: list[Transform] = []
    for index in range(layers):
        steps.append(ActNorm(dim, zero_com=zero_com))
        if linear:
            steps.append(EquivariantLinear(dim, zero_com=zero_com))
        steps.append(SetCoupling(dim, index % 2, hidden, blocks, heads, bins, tail_bound,
                                 zero_com=zero_com))
    return steps


class _Conditioner(nn.Module):
    """Spline parameters of every element from the b-features of all present elements.

    Embedding of (x_j^b, 1/sqrt(n), log n), ``blocks`` pre-norm blocks h + MHA(LN h),
    h + MLP(LN h) over the present elements, then a zero-initialised per-element head: output
    (B, N, moved, 3 bins - 1), where the inner derivatives start at slope 1 (an identity spline).
    """

    def __init__(self, kept: int, moved: int, hidden: int, blocks: int, heads: int, bins: int):
        super().__init__()
        self.moved, self.width = moved, 3 * bins - 1
        self.embed = nn.Linear(kept + 2, hidden)
        self.blocks = nn.ModuleList(_Block(hidden, heads) for _ in range(blocks))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, moved * self.width)
        nn.init.zeros_(self.head.weight)
        with torch.no_grad():
            bias = torch.zeros(moved, self.width)
            bias[:, 2 * bins:] = UNIT_SLOPE
            self.head.bias.copy_(bias.flatten())

    def forward(self, xb: Tensor, mask: Tensor | None) -> Tensor:
        n = present_weights(xb, mask).sum(dim=1)
        size = size_features(n).to(xb.dtype)[:, None].expand(*xb.shape[:2], 2)
        h = self.embed(torch.cat([xb, size], dim=-1))
        for block in self.blocks:
            h = block(h, mask)
        out = self.head(self.norm(h))
        return out.reshape(*xb.shape[:2], self.moved, self.width)


class _Block(nn.Module):
    """h + MHA(LN h) over the present elements, then h + MLP(LN h) on each element."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attention = DotProductMHA(hidden, heads)
        self.mlp = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(),
                                 nn.Linear(2 * hidden, hidden))

    def forward(self, h: Tensor, mask: Tensor | None) -> Tensor:
        h = h + self.attention(self.norm1(h), mask)
        return h + self.mlp(self.norm2(h))
