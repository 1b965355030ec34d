"""Lipschitz constants: certified upper bounds and measured lower bounds.

Upper bounds (certificates) are closed-form functions of the weights:

* Theorem 3.2 of Kim, Papamakarios & Mnih (2021) for tied L2 multi-head attention,
* Appendix N of the same paper for LayerNorm, and the exact constant of LipsFormer's CenterNorm,
* matrix norms: the max-row-sum norm and the spectral norm (exact from an eigensolver, a
  certified upper bound from matrix products alone, or power iteration).

Lower bounds are measured: ``jacobian_norm`` at a point, and ``lipschitz_lower_bound`` which
maximises it over inputs as in Kim et al. (2021), Appendix H.

Conventions: a map f acts on one set X in R^{N x D}; its Jacobian is the (N D) x (N D) matrix
d vec(f(X)) / d vec(X) with row-major vec. ``p = "inf"`` is the max-row-sum norm of that matrix
(the operator norm for the max-abs vector norm); ``p = 2`` is its largest singular value.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable

import torch
from torch import Tensor, nn

from .errors import InputError, NonFiniteError
from .validation import LOW_PRECISION, check_count

__all__ = [
    "lambertw0",
    "check_counts",
    "check_certificate_precision",
    "phi_inverse",
    "matrix_inf_norm",
    "spectral_norm_exact",
    "spectral_norm_bound",
    "power_iteration",
    "PowerIteration",
    "l2_attention_bound",
    "induced_attention_bound",
    "induced_core_constant",
    "l2_core_row_constant",
    "l2_core_column_constant",
    "l2_core_kernel_constant",
    "logit_margin_constant",
    "layernorm_lipschitz_bound",
    "centernorm_lipschitz_bound",
    "jacobian",
    "jacobian_norm",
    "mixed_operator_norm",
    "lipschitz_lower_bound",
]

_INF_NAMES = ("inf", float("inf"), math.inf)
MIXED_NAMES = ("2,inf",)
CERTIFICATES = ("tight", "thm3.2")
SPECTRAL_NORMS = ("eigh", "squarings")


def _norm_name(p, mixed: bool = False) -> str:
    """Canonical name of a norm: ``"inf"``, ``"2"`` or, where ``mixed`` is allowed, ``"2,inf"``.

    ``"2,inf"`` is the mixed norm of a set X in R^{N x D}, max_i ||x_i||_2: the largest Euclidean
    norm of an element. Only the certificates of tied L2 attention are derived for it, so other
    callers refuse it.
    """
    if mixed and p in MIXED_NAMES:
        return "2,inf"
    if p in _INF_NAMES:
        return "inf"
    if p in (2, "2", 2.0):
        return "2"
    expected = "'inf', 2 or '2,inf'" if mixed else "'inf' or 2"
    raise InputError(f"norm must be {expected}, got {p!r}")


# ----------------------------------------------------------------------------- Lambert W


def lambertw0(x: Tensor | float, iterations: int = 3, check: bool = True) -> Tensor:
    """Principal branch W_0 of the Lambert W function, w e^w = x, for x >= 0.

    Winitzki's approximation W(x) ~ L (1 - log(1 + L) / (2 + L)), L = log(1 + x) (relative error
    below 2% on [0, inf)) is refined by Halley's method, which converges cubically:

        w <- w - f / (e^w (w + 1) - (w + 2) f / (2 w + 2)),   f = w e^w - x.

    From that start two iterations are within 2e-15 relative of W_0 in float64 over
    [1e-300, 1e300], and three (the default) reach its rounding error there (the tests check the
    whole range). The derivative is the closed form W'(x) = 1 / (e^W (1 + W)) (differentiating
    w e^w = x), not that of the iterations: one operation in the backward pass instead of the
    iterations' graph, and differentiable again (second derivatives, ``torch.func``).

    Arguments:
        x: non-negative values (tensor or float).
        iterations: number of Halley steps.
        check: refuse negative and NaN entries (reads the values back from their device; the
            certificates, whose arguments are sums of exponentials, pass ``False``).

    Examples:
        >>> float(lambertw0(math.e))
        1.0
        >>> x = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
        >>> w = lambertw0(x)
        >>> bool(torch.isclose(torch.autograd.grad(w, x)[0], 1 / (w.exp() * (1 + w))))
        True
    """
    x = torch.as_tensor(x, dtype=torch.get_default_dtype() if not torch.is_tensor(x) else None)
    if not x.is_floating_point():
        x = x.to(torch.get_default_dtype())
    if check and ((x < 0).any() or torch.isnan(x).any()):
        raise InputError("lambertw0 is implemented for x >= 0 only")
    return _LambertW0.apply(x, iterations)


class _LambertW0(torch.autograd.Function):
    """W_0 by Halley's method, with the closed-form derivative (see :func:`lambertw0`)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, iterations: int) -> Tensor:
        log1p = torch.log1p(x)
        w = log1p * (1 - torch.log1p(log1p) / (2 + log1p))
        for _ in range(iterations):
            ew = torch.exp(w)
            f = w * ew - x
            w = w - f / (ew * (w + 1) - (w + 2) * f / (2 * w + 2))
        # W_0(0) = 0 and W_0(inf) = inf (the iterations would give NaN there)
        return torch.where(x == 0, torch.zeros_like(w), torch.where(torch.isinf(x), x, w))

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(output)  # the output: a second derivative goes through W again

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        (w,) = ctx.saved_tensors
        return grad / (torch.exp(w) * (1 + w)), None


@torch.compiler.disable  # a host-side constant: not traced
@functools.lru_cache(maxsize=4096)
def _phi_inverse_of_count(n: int) -> float:
    """phi^{-1}(n - 1) for one count n >= 1, as a float (cached: the bounds of attention on sets
    of one size reuse it on every call)."""
    return float(phi_inverse(float(n - 1)))


