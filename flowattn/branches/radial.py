r"""A contractive, E(n)-equivariant pairwise interaction of set elements (particles).

Each element moves along the lines to the others by a learned function of their distance,

    g(X)_i = (1/n) sum_j psi(d_ij) (x_i - x_j) / d_ij,    d_ij = ||x_i - x_j||_2,

with psi(0) = 0. The Jacobian of the radial field h(r) = psi(|r|) r/|r| of R^D has eigenvalues
psi'(d) (along r) and psi(d)/d (across it), both at most L = sup |psi'| in size. The Jacobian of
g is a graph Laplacian with the symmetric matrix weights J_h(x_i - x_j) / n, so for any v

    |v^T J_g v| = (1/n) |sum_{i<j} (v_i - v_j)^T J_h (v_i - v_j)| <= (L/n) sum_{i<j} |v_i - v_j|^2
               <= L |v|^2,

and Lip(g) <= L in the 2-norm, for every set size n. Dividing psi by a certified bound on
sup |psi'| makes x + g(x) an invertible residual block whose bound is tight for near-uniform
interactions, unlike a product of weight norms. The field commutes with rotations,
reflections, translations and permutations, and h is odd, so sum_i g(X)_i = 0: the centre of
mass is preserved, as particle systems need.

psi' is a combination of K Gaussian bumps on a grid of distances, so psi has a closed form in
erf and the bound is exact arithmetic, not an estimate.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..errors import InputError
from ..validation import present_weights

__all__ = ["RadialInteraction"]


class RadialInteraction(nn.Module):
    r"""Contractive branch g(X)_i = (1/n) sum_j psi(d_ij) (x_i - x_j) / d_ij for sets of points.

    psi'(d) = sum_k w_k exp(-(d - mu_k)^2 / (2 s^2)) with centres mu_k = k r_max / (K - 1) and
    width s = r_max / (K - 1), so psi(d) = s sqrt(pi/2) sum_k w_k [erf((d - mu_k)/(s sqrt 2)) +
    erf(mu_k/(s sqrt 2))]. The certified bound on sup|psi'| is min(||w||_1, ||w||_inf S), where
    S bounds sum_k exp(-(d - mu_k)^2 / (2 s^2)) for every d; the weights are scaled down
    whenever that bound exceeds ``coeff``. Use it as the branch of an
    :class:`~flowattn.flows.InvertibleResidual` (it has ``lipschitz_bound`` and ``norm = "2"``).

    Arguments:
        coeff: the Lipschitz coefficient c < 1 of the branch.
        basis: K, the number of Gaussian bumps.
        r_max: the largest bump centre; beyond it psi' decays to zero.
        max_slope: ``None`` for a contractive branch (|psi'| <= coeff). A number u switches to
            the monotone mode -coeff <= psi' <= u, for :class:`~flowattn.flows.MonotoneResidual`:
            x + g(x) is then the gradient of a strongly convex potential, invertible with
            expansions up to 1 + u.

    Examples:
        >>> from flowattn.flows import InvertibleResidual, LogDetOptions
        >>> branch = RadialInteraction(coeff=0.9)
        >>> block = InvertibleResidual(branch, logdet=LogDetOptions("exact")).eval()
        >>> x = torch.randn(3, 4, 2)
        >>> y, logdet = block(x)
        >>> bool((block.inverse(y)[0] - x).abs().max() < 1e-4)
        True
    """

    norm = "2"

    def __init__(self, coeff: float = 0.9, basis: int = 64, r_max: float = 4.0,
                 max_slope: float | None = None) -> None:
        super().__init__()
        if not 0 < coeff < 1:
            raise InputError(f"coeff must lie in (0, 1), got {coeff}")
        if basis < 2 or not (math.isfinite(r_max) and r_max > 0):
            raise InputError(f"need basis >= 2 and r_max > 0, got {basis}, {r_max}")
        if max_slope is not None and not (math.isfinite(max_slope) and max_slope > 0):
            raise InputError(f"max_slope must be a positive number or None, got {max_slope}")
        self.coeff = float(coeff)
        self.max_slope = None if max_slope is None else float(max_slope)
        self.width = r_max / (basis - 1)
        self.register_buffer("centres", torch.linspace(0.0, r_max, basis))
        self.weight = nn.Parameter(0.01 * torch.randn(basis))
        # The grid spacing equals the width, so the bumps sum to at most theta(t) =
        # sum_m exp(-(m + t)^2 / 2) over all integers m, t the offset from a grid point. By
        # Poisson summation theta(t) = sqrt(2 pi) (1 + 2 sum_k exp(-2 pi^2 k^2) cos(2 pi k t)),
        # largest at t = 0.
        # The centres are stored in the working precision, so their spacing can differ from the
        # width by a relative 1e-7 (float32); the factor 1 + 1e-4 covers what that does to theta.
        theta = 1.0 + sum(2 * math.exp(-0.5 * m * m) for m in range(1, 40))
        self.bump_sum_bound = theta * (1 + 1e-4)

    def _dpsi_bound(self, w: Tensor) -> Tensor:
        """Certified bound on sup |psi'| for bump weights ``w``."""
        w = w.abs()
        return torch.minimum(w.sum(), w.amax() * self.bump_sum_bound)

    def effective_weight(self) -> Tensor:
        """w scaled so that the certified bound on sup |psi'| is at most ``coeff``.

        With ``max_slope`` (monotone mode) the negative weights are scaled so that
        -psi' <= ``coeff`` and the positive ones so that psi' <= ``max_slope``.
        """
        w = self.weight
        if self.max_slope is None:
            bound = self._dpsi_bound(w).clamp_min(1e-12)
            return w * torch.clamp(self.coeff / bound, max=1.0)
        up, down = w.clamp(min=0.0), w.clamp(max=0.0)
        up = up * torch.clamp(self.max_slope / self._dpsi_bound(up).clamp_min(1e-12), max=1.0)
        return up + down * torch.clamp(self.coeff / self._dpsi_bound(down).clamp_min(1e-12),
                                       max=1.0)

    def spectrum(self) -> tuple[Tensor, Tensor]:
        """(l, u): the Jacobian's eigenvalues lie in [-l, u], for every set size.

        v^T J_g v = (1/n) sum_{i<j} (v_i - v_j)^T J_h (v_i - v_j) and the eigenvalues of J_h lie
        in [inf psi', sup psi'] (psi(d)/d is a mean of psi'), while
        sum_{i<j} |v_i - v_j|^2 <= n |v|^2.
        """
        w = self.effective_weight()
        both = self._dpsi_bound(w)
        lower = torch.minimum(self._dpsi_bound(w.clamp(max=0.0)), both)
        upper = torch.minimum(self._dpsi_bound(w.clamp(min=0.0)), both)
        return lower, upper

    def lipschitz_bound(self, n: int | None = None) -> Tensor:
        """Certified Lipschitz constant in the 2-norm (independent of the set size n).

        In monotone mode it may exceed 1: wrap the branch in a
        :class:`~flowattn.flows.MonotoneResidual`, which needs only ``spectrum``'s l < 1.
        """
        return torch.maximum(*self.spectrum())

    def psi(self, d: Tensor) -> Tensor:
        """psi(d) = int_0^d psi'(t) dt, closed form."""
        return self._profile(d, slope=False)[0]

    def dpsi(self, d: Tensor) -> Tensor:
        """psi'(d), the sum of Gaussian bumps."""
        return self._profile(d, value=False)[1]

    def _profile(self, d: Tensor, value: bool = True,
                 slope: bool = True) -> tuple[Tensor | None, Tensor | None]:
        """(psi(d), psi'(d)) from one evaluation of the K bumps' argument z_k = (d - mu_k) /
        (s sqrt 2): psi = s sqrt(pi/2) (sum_k w_k erf(z_k) + sum_k w_k erf(mu_k / (s sqrt 2)))
        and psi' = sum_k w_k exp(-z_k^2), each a matrix-vector product over the bumps."""
        w = self.effective_weight().to(d)
        c = self.centres.to(d)
        root2s = math.sqrt(2.0) * self.width
        z = (d[..., None] - c) / root2s
        psi = dpsi = None
        if value:
            offset = torch.erf(c / root2s) @ w
            psi = self.width * math.sqrt(math.pi / 2) * (torch.erf(z) @ w + offset)
        if slope:
            dpsi = torch.exp(-z * z) @ w
        return psi, dpsi

    def _pairs(self, x: Tensor, mask: Tensor | None):
        """Each unordered pair i < j once: its indices (P,), x_i - x_j (B, P, D), |x_i - x_j|^2
        and the distance (B, P), the weight c_ij = 1/n of present pairs (B, P), and eps (the
        distance is clamped at eps)."""
        first, second = torch.triu_indices(x.shape[1], x.shape[1], 1, device=x.device)
        diff = x[:, first] - x[:, second]
        eps = torch.finfo(x.dtype).eps ** 0.5
        sq = diff.pow(2).sum(-1)
        dist = sq.clamp_min(eps * eps).sqrt()
        present = present_weights(x, mask)
        n = present.sum(1, keepdim=True).clamp_min(1.0)
        weight = present[:, first] * present[:, second] / n
        return (first, second), diff, sq, dist, weight, eps

    def jacobian(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        r"""The exact Jacobian dg_i/dx_k, shape (B, N, D, N, D), in closed form.

        J_h(r) = psi'(d) r̂ r̂ᵀ + (psi(d)/d)(I - r̂ r̂ᵀ), and dg_i/dx_k = delta_ik sum_j
        c_ij J_h(x_i - x_j) - c_ik J_h(x_i - x_k) with c_ij = 1/n for present pairs. One pass
        over the pairs instead of N D backward passes: the residual block uses it for its exact
        log-determinant. J_h is even in r, so each unordered pair is evaluated once.
        """
        (first, second), diff, sq, dist, c, eps = self._pairs(x, mask)
        psi, along = self._profile(dist)
        across = psi / dist
        # below eps the field is the linear map (psi(eps)/eps) r, isotropic
        along = torch.where(sq < eps * eps, across, along)
        unit = diff / dist[..., None]
        outer = unit[..., :, None] * unit[..., None, :]  # (B, P, D, D)
        eye = torch.eye(x.shape[-1], dtype=x.dtype, device=x.device)
        pair = (c * along)[..., None, None] * outer + (c * across)[..., None, None] * (eye - outer)
        B, N, D = x.shape
        jh = x.new_zeros(B, N, N, D, D)
        jh[:, first, second] = pair
        jh[:, second, first] = pair
        diag = torch.diag_embed(jh.sum(2).transpose(-3, -1)).permute(0, 3, 1, 4, 2)
        return diag - jh.permute(0, 1, 3, 2, 4)

    def forward(self, x: Tensor, mask: Tensor | None = None, causal: bool = False) -> Tensor:
        if causal:
            raise InputError("RadialInteraction acts on sets; a causal mask would break the "
                             "symmetric Jacobian its bound relies on")
        (first, second), diff, _, dist, c, _ = self._pairs(x, mask)
        psi, _ = self._profile(dist, slope=False)
        force = (c * psi / dist)[..., None] * diff  # the pull of j on i; i's on j is its negative
        return x.new_zeros(x.shape).index_add(1, first, force).index_add(1, second, -force)
