r"""Pair splines: every pair of particles pushed apart or together by a monotone radial spline.

A residual block moves a pair's distance by a bounded factor (a monotone radial block squeezes
a pair by at most 1 - 2c/n), so a flow of them cannot map a hard core, a gap in the pair
distances that the data never enter, onto a Gaussian's short distances. A pair spline can: it
moves one pair (a, b) at a time, keeping its midpoint and the other particles,

.. math:: x_a' = m + \tfrac12 \rho(r) \hat d, \quad x_b' = m - \tfrac12 \rho(r) \hat d,
    \qquad m = \tfrac12 (x_a + x_b),\ d = x_a - x_b,\ r = \|d\|,\ \hat d = d / r,

with ρ a monotone bijection of (0, ∞) given by a rational-quadratic spline S of log r,
ρ(r) = exp(S(log r)), the identity outside [e^{-B}, e^{B}]. On R^D the map d ↦ ρ(r) d̂ has

.. math:: \log|\det J| = \log \rho'(r) + (D - 1) \log \frac{\rho(r)}{r}
    = \log S'(\log r) + D\,(S(\log r) - \log r),

and (x_a, x_b) ↦ (m, d) is linear, so that is the pair's whole log-determinant; the inverse
solves the spline in closed form. A layer runs one round-robin tournament: the n particles meet
in n - 1 rounds (n rounds for odd n, one particle resting in each), the pairs of a round are
disjoint and move together, and every pair moves once. The midpoints stay, so the centre of
mass does, and the map commutes with rotations, reflections and translations. It does not
commute with permutations: the rounds follow the particles' order, so a flow with pair splines
has a density that is E(n)-invariant but not exactly exchangeable.
"""

from __future__ import annotations

import functools
import math

import torch
from nflows.transforms import Transform
from torch import Tensor, nn

from ..errors import InputError
from .geometry import checked_inputs, full_precision
from .splines import UNIT_SLOPE, rational_quadratic

__all__ = ["PairSplines", "round_robin"]