def phi_inverse(n_minus_one: Tensor | float, check: bool = True) -> Tensor:
    """phi^{-1}(N - 1) = W_0((N - 1) / e), where phi(x) = x exp(x + 1) (Kim et al. 2021, Thm 3.2).

    Solving x e^{x + 1} = N - 1 gives x e^x = (N - 1) / e; the paper prints W_0(N / e), which is
    larger and so also a valid, looser bound. ``check``: as in :func:`lambertw0`.
    """
    return lambertw0(torch.as_tensor(n_minus_one, dtype=torch.float64) / math.e, check=check)


# ----------------------------------------------------------------------------- matrix norms


def check_counts(n, what: str = "sequence length"):
    """``n``, the number(s) of keys a certificate is asked for, refused unless it is a positive
    integer, a non-empty range of them or an integer tensor (or list) of them: a count of 2.5
    or NaN certifies no set. A tensor is checked on its device (one read back).

    Examples:
        >>> check_counts(range(1, 4))
        range(1, 4)
        >>> check_counts(2.5)
        Traceback (most recent call last):
        ...
        flowattn.errors.InputError: sequence length must be an integer >= 1 (or a range or ...
    """
    if isinstance(n, bool) or not isinstance(n, (numbers.Integral, range, Tensor, list, tuple)):
        raise InputError(f"{what} must be an integer >= 1 (or a range or an integer tensor of "
                         f"them), got {n!r}")
    if isinstance(n, numbers.Integral):
        return check_count(n, what)
    if isinstance(n, range):
        if len(n) == 0 or min(n[0], n[-1]) < 1:  # a range's least is at one of its ends
            raise InputError(f"{what} must be >= 1, got {n}")
        return n
    counts = torch.as_tensor(n)
    if counts.is_floating_point() or counts.is_complex() or counts.dtype == torch.bool:
        raise InputError(f"{what} counts must be integers, got a tensor of dtype {counts.dtype}")
    if counts.numel() == 0 or (counts < 1).any():
        raise InputError(f"{what} must be >= 1, got {n}")
    return n if isinstance(n, Tensor) else counts


def check_certificate_precision(*weights: Tensor) -> None:
    """Refuse weights in half precision: a certificate is evaluated in its weights' precision,
    and in float16 or bfloat16 neither its rounding nor the CPU's eigensolvers serve (mixed
    precision keeps the weights in float32 under ``torch.autocast``).

    Examples:
        >>> check_certificate_precision(torch.eye(2, dtype=torch.bfloat16))
        Traceback (most recent call last):
        ...
        flowattn.errors.InputError: a certified bound needs float32 or float64 weights, got ...
    """
    for w in weights:
        if w.dtype in LOW_PRECISION:
            raise InputError(
                f"a certified bound needs float32 or float64 weights, got {w.dtype}: keep the "
                "module in float32 and run it under torch.autocast for mixed precision (its "
                "certificate is then evaluated in float32)")


def _empty_norm(w: Tensor, name: str) -> Tensor | None:
    """Refuse a ``w`` of fewer than two dimensions (a norm ``name`` of matrices was asked for);
    for empty matrices their norm, 0 (with the derivative of an empty sum), else None."""
    if not isinstance(w, Tensor) or w.dim() < 2:
        got = f"shape {tuple(w.shape)}" if isinstance(w, Tensor) else type(w).__name__
        raise InputError(f"{name} takes a matrix or a batch of them, got {got}")
    return w.abs().sum(dim=(-2, -1)) if w.shape[-1] == 0 or w.shape[-2] == 0 else None


def matrix_inf_norm(w: Tensor) -> Tensor:
    """||W||_inf = max_i sum_j |W_ij| (over the last two dimensions)."""
    if (zero := _empty_norm(w, "matrix_inf_norm")) is not None:
        return zero
    return w.abs().sum(dim=-1).amax(dim=-1)


def spectral_norm_exact(w: Tensor) -> Tensor:
    r"""||W||_2 = sigma_max(W), exact, batched over leading dims.

    With v the top eigenvector of the smaller Gram matrix (W^T W for a tall or square W, else
    W W^T; a symmetric eigensolver, ``torch.linalg.eigh``), sigma_max = ||W v|| (or
    ||W^T v||). The eigenvector is held constant, so the derivative is u v^T, that of
    sigma_max (u = W v / sigma_max; 0 at W = 0), and the value is never above sigma_max:
    ||W v|| <= sigma_max for every unit v, and the rounding error of v enters only to second
    order. A symmetric eigensolver costs less than an SVD on the CPU and on a GPU (measured in
    ``benchmarks/attention.py``); where it reports a failure to converge (as CUDA's can on
    ill-conditioned Gram matrices) the largest singular value is taken instead.

    Examples:
        >>> w = torch.tensor([[3.0, 0.0], [0.0, 4.0], [0.0, 0.0]])
        >>> float(spectral_norm_exact(w))
        4.0
    """
    if (zero := _empty_norm(w, "spectral_norm_exact")) is not None:
        return zero
    tall = w.shape[-1] <= w.shape[-2]
    try:
        with torch.no_grad():
            # the Gram matrix of W / max|W|: its eigenvectors are W's, and its entries stay
            # within range for every finite W (those of W^T W overflow float32 from |W| ~ 1e19)
            scale = w.abs().amax(dim=(-2, -1), keepdim=True).clamp_min(torch.finfo(w.dtype).tiny)
            scaled = w / scale
            gram = scaled.mT @ scaled if tall else scaled @ scaled.mT
            v = torch.linalg.eigh(gram).eigenvectors[..., -1:]  # (..., q, 1), ascending order
    except torch.linalg.LinAlgError:
        try:
            return torch.linalg.matrix_norm(w, ord=2)
        except torch.linalg.LinAlgError as error:
            if bool(torch.isfinite(w).all()):
                raise
            raise NonFiniteError(
                f"a spectral norm of a {w.dtype} matrix holding NaN or Inf was asked for: a "
                "certificate of weights too large for their dtype overflows (scale them down or "
                "use float64)"
            ) from error
    return torch.linalg.vector_norm(w @ v if tall else w.mT @ v, dim=(-2, -1))


