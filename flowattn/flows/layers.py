"""Invertible layers of sets with exact log-determinants and closed-form inverses.

Each layer is an nflows transform on (B, N, D) sets or sequences that takes the padding mask as
``context``; padded elements pass through unchanged.

* :class:`ActNorm` -- a per-feature affine map with data-dependent initialisation;
* :class:`EquivariantLinear` -- the general permutation-equivariant linear map of sets;
* :class:`SetLocation` -- a learned map of each set's centroid, given its size.

Why a set's location needs a layer of its own: tied-weight L2 attention cannot model it. Its
logits -||x_i W^Q - x_j W^Q||^2 / sqrt(d) do not change when the whole set moves,
x_i -> x_i + t, and its rows of attention weights sum to one, so the branch moves by t W^V W^O:
every attention residual (and every equivariant linear map) is *affine* along the translation
direction. A distribution of sets whose location is multimodal (objects at a few places, point
clouds of several classes) needs a non-linear map of the centroid, and pointwise MLPs reach it
only through the positions of single elements. :class:`SetLocation` supplies it directly.
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
from torch import Tensor, nn

from ..errors import InputError
from ..validation import check_count, check_sets, present_weights
from .base import set_dims
from .geometry import checked_inputs, full_precision
from .splines import rational_quadratic

__all__ = ["ActNorm", "EquivariantLinear", "SetLocation", "feature_moments", "size_features"]


class _InitialisedOnce:
    """The ``initialized`` buffer of a data-initialised layer, read back to the host once.

    Once it has been seen True (or loaded as True), training calls read nothing back: no host
    synchronisation per step, and under torch.compile no graph break on it.
    """

    _seen_initialised = False

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        # the loaded buffer decides, read once here: a resumed training step reads nothing
        self._seen_initialised = bool(self.initialized)

    def _needs_initialisation(self) -> bool:
        if not self._seen_initialised:
            self._seen_initialised = bool(self.initialized)  # one host read, until it is True
        return not self._seen_initialised


class ActNorm(_InitialisedOnce, Transform):
    r"""Per-feature affine map y_i = (x_i + b) * exp(s) applied to every present element.

    References:
        Kingma & Dhariwal, "Glow", NeurIPS 2018, §3.1 (ActNorm with data-dependent init).

    On the first forward call in training mode, b and s are set so that the present elements of
    that batch have zero mean and unit variance per feature (padded elements are excluded from
    the statistics; :func:`feature_moments`, computed in float64). A feature that does not vary
    in that batch (a constant coordinate, one element in all) keeps the scale 1 and is only
    centred: the initialisation is finite for any finite batch, at any offset and scale.
    Padded elements pass through unchanged. The log-determinant of a set of n present elements
    is n * sum_d s_d.

    With ``zero_com=True`` (particle systems) the shift is fixed to zero so that a zero centre of
    mass is preserved, the scale is initialised from the root-mean-square per feature, and the
    log-determinant is that of the map restricted to the (n - 1) D-dimensional subspace:
    (n - 1) sum_d s_d.

    Arguments:
        dim: feature width D.
        zero_com: zero-centre-of-mass mode.
        eps: a standard deviation at most ``eps`` times the feature's magnitude |mean| (or
            below the smallest normal number) counts as no variation (default: 4 machine
            epsilons of the batch's dtype, the rounding noise of a constant feature).

    Examples:
        >>> act = ActNorm(3)
        >>> y, logdet = act(torch.randn(8, 5, 3) * 4 + 1)
        >>> bool(y.mean(dim=(0, 1)).abs().max() < 1e-5)
        True
    """

    def __init__(self, dim: int, zero_com: bool = False, eps: float | None = None) -> None:
        super().__init__()
        if eps is not None and not (math.isfinite(eps) and eps >= 0):
            raise InputError(f"eps must be a finite number >= 0, got {eps}")
        self.dim = check_count(dim, "dim")
        self.zero_com = bool(zero_com)
        self.eps = eps
        self.log_scale = nn.Parameter(torch.zeros(dim))
        self.shift = nn.Parameter(torch.zeros(dim), requires_grad=not zero_com)
        self.register_buffer("initialized", torch.tensor(False))

    @torch.no_grad()
    def initialise(self, x: Tensor, mask: Tensor | None = None) -> None:
        """Set b and s from the present elements of ``x`` (B, N, D): see :func:`feature_moments`.

        A feature that does not vary (a constant coordinate, a single element) keeps the scale
        1 and is only shifted, so the initialisation never divides by zero.
        """
        mean, std = feature_moments(x, mask, self.zero_com, self.eps)
        self.shift.copy_(-mean.to(self.shift.dtype))
        self.log_scale.copy_(-torch.log(std).to(self.log_scale.dtype))
        self.initialized.fill_(True)
        self._seen_initialised = True

    def _logdet(self, x: Tensor, mask: Tensor | None) -> Tensor:
        # set_dims gives n D (or (n - 1) D); every feature direction holds 1/D of them.
        count = set_dims(x, mask, self.zero_com) / x.shape[-1]
        return count * self.log_scale.sum()

    def _prepare(self, inputs: Tensor, context):
        flat = isinstance(inputs, Tensor) and inputs.dim() == 2
        x = inputs.unsqueeze(1) if flat else inputs
        mask = checked_inputs(x, context, self, self.dim)
        return x, mask, flat

    def forward(self, inputs: Tensor, context=None) -> tuple[Tensor, Tensor]:
        x, mask, flat = self._prepare(inputs, context)
        if self.training and self._needs_initialisation():
            self.initialise(x, mask)
        y = (x + self.shift) * torch.exp(self.log_scale)
        if mask is not None:
            y = torch.where(mask.unsqueeze(-1), y, x)
        return (y.squeeze(1) if flat else y), self._logdet(x, mask)

    def inverse(self, inputs: Tensor, context=None) -> tuple[Tensor, Tensor]:
        y, mask, flat = self._prepare(inputs, context)
        x = y * torch.exp(-self.log_scale) - self.shift
        if mask is not None:
            x = torch.where(mask.unsqueeze(-1), x, y)
        return (x.squeeze(1) if flat else x), -self._logdet(y, mask)


def feature_moments(
    x: Tensor, mask: Tensor | None = None, zero_com: bool = False, eps: float | None = None
) -> tuple[Tensor, Tensor]:
    r"""Mean and a safe standard deviation of each feature over the present elements of sets.

    Both are computed in float64 over every present element of ``x`` (B, N, D) (``mask`` False
    excluded); with ``zero_com`` the mean is 0 and the spread is the root mean square. A spread
    that is not above max(eps |mean|, tiny) -- a constant feature, whose computed spread is
    rounding noise of the order of eps |mean|, or a single element -- is replaced by 1, so
    that an affine standardisation (x - mean) / std built from them is finite for any finite
    data, at any offset and scale.

    Arguments:
        x: sets (B, N, D) or vectors (B, D).
        mask: bool (B, N), True = present.
        zero_com: the data live in the zero-centre-of-mass subspace (no shift).
        eps: relative threshold (default: 4 machine epsilons of ``x``'s dtype).

    Returns:
        (mean, std), each (D,) in float64.

    Examples:
        >>> x = torch.tensor([[[1e6, 3.0], [1e6 + 2, 3.0]]], dtype=torch.float64)
        >>> mean, std = feature_moments(x)
        >>> mean.tolist(), std.tolist()
        ([1000001.0, 3.0], [1.0, 1.0])
    """
    if x.dim() == 2:
        x = x.unsqueeze(1)
    eps = 4 * torch.finfo(x.dtype).eps if eps is None else float(eps)
    xd = x.detach().double()
    w = present_weights(xd, mask).unsqueeze(-1)
    count = w.sum(dim=(0, 1))
    mean = torch.zeros_like(count) if zero_com else (xd * w).sum(dim=(0, 1)) / count
    std = (((xd - mean).pow(2) * w).sum(dim=(0, 1)) / count).sqrt()
    floor = (eps * mean.abs()).clamp_min(torch.finfo(x.dtype).tiny)
    return mean, torch.where(std > floor, std, torch.ones_like(std))


class _CentroidActNorm(_InitialisedOnce, VectorActNorm):
    """nflows' ActNorm of vectors (B, D), initialised by :func:`feature_moments`.

    nflows divides by the batch's standard deviation unguarded: a batch of one vector, or a
    coordinate that is constant in the batch, gives an infinite scale. Here such a coordinate
    keeps the scale 1. nflows also reads its ``initialized`` flag at every training call; here
    it is read until it is True. The parametrisation (y = x exp(s) + b) and the state are
    nflows', so saved flows load unchanged.
    """

    def _initialize(self, inputs: Tensor) -> None:
        with torch.no_grad():
            mean, std = feature_moments(inputs)
            self.log_scale.data = -torch.log(std).to(self.log_scale)
            self.shift.data = (-mean / std).to(self.shift)
            self.initialized.fill_(True)  # in place: the buffer stays on its device
            self._seen_initialised = True

    def forward(self, inputs: Tensor, context=None) -> tuple[Tensor, Tensor]:
        if inputs.dim() != 2:
            raise InputError(f"the centroid flow's ActNorm takes vectors (B, D), got shape "
                             f"{tuple(inputs.shape)}")
        if self.training and self._needs_initialisation():
            self._initialize(inputs)
        outputs = inputs * torch.exp(self.log_scale) + self.shift
        return outputs, self.log_scale.sum() * outputs.new_ones(inputs.shape[0])


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
        self.dim, self.zero_com = check_count(dim, "dim"), zero_com
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
        mask = checked_inputs(inputs, context, self, self.dim)
        with full_precision(inputs):  # an exact layer: its log-det is that of this very map
            mean, w, n = self._split(inputs, mask)
            y = (inputs - mean) @ self.deviation.matrix()
            if self.mean is not None:
                y = y + mean @ self.mean.matrix()
            y = w * y + (1 - w) * inputs
            return y, self._logdet(n)

    def inverse(self, inputs: Tensor, context=None) -> tuple[Tensor, Tensor]:
        mask = checked_inputs(inputs, context, self, self.dim)
        with full_precision(inputs):
            mean, w, n = self._split(inputs, mask)
            x = self.deviation.solve_right(inputs - mean)
            if self.mean is not None:
                x = x + self.mean.solve_right(mean)
            x = w * x + (1 - w) * inputs
            return x, -self._logdet(n)


def size_features(n: Tensor) -> Tensor:
    """Context of the centroid flow for sets of ``n`` present elements, shape (B, 2).

    The centroid of n exchangeable elements fluctuates on a scale proportional to 1/sqrt(n),
    so the flow sees (1/sqrt(n), log n).
    """
    n = n.clamp_min(1)
    return torch.stack([n.rsqrt(), n.log()], dim=-1)


def _spline_flow(dim: int, layers: int, hidden: int, bins: int, tail_bound: float) -> Transform:
    steps: list[Transform] = [_CentroidActNorm(dim)]
    for _ in range(layers):
        steps.append(
            _AutoregressiveSpline(
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


class _AutoregressiveSpline(MaskedPiecewiseRationalQuadraticAutoregressiveTransform):
    """nflows' masked autoregressive spline transform (its parameters, state and conditioner),
    with the spline evaluated by :func:`~flowattn.flows.splines.rational_quadratic`: the same
    values, and nothing read back from the device."""

    def _elementwise(self, inputs: Tensor, autoregressive_params: Tensor,
                     inverse: bool = False) -> tuple[Tensor, Tensor]:
        params = autoregressive_params.view(*inputs.shape, self._output_dim_multiplier())
        k = self.num_bins  # (nflows scales by the width only for conditioners other than MADE)
        outputs, logslope = rational_quadratic(inputs, params[..., :k], params[..., k:2 * k],
                                               params[..., 2 * k:], self.tail_bound, inverse)
        return outputs, logslope.sum(dim=-1)


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

    @torch.no_grad()
    def initialise(self, x: Tensor, mask: Tensor | None = None) -> None:
        """Initialise the default f's ActNorm from the centroids of the sets ``x`` (B, N, D).

        Without this call it is initialised on the first training batch, from one centroid per
        set: a batch of 2 sets (all that fits at N = 1000-10,000) gives a scale from 2 numbers,
        and a held-out centroid may then lie hundreds of those scales away. Does nothing for a
        custom f or an ActNorm that is already initialised.

        Examples:
            >>> loc = SetLocation(2)
            >>> x = 3 + 0.1 * torch.randn(64, 5, 2)  # centroids near 3, spread 0.1 / sqrt(5)
            >>> loc.initialise(x)
            >>> centres = loc.centroid_flow._transforms[0](x.mean(1))[0]
            >>> moments = centres.mean(0).tolist() + centres.var(0, correction=0).tolist()
            >>> [round(v, 4) + 0.0 for v in moments]  # mean 0, variance 1
            [0.0, 0.0, 1.0, 1.0]
        """
        first = getattr(self.centroid_flow, "_transforms", [None])[0]
        if not isinstance(first, _CentroidActNorm) or not first._needs_initialisation():
            return
        mask = check_sets(x, mask, dim=self.dim)
        first._initialize(self._centroid(x, mask)[0])

    def _centroid(self, x: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        w = present_weights(x, mask).unsqueeze(-1)
        n = w.sum(dim=(1, 2))  # check_sets has ruled out empty sets
        return (x * w).sum(dim=1) / n.unsqueeze(-1), n, w

    def _move(self, x: Tensor, context, direction: str) -> tuple[Tensor, Tensor]:
        mask = checked_inputs(x, context, self, self.dim)
        with full_precision(x):  # an exact layer (splines with their own log-dets)
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
