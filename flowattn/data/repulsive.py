"""Sets of points that repel each other softly, with an exact normaliser and an exact sampler.

A set of n points x_1..x_n in R^D has density (strength a in (0, 1], range l, spread sigma)

    p(X) = (1/Z_n) prod_i N(x_i; 0, sigma^2 I) prod_{i<j} phi(||x_i - x_j||),
    phi(d) = 1 - a exp(-d^2 / (2 l^2)),

so two points closer than about l are unlikely (impossible to coincide when a = 1), and no
Gaussian, centroid or linear model can express it. Since 0 <= phi <= 1:

* **Sampling is exact** by rejection: draw the points i.i.d. from N(0, sigma^2 I) and accept
  with probability prod_{i<j} phi(d_ij); the acceptance rate is Z_n.
* **The normaliser is exact** (no estimate): expanding the product over the pairs of K_n,
  prod_{i<j} (1 - a e_ij) = sum_{G subset of edges} (-a)^|G| prod_{(i,j) in G} e_ij, and every
  term is a Gaussian integral, sum_{(i,j) in G} ||x_i - x_j||^2 = sum_c x_c^T L_G x_c with L_G the
  graph Laplacian and x_c one coordinate of all points:

      Z_n = sum_G (-a)^|G| det(I_n + (sigma^2 / l^2) L_G)^(-D/2)

  (2^(n (n - 1) / 2) graphs: 32768 for n = 6; sizes up to 6 are allowed).
* **The one-point marginal is exact** the same way. With K = L_G / l^2 split into the point
  (index 1) and the rest (r), integrating the rest out of one term gives a Gaussian in x_1:

      p̄_n(x) = N(x; 0, sigma^2 I) / Z_n sum_G (-a)^|G| det(I + sigma^2 K_rr)^(-D/2)
                 exp(-||x||^2 s_G / 2),   s_G = K_11 - K_1r (K_rr + I / sigma^2)^(-1) K_r1,

  and log q_iid(X) = sum_i log p̄_n(x_i) is the best density of i.i.d. points. Terms with the
  same s_G (to 1e-9; isomorphic graphs among them) are merged into one, which leaves a few
  hundred.

Sums with alternating signs are taken in float64, with terms at most 1 in magnitude. At the
defaults (n = 6, D = 1, sigma = 1, l = 0.4, a = 1) the absolute sum of the terms of Z_6 is
9.7e3 Z_6, which leaves about 12 significant digits; a longer range l / sigma or a larger D
makes Z_n smaller and costs digits in proportion (and acceptance in the sampler). With fewer
than 6 digits left the normaliser is refused (its value would be noise, even negative), and so
is a sampler that would need more than ``MAX_DRAWS`` proposals.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
from torch import Tensor

from ..errors import InputError
from .sets import SetData

__all__ = ["repulsive_sets", "repulsive_sets_log_prob", "repulsive_sets_iid_log_prob",
           "repulsive_log_normaliser"]

LOG_2PI = math.log(2 * math.pi)
MAX_SIZE = 6  # 2^15 graphs; 7 points would need 2^21
MAX_PROPOSALS = 100_000  # proposals drawn at once by the rejection sampler
MAX_DRAWS = 1e9  # the most proposals the rejection sampler may need in all (minutes of work)


def repulsive_sets(
    num_sets: int,
    set_size: int = 6,
    dim: int = 1,
    sigma: float = 1.0,
    length: float = 0.4,
    strength: float = 1.0,
    generator: torch.Generator | None = None,
) -> SetData:
    """Sets of ``set_size`` softly repelling points in R^dim, sampled exactly by rejection.

    Arguments:
        num_sets: number of sets M.
        set_size: points per set n, 1 to 6 (the exact normaliser sums over 2^(n(n-1)/2) graphs).
        dim: dimension D of each point.
        sigma: spread of the Gaussian that holds the points together.
        length: range l of the repulsion.
        strength: depth a in (0, 1] of the repulsion; 1 forbids coinciding points.
        generator: seeded random numbers.

    Returns:
        :class:`SetData` with the exact ``true_log_prob`` and ``iid_log_prob`` (module
        docstring) and ``meta["acceptance"]``, the rejection sampler's acceptance rate Z_n.

    Raises:
        InputError: a parameter out of range (the message names it).

    Examples:
        >>> data = repulsive_sets(2000, generator=torch.Generator().manual_seed(0))
        >>> data.x.shape
        torch.Size([2000, 6, 1])
        >>> round(data.meta["acceptance"], 5)  # = Z_6
        0.00813
        >>> round(data.mean_true_nll(), 2), round(data.mean_iid_nll(), 2)  # nats per set
        (8.86, 10.26)
    """
    _check(set_size, dim, sigma, length, strength)
    if num_sets < 1:
        raise InputError(f"num_sets must be positive, got {num_sets}")
    accepted: list[Tensor] = []
    count = 0
    acceptance = math.exp(repulsive_log_normaliser(set_size, dim, sigma, length, strength))
    if num_sets / acceptance > MAX_DRAWS:
        raise InputError(f"{num_sets} repelling sets at an acceptance rate of {acceptance:.2g} "
                         f"would take about {num_sets / acceptance:.2g} proposals (at most "
                         f"{MAX_DRAWS:.0e}): use a shorter length or a weaker strength")
    while count < num_sets:
        batch = min(MAX_PROPOSALS, max(64, int(1.2 * (num_sets - count) / acceptance)))
        x = sigma * torch.randn(batch, set_size, dim, dtype=torch.float64, generator=generator)
        log_accept = _log_pair_factor(x, None, length, strength)
        keep = torch.rand(batch, dtype=torch.float64, generator=generator).log() < log_accept
        accepted.append(x[keep])
        count += int(keep.sum())
    x = torch.cat(accepted)[:num_sets].float()

    def true_log_prob(x: Tensor, mask: Tensor | None) -> Tensor:
        return repulsive_sets_log_prob(x, mask, sigma, length, strength)

    def iid_log_prob(x: Tensor, mask: Tensor | None) -> Tensor:
        return repulsive_sets_iid_log_prob(x, mask, sigma, length, strength)

    meta = {"set_size": set_size, "dim": dim, "sigma": sigma, "length": length,
            "strength": strength, "acceptance": acceptance}
    return SetData(x, None, "repulsive-sets", true_log_prob=true_log_prob, meta=meta,
                   iid_log_prob=iid_log_prob)


def repulsive_sets_log_prob(
    x: Tensor, mask: Tensor | None, sigma: float = 1.0, length: float = 0.4, strength: float = 1.0
) -> Tensor:
    """Exact log-density of sets of softly repelling points given their sizes, shape (M,).

    log p(X) = sum_i log N(x_i; 0, sigma^2 I) + sum_{i<j} log phi(d_ij) - log Z_n, with Z_n
    from :func:`repulsive_log_normaliser` for each set's number n of present points.

    Examples:
        >>> x = torch.tensor([[[0.0], [1.0]], [[0.0], [0.01]]])  # two pairs of points
        >>> repulsive_sets_log_prob(x, None)  # close pairs are strongly suppressed
        tensor([-2.0651, -9.5913])
    """
    sizes = _sizes(x, mask)
    _check(int(sizes.max()), x.shape[-1], sigma, length, strength)
    xd = x.double()
    w = torch.ones(x.shape[:2], dtype=torch.float64, device=x.device) if mask is None \
        else mask.double()
    dim = x.shape[-1]
    gauss = -0.5 * ((xd.pow(2).sum(-1) / sigma**2 + dim * (LOG_2PI + 2 * math.log(sigma)))
                    * w).sum(1)
    log_z = _log_normalisers(sizes, dim, sigma, length, strength)
    return (gauss + _log_pair_factor(xd, mask, length, strength) - log_z).to(x.dtype)


def repulsive_sets_iid_log_prob(
    x: Tensor, mask: Tensor | None, sigma: float = 1.0, length: float = 0.4, strength: float = 1.0
) -> Tensor:
    """Log-density of the sets as i.i.d. points from the exact one-point marginal, shape (M,).

    log q_iid(X) = sum_i log p̄_n(x_i), with p̄_n the marginal of one point of a set of n
    (module docstring): the best a model of independent points can do.

    Examples:
        >>> x = torch.tensor([[[0.0], [1.0]], [[0.0], [0.01]]])
        >>> repulsive_sets_iid_log_prob(x, None)  # blind to the distance between the points
        tensor([-2.4430, -2.1310])
    """
    sizes = _sizes(x, mask)
    _check(int(sizes.max()), x.shape[-1], sigma, length, strength)
    dim = x.shape[-1]
    r2 = x.double().pow(2).sum(-1)  # (M, N)
    out = torch.zeros_like(r2)
    for n in sizes.unique().tolist():
        coeff, slope = _marginal_terms(int(n), dim, sigma, length, strength)
        coeff, slope = coeff.to(r2.device), slope.to(r2.device)
        rows = sizes == n
        series = (coeff * torch.exp(-0.5 * r2[rows, :, None] * slope)).sum(-1)
        log_z = repulsive_log_normaliser(int(n), dim, sigma, length, strength)
        out[rows] = (series.log() - log_z - 0.5 * r2[rows] / sigma**2
                     - 0.5 * dim * (LOG_2PI + 2 * math.log(sigma)))
    if mask is not None:
        out = out * mask.double()
    return out.sum(1).to(x.dtype)


@lru_cache(maxsize=64)
def repulsive_log_normaliser(
    set_size: int, dim: int, sigma: float, length: float, strength: float
) -> float:
    """log Z_n, exactly: Z_n = sum over graphs G of (-a)^|G| det(I + sigma² L_G / l²)^(-D/2).

    Z_n is also the acceptance rate of the rejection sampler of :func:`repulsive_sets`.

    Examples:
        >>> # two points: one graph with an edge, Z = 1 - a (1 + 2 sigma^2 / l^2)^(-D/2)
        >>> z = math.exp(repulsive_log_normaliser(2, 1, 1.0, 0.5, 1.0))
        >>> round(z, 12) == round(1 - 9 ** -0.5, 12)
        True
    """
    _check(set_size, dim, sigma, length, strength)
    laplacians, edges = _graph_laplacians(set_size)
    matrix = torch.eye(set_size, dtype=torch.float64) + (sigma / length) ** 2 * laplacians
    terms = (-strength) ** edges * torch.exp(-0.5 * dim * torch.linalg.slogdet(matrix)[1])
    total = float(terms.sum())
    # 2^E terms of both signs: the sum keeps about log10(Z / sum |terms|) fewer digits than
    # float64's 16; with fewer than 6 left it is no value (it was garbage or negative)
    digits = 16 + math.log10(total / float(terms.abs().sum())) if total > 0 else -math.inf
    if digits < 6:
        raise InputError(
            f"the normaliser of {set_size} repelling points (sigma={sigma}, length={length}, "
            f"strength={strength}) is lost to cancellation: its series keeps "
            f"{max(digits, 0):.0f} of float64's 16 digits (Z is far below the size of its "
            "terms); use fewer points, a shorter length or a weaker strength")
    return math.log(total)


@lru_cache(maxsize=64)
def _marginal_terms(set_size: int, dim: int, sigma: float, length: float,
                    strength: float) -> tuple[Tensor, Tensor]:
    """Coefficients c_G and slopes s_G of the one-point marginal's series, merged by value."""
    laplacians, edges = _graph_laplacians(set_size)
    k = laplacians / length**2
    if set_size == 1:
        return torch.ones(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    k11, k1r, krr = k[:, 0, 0], k[:, 0, 1:], k[:, 1:, 1:]
    eye = torch.eye(set_size - 1, dtype=torch.float64)
    slope = k11 - (k1r[:, None, :] @ torch.linalg.solve(krr + eye / sigma**2,
                                                         k1r[:, :, None])).flatten()
    coeff = (-strength) ** edges * torch.exp(-0.5 * dim * torch.linalg.slogdet(
        eye + sigma**2 * krr)[1])
    _, inverse = torch.unique((slope * 1e9).round(), return_inverse=True)
    merged_coeff = torch.zeros(int(inverse.max()) + 1, dtype=torch.float64)
    merged_coeff.index_add_(0, inverse, coeff)
    merged_slope = torch.zeros_like(merged_coeff)
    merged_slope[inverse] = slope  # any member: they agree to 1e-9
    return merged_coeff, merged_slope


@lru_cache(maxsize=8)
def _graph_laplacians(set_size: int) -> tuple[Tensor, Tensor]:
    """Laplacians (2^E, n, n) of every graph on ``set_size`` labelled points, and edge counts."""
    i, j = torch.triu_indices(set_size, set_size, 1)
    num_edges = i.numel()
    single = torch.zeros(num_edges, set_size, set_size, dtype=torch.float64)
    e = torch.arange(num_edges)
    single[e, i, i] = single[e, j, j] = 1.0
    single[e, i, j] = single[e, j, i] = -1.0
    graphs = torch.arange(2**num_edges)
    bits = ((graphs[:, None] >> e) & 1).double()  # (G, E)
    return torch.einsum("ge,eab->gab", bits, single), bits.sum(1)


def _log_pair_factor(x: Tensor, mask: Tensor | None, length: float, strength: float) -> Tensor:
    """sum_{i<j present} log(1 - a exp(-d_ij^2 / (2 l^2))), shape (M,)."""
    n = x.shape[1]
    if n < 2:
        return torch.zeros(x.shape[0], dtype=x.dtype, device=x.device)
    i, j = torch.triu_indices(n, n, 1, device=x.device)
    d2 = (x[:, i] - x[:, j]).pow(2).sum(-1)
    log_phi = torch.log1p(-strength * torch.exp(-0.5 * d2 / length**2))
    if mask is not None:
        log_phi = torch.where(mask[:, i] & mask[:, j], log_phi, torch.zeros_like(log_phi))
    return log_phi.sum(1)


def _log_normalisers(sizes: Tensor, dim: int, sigma: float, length: float,
                     strength: float) -> Tensor:
    table = torch.tensor([0.0] + [repulsive_log_normaliser(n, dim, sigma, length, strength)
                                  for n in range(1, int(sizes.max()) + 1)],
                         dtype=torch.float64, device=sizes.device)
    return table[sizes]


def _sizes(x: Tensor, mask: Tensor | None) -> Tensor:
    if x.dim() != 3:
        raise InputError(f"sets must have shape (M, N, D), got shape {tuple(x.shape)}")
    if mask is None:
        return torch.full((x.shape[0],), x.shape[1], dtype=torch.long, device=x.device)
    return mask.sum(1)


def _check(set_size: int, dim: int, sigma: float, length: float, strength: float) -> None:
    if not 1 <= set_size <= MAX_SIZE:
        raise InputError(f"set_size must be between 1 and {MAX_SIZE} (the exact normaliser sums "
                         f"over 2^(n(n-1)/2) graphs), got {set_size}")
    if dim < 1:
        raise InputError(f"dim must be positive, got {dim}")
    if not sigma > 0:
        raise InputError(f"sigma must be positive, got {sigma}")
    if not length > 0:
        raise InputError(f"length must be positive, got {length}")
    if not 0 < strength <= 1:
        raise InputError(f"strength must lie in (0, 1] (a repulsion bounded by 1), got {strength}")