def spectral_norm_bound(w: Tensor, squarings: int = 10) -> Tensor:
    r"""A certified upper bound on ||W||_2 = sigma_max(W) from matrix products alone, batched
    over leading dims.

    With G = W^T W (or W W^T, the smaller Gram matrix, q x q) and k = 2^``squarings``::

        sigma_max^{2k} = lambda_max(G)^k <= tr(G^k) = sum_i lambda_i^k <= r lambda_max(G)^k,

    so tr(G^k)^{1/(2k)} is at least sigma_max and at most r^{1/(2k)} sigma_max, r the rank of
    W: with the default k = 1024 at most 0.24 % above it for r <= 128 and 0.31 % for r <= 512,
    and within about 10^-6 of it when the top singular value stands apart. G^k is formed by
    repeated squaring in float64, rescaled to unit trace at every step (the logarithms of the
    scales summed), so nothing overflows; a factor 1 + 4 q eps (float64's eps, then the result's
    dtype's) covers the rounding of the products and of the final cast, so the value is never
    below sigma_max. The column of G^k with the largest diagonal entry is proportional to a top
    eigenvector v (G^k / tr G^k -> v v^T); the derivative is that of ||W v|| with v held
    constant, u v^T, which is sigma_max's, as for :func:`spectral_norm_exact`.

    It needs no eigensolver and no host synchronisation: ``squarings`` + 2 batched products.
    On the CPU the float64 products cost more than the eigensolver; on a GPU, where cuSOLVER's
    small eigensolvers launch many kernels and read their convergence back at every sweep, the
    contractive language model trains 1.12x faster with it at D = 128 and 4.9x faster at
    D = 512 (``docs/benchmarks.md``). The certificates take it with
    ``spectral_norms="squarings"``.

    Examples:
        >>> w = torch.tensor([[3.0, 0.0], [0.0, 4.0], [0.0, 0.0]])
        >>> b = float(spectral_norm_bound(w))
        >>> 4.0 <= b < 4.0 * (1 + 1e-5)
        True
    """
    if (zero := _empty_norm(w, "spectral_norm_bound")) is not None:
        return zero
    if squarings < 1:
        raise InputError(f"squarings must be >= 1, got {squarings}")
    tall = w.shape[-1] <= w.shape[-2]
    with torch.no_grad():
        w64 = w.detach().to(torch.float64)
        g = w64.mT @ w64 if tall else w64 @ w64.mT
        tiny = torch.finfo(torch.float64).tiny
        log_bound = g.new_zeros(g.shape[:-2])  # sum_j 2^-j log tr(G_j), G_j the rescaled powers
        weight = 1.0
        for _ in range(squarings):
            trace = g.diagonal(dim1=-2, dim2=-1).sum(-1).clamp_min(tiny)
            log_bound = log_bound + weight * trace.log()
            g = g / trace[..., None, None]
            g = g @ g
            weight /= 2
        diagonal = g.diagonal(dim1=-2, dim2=-1)
        log_bound = log_bound + weight * diagonal.sum(-1).clamp_min(tiny).log()
        q = g.shape[-1]
        slack = (1 + 4 * q * torch.finfo(torch.float64).eps) * (1 + 4 * torch.finfo(w.dtype).eps)
        bound = (torch.exp(log_bound / 2) * slack).to(w.dtype)
        index = diagonal.argmax(dim=-1, keepdim=True).unsqueeze(-2)  # (..., 1, 1)
        v = torch.take_along_dim(g, index, dim=-1)  # (..., q, 1): the dominant column
        v = (v / torch.linalg.vector_norm(v, dim=-2, keepdim=True).clamp_min(tiny)).to(w.dtype)
    estimate = torch.linalg.vector_norm(w @ v if tall else w.mT @ v, dim=(-2, -1))
    return estimate + (bound - estimate).detach()


def _spectral_norm(method: str) -> Callable[[Tensor], Tensor]:
    """The spectral-norm function a certificate uses: ``"eigh"`` (:func:`spectral_norm_exact`)
    or ``"squarings"`` (:func:`spectral_norm_bound`)."""
    if method not in SPECTRAL_NORMS:
        raise InputError(f"spectral_norms must be one of {SPECTRAL_NORMS}, got {method!r}")
    return spectral_norm_exact if method == "eigh" else spectral_norm_bound


