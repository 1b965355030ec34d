r"""A contractive, E(n)-equivariant many-body interaction: the gradient of an embedding potential.

Each element gets soft counts of its neighbours in C distance shells,

    s_i^c = (1/n) sum_{j != i} phi_c(rho_ij),    phi_c(rho) = exp(-(rho - mu_c)^2 / (2 w^2)),

with the smoothed distance rho_ij = sqrt(d_ij^2 + w^2) (smooth at d = 0, and rho >= w keeps
phi_c'(rho) / rho bounded), and the branch is the gradient of the potential
U(X) = (1/2) sum_i F(s_i) of a learned embedding function F: R^C -> R (the form of an
embedded-atom potential):

    g(X)_i = dU/dx_i = (1/n) sum_j psi_ij (x_i - x_j),
    psi_ij = sum_c (1/2) (dF/ds_c(s_i) + dF/ds_c(s_j)) phi_c'(rho_ij) / rho_ij.

A pair pushes or pulls with a strength that depends on the neighbourhoods of both its elements:
the many-body coupling that a sum of pair terms (:class:`RadialInteraction`) lacks. The Jacobian
of g is the Hessian of U, a symmetric matrix, so Lip_2(g) = sup ||Hess U||_2, and

    ||Hess U||_2 <= sup_r sum_c |dF/ds_c| ||Hess phi_c(r)||_2
                    + ||Hess F||_2 sup_r sum_c |grad phi_c(r)|^2

for every set size n: the first term bounds the weighted graph Laplacians of the Hessians of the
s_i as in :mod:`flowattn.branches.radial`, the second bounds (1/2) sum_i (ds_i)^T Hess F (ds_i) by
Cauchy-Schwarz and sum_i sum_j |v_i - v_j|^2 <= 2 n |v|^2. Both sups over r are sums of shifted
copies of one profile (the shells are w apart), bounded once (at import) by a fine grid over the
shift plus a Lipschitz margin. Dividing U by the bound when it exceeds ``coeff`` makes x + g(x)
an invertible residual block. psi_ij = psi_ji and x_i - x_j is odd, so sum_i g(X)_i = 0: the
centre of mass is preserved.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..errors import InputError
from ..validation import present_weights

__all__ = ["NeighbourhoodInteraction"]

# sup |tanh''| = 4 / (3 sqrt 3), at tanh(z) = 1 / sqrt 3
_TANH_CURVATURE = 4.0 / (3.0 * math.sqrt(3.0))


def _hessian_profile(u: Tensor) -> Tensor:
    """w^2 ||Hess phi(r)|| <= max(|u^2 - 1|, |u|) exp(-u^2/2), u = (rho - mu) / w."""
    return torch.maximum((u * u - 1).abs(), u.abs()) * torch.exp(-0.5 * u * u)


def _gradient_profile(u: Tensor) -> Tensor:
    """w^2 |grad phi(r)|^2 <= u^2 exp(-u^2)."""
    return u * u * torch.exp(-u * u)


def _shifted_sum_bound(profile, lipschitz: float, steps: int = 10000, reach: int = 12) -> float:
    """Certified sup over t of sum_m profile(m + t), m over all integers.

    The sum is 1-periodic in t; it is evaluated on a grid of ``steps`` points of [0, 1] and
    increased by the grid's worst case, ``lipschitz`` (a bound on the sum's slope) times half
    the spacing. The terms beyond |m| = ``reach`` are below exp(-reach^2 / 4) and added.
    """
    # on the host whatever the default device (the module may first be imported under
    # torch.device("meta"), where a model's size is counted)
    t = torch.linspace(0.0, 1.0, steps + 1, dtype=torch.float64, device="cpu")
    m = torch.arange(-reach, reach + 1, dtype=torch.float64, device="cpu")
    total = profile(m[:, None] + t[None, :]).sum(0).max().item()
    return total + lipschitz * 0.5 / steps + 2 * math.exp(-reach * reach / 4)


# Slopes: |d/du profile| <= 1.5 per unit of u for both, so the shifted sums (about three terms
# of size above exp(-2) per period) change by at most 10 per unit of t: a generous margin, which
# also covers the centres' rounding to the working precision (shifts of about 1e-7 w).
_HESSIAN_SUM = _shifted_sum_bound(_hessian_profile, lipschitz=10.0)
_GRADIENT_SUM = _shifted_sum_bound(_gradient_profile, lipschitz=10.0)


class NeighbourhoodInteraction(nn.Module):
    r"""Contractive branch g = grad U, U(X) = (1/2) sum_i F(s_i), s_i soft neighbour counts.

    The embedding function is F(s) = v^T s + sum_m a_m tanh(b_m^T s + e_m). The counts lie in
    [0, 1]^C, so each z_m = b_m^T s + e_m lies in a known interval, on which tanh' <= tau_m and
    |tanh''| <= kappa_m (at most 1 and 4 / (3 sqrt 3)); then
    |dF/ds_c| <= |v_c| + sum_m |a_m| tau_m |b_mc| =: S_c and
    ||Hess F||_2 <= lambda_max(B^T diag(kappa |a|) B). With the shell profiles,
    sup_r sum_c S_c ||Hess phi_c|| <= min(sum_c S_c, A max_c S_c) / w^2 and
    sup_r sum_c |grad phi_c|^2 <= min(C / e, G) / w^2, where A ~ 3.2 and G ~ 0.9 bound the sums
    over shells of the two profiles: the certificate is exact arithmetic on the weights. Use it
    as the branch of an :class:`~flowattn.flows.InvertibleResidual` (it has ``lipschitz_bound``,
    ``norm = "2"`` and a closed-form ``jacobian``).

    Arguments:
        coeff: the Lipschitz coefficient c < 1 of the branch.
        channels: C >= 2, the number of shells, centred at mu_c evenly spaced on [0, r_max].
        hidden: the number of tanh units of F.
        r_max: the centre of the outermost shell; the shells' width w is r_max / (C - 1).

    Examples:
        >>> from flowattn.flows import InvertibleResidual, LogDetOptions
        >>> branch = NeighbourhoodInteraction(coeff=0.9)
        >>> block = InvertibleResidual(branch, logdet=LogDetOptions("exact")).eval()
        >>> x = torch.randn(3, 4, 2)
        >>> y, logdet = block(x)
        >>> bool((block.inverse(y)[0] - x).abs().max() < 1e-4)
        True
    """

    norm = "2"

    def __init__(self, coeff: float = 0.9, channels: int = 8, hidden: int = 32,
                 r_max: float = 4.0) -> None:
        super().__init__()
        if not 0 < coeff < 1:
            raise InputError(f"coeff must lie in (0, 1), got {coeff}")
        if channels < 2 or hidden < 1 or not (math.isfinite(r_max) and r_max > 0):
            raise InputError(f"need channels >= 2, hidden >= 1 and r_max > 0, got {channels}, "
                             f"{hidden}, {r_max}")
        self.coeff = float(coeff)
        self.width = r_max / (channels - 1)
        self.register_buffer("centres", torch.linspace(0.0, r_max, channels))
        self.linear = nn.Parameter(0.01 * torch.randn(channels))
        self.in_weight = nn.Parameter(torch.randn(hidden, channels))
        self.in_bias = nn.Parameter(torch.randn(hidden))
        self.out_weight = nn.Parameter(0.01 * torch.randn(hidden))

    # -- the certificate ------------------------------------------------------------------------
    def _unit_bounds(self) -> tuple[Tensor, Tensor]:
        """sup |tanh'| and sup |tanh''| of each unit over the counts' range s in [0, 1]^C.

        Each shell count is a mean of values in (0, 1], so z_m = b_m^T s + e_m lies in
        [e_m + sum_c min(b_mc, 0), e_m + sum_c max(b_mc, 0)]; tanh' peaks at 0 and |tanh''| at
        +-z*, and both fall off monotonically away from their peaks.
        """
        low = self.in_bias + self.in_weight.clamp(max=0.0).sum(1)
        high = self.in_bias + self.in_weight.clamp(min=0.0).sum(1)
        nearest_zero = torch.clamp(torch.zeros_like(low), min=low, max=high)
        slope = 1 - torch.tanh(nearest_zero) ** 2
        peak = math.atanh(1 / math.sqrt(3.0))

        def curvature(z: Tensor) -> Tensor:
            t = torch.tanh(z)
            return 2 * t.abs() * (1 - t * t)

        covers_peak = ((low <= peak) & (high >= peak)) | ((low <= -peak) & (high >= -peak))
        ends = torch.maximum(curvature(low), curvature(high))
        return slope, torch.where(covers_peak, torch.full_like(ends, _TANH_CURVATURE), ends)

    def _raw_bound(self) -> Tensor:
        tanh_slope, tanh_curvature = self._unit_bounds()
        a = self.out_weight.abs()
        slope = self.linear.abs() + (a * tanh_slope) @ self.in_weight.abs()  # >= sup |dF/ds_c|
        gram = self.in_weight.T @ ((a * tanh_curvature)[:, None] * self.in_weight)
        curvature = torch.linalg.eigvalsh(gram)[-1].clamp_min(0.0)  # >= sup ||Hess F||
        channels = slope.numel()
        hessians = torch.minimum(slope.sum(), _HESSIAN_SUM * slope.amax())
        gradients = min(channels / math.e, _GRADIENT_SUM)
        return (hessians + curvature * gradients) / self.width**2

    def scale(self) -> Tensor:
        """t = min(1, coeff / bound): the branch is t grad U."""
        return torch.clamp(self.coeff / self._raw_bound().clamp_min(1e-12), max=1.0)

    def lipschitz_bound(self, n: int | None = None) -> Tensor:
        """Certified Lipschitz constant in the 2-norm (independent of the set size n)."""
        return self.scale() * self._raw_bound()

    # -- the potential --------------------------------------------------------------------------
    def _embedding(self, s: Tensor) -> tuple[Tensor, Tensor]:
        """dF/ds (..., C) and Hess F (..., C, C) at s (..., C)."""
        b = self.in_weight.to(s)
        a = self.out_weight.to(s)
        th = torch.tanh(s @ b.T + self.in_bias.to(s))
        slope = self.linear.to(s) + (a * (1 - th**2)) @ b
        curv = a * (-2.0 * th * (1 - th**2))  # a_m tanh''(z_m)
        return slope, torch.einsum("...m,mc,md->...cd", curv, b, b)

    def _pairs(self, x: Tensor, mask: Tensor | None):
        """x_i - x_j, and per shell phi_c, phi_c'/rho and phi_c''(rho), each weighted by 1/n."""
        diff = x[:, :, None] - x[:, None, :]  # (B, N, N, D): x_i - x_j
        w2 = self.width**2
        rho = (diff.pow(2).sum(-1) + w2).sqrt()[..., None]  # (B, N, N, 1)
        u = (rho - self.centres.to(x)) / self.width  # (B, N, N, C)
        present = present_weights(x, mask)
        n = present.sum(1).clamp_min(1.0)[:, None, None]
        off_diagonal = 1.0 - torch.eye(x.shape[1], dtype=x.dtype, device=x.device)
        weight = (present[:, :, None] * present[:, None, :] * off_diagonal / n)[..., None]
        phi = torch.exp(-0.5 * u * u) * weight
        d_phi = -u / self.width * phi  # phi'(rho) / n
        dd_phi = (u * u - 1) / w2 * phi  # phi''(rho) / n
        return diff, rho, phi, d_phi / rho, dd_phi

    def forward(self, x: Tensor, mask: Tensor | None = None, causal: bool = False) -> Tensor:
        if causal:
            raise InputError("NeighbourhoodInteraction acts on sets; a causal mask would break "
                             "the symmetric Jacobian its bound relies on")
        diff, _, phi, radial, _ = self._pairs(x, mask)
        slope, _ = self._embedding(phi.sum(2))  # at s_i = (1/n) sum_j phi(rho_ij)
        pair_slope = 0.5 * (slope[:, :, None] + slope[:, None, :])  # (B, N, N, C)
        psi = (pair_slope * radial).sum(-1)  # (B, N, N), with the 1/n weights
        return self.scale().to(x) * (psi[..., None] * diff).sum(2)

    def jacobian(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        r"""The exact Jacobian dg_i/dx_k = t Hess U, shape (B, N, D, N, D), in closed form.

        Hess U = sum_{i<j} (graph Laplacian of A_ij) + (1/2) sum_i G_i^T Hess F(s_i) G_i with
        A_ij = (1/n) sum_c m_ij^c Hess phi_c(r_ij), Hess phi(r) = (phi'/rho) I +
        (phi'' - phi'/rho) r r^T / rho^2, m_ij^c = (1/2)(dF/ds_c(s_i) + dF/ds_c(s_j)),
        r = x_i - x_j, and G_i^c = grad s_i^c.
        """
        diff, rho, phi, radial, dd_phi = self._pairs(x, mask)
        slope, hess_f = self._embedding(phi.sum(2))
        pair_slope = 0.5 * (slope[:, :, None] + slope[:, None, :])
        iso = (pair_slope * radial).sum(-1)  # sum_c m_c phi_c' / rho
        aniso = (pair_slope * (dd_phi - radial) / rho**2).sum(-1)
        B, N, D = x.shape
        eye = torch.eye(D, dtype=x.dtype, device=x.device)
        outer = diff[..., :, None] * diff[..., None, :]
        pair = aniso[..., None, None] * outer + iso[..., None, None] * eye  # A_ij (B,N,N,D,D)
        laplacian = _with_diagonal(pair.sum(2), -pair.permute(0, 1, 3, 2, 4))
        # grad_{x_k} s_i^c = delta_ik S_i^c - Q_i^c,k with Q_i^c,k = P_ik^c = (phi_c'/rho)(x_i -
        # x_k)/n and S_i^c = sum_k Q_i^c,k; then (1/2) sum_i G_i^T Hess F(s_i) G_i expands into
        # sum_i Q_i^T H_i Q_i (one product over the N C rows of all the Q_i), the cross terms
        # -S_i^T H_i Q_i in block row i (and their transposes in block column i), and
        # S_i^T H_i S_i on the diagonal, with H_i = Hess F(s_i) / 2
        C = radial.shape[-1]
        q = radial.transpose(2, 3)[..., None] * diff[:, :, None]  # (B, N_i, C, N_k, D)
        total = q.sum(3)  # S_i (B, N, C, D)
        q = q.reshape(B, N, C, N * D)
        hq = (0.5 * hess_f) @ q  # H_i Q_i (B, N, C, N D)
        embedding = q.reshape(B, N * C, N * D).transpose(1, 2) @ hq.reshape(B, N * C, N * D)
        cross = total.transpose(2, 3) @ hq  # S_i^T H_i Q_i (B, N_i, D, N D)
        inner = total.transpose(2, 3) @ (0.5 * hess_f) @ total  # S_i^T H_i S_i (B, N, D, D)
        embedding = embedding.reshape(B, N, D, N, D) - cross.reshape(B, N, D, N, D)
        embedding = embedding - cross.reshape(B, N, D, N, D).permute(0, 3, 4, 1, 2)
        embedding = _with_diagonal(inner, embedding)
        return self.scale().to(x) * (laplacian + embedding)


def _with_diagonal(diagonal: Tensor, rest: Tensor) -> Tensor:
    """``rest`` (B, N, *S, N, D) plus delta_ik ``diagonal`` (B, N, *S, D) at [:, i, ..., k, :]."""
    out = rest.clone()
    # the diagonal over the two set dimensions is a view of shape (B, *S, D, N)
    out.diagonal(0, 1, -2).add_(diagonal.movedim(1, -1))
    return out