@functools.lru_cache(maxsize=64)
def _schedule(n: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    seats = n + n % 2  # odd n: one extra seat, whose partner rests in that round
    others = list(range(1, seats))
    rounds = []
    for _ in range(seats - 1):
        table = [0, *others]
        pairs = [(table[i], table[seats - 1 - i]) for i in range(seats // 2)]
        rounds.append(tuple((a, b) for a, b in pairs if max(a, b) < n))
        others = others[-1:] + others[:-1]  # the circle method: every seat but the first turns
    return tuple(rounds)


def round_robin(n: int) -> list[list[tuple[int, int]]]:
    """The rounds of a round-robin tournament of ``n`` players (the circle method).

    Every pair (a, b), a != b, meets in exactly one round, and the pairs of a round are disjoint:
    n - 1 rounds of n / 2 pairs for even n, n rounds of (n - 1) / 2 pairs for odd n.

    Examples:
        >>> round_robin(4)
        [[(0, 3), (1, 2)], [(0, 2), (3, 1)], [(0, 1), (2, 3)]]
        >>> sum(len(r) for r in round_robin(13)), len(round_robin(13))
        (78, 13)
    """
    if n < 1:
        raise InputError(f"a tournament needs at least one player, got n={n}")
    return [list(r) for r in _schedule(n)]


class PairSplines(Transform):
    r"""Every pair of particles moved along its axis by a monotone spline of its log-distance.

    One learnt spline S on [-B, B] (``bins`` rational-quadratic bins, linear tails, so the
    identity outside) maps s = log r to S(s); pair (a, b) keeps its midpoint and gets the
    distance ρ(r) = exp(S(log r)). The pairs move in the rounds of :func:`round_robin`, so
    every pair moves once and a pair's distance is taken after the rounds before it. The layer
    starts as the identity.

    log|det J| = sum over the pairs of log S'(s) + D (S(s) - s), exact, with the inverse in
    closed form (the rounds in reverse). Pairs with a padded element stay, and enter neither the
    map nor the log-det. Coincident particles (r = 0) stay where they are: ρ is the identity
    below e^{-B}.

    Arguments:
        dim: the particles' dimension D.
        bins: spline bins.
        bound: B, the spline acts on distances in [e^{-B}, e^{B}] (in the units of its input).

    Examples:
        >>> layer = PairSplines(3).double()
        >>> x = torch.randn(2, 5, 3, dtype=torch.float64)
        >>> y, logdet = layer(x)
        >>> bool(torch.allclose(y, x)), bool(logdet.abs().max() < 1e-6)  # starts as identity
        (True, True)
        >>> with torch.no_grad():
        ...     _ = layer.heights.normal_(0, 0.5)
        >>> y, logdet = layer(x)
        >>> x_back, logdet_back = layer.inverse(y)
        >>> bool((x_back - x).abs().max() < 1e-12)
        True
        >>> bool((logdet + logdet_back).abs().max() < 1e-12)
        True
    """

    def __init__(self, dim: int, bins: int = 8, bound: float = 3.0) -> None:
        super().__init__()
        if dim < 1 or bins < 1:
            raise InputError(f"dim and bins must be positive, got dim={dim}, bins={bins}")
        if not (math.isfinite(bound) and bound > 0):
            raise InputError(f"bound must be positive, got {bound}")
        self.dim, self.bins, self.bound = dim, bins, float(bound)
        self.widths = nn.Parameter(torch.zeros(bins))
        self.heights = nn.Parameter(torch.zeros(bins))
        self.derivatives = nn.Parameter(torch.full((bins - 1,), UNIT_SLOPE))
        self._rounds: dict[tuple[int, torch.device], list[Tensor]] = {}

    def _pairs(self, n: int, device: torch.device) -> list[Tensor]:
        """The rounds for n particles as index tensors (P, 2) on ``device``, made once: no
        copy to the device in a training step."""
        key = (n, device)
        if key not in self._rounds:
            self._rounds[key] = [torch.tensor(r, device=device) for r in _schedule(n) if r]
        return self._rounds[key]

    def _move(self, inputs: Tensor, context, inverse: bool) -> tuple[Tensor, Tensor]:
        mask = checked_inputs(inputs, context, self, self.dim)
        batch, n = inputs.shape[:2]
        rounds = self._pairs(n, inputs.device)
        x = inputs
        logdet = inputs.new_zeros(batch)
        floor = math.exp(-self.bound)  # below it the spline is the identity
        with full_precision(inputs):
            for index in reversed(rounds) if inverse else rounds:  # index: (P, 2)
                a, b = x[:, index[:, 0]], x[:, index[:, 1]]  # (B, P, D)
                d = a - b
                r = torch.linalg.vector_norm(d, dim=-1)  # (B, P)
                # clamped: log stays finite at r = 0, with gradient 0 where the map is the identity
                s = torch.log(r.clamp_min(floor))
                shape = s.shape + (self.bins,)
                s_new, log_slope = rational_quadratic(
                    s, self.widths.expand(shape), self.heights.expand(shape),
                    self.derivatives.expand(shape[:-1] + (self.bins - 1,)), self.bound, inverse)
                gain = torch.exp(s_new - s)
                pair_logdet = log_slope + self.dim * (s_new - s)
                if mask is not None:
                    present = mask[:, index[:, 0]] & mask[:, index[:, 1]]
                    gain = torch.where(present, gain, torch.ones_like(gain))
                    pair_logdet = torch.where(present, pair_logdet, torch.zeros_like(s))
                half = 0.5 * d * (gain - 1).unsqueeze(-1)  # each end moves by half the change
                x = x.index_add(1, index[:, 0], half).index_add(1, index[:, 1], -half)
                logdet = logdet + pair_logdet.sum(dim=1)
        return x, logdet

    def forward(self, inputs: Tensor, context=None) -> tuple[Tensor, Tensor]:
        return self._move(inputs, context, inverse=False)

    def inverse(self, inputs: Tensor, context=None) -> tuple[Tensor, Tensor]:
        return self._move(inputs, context, inverse=True)