def power_iteration(
    w: Tensor,
    u: Tensor | None = None,
    tol: float = 1e-6,
    max_iter: int = 100,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Largest singular value of a matrix by power iteration on W^T W.

    Starts from ``u`` (a left singular vector estimate, persistent across calls) and stops when
    the estimate changes by less than ``tol`` relative. The returned sigma = u^T W v carries
    gradients to ``w`` with u, v held fixed (Miyato et al. 2018). Power iteration approaches
    sigma_max from below: use ``spectral_norm_exact`` when a certificate is needed.

    Returns:
        (sigma, u, v), with u, v detached unit vectors.
    """
    if w.dim() != 2:
        raise InputError(f"power_iteration expects a matrix, got shape {tuple(w.shape)}")
    with torch.no_grad():
        if u is None:
            u = torch.randn(w.shape[0], generator=generator, dtype=w.dtype).to(w.device)
        u = u / u.norm().clamp_min(torch.finfo(w.dtype).tiny)
        previous = None
        for _ in range(max_iter):
            v = w.t() @ u
            v = v / v.norm().clamp_min(torch.finfo(w.dtype).tiny)
            wu = w @ v
            sigma = wu.norm()
            u = wu / sigma.clamp_min(torch.finfo(w.dtype).tiny)
            if previous is not None and abs(sigma - previous) <= tol * sigma:
                break
            previous = sigma
    return u @ (w @ v), u, v


class PowerIteration(nn.Module):
    """Spectral-norm estimator keeping its singular vector between calls.

    Each call runs a few power iterations from the stored vector, so during training the
    estimate tracks the slowly changing weight at the cost of one or two matrix-vector products.

    Arguments:
        rows: number of rows of the matrices it will see.
        tol: relative tolerance of the iteration.
        max_iter: iterations at most per call.

    Examples:
        >>> est = PowerIteration(4)
        >>> w = torch.diag(torch.tensor([3.0, 1.0, 0.5, 0.1]))
        >>> round(float(est(w)), 4)
        3.0
    """

    def __init__(self, rows: int, tol: float = 1e-6, max_iter: int = 100):
        super().__init__()
        self.tol, self.max_iter = tol, max_iter
        g = torch.Generator().manual_seed(0)
        self.register_buffer("u", torch.randn(rows, generator=g))

    def forward(self, w: Tensor) -> Tensor:
        sigma, u, _ = power_iteration(w, self.u.to(w.dtype), self.tol, self.max_iter)
        self.u.copy_(u)
        return sigma


# ----------------------------------------------------------------------------- certificates


def l2_attention_bound(
    n: int | range | Tensor,
    w_q: Tensor,
    w_v: Tensor,
    w_o: Tensor,
    norm: str | int = "inf",
    method: str = "tight",
    margin: Tensor | float | None = None,
    weighted_counts: Tensor | None = None,
    spectral_norms: str = "eigh",
    causal: bool | None = None,
) -> Tensor:
    """Certified Lipschitz bound of tied L2 multi-head attention F for sets of ``n`` elements.

    With H heads of width d = D / H, per-head W^{Q,h}, W^{V,h} in R^{D x d} and W^O in R^{D x D}
    (row convention, F(X) = [heads] W^O):

    * ``method="thm3.2"``: Theorem 3.2 of Kim et al. (2021), a product of per-matrix norms::

        Lip_inf <= (4 phi^{-1}(N-1) + 1/sqrt(d)) ||W^O^T||_inf
                   max_h ||W^{Q,h}||_inf ||W^{Q,h}^T||_inf  max_h ||W^{V,h}^T||_inf
        Lip_2   <= sqrt(N)/sqrt(d) (4 phi^{-1}(N-1) + 1)
                   sqrt(sum_h ||W^{Q,h}||_2^4 ||W^{V,h}||_2^2) ||W^O||_2

      (the paper prints ||W^{Q,h}||_2^2 in the 2-norm bound; its own proof, eqs. (34)-(35),
      gives the fourth power: each head's core bound carries ||W^{Q,h}||_2^2, and the
      printed form falls below the Lipschitz constant when the query weights are large:
      W^Q x 10 with W^V, W^O / 10 does it at D = 4, H = 2)

    * ``method="tight"`` (default): each head factors as f_h(X) = g(X W^{Q,h} / d^{1/4}) d^{1/4}
      M_h with a parameter-free core g(Z) = softmax(-dist^2(Z)) Z and the product
      M_h = W^{Q,h T} W^{V,h} W^{O,h} / sqrt(d) (W^{O,h}: the rows of W^O that head h feeds).
      The bound uses norms of M_h and of G_h = W^{Q,h} M_h instead of products of norms, with
      c = phi^{-1}(N-1), beta_h = ||W^{Q,h}||_2, omega_h >= ||W^{Q,h}||_{2->1}::

        Lip_inf   <= max_r sum_h ( ||G_h e_r||_1 + 4 c omega_h ||M_h e_r||_2 )
        Lip_2,inf <= min( min(sqrt(1^T Gamma^G 1), sqrt(H) ||[G_h]_h||_2)
                          + 4 c min(sqrt(beta^T Gamma beta), ||[M_h]_h||_2 ||beta||_2),
                          R_N sum_h beta_h ||M_h||_2 )   (the last for H <= 2)
        Lip_2     <= min( kappa_2(N) min_lambda ||[lambda_h M_h]_h||_2 ||[W^{Q,h}/lambda_h]_h||_2,
                          sqrt(N) Lip_2,inf bound )

      with Gamma_hk = ||M_h M_k^T||_2, Gamma^G_hk = ||G_h G_k^T||_2,
      lambda in {1, beta, sqrt(beta / mu)} (mu_h = ||M_h||_2: both factors of a head balanced) and
      kappa_2(N) = min(sqrt(N) R_N, sqrt(R_N C_N)), R_N the block-row bound of
      :func:`l2_core_row_constant` (1 + 4c, or 2 c_2 - 1 from N = 7 on), C_N the block-column
      bound of :func:`l2_core_column_constant`, and for full attention (``causal=False``, no
      ``margin``) the crowded C_N (``full=True``) and also N^{1/4} (1 + 2 sqrt(c)) + 2c
      (:func:`l2_core_kernel_constant`, the smaller from N = 53 on). The inf- and 2-norm
      values returned are the minimum of these and Theorem 3.2 (both are certificates), so
      never looser than the paper's. The derivation is in ``docs/attention.md``.

    ``norm="2,inf"`` is the mixed norm max_i ||x_i||_2 over the elements of a set (tight method
    only). With masking (App. G) the bound holds with N the number of keys a row sees, so ``n``
    may be a tensor of per-row counts; the result then has its shape. A ``range`` of counts
    gives the bound for each (a table to look rows up in), computed without reading any tensor
    back. Differentiable in the weights.

    ``margin`` (tight method only) certifies attention whose logits carry a constant offset
    beyond the distance term: l_ij = -||z_i - z_j||^2 + b_h(i, j) with
    b_h(i, j) - b_h(i, i) <= B_h for every row (a self-offset beta_h, a bounded relative-position
    bias). ``margin`` holds B_h, one value per head (H,) or one for all; the bounds then use
    c_h = W_0((N - 1) e^{B_h} / e) in place of c (see :func:`logit_margin_constant`).
    ``weighted_counts`` (with ``margin``) sharpens that: S_h (..., H) for each count of ``n``,
    the largest sum over a row's other keys of e^{b_h(i, j) - b_h(i, i)} (at most
    (N - 1) e^{B_h}; :meth:`~flowattn.attention.offsets.LogitOffsets.weighted_counts`), and
    c_h = W_0(S_h / e).

    Arguments:
        n: sequence length(s) N >= 1.
        w_q: (H, D, d) query (= key) weights, row convention x^T W.
        w_v: (H, D, d) value weights.
        w_o: (D, D) output weights, applied as [heads] W^O.
        norm: "inf", 2 or "2,inf".
        method: "tight" or "thm3.2".
        margin: B_h, the most by which a row's other logits may exceed its own beyond the
            distance term (tight method only); None for plain L2 attention (B = 0).
        weighted_counts: S_h (..., H), the offsets' weighted count of other keys for each
            count of ``n`` (tight method, with ``margin``); None: (n - 1) e^{B_h}.
        spectral_norms: how every spectral norm is taken: ``"eigh"``, exact from a symmetric
            eigensolver (:func:`spectral_norm_exact`), or ``"squarings"``, a certified upper
            bound from matrix products alone (:func:`spectral_norm_bound`: at most about
            10^-6 above the exact one for trained weights, no host synchronisation; the faster
            on a GPU).
        causal: which calls the bound is for: ``None`` (default) holds for causal and full
            calls alike; ``False`` full calls only, where every element sees every other of
            its set (padded elements aside), which lets the 2-norm bound use the kernel
            constant; ``True`` causal calls only (no difference here; the offsets' weighted
            counts are taken by the caller).

    Examples:
        >>> eye = torch.eye(1, dtype=torch.float64)
        >>> b = l2_attention_bound(2, eye[None], eye[None], eye)
        >>> round(float(b), 6)  # 4 W0(1/e) + 1, for either method at identity weights
        2.113858
    """
    if method not in CERTIFICATES:
        raise InputError(f"method must be one of {CERTIFICATES}, got {method!r}")
    norm = _norm_name(norm, mixed=method == "tight")
    spectral = _spectral_norm(spectral_norms)
    check_certificate_precision(w_q, w_v, w_o)
    heads, dim, head_dim = w_q.shape
    if w_v.shape != w_q.shape or w_o.shape != (dim, dim) or heads * head_dim != dim:
        raise InputError(
            f"inconsistent weight shapes: w_q {tuple(w_q.shape)}, w_v {tuple(w_v.shape)}, "
            f"w_o {tuple(w_o.shape)}"
        )
    # Counts given as numbers (or host tensors) are checked and turned into the constants on
    # the host, then moved: no read back from the weights' device.
    w0_of_count = None
    n = check_counts(n)
    if isinstance(n, (int, range)):  # the constants from a cache: no tensor read
        counts = [n] if isinstance(n, int) else list(n)
        w0_of_count = [_phi_inverse_of_count(k) for k in counts]
        if isinstance(n, int):
            w0_of_count = w0_of_count[0]
        n_host = torch.tensor(n if isinstance(n, int) else counts)
    else:
        n_host = torch.as_tensor(n)
    n = n_host.to(w_q.device)
    if weighted_counts is not None and margin is None:
        raise InputError("weighted_counts needs the margin of the same offsets")
    if margin is not None:
        if method != "tight":
            raise InputError(
                "Theorem 3.2 assumes the self-logit is the row's largest (no offset or position "
                "bias): use method='tight' with a logit margin"
            )
        margin = torch.as_tensor(margin, dtype=w_q.dtype, device=w_q.device).expand(heads)
        if weighted_counts is None:
            c = logit_margin_constant(n.unsqueeze(-1), margin)  # (..., H)
        else:
            # sums of exponentials, non-negative: no check, so no read back from the device
            c = phi_inverse(weighted_counts, check=False).to(device=w_q.device, dtype=w_q.dtype)
        return _tight_l2_attention_bound(n, c, w_q, w_v, w_o, norm, margin, n_host, spectral,
                                         causal)
    if w0_of_count is not None:
        w0 = torch.tensor(w0_of_count, dtype=w_q.dtype, device=w_q.device)
    else:
        w0 = phi_inverse((n_host - 1).to(torch.float64)).to(device=w_q.device, dtype=w_q.dtype)
    if method == "thm3.2":
        return _theorem_3_2(n, w0, w_q, w_v, w_o, norm, spectral)
    c = w0.unsqueeze(-1).expand(*w0.shape, heads)
    tight = _tight_l2_attention_bound(n, c, w_q, w_v, w_o, norm, counts=n_host,
                                      spectral=spectral, causal=causal)
    if norm == "2,inf":
        return tight
    # both are certificates, so their minimum is one: never looser than the paper's
    return torch.minimum(tight, _theorem_3_2(n, w0, w_q, w_v, w_o, norm, spectral))


def _theorem_3_2(n: Tensor, w0: Tensor, w_q: Tensor, w_v: Tensor, w_o: Tensor, norm: str,
                 spectral: Callable[[Tensor], Tensor] = spectral_norm_exact):
    head_dim = w_q.shape[-1]
    if norm == "inf":
        q_term = (matrix_inf_norm(w_q) * matrix_inf_norm(w_q.transpose(1, 2))).amax()
        v_term = matrix_inf_norm(w_v.transpose(1, 2)).amax()
        o_term = matrix_inf_norm(w_o.t())
        return (4 * w0 + head_dim**-0.5) * o_term * q_term * v_term
    tiny = torch.finfo(w_q.dtype).tiny  # zero weights: a finite derivative of sqrt at 0
    # sqrt(sum_h ||J_{f^h}||^2 ||W^{V,h}||^2) with ||J_{f^h}|| proportional to ||W^{Q,h}||^2 (the
    # paper's (34)-(35)): the fourth power of ||W^{Q,h}||, where the printed theorem has a square
    qv = torch.sqrt((spectral(w_q) ** 4 * spectral(w_v) ** 2).sum().clamp_min(tiny))
    sqrt_n = torch.sqrt(n.to(w_q.dtype))
    return sqrt_n * head_dim**-0.5 * (4 * w0 + 1) * qv * spectral(w_o)


def induced_attention_bound(
    n: int | range | Tensor, inducing: int, w_q: Tensor, w_v: Tensor, w_o: Tensor
) -> Tensor:
    """Certified Lip_{2,inf} bound of induced-point tied L2 attention on sets of ``n`` elements.

    :class:`~flowattn.attention.InducedL2MHA` with M = ``inducing`` points per head is, per head,
    a parameter-free core between the linear maps of the tight certificate (W^{Q,h} and
    M_h = W^{Q,h T} W^{V,h} W^{O,h} / sqrt(d)). Its Jacobian splits into a sub-convex
    combination of the input perturbations (the linear part, through G_h = W^{Q,h} M_h) and
    rank-one terms of norm at most r(N, M) beta_h ||M_h|| (:func:`induced_core_constant`, from
    Kim et al.'s Lemma F.2 in both stages)::

        Lip_2,inf <= min(sqrt(1^T Gamma^G 1), sqrt(H) ||[G_h]_h||_2)
                     + r min(sqrt(beta^T Gamma beta), ||[M_h]_h||_2 ||beta||_2),

    the mixed-norm bound of :func:`l2_attention_bound` with its 4 c replaced by r (derivation in
    ``docs/attention.md``). ``n`` an int, a ``range`` (a table over counts) or a tensor of
    counts; differentiable in the weights.

    Examples:
        >>> eye = torch.eye(1, dtype=torch.float64)
        >>> b = induced_attention_bound(2, 1, eye[None], eye[None], eye)
        >>> bool(torch.isclose(b, 1 + induced_core_constant(2, 1)))
        True
    """
    check_certificate_precision(w_q, w_v, w_o)
    heads, dim, head_dim = w_q.shape
    if w_v.shape != w_q.shape or w_o.shape != (dim, dim) or heads * head_dim != dim:
        raise InputError(
            f"inconsistent weight shapes: w_q {tuple(w_q.shape)}, w_v {tuple(w_v.shape)}, "
            f"w_o {tuple(w_o.shape)}"
        )
    rank_one = induced_core_constant(n, inducing).to(device=w_q.device, dtype=w_q.dtype)
    m = w_q.transpose(1, 2) @ w_v @ w_o.reshape(heads, head_dim, dim) / math.sqrt(head_dim)
    c = (rank_one / 4).unsqueeze(-1).expand(*rank_one.shape, heads)
    return _mixed_norm_bound(c, w_q, m, spectral_norm_exact(w_q))


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
    c = _phi_inverse_of_count(n)
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


def _pairwise_spectral(a: Tensor,
                       spectral: Callable[[Tensor], Tensor] = spectral_norm_exact) -> Tensor:
    """(H, p, q) -> (H, H): ||A_h A_k^T||_2 for every pair of heads, from the H (H + 1) / 2
    pairs h <= k (the matrix is symmetric: A_k A_h^T is the transpose of A_h A_k^T)."""
    heads, rows, _ = a.shape
    stack = a.reshape(heads * rows, -1)
    # every product A_h A_k^T is a block of the Gram matrix of the stacked rows: one matrix
    # product, then the blocks h <= k (a gather of p x p blocks, not of the A_h)
    blocks = (stack @ stack.mT).reshape(heads, rows, heads, rows).transpose(1, 2)
    h, k = torch.triu_indices(heads, heads, device=a.device)
    upper = spectral(blocks[h, k])
    gamma = a.new_zeros(heads, heads).index_put((h, k), upper)
    return gamma + gamma.triu(1).transpose(0, 1)


def _tight_l2_attention_bound(
    n: Tensor, c: Tensor, w_q: Tensor, w_v: Tensor, w_o: Tensor, norm: str,
    margin: Tensor | None = None, counts: Tensor | None = None,
    spectral: Callable[[Tensor], Tensor] = spectral_norm_exact, causal: bool | None = None,
) -> Tensor:
    """The tight certificate with c (..., H), Lemma F.2's constant of each head; ``margin``
    (H,) the logit margins (only the 2-norm's column constant reads it, on the host);
    ``spectral`` the spectral-norm function; ``causal`` False: full attention only (the 2-norm
    may use :func:`l2_core_kernel_constant`)."""
    heads, dim, head_dim = w_q.shape
    m = w_q.transpose(1, 2) @ w_v @ w_o.reshape(heads, head_dim, dim) / math.sqrt(head_dim)
    beta = spectral(w_q)  # (H,)
    if norm == "inf":
        g = w_q @ m  # (H, D, D): G_h = W^{Q,h} M_h = A_h W^{V,h} W^{O,h}
        omega = torch.minimum(dim**0.5 * beta, w_q.norm(dim=2).sum(dim=1))
        linear = g.abs().sum(dim=1).sum(dim=0)  # (D,): sum_h ||G_h e_r||_1
        rank_one = omega.unsqueeze(-1) * m.norm(dim=1)  # (H, D): omega_h ||M_h e_r||
        return (linear + 4 * c @ rank_one).amax(dim=-1)
    # the head-by-head form adds up the heads: it can win for one or two heads only (four
    # heads' cross terms are smaller), so larger models skip its W_0 (3-4 % of a training step)
    rows = l2_core_row_constant(c) if heads <= 2 else None
    mixed = _mixed_norm_bound(c, w_q, m, beta, spectral, rows)
    if norm == "2,inf":
        return mixed
    # any lambda_h > 0 may be moved across the heads (the stacks [lambda_h M_h]_h and
    # [W^{Q,h} / lambda_h]_h): 1, beta_h, and sqrt(beta_h / ||M_h||), which gives both factors
    # of head h the same norm; the three in one batch, kept away from 0 and inf (a zero
    # W^{Q,h} or M_h would give 0 / 0; its head then contributes 0 either way)
    tiny = torch.finfo(beta.dtype).tiny
    beta_ = beta.clamp_min(tiny)
    lam = torch.stack([torch.ones_like(beta), beta_,
                       beta_.sqrt() / spectral(m).clamp_min(tiny).sqrt()])[:, :, None, None]
    weights = (spectral((lam * m).reshape(3, dim, dim))
               * spectral((w_q / lam).permute(0, 2, 1, 3).reshape(3, dim, dim))).amin(dim=0)
    c = c.amax(dim=-1)  # the cores of all heads side by side: the largest constant
    row = l2_core_row_constant(c)
    top = None if margin is None else float(margin.detach().max())
    full = margin is None and causal is False  # rows crowd each other (no mask, no offsets)
    column = l2_core_column_constant(n if counts is None else counts, top, full)
    column = column.to(device=c.device, dtype=c.dtype)
    sqrt_n = torch.sqrt(n.to(c.dtype))
    kappa = torch.minimum(sqrt_n * row, torch.sqrt(row * column))
    if margin is None and causal is False:  # one kernel matrix for every row
        kernel = l2_core_kernel_constant(n if counts is None else counts)
        kappa = torch.minimum(kappa, kernel.to(device=c.device, dtype=c.dtype))
    return torch.minimum(kappa * weights, sqrt_n * mixed)


def _mixed_norm_bound(c: Tensor, w_q: Tensor, m: Tensor, beta: Tensor,
                      spectral: Callable[[Tensor], Tensor] = spectral_norm_exact,
                      rows: Tensor | None = None) -> Tensor:
    """The "2,inf" bound: linear part from G_h = W^{Q,h} M_h, rank-one part from M_h; c (..., H)
    (head h's rank-one term has norm at most 4 c_h beta_h); ``spectral`` the norm function.
    ``rows`` (..., H), the block-row constants R_h of the heads' cores (the L2 core's
    :func:`l2_core_row_constant`, which keeps the identity and the rank-one part of a block
    together), adds sum_h R_h beta_h ||M_h||: the smaller of the two is returned."""
    heads, dim, _ = w_q.shape
    # G_h G_k^T = Q_h (R_h M_h M_k^T R_k^T) Q_k^T with W^{Q,h} = Q_h R_h (orthonormal Q_h): the
    # d x d middle factor has the same spectral norm, at a fraction of the cost. Q is held
    # constant and R taken as Q^T W^{Q,h}: the value is the same, and so is its derivative
    # (the top singular vectors of G_h G_k^T lie in the span of Q), but it needs no QR
    # backward, which divides by R's diagonal and gives NaN for a rank-deficient W^{Q,h}
    # (a zeroed head, say).
    with torch.no_grad():
        q = torch.linalg.qr(w_q).Q  # (H, D, d)
    rm = (q.mT @ w_q) @ m  # (H, d, D)
    # c = 0 for rows that see one key, or zero weights (a zeroed W^O): keep sqrt's derivative
    # at 0 finite (the value moves by at most sqrt(tiny), upwards: still a bound)
    tiny = torch.finfo(m.dtype).tiny
    linear = torch.minimum(
        _pairwise_spectral(rm, spectral).sum().clamp_min(tiny).sqrt(),
        heads**0.5 * spectral(rm.reshape(dim, dim)),
    )
    gamma = _pairwise_spectral(m, spectral)
    cb = c * beta  # (..., H)
    rank_one = torch.minimum(
        ((cb @ gamma) * cb).sum(dim=-1).clamp_min(tiny).sqrt(),
        spectral(m.reshape(dim, dim)) * cb.norm(dim=-1),
    )
    if rows is None:
        return linear + 4 * rank_one
    # block (i, k) is sum_h W^{Q,h} C^h_ik M_h with C^h the core's blocks, whose rows sum to at
    # most R_h; ||M_h|| from gamma's diagonal ||M_h M_h^T||
    per_head = (rows * beta * gamma.diagonal().clamp_min(tiny).sqrt()).sum(dim=-1)
    return torch.minimum(linear + 4 * rank_one, per_head)


def layernorm_lipschitz_bound(
    weight: Tensor | None, dim: int, eps: float, norm: str | int = "inf"
) -> Tensor:
    """Certified Lipschitz bound of LayerNorm(x) = gamma * (x - mu) / sqrt(sigma^2 + eps) + beta.

    * inf-norm (Kim et al. 2021, App. N, eq. after (39)): eps^{-1/2} max|gamma| (D^2 - 2) / D.
    * 2-norm: the Jacobian is (sigma^2 + eps)^{-1/2} diag(gamma) P with P symmetric, eigenvalues
      0 (along 1), eps / (sigma^2 + eps) (along x - mu) and 1 elsewhere, so
      ||J||_2 <= eps^{-1/2} max|gamma|.

    For D = 1 the output is constant and the bound is 0.
    """
    norm = _norm_name(norm)
    check_count(dim, "dim")
    if not (math.isfinite(eps) and eps > 0):
        raise InputError(f"LayerNorm's eps must be a finite number > 0 for a bound, got {eps}")
    gamma = torch.ones(()) if weight is None else weight.detach().abs().max()
    if dim == 1:
        return torch.zeros_like(gamma)
    scale = gamma * eps**-0.5
    return scale * (dim**2 - 2) / dim if norm == "inf" else scale


def centernorm_lipschitz_bound(weight: Tensor | None, dim: int, norm: str | int = "inf") -> Tensor:
    """Lipschitz constant of CenterNorm(x) = gamma * D/(D-1) (x - mean x) + beta (LipsFormer).

    The Jacobian diag(gamma) D/(D-1) (I - 11^T/D) is constant, so these values are exact:
    2-norm D/(D-1) max|gamma| (the centring projection has norm 1); inf-norm 2 max|gamma|
    (each row of I - 11^T/D has absolute sum 2(D-1)/D).
    """
    norm = _norm_name(norm)
    if dim < 2:
        raise InputError(f"CenterNorm needs D >= 2, got D={dim}")
    gamma = torch.ones(()) if weight is None else weight.detach().abs().max()
    return 2 * gamma if norm == "inf" else gamma * dim / (dim - 1)


# ----------------------------------------------------------------------------- measurement


def jacobian(f: Callable[[Tensor], Tensor], x: Tensor, create_graph: bool = False) -> Tensor:
    """Full Jacobian of a map on one set: f: R^{N x D} -> R^{N' x D'}, as a 2-D matrix.

    Returns the (N' D') x (N D) matrix d vec f(X) / d vec X (row-major vec). With
    ``create_graph=True`` the Jacobian is itself differentiable (every attention module of
    flowattn is differentiable to any order, see :mod:`flowattn.attention.kernels`).
    """
    jac = torch.autograd.functional.jacobian(f, x, create_graph=create_graph, vectorize=True)
    out_numel = jac.numel() // x.numel()
    return jac.reshape(out_numel, x.numel())


def jacobian_norm(f: Callable[[Tensor], Tensor], x: Tensor, p="inf", create_graph=False) -> Tensor:
    """||J_f(X)||_p for p in {2, "inf", "2,inf"}: the local Lipschitz constant of f at X.

    "2,inf" is the operator norm for the mixed norm max_i ||x_i||_2 of sets X in R^{N x D}
    (see :func:`mixed_operator_norm`; f must map (N, D) to (N', D')): an ascent that returns a
    value at most the exact local norm (exact when the output elements are scalars), so still a
    lower bound on the Lipschitz constant.
    """
    name = _norm_name(p, mixed=True)
    jac = jacobian(f, x, create_graph=create_graph)
    if name == "inf":
        return matrix_inf_norm(jac)
    if name == "2":
        return spectral_norm_exact(jac)
    if x.dim() != 2:
        raise InputError(f"the 2,inf norm is for sets (N, D), got shape {tuple(x.shape)}")
    with torch.no_grad():
        out_shape = f(x.detach()).shape
    if len(out_shape) != 2:
        raise InputError(f"the 2,inf norm is for maps to sets (N', D'), got {tuple(out_shape)}")
    return mixed_operator_norm(jac.reshape(*out_shape, *x.shape))  # (N', D', N, D)


def mixed_operator_norm(blocks: Tensor, starts: int = 4, iterations: int = 100) -> Tensor:
    """max_i sup{ ||sum_k J_ik d_k||_2 : ||d_k||_2 <= 1 } for a block matrix (N', D', N, D).

    This is the operator norm of J for the norm max_i ||x_i||_2 on both sides. For each block
    row it maximises, over unit u, sum_k ||J_ik^T u||_2 (the dual form) by the monotone ascent
    d_k <- J_ik^T u / ||J_ik^T u||, u <- sum_k J_ik d_k / ||.||, from the top left singular vector
    of the block row and ``starts - 1`` fixed random directions. The value returned is reached
    by a unit u, so it never exceeds the exact norm; it is exact when D' = 1. Differentiable in
    ``blocks`` (with the maximising u held fixed).
    """
    n_out, d_out, n_in, d_in = blocks.shape
    rows = blocks.reshape(n_out, d_out, n_in * d_in)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        top = torch.linalg.svd(rows, full_matrices=False).U[:, :, :1].transpose(1, 2)
        random = torch.randn(n_out, starts - 1, d_out, generator=generator, dtype=rows.dtype)
        u = torch.cat([top, random.to(rows.device)], dim=1)  # (N', S, D')
        tiny = torch.finfo(rows.dtype).tiny
        u = u / u.norm(dim=-1, keepdim=True).clamp_min(tiny)
        previous = None
        for step in range(iterations):
            d = torch.einsum("isa,iakb->iskb", u, blocks)  # J_ik^T u, (N', S, N, D)
            if step % 10 == 0:  # the values increase monotonically: stop once they settle
                current = d.norm(dim=-1).sum(dim=-1)
                if previous is not None and (current - previous).abs().max() <= 1e-10 * (
                    current.abs().max() + tiny
                ):
                    break
                previous = current
            d = d / d.norm(dim=-1, keepdim=True).clamp_min(tiny)
            u = torch.einsum("iakb,iskb->isa", blocks, d)
            u = u / u.norm(dim=-1, keepdim=True).clamp_min(tiny)
    values = torch.einsum("isa,iakb->iskb", u, blocks).norm(dim=-1).sum(dim=-1)  # (N', S)
    return values.amax()


def lipschitz_lower_bound(
    f: Callable[[Tensor], Tensor],
    shape: tuple[int, int],
    p="inf",
    restarts: int = 5,
    steps: int = 100,
    lr: float = 0.1,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float64,
    device=None,
) -> tuple[float, Tensor]:
    """Lower bound on Lip_p(f) by maximising ||J_f(X)||_p over X (Kim et al. 2021, App. H).

    Each restart draws c ~ U[0, 10] and X_ij ~ U[-c, c], then runs Adam (learning rate ``lr``)
    on -||J_f(X)||_p. Any value found is a valid lower bound on the Lipschitz constant.

    Returns:
        (best norm found, the input X that reached it).

    Raises:
        InputError: a ``shape`` that is not two positive integers (N, D), ``restarts`` below 1,
            ``steps`` below 0 or a learning rate that is not a finite number > 0.
        NonFiniteError: if the Jacobian's norm is NaN or Inf at every point tried.

    Examples:
        >>> lipschitz_lower_bound(lambda x: 3 * x, (2, 2), restarts=1, steps=0)[0]  # linear
        3.0
    """
    if not (isinstance(shape, (tuple, list, torch.Size)) and len(shape) == 2):
        raise InputError(f"shape must be (N, D), two integers, got {shape!r}")
    shape = (check_count(shape[0], "shape's N"), check_count(shape[1], "shape's D"))
    restarts, steps = check_count(restarts, "restarts"), check_count(steps, "steps", low=0)
    if isinstance(lr, bool) or not isinstance(lr, numbers.Real) or not 0 < lr < math.inf:
        raise InputError(f"lr must be a finite number > 0, got {lr!r}")
    if generator is None:
        generator = torch.Generator().manual_seed(0)
    best, best_x = -math.inf, None
    for _ in range(restarts):
        c = 10 * torch.rand((), generator=generator, dtype=dtype)
        x0 = (2 * torch.rand(shape, generator=generator, dtype=dtype) - 1) * c
        x = x0.to(device).requires_grad_(True)
        opt = torch.optim.Adam([x], lr=lr)
        for _ in range(steps + 1):
            value = jacobian_norm(f, x, p, create_graph=True)
            if value.item() > best and math.isfinite(value.item()):
                best, best_x = value.item(), x.detach().clone()
            if not value.requires_grad:  # the Jacobian does not depend on X (f is linear)
                break
            opt.zero_grad()
            (-value).backward()
            opt.step()
    if best_x is None:
        raise NonFiniteError(f"the Jacobian's {_norm_name(p, mixed=True)} norm was NaN or Inf "
                             f"at every one of the {restarts * (steps + 1)} points tried")
    return best, best_x
