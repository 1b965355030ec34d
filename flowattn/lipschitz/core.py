"""Constants of the parameter-free cores of L2 attention: the Lipschitz constants of
g(Z) = softmax(-dist²(Z)) Z in z-space, for N keys (with logit offsets of a given margin, and for
induced-point attention), which the attention certificates multiply by norms of the weights.

The derivations are in ``docs/attention.md`` (steps 3-7 of the tight certificate)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch import Tensor

from ..errors import InputError
from .checks import check_counts
from .lambertw import lambertw0, phi_inverse, phi_inverse_of_count

__all__ = ["logit_margin_constant", "l2_core_row_constant", "l2_core_column_constant",
           "l2_core_kernel_constant", "induced_core_constant"]


def induced_core_constant(n: int | range | Tensor, inducing: int) -> Tensor:
    """r(N, M): the rank-one part of the induced-point attention core's Lipschitz constant.

    In the core at unit temperature (z-space; ``docs/attention.md``) summary m has self weight
    p = P_m0 and element i self weight q = Q_i0. Given its self weight, a row's second moment
    about its own point is at most m2_K(p) = (1 - p) log(K p / (1 - p)) over K other keys (the
    maximiser of the concave sum_k P_k log(p / P_k) spreads the rest equally; its maximum over p
    is Lemma F.2's c_K = W_0(K / e)). The rank-one terms are then at most

        r = max_q [ 2 (1 - q) c_N + 2 m2_M(q) L(N) ],   L(N) = max_p [ 2 - p + 2 m2_N(p) ]

    (L bounds ||d s_m - d z_i|| for unit input perturbations). Both maxima are of concave
    functions of t = 1 - p or 1 - q on (0, 1): found by bisection on the derivative and
    certified by the tangent, f(t) <= f(t0) + |f'(t0)|. Returns a float64 tensor of the shape
    of ``n`` (a table for a range); computed on the host, cached per (N, M).

    Examples:
        >>> r = float(induced_core_constant(2, 1))
        >>> 1.45 < r < 1.5
        True
    """
    if not isinstance(inducing, int) or inducing < 1:
        raise InputError(f"inducing must be a positive number of points, got {inducing!r}")
    n = check_counts(n, "set size")
    if isinstance(n, (int, range)):
        counts = [n] if isinstance(n, int) else list(n)
        values = torch.tensor(_induced_constant_table(tuple(counts), inducing),
                              dtype=torch.float64)
        return values[0] if isinstance(n, int) else values
    return _induced_constants(torch.as_tensor(n).to(torch.float64), inducing)


_INDUCED_CONSTANTS: dict[tuple[int, int], float] = {}  # (N, M) -> r(N, M)


@torch.compiler.disable  # a host-side constant: not traced
def _induced_constant_table(counts: tuple[int, ...], inducing: int) -> list[float]:
    """r(N, M) for each count, from a host cache; the missing counts in one vectorised pass
    (a table of 10,000 counts costs one bisection, not 10,000)."""
    missing = sorted({k for k in counts if (k, inducing) not in _INDUCED_CONSTANTS})
    if missing:
        values = _induced_constants(torch.tensor(missing, dtype=torch.float64), inducing)
        _INDUCED_CONSTANTS.update(zip(((k, inducing) for k in missing), values.tolist(),
                                      strict=True))
    return [_INDUCED_CONSTANTS[(k, inducing)] for k in counts]


def _induced_constants(n: Tensor, inducing: int) -> Tensor:
    """r(N, M) for a float64 tensor of counts N (see :func:`induced_core_constant`)."""
    c_n = phi_inverse(n)

    def spread(t: Tensor, k: Tensor | float) -> tuple[Tensor, Tensor]:  # t log(k (1 - t) / t)
        log = torch.log(k * (1 - t) / t)
        return t * log, log - 1 / (1 - t)  # the value and its derivative in t

    def stage_one(t: Tensor) -> tuple[Tensor, Tensor]:  # 2 - p + 2 m2_N(p), t = 1 - p
        value, slope = spread(t, n)
        return 1 + t + 2 * value, 1 + 2 * slope

    link = _concave_maximum(stage_one, n)

    def stage_two(t: Tensor) -> tuple[Tensor, Tensor]:  # t = 1 - q
        value, slope = spread(t, float(inducing))
        return 2 * t * c_n + 2 * value * link, 2 * c_n + 2 * slope * link

    return _concave_maximum(stage_two, n)


def _concave_maximum(f: Callable[[Tensor], tuple[Tensor, Tensor]], like: Tensor) -> Tensor:
    """An upper bound on max_{t in (0, 1)} f(t) for concave f whose slope runs from +inf to
    -inf (one for each element of ``like``, on its device): bisection on the slope, then the
    tangent bound f(t0) + |f'(t0)| (the interval has length 1)."""
    lo = torch.zeros(like.shape, dtype=torch.float64, device=like.device)
    hi = torch.ones(like.shape, dtype=torch.float64, device=like.device)
    for _ in range(60):
        mid = (lo + hi) / 2
        rising = f(mid)[1] > 0
        lo, hi = torch.where(rising, mid, lo), torch.where(rising, hi, mid)
    value, slope = f((lo + hi) / 2)
    return value + slope.abs()


def logit_margin_constant(n: int | Tensor, margin: Tensor | float = 0.0) -> Tensor:
    """c = W_0((N - 1) e^B / e): Kim et al.'s Lemma F.2 when other logits may exceed the self-logit
    by B beyond the distance term.

    Row i of the core has weights P_ij = rho_j e^{-t_j} / (1 + sum_{k != i} rho_k e^{-t_k}) with
    t_j = ||z_i - z_j||^2 and rho_j = e^{b(i, j) - b(i, i)} the ratio of key j's offset to the
    self-offset (all 1 without offsets). Its second moment obeys the weighted lemma

        V(t) = sum_{j != i} rho_j t_j e^{-t_j} / (1 + sum_{j != i} rho_j e^{-t_j}) <= W_0(S / e),
        S = sum_{j != i} rho_j,

    with equality when every t_j = 1 + W_0(S / e): for any v >= 0, V(t) <= v is
    sum_j rho_j e^{-t_j} (t_j - v) <= v, and e^{-t} (t - v) is largest at t = 1 + v, where it is
    e^{-1-v}; so V <= v whenever S e^{-1-v} <= v, i.e. v e^v >= S / e. Kim et al.'s Lemma F.2 is
    S = N - 1; ratios at most e^B give S <= (N - 1) e^B and this function's value,
    phi^{-1}((N - 1) e^B). A sharper S, the actual sum of the ratios, is what
    :meth:`~flowattn.attention.offsets.LogitOffsets.weighted_counts` provides (then
    c = phi_inverse(S)). Differentiable in B.

    Examples:
        >>> bool(torch.isclose(logit_margin_constant(8, 0.0), phi_inverse(7)))
        True
        >>> round(float(logit_margin_constant(8, 2.0) - logit_margin_constant(8, 0.0)), 2)
        1.2
    """
    n = torch.as_tensor(n)
    given = torch.is_tensor(margin) and margin.is_floating_point()
    margin = torch.as_tensor(margin)
    dtype = margin.dtype if given else torch.float64
    scaled = (n - 1).to(torch.float64) * torch.exp(margin.to(torch.float64))
    return phi_inverse(scaled).to(dtype)


def l2_core_column_constant(n: int | Tensor, margin: float | None = None,
                            full: bool = False) -> Tensor:
    """C_N >= max_k sum_i ||J_ik||_2, the block-column sums of the Jacobian of the L2 core.

    The core is g(Z)_i = sum_j P_ij z_j with P_ij = softmax_j(-||z_i - z_j||^2) on N points of
    R^d. Block (k, k) is P_kk I + 2 Cov_k. Its norm is at most P_kk + 2 sum_i P_ki t_i
    (t_i = ||z_i - z_k||^2: a covariance is at most the second moment about z_k, whose largest
    eigenvalue is at most its trace), a ratio (1 + sum_i rho_i e^{-t_i} 2 t_i) /
    (1 + sum_i rho_i e^{-t_i}) (rho_i = 1 without offsets) that is at most R exactly when
    1 - R + sum_i rho_i e^{-t_i} (2 t_i - R) <= 0; e^{-t} (2 t - R) is largest at t = 1 + R / 2,
    where it is 2 e^{-1 - R/2}, so with S = sum_i rho_i <= N - 1 the norm is at most
    c_2 = 1 + 2 W_0(S e^{-3/2}), attained by k midway between two equal clusters at distance
    sqrt(1 + c_2 / 2) (below 1 + 2c, c = phi^{-1}(N-1), Lemma F.2 of Kim et al. 2021, which
    bounds P_kk and the covariance apart). A block (i, k), i != k, is P_ik (I - 2 a b^T) with
    b = z_k - z_i and
    a = z_k - E_i[z]. Row i gives weight 1 to itself, s = e^{-u^2} to k (u = ||b||) and
    W = sum_j e^{-||z_i - z_j||^2} to the m = N - 2 others, so P_ik = s / (1 + s + W) and
    a = (1 - P_ik) b + e with e = -sum_{j other} P_ij (z_j - z_i). Then

        ||I - 2 a b^T|| <= F(2 (1 - P_ik) u^2, 2 u ||e||)
                        <= max(1, 2 (1 - P_ik) u^2 - 1) + 2 u ||e||,
        ||e|| <= min(sqrt(c), W sqrt(log(m / W)) / (1 + s + W))

    with F(g, h) the largest norm of the operator over pulls of length 2 u ||e|| <= h in every
    direction, in closed form sqrt(1 + h^2 / (1 - alpha^2)) (alpha = 1 - g) where |alpha| < 1
    and h |alpha| <= 1 - alpha^2, else |alpha| + h (the proof is in ``docs/attention.md``; the
    triangle inequality's bound, on the second line, is what it replaced: I - 2 lambda b b^T
    has the eigenvalues 1 and 1 - 2 lambda u^2). For the pull, sqrt(c) by Lemma F.2 and
    Cauchy-Schwarz, and the other bound because x sqrt(log(1/x)) is concave on (0, 1], so the
    m terms e^{-v^2} v with sum W are at most W sqrt(log(m / W)). Hence C_N = c_2 +
    (N - 1) kappa_N with kappa_N the supremum over
    u >= 0 and 0 <= W <= m of P_ik times that bracket, bounded from above cell by cell on a
    grid (step 4e-3 in u over [0, 6]; in W a first cell [0, 1e-6 m], then 191 cells growing
    geometrically up to m; every factor is monotone in u and W or, for W sqrt(log(m / W)),
    concave with a known peak, and F is nondecreasing in h and convex in g, so each cell is
    bounded by its corners and the ends of its range of g) plus 1e-9 for the tail
    u > 6: an upper bound, not an estimate.

    ``margin`` None is plain L2 attention. A logit ``margin`` B (logits may carry offsets with
    b(i, j) - b(i, i) <= B, see :func:`logit_margin_constant`) gives c = W_0((N - 1) e^B / e),
    a weight of k of at most e^{B - u^2} but possibly much less (so 1 - P_ik is only bounded
    by 1 and the denominator of the pull by 1 + W), W up to m e^B (the concavity bound holds
    with m e^B in place of m), S up to (N - 1) e^B in c_2, and a grid that extends to
    sqrt(B) + 6. B is first rounded up
    to a multiple of 1/64 (offsets allowed up to B are allowed up to any larger value, so the
    bound holds): a learnt margin that drifts between training steps then reuses the cached
    constant instead of evaluating the grid again (about 25 ms) at every step.

    ``full`` (only without a ``margin``): every row sees every element, as in full attention on
    a set. The rows of a column then crowd each other: order the other points by their distance
    u_r to z_k; the r - 1 closer ones lie within u_r + u_j <= 2 u_r of the r-th, which is
    another point of its row, so that row's W is at least (r - 1) e^{-4 u_r^2}. The r-th block
    is bounded over the cells that allow that (with W's smallest value in a cell raised to the
    floor), and C_N = c_2 + sum_r kappa_{N, r}, the floor held at r - 1 = 15 beyond the 16th
    point (a smaller floor is still a bound): 5 % lower at N = 8, 4 % at N = 32 and 64. Causal
    rows may not see the closer points, and offsets may lower their weights without bound, so
    neither allows it.

    Examples:
        >>> float(l2_core_column_constant(1))  # one element: the core is the identity
        1.0
        >>> bool(l2_core_column_constant(8, full=True) < l2_core_column_constant(8))
        True
    """
    if full and margin is not None:
        raise InputError("the crowded column constant (full=True) holds without offsets only")
    margin = None if margin is None else math.ceil(float(margin) * 64) / 64
    return _per_count(n, lambda k: _core_column_constant(k, margin, full))


# S_1: from this weighted count of a row's other keys on (S = N - 1 without offsets), the
# block-row sums of the core are at most 2 c_2 - 1 (see l2_core_row_constant); the derivation's
# threshold is 5.7320..., rounded up
_ROW_THRESHOLD = 5.74


def l2_core_row_constant(c: Tensor) -> Tensor:
    """R >= max_i sum_k ||J_ik||_2, the block-row sums of the Jacobian of the L2 core, from
    Lemma F.2's constant c = W_0(S / e) of the rows (S = N - 1 without offsets): 1 + 4c, and
    2 c_2 - 1 = 1 + 4 W_0(S e^{-3/2}) (c_2 of :func:`l2_core_column_constant`, the diagonal
    block's supremum) once S >= 5.74.

    Row i of the core has the blocks P_ii I + 2 Cov_i and P_ik (I - 2 a_k b_k^T), k != i, with
    b_k = z_k - z_i, t_k = ||b_k||^2, m = E_i[z] - z_i and a_k = b_k - m. The covariance's
    largest eigenvalue is at most its trace, sum_k P_ik t_k - ||m||^2. Each other block obeys

        ||I - 2 (b - m) b^T|| <= phi(t) - 2 <m, b> + 4 ||m||^2,

    phi(t) = 2t - 1 for t >= 5/3 and max(2t - 1, 1 + t/4) + t/4 below (the operator is the
    identity off the plane of b and m, where it is [[A, 0], [B, 1]] with A = 1 - 2t + 2 alpha
    sqrt(t), B = 2 sqrt(t) mu, alpha and mu the parts of m along and across b; the proof is in
    ``docs/attention.md``). Since sum_k P_ik <m, b_k> = ||m||^2 and sum_{k != i} P_ik <= 1,
    the terms in m cancel to at most 0, and the row sum is at most 1 + sum_{k != i} P_ik h(t_k)
    with h(t) = 2t + phi(t) - 1: 2.5 t below 8/7, 4.25 t - 2 up to 5/3, 4t - 2 above. That is a
    ratio of sums, at most R when S sup_t e^{-t} (h(t) - R) <= R. On t >= 5/3 the supremum is
    4 e^{-3/2 - R/4}, which gives R = 4 W_0(S e^{-3/2}); the lower pieces stay below it exactly
    when S >= 5.7320... For an even number of other points the value is attained (two equal
    clusters on either side of z_i at squared distance 3/2 + R/4), so it is then the supremum
    of the row sums. Below the threshold the function returns Lemma F.2's 1 + 4c.
    Differentiable in c (through W_0), on c's device and dtype, with no value read back.

    Examples:
        >>> c = phi_inverse(7.0)  # N = 8 without offsets
        >>> round(float(1 + 4 * c), 3), round(float(l2_core_row_constant(c)), 3)
        (4.893, 3.972)
    """
    count = c * torch.exp(c + 1)  # S, from c = W_0(S / e)
    return torch.where(count >= _ROW_THRESHOLD, 1 + 4 * _diagonal_excess(count), 1 + 4 * c)


def l2_core_kernel_constant(n: int | Tensor) -> Tensor:
    """kappa >= ||J_g||_2 for the L2 core on N points that all see each other (not causal rows),
    from the positive definiteness of the Gaussian kernel: N^{1/4} (1 + 2 sqrt(c)) + 2c with
    c = phi^{-1}(N-1).

    The core is g(Z)_i = sum_j P_ij z_j, P = diag(1/Z) K with K_ij = e^{-||z_i - z_j||^2} and
    row sums Z_i >= 1. Its Jacobian is exactly

        J_g = P (x) I + 2 diag_i(Cov_i) - 2 T,   T_ij = P_ij a_ij b_ij^T (j != i),

    with a_ij = z_j - E_i[z], b_ij = z_j - z_i and Cov_i the covariance of the points under
    row i. Three bounds, each proved in ``docs/attention.md`` (step 7):

    * ||P||_2 <= sqrt(max_k C_k) <= N^{1/4} (Schur test; the column sums C_k = (K a)_k,
      a_i = 1/Z_i, obey C_k <= sqrt(a^T K a) <= sqrt(N) by Cauchy-Schwarz in the kernel's
      feature space);
    * ||Cov_i||_2 <= c (Lemma F.2 of Kim et al. 2021);
    * T = L R with R: dZ -> (sqrt(P_ij) b_ij^T dz_j)_ij and L: t -> (sum_j sqrt(P_ij) a_ij t_ij)_i,
      ||L||^2 = max_i ||Cov_i|| <= c and ||R||^2 = max_j ||sum_i P_ij b_ij b_ij^T|| <= sqrt(N):
      for a unit v, K_ij (b_ij^T v)^2 = (2 K_ij - H_ij)/4 with H the kernel of the derivatives
      of the features along v (positive semi-definite, H_jj = 2, H_ij <= 2 K_ij), so the
      weighted scatter of column j is C_j / 2 - (H a)_j / 4 <= sqrt(N) / 2 + sqrt(2 a^T H a) / 4
      <= sqrt(N).

    It grows like N^{1/4} sqrt(log N), where the block-column bound of
    :func:`l2_core_column_constant` grows like sqrt(N log N) (both for full attention, with the
    row constant of :func:`l2_core_row_constant` and the crowded columns): the smaller of the
    two from N = 53 on (15.00 against 15.01 at N = 53, 16.0 against 16.9 at N = 64, 38 against
    93 at N = 1000). Causal rows do not share one kernel matrix (row i sees only j <= i), and
    logit offsets break its symmetry: the bound is for full attention without offsets.

    Evaluated on the host in float64, like :func:`l2_core_column_constant`, with the result of
    ``n``'s shape.

    Examples:
        >>> round(float(l2_core_kernel_constant(64)), 2)
        16.04
        >>> float(l2_core_kernel_constant(1))  # one element: the core is the identity
        1.0
    """
    check_counts(torch.as_tensor(n))
    return _per_count(n, _core_kernel_constant)


def _core_kernel_constant(n: int) -> float:
    c = phi_inverse_of_count(n)
    return n**0.25 * (1 + 2 * math.sqrt(c)) + 2 * c


def _per_count(n: int | Tensor, constant: Callable[[int], float]) -> Tensor:
    """``constant(k)`` for every count k of ``n``, a float64 host tensor of ``n``'s shape, each
    distinct count evaluated once."""
    n = torch.as_tensor(n)
    values = {int(k): constant(int(k)) for k in torch.unique(n).tolist()}
    return torch.tensor([values[int(k)] for k in n.reshape(-1).tolist()],
                        dtype=torch.float64).reshape(n.shape)


# the crowding floor (r - 1) e^{-4 u^2} of the full column constant is held at this r - 1
_CROWDING_CAP = 15


@functools.lru_cache(maxsize=4096)
def _core_column_constant(n: int, margin: float | None = None, full: bool = False) -> float:
    if n < 1:
        raise InputError(f"sequence length must be >= 1, got {n}")
    if n == 1:
        return 1.0
    c = float(logit_margin_constant(n, 0.0 if margin is None else margin))
    if not full:
        return (_diagonal_block_constant(n, margin)
                + (n - 1) * _column_block_supremum(n - 2, c, margin)[0])
    capped = min(n - 1, _CROWDING_CAP + 1)  # ranks r - 1 = 0 .. capped - 1 get their own floor
    blocks = _column_block_supremum(n - 2, c, None, tuple(range(capped)))
    return _diagonal_block_constant(n) + sum(blocks) + (n - 1 - capped) * blocks[-1]


def _diagonal_block_constant(n: int, margin: float | None = None) -> float:
    """c_2 = 1 + 2 W_0(S e^{-3/2}) >= ||P_kk I + 2 Cov_k||_2, S = (N - 1) e^B (B = ``margin``,
    0 without offsets): the diagonal block of the core's Jacobian, P_kk and the covariance
    bounded together (see :func:`l2_core_column_constant`)."""
    others = (n - 1) * math.exp(0.0 if margin is None else margin)
    return 1 + 2 * float(_diagonal_excess(torch.tensor(others, dtype=torch.float64)))


def _diagonal_excess(count: Tensor) -> Tensor:
    """W_0(S e^{-3/2}) for the weighted count S of a row's other keys: c_2 = 1 + 2 W_0 and the
    block-row constant 2 c_2 - 1 = 1 + 4 W_0 (differentiable, on S's device)."""
    return lambertw0(count * math.exp(-1.5), check=False)


def _column_block_supremum(others: int, c: float, margin: float | None,
                           crowds: tuple[int, ...] = (0,)) -> list[float]:
    """Upper bounds on sup_{u, W} P_ik F(2 (1 - P_ik) u^2, 2 u ||e||) (F of
    :func:`_rank_one_bracket`), the largest
    norm of an off-diagonal block of a column of the core's Jacobian (see
    :func:`l2_core_column_constant`; ``margin`` None: no logit offsets), by monotone brackets
    over the cells of a grid; one value per entry q of ``crowds`` (without offsets), with W
    restricted to at least q e^{-4 u^2}."""
    plain = margin is None
    margin = 0.0 if plain else margin
    top = 6.0 + math.sqrt(max(margin, 0.0))
    u = torch.arange(0, round(top * 250) + 1, dtype=torch.float64) * 4e-3
    u0, u1 = u[:-1, None], u[1:, None]  # cells in u (rows)
    largest = others * math.exp(margin)  # W <= m e^B
    if others == 0:
        w0 = w1 = torch.zeros(1, 1, dtype=torch.float64)
    else:
        edges = largest * torch.logspace(-6, 0, 192, dtype=torch.float64)
        edges = torch.cat([edges.new_zeros(1), edges])
        w0, w1 = edges[None, :-1], edges[None, 1:]  # cells in W (columns)

    def cells(u0, u1, w0):
        weight_hi = torch.exp(margin - u0**2)  # the weight of k, largest at u0
        p_hi = weight_hi / (1 + weight_hi + w0)  # P_ik is increasing in that weight, falling in W
        # the weight of k is at least e^{-u1^2} without offsets, which may make it arbitrarily
        # small with them
        weight_lo = torch.exp(-(u1**2)) if plain else torch.zeros_like(u1)
        keep = 1 - weight_lo / (1 + weight_lo + w1)  # 1 - P_ik, largest at u1 and w1
        # 2 (1 - P_ik) u^2 over the cell lies in [lows, highs]
        lows, highs = 2 * (1 - p_hi) * u0**2, 2 * keep * u1**2
        if others == 0:
            return p_hi * _rank_one_bracket(lows, highs, torch.zeros_like(highs))

        # W sqrt(log(M / W)) is concave in W, largest at M e^{-1/2}
        def h(w):
            return w * torch.sqrt(torch.log(largest / w.clamp_min(1e-300)).clamp_min(0))

        peak = largest * math.exp(-0.5)
        inner = torch.where(w0 >= peak, h(w0), h(w0.new_tensor(peak)))
        spread = torch.where(w1 <= peak, h(w1), inner)
        pull = torch.clamp(spread / (1 + weight_lo + w0), max=math.sqrt(c))
        return p_hi * _rank_one_bracket(lows, highs, 2 * u1 * pull)

    rows = cells(u0, u1, w0).amax(dim=1)  # (U,): the largest cell of each row in u
    values = []
    for q in crowds:
        if q == 0:
            values.append(float(rows.max()) + 1e-9)
            continue
        # W >= q e^{-4 u^2} >= q e^{-4 u1^2} in a cell, and cells below that are empty; rows
        # whose floor is below the first positive edge keep their plain value (a bound)
        floor = q * torch.exp(-4 * u1**2)
        near = (floor >= w1[0, 1]).squeeze(1)
        crowded = cells(u0[near], u1[near], torch.maximum(w0, floor[near]))
        crowded = crowded.masked_fill(w1 < floor[near], 0.0).amax(dim=1)
        values.append(float(torch.cat([crowded, rows[~near]]).max()) + 1e-9)
    return values


def _rank_one_bracket(lows: Tensor, highs: Tensor, reach: Tensor) -> Tensor:
    """An upper bound on ||I - 2 a b^T||_2 over a = (1 - P) b + e with g = 2 (1 - P) ||b||^2
    anywhere in [lows, highs] and 2 ||b|| ||e|| <= ``reach`` (h), e in any direction.

    In the plane of b and e the operator is X = [[1 - g - x, 0], [y, 1]] with x^2 + y^2 <= h^2
    (x, y = 2 ||b|| times e's parts along and across b). For a unit v = (cos f, sin f),
    X v = (a cos f, sin f) + cos f (-x, y) with a = 1 - g, whose largest norm over the disk is
    ||(a cos f, sin f)|| + h |cos f|; with t = |cos f|, the supremum over the disk is therefore

        F(g, h) = max_{t in [0, 1]} sqrt(1 - (1 - a^2) t^2) + h t
                = sqrt(1 + h^2 / (1 - a^2))   if |a| < 1 and h |a| <= 1 - a^2,
                = |a| + h                     otherwise

    (the first at the stationary point t^2 = h^2 / (q (q + h^2)), q = 1 - a^2, when it lies
    in [0, 1]). It is at most max(1, |a|) + h, the triangle inequality's bound, and below it
    when the pull is small and g is away from 0 (1 - a^2 large). F is the supremum of the
    convex X -> ||X|| over a disk that moves linearly with g, so it is convex in g: its
    largest value over [lows, highs] is at an end."""

    def bound(g: Tensor) -> Tensor:
        a = (1 - g).abs()
        room = 1 - a**2
        inside = (a < 1) & (reach * a <= room)
        return torch.where(inside, torch.sqrt(1 + reach**2 / room.clamp_min(1e-300)), a + reach)

    return torch.maximum(bound(lows), bound(highs))
