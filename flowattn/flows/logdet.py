"""Estimators of log|det(I + J_g(x))| for residual maps on sets and sequences of shape (B, N, D).

Every estimator takes ``gx = g(x)`` computed *with* its autograd graph from an ``x`` that requires
grad, and obtains Jacobian products by vector-Jacobian products (VJPs); or, with ``vjp_fn``, the
branch's own product w -> w^T J (e.g. :meth:`flowattn.branches.LipschitzMLP.linearise`), made of
differentiable operations, which needs neither autograd's backward nor a double backward. The
Jacobian is that of the *restricted* map: padded elements (``mask`` False) are removed and, in
zero-centre-of-mass mode, the map is restricted to the subspace {sum_i x_i = 0}. Concretely,
with P the orthogonal projection onto the admissible coordinates, the estimators work with P J P;
the caller passes ``gx = P g(x)`` and every VJP result is projected by P again. Then
det(I + P J P) is the determinant of the restricted map (P J P is zero on the complement, where
I + P J P is I).

Precision: products, power-series terms and determinants are accumulated in ``x``'s dtype
(float32 or float64). Under ``torch.autocast`` the branch may compute in bfloat16 or float16;
each product is cast back to ``x``'s dtype before it enters a sum or a determinant.

References:
    Behrmann et al., "Invertible Residual Networks", ICML 2019, eq. (5)-(6) (power series and
    Hutchinson trace estimator); Chen et al., "Residual Flows for Invertible Generative
    Modeling", NeurIPS 2019, Thm. 1 (Russian roulette), Thm. 2 and eq. (8) (Neumann gradient
    series), §3.2 (memory-efficient gradient in the forward pass).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import KW_ONLY, dataclass

import torch
from torch import Tensor

from ..errors import InputError
from ..validation import present_weights
from .geometry import PROBES, project, sample_probes, vjp

__all__ = [
    "LogDetOptions",
    "exact_logdet",
    "jacobian_logdet",
    "series_logdet",
    "roulette_logdet",
    "sample_roulette_lengths",
    "roulette_tail_probability",
    "memory_efficient_logdet",
    "precise_series_logdet",
    "LOGDET_METHODS",
    "STRUCTURES",
]

STRUCTURES = ("full", "pointwise", "causal")
GRADIENTS = ("backprop", "neumann")
ROULETTE_LAWS = ("geometric", "poisson")
ROULETTE_LENGTHS = ("batch", "sample")
LOGDET_METHODS = ("auto", "exact", "series", "roulette")


@dataclass(frozen=True)
class LogDetOptions:
    r"""How an invertible residual block computes log|det(I + J_g(x))|.

    In training mode the block runs ``method``: ``"exact"`` (:func:`exact_logdet`, or the
    branch's closed-form Jacobian), ``"series"`` (:func:`series_logdet`), ``"roulette"``
    (:func:`roulette_logdet`) or ``"auto"`` (exact when the Jacobian is block-structured or
    N D <= ``exact_max_dim``, roulette otherwise). In evaluation mode it is always deterministic
    and accurate: exact where N D <= ``eval_exact_max_dim`` (or the Jacobian is
    block-structured), otherwise ``eval_n_terms`` series terms with probes drawn, in rounds of
    ``eval_n_samples``, from a generator seeded with ``eval_seed`` until the standard error of
    every set's estimate is at most ``eval_max_error`` nats per degree of freedom (or
    ``eval_max_samples`` probes are spent); see :func:`precise_series_logdet`.

    Attributes:
        method: ``"auto"``, ``"exact"``, ``"series"`` or ``"roulette"``.
        n_terms: terms of the truncated series.
        n_exact_terms: terms always computed by the roulette estimator.
        n_samples: Hutchinson probes per set.
        probe: ``"rademacher"`` or ``"gaussian"``.
        grad: ``"backprop"`` or ``"neumann"`` (the Neumann gradient series).
        memory_efficient: compute the log-det's gradient inside the forward pass, so that the
            peak memory does not grow with the number of terms
            (:func:`memory_efficient_logdet`).
        roulette: the law of the roulette length, ``"geometric"`` or ``"poisson"``.
        roulette_param: its p or lambda.
        roulette_lengths: ``"batch"`` (one length per call) or ``"sample"`` (one per set).
        exact_max_dim: the largest N D for which ``"auto"`` uses the full exact path in training
            (8 times more for a branch with a closed-form ``jacobian``).
        eval_exact_max_dim: the same in evaluation (no double backward there: cheaper).
        eval_n_terms: series terms in evaluation when exact is infeasible (``None``: from the
            branch bound, between 20 and 100).
        eval_n_samples: probes per round in evaluation when exact is infeasible.
        eval_max_error: the standard error, in nats per degree of freedom of a set, at which
            evaluation stops drawing probes.
        eval_max_samples: the most probes per set in evaluation.
        eval_seed: seed of the evaluation probes, re-seeded at every call or, inside
            :func:`~flowattn.flows.geometry.probe_stream`, drawn on from one stream.
        generator: torch.Generator of the training-time probes and lengths (``None``: torch's
            global RNG).

    Examples:
        >>> LogDetOptions("series", n_terms=20).n_terms
        20
    """

    method: str = "auto"
    _: KW_ONLY
    n_terms: int = 10
    n_exact_terms: int = 2
    n_samples: int = 1
    probe: str = "rademacher"
    grad: str = "neumann"
    memory_efficient: bool = False
    roulette: str = "geometric"
    roulette_param: float = 0.5
    roulette_lengths: str = "batch"
    exact_max_dim: int = 64
    eval_exact_max_dim: int = 512
    eval_n_terms: int | None = None
    eval_n_samples: int = 16
    eval_max_error: float = 2e-3
    eval_max_samples: int = 1024
    eval_seed: int = 0
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("method", self.method, LOGDET_METHODS),
            ("grad", self.grad, GRADIENTS),
            ("probe", self.probe, PROBES),
            ("roulette", self.roulette, ROULETTE_LAWS),
            ("roulette_lengths", self.roulette_lengths, ROULETTE_LENGTHS),
        ):
            if value not in allowed:
                raise InputError(f"LogDetOptions.{name} must be one of {allowed}, got {value!r}")
        for name, low in (("n_terms", 1), ("n_exact_terms", 0), ("n_samples", 1),
                          ("eval_n_samples", 1), ("eval_max_samples", 1)):
            value = getattr(self, name)
            if int(value) != value or value < low:
                raise InputError(f"LogDetOptions.{name} must be an integer >= {low}, got {value}")
            object.__setattr__(self, name, int(value))
        if self.eval_n_terms is not None:
            if int(self.eval_n_terms) != self.eval_n_terms or self.eval_n_terms < 1:
                raise InputError("LogDetOptions.eval_n_terms must be an integer >= 1 or None "
                                 f"(from the branch's bound), got {self.eval_n_terms}")
            object.__setattr__(self, "eval_n_terms", int(self.eval_n_terms))
        object.__setattr__(self, "memory_efficient", bool(self.memory_efficient))
        object.__setattr__(self, "roulette_param", float(self.roulette_param))
        check_roulette_param(self.roulette, self.roulette_param, "LogDetOptions.roulette_param")
        if self.generator is not None and not isinstance(self.generator, torch.Generator):
            raise InputError("LogDetOptions.generator must be a torch.Generator or None, got "
                             f"{type(self.generator).__name__}")
        if not (math.isfinite(self.eval_max_error) and self.eval_max_error >= 0):
            raise InputError("LogDetOptions.eval_max_error must be a finite number >= 0, got "
                             f"{self.eval_max_error}")
        object.__setattr__(self, "eval_max_error", float(self.eval_max_error))
        object.__setattr__(self, "exact_max_dim", int(self.exact_max_dim))
        object.__setattr__(self, "eval_exact_max_dim", int(self.eval_exact_max_dim))
        object.__setattr__(self, "eval_seed", int(self.eval_seed))


def _check_pair(gx: Tensor, x: Tensor, vjp_fn: Callable[[Tensor], Tensor] | None) -> None:
    if gx.shape != x.shape or x.dim() != 3:
        raise InputError(
            f"gx and x must both have shape (B, N, D); got {tuple(gx.shape)} and {tuple(x.shape)}"
        )
    if vjp_fn is None and (not x.requires_grad or gx.grad_fn is None):
        raise InputError("x must require grad and gx must be computed from x with its graph "
                         "(or pass the branch's own product as vjp_fn)")


Product = Callable[[Tensor, bool, bool], Tensor]


def _pointwise(structure: str) -> bool:
    if structure not in STRUCTURES:
        raise InputError(f"structure must be one of {STRUCTURES}, got {structure!r}")
    return structure == "pointwise"


def _products(gx: Tensor, x: Tensor, vjp_fn: Callable[[Tensor], Tensor] | None) -> Product:
    """(w, create_graph, batched) -> w^T P J, in ``x``'s dtype (the accumulation precision).

    Without ``vjp_fn``: autograd VJPs of ``gx``. With it: ``vjp_fn(w)``, under ``no_grad``
    unless a differentiable product is asked for (``vjp_fn`` handles leading batch dimensions).
    """
    if vjp_fn is None:
        return lambda w, create_graph, batched: vjp(gx, x, w, create_graph, batched)

    def product(w: Tensor, create_graph: bool, batched: bool) -> Tensor:
        if create_graph:
            return vjp_fn(w).to(x.dtype)
        with torch.no_grad():
            return vjp_fn(w).to(x.dtype)

    return product


def exact_logdet(
    gx: Tensor,
    x: Tensor,
    mask: Tensor | None = None,
    structure: str = "full",
    zero_com: bool = False,
    create_graph: bool = False,
    chunk_size: int | None = 256,
    vjp_fn: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    r"""Exact log|det(I + J)| per set, from Jacobian rows obtained by batched VJPs.

    * ``structure="full"``: all N D rows of the (N D x N D) Jacobian (N D VJPs, run in chunks of
      ``chunk_size`` vectors with ``is_grads_batched``), then ``slogdet``. Any N and D; cost
      O(N D) branch backward passes and O((N D)^3) for the determinant.
    * ``structure="causal"``: for a causal branch (g_i depends on x_j only for j <= i) the Jacobian
      is block lower-triangular, so log det(I + J) = sum_i log det(I + J_ii) with D x D blocks
      (REFERENCE §2). The rows are still obtained by N D VJPs, but only the diagonal blocks are
      kept: memory O(chunk_size B N D), determinant cost O(N D^3).
    * ``structure="pointwise"``: g_i depends on x_i only (block-diagonal Jacobian); D VJPs with
      the vectors sum_i e_{i,d} recover every diagonal block at once.

    Zero-centre-of-mass mode couples all elements, so it always uses the full path.

    Arguments:
        gx: P g(x), shape (B, N, D), with graph.
        x: the input, shape (B, N, D), requiring grad.
        mask: bool (B, N), True = present.
        structure: ``"full"``, ``"causal"`` or ``"pointwise"``.
        zero_com: restrict to the zero-centre-of-mass subspace.
        create_graph: keep the graph so that the result is differentiable (exact gradients).
        chunk_size: basis vectors per batched VJP call (``None``: all at once).
        vjp_fn: the branch's own product w -> w^T P J (leading batch dimensions allowed), used
            instead of autograd VJPs of ``gx``.

    Returns:
        Tensor (B,).

    Examples:
        >>> x = torch.randn(2, 3, 2, dtype=torch.float64, requires_grad=True)
        >>> gx = 0.5 * torch.tanh(x)
        >>> exact_logdet(gx, x, structure="pointwise").shape
        torch.Size([2])
    """
    _check_pair(gx, x, vjp_fn)
    product = _products(gx, x, vjp_fn)
    if structure not in STRUCTURES:
        raise InputError(f"structure must be one of {STRUCTURES}, got {structure!r}")
    B, N, D = x.shape
    if zero_com:
        structure = "full"
    eye_d = torch.eye(D, dtype=x.dtype, device=x.device)

    if structure == "pointwise":
        basis = eye_d.reshape(D, 1, 1, D).expand(D, B, N, D)
        rows = product(basis, create_graph, True)  # (D_out, B, N, D_in)
        rows = project(rows, mask)
        blocks = rows.permute(1, 2, 0, 3)  # (B, N, D_out, D_in) = J_ii
        return _block_logdet(blocks, mask)

    M = N * D
    step = M if chunk_size is None else max(1, chunk_size)
    eye_m = torch.eye(M, dtype=x.dtype, device=x.device)
    if structure == "causal":
        pieces = []
        for start in range(0, M, step):
            idx = torch.arange(start, min(start + step, M), device=x.device)
            basis = eye_m[idx].reshape(-1, 1, N, D).expand(-1, B, N, D)
            rows = project(product(basis, create_graph, True), mask)
            elem = idx // D
            # row (i, d) restricted to element i's columns: J_ii[d, :]
            pieces.append(rows[torch.arange(len(idx), device=x.device), :, elem, :])
            del rows
        diag = torch.cat(pieces, dim=0)  # (N D, B, D_in), ordered (i, d)
        blocks = diag.reshape(N, D, B, D).permute(2, 0, 1, 3)
        return _block_logdet(blocks, mask)

    pieces = []
    for start in range(0, M, step):
        basis = eye_m[start : start + step].reshape(-1, 1, N, D).expand(-1, B, N, D)
        pieces.append(project(product(basis, create_graph, True), mask, zero_com))
    jac = torch.cat(pieces, dim=0).reshape(M, B, M).transpose(0, 1)  # (B, rows, cols)
    return torch.linalg.slogdet(jac + eye_m)[1]


def jacobian_logdet(jac: Tensor, mask: Tensor | None = None, zero_com: bool = False) -> Tensor:
    """log|det(I + P J)| per set from a branch's own Jacobian ``jac`` of shape (B, N, D, N, D).

    Padded elements (``mask`` False) are cut out of J; with ``zero_com`` the rows are projected
    onto the zero-centre-of-mass subspace (P), which gives the log-det of the block restricted
    to it (I + P J is block-triangular in a basis of the subspace and its complement).

    Examples:
        >>> jac = 0.1 * torch.eye(6, dtype=torch.float64).reshape(1, 3, 2, 3, 2)
        >>> round(float(jacobian_logdet(jac)), 6) == round(6 * math.log(1.1), 6)
        True
    """
    return torch.linalg.slogdet(residual_matrix(jac, mask, zero_com))[1]


def residual_matrix(jac: Tensor, mask: Tensor | None = None, zero_com: bool = False) -> Tensor:
    """I + P J as a (B, N D, N D) matrix, from a branch's Jacobian of shape (B, N, D, N, D).

    Padded elements get identity rows and columns; with ``zero_com`` the rows are projected.
    """
    B, N, D = jac.shape[:3]
    if mask is not None:  # padded inputs: zero columns
        jac = jac * mask.to(jac.dtype)[:, None, None, :, None]
    # P acts on the outputs: move the input index ahead, as for a batch of VJP rows
    rows = project(jac.permute(3, 4, 0, 1, 2), mask, zero_com)  # (N_in, D_in, B, N, D)
    jac = rows.permute(2, 3, 4, 0, 1).reshape(B, N * D, N * D)
    return jac + torch.eye(N * D, dtype=jac.dtype, device=jac.device)


def _block_logdet(blocks: Tensor, mask: Tensor | None) -> Tensor:
    eye = torch.eye(blocks.shape[-1], dtype=blocks.dtype, device=blocks.device)
    per_element = torch.linalg.slogdet(blocks + eye)[1]  # (B, N)
    if mask is not None:
        per_element = per_element * mask.to(per_element.dtype)
    return per_element.sum(dim=1)


Draw = Callable[[], tuple[Tensor, Tensor]]


@torch.compiler.disable
def _draw_and_powers(
    draw: Draw,
    product: Product,
    mask: Tensor | None,
    zero_com: bool,
    create_graph: bool,
    pointwise: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """The random draws of a series estimate and its K products, eagerly.

    ``draw()`` gives the term weights (K,) or (B, K) and the projected probes (S, B, N, D).
    Returns the weights, the probes v ((B, N, D) for one probe, else (S, B, N, D)) and
    (P J^T P)^k v for k = 0..K stacked along a new first dimension, with a graph only if
    ``create_graph``. With ``pointwise`` (g_i depends on x_i only) and D < K the powers come
    from the Jacobian's D x D diagonal blocks, built from D products instead of K.

    Run eagerly, also under ``torch.compile``: the draws then come from the same random stream
    as without it, and the number of terms, which the roulette draws anew on every call, never
    reaches a compiled loop (which would be recompiled for every count). Each step is one
    product, a few large kernels; the code around, whose shapes only carry K, compiles once.
    """
    coeffs, probes = draw()
    batched = probes.shape[0] > 1
    v = probes if batched else probes[0]
    if not create_graph:
        v = v.detach()
    K, D = coeffs.shape[-1], v.shape[-1]
    if pointwise and not zero_com and D < K:
        # A block-diagonal Jacobian: its D x D blocks J_ii from D products, then the K powers
        # per element, w_i <- w_i J_ii, at the cost of D products instead of K.
        basis = torch.eye(D, dtype=v.dtype, device=v.device).reshape(D, 1, 1, D)
        rows = project(product(basis.expand(D, *v.shape[-3:]), create_graph, True), mask)
        blocks = rows.permute(1, 2, 0, 3)  # (B, N, D_out, D_in) = J_ii
        if not create_graph:
            blocks = blocks.detach()

        def step(w: Tensor) -> Tensor:
            return (w.unsqueeze(-2) @ blocks).squeeze(-2)
    else:

        def step(w: Tensor) -> Tensor:
            return project(product(w, create_graph, batched), mask, zero_com)

    w, powers = v, [v]
    for _ in range(K):
        w = step(w)
        if not create_graph:
            w = w.detach()
        powers.append(w)
    return coeffs, v, torch.stack(powers)


def _series_core(
    product: Product,
    x: Tensor,
    draw: Draw,
    mask: Tensor | None,
    zero_com: bool,
    grad: str,
    create_graph: bool,
    pointwise: bool = False,
) -> Tensor:
    """sum_k c_k v^T (P J P)^k v averaged over probes, with the chosen gradient.

    ``product`` is ``(w, create_graph, batched) -> w^T P J`` (see :func:`_products`); ``draw``
    gives the weights ``coeffs`` of tr(J^k), k = 1..K, of shape (K,) or (B, K), and the probes,
    of shape (S, B, N, D), already projected. The K terms are collected and weighted in one
    operation each (their dot products, the sum, and the Neumann vector u), not term by term.
    """
    if grad not in GRADIENTS:
        raise InputError(f"grad must be 'backprop' or 'neumann', got {grad!r}")
    backprop = grad == "backprop"
    coeffs, v, stacked = _draw_and_powers(draw, product, mask, zero_com,
                                          backprop and create_graph, pointwise)
    batched = v.dim() == 4
    B, K = x.shape[0], coeffs.shape[-1]
    c = coeffs.to(x.dtype)
    if c.dim() == 1:
        c = c.unsqueeze(0).expand(B, K)
    d = (stacked[1:] * v).sum(dim=(-2, -1))  # (K, [S], B): v^T (J^k v), per probe
    dots = (d.mean(dim=1) if batched else d).transpose(0, 1)  # (B, K), averaged over probes
    if backprop:
        return (c * dots).sum(dim=-1)
    # Neumann series (Chen et al. 2019, eq. 8): d/dθ c_k tr(J^k) = k c_k tr(J^(k-1) dJ/dθ), so the
    # gradient needs u^T dJ v with u = sum_{k=1}^K k c_k (J^T)^(k-1) v, built without a graph.
    c = c.detach()
    value = (c * dots).sum(dim=-1)
    if not create_graph:
        return value
    with torch.no_grad():
        ck = c * torch.arange(1, K + 1, dtype=x.dtype, device=x.device)
        weights = ck.transpose(0, 1).reshape(K, *([1] * (v.dim() - 3)), B, 1, 1)
        u = (weights * stacked[:-1]).sum(dim=0)
    surrogate = (project(product(u, True, batched), mask, zero_com) * v).sum(dim=(-2, -1))
    if batched:
        surrogate = surrogate.mean(dim=0)
    return value + surrogate - surrogate.detach()


def _series_coefficients(K: int, dtype=torch.float64, device=None) -> Tensor:
    k = torch.arange(1, K + 1, dtype=dtype, device=device)
    return (-1.0) ** (k + 1) / k


def series_logdet(
    gx: Tensor,
    x: Tensor,
    n_terms: int = 10,
    mask: Tensor | None = None,
    n_samples: int = 1,
    probe: str = "rademacher",
    grad: str = "backprop",
    zero_com: bool = False,
    generator: torch.Generator | None = None,
    create_graph: bool = False,
    vjp_fn: Callable[[Tensor], Tensor] | None = None,
    structure: str = "full",
) -> Tensor:
    r"""Truncated power series with Hutchinson probes (Behrmann et al. 2019, eq. 6):

    log det(I + J) = sum_{k>=1} (-1)^(k+1) tr(J^k) / k  ~  sum_{k=1}^n (-1)^(k+1) v^T J^k v / k,

    with E[v v^T] = I. Biased by the truncated tail, |bias| <= N D Lip^(n+1) / ((n+1)(1 - Lip)).

    Arguments:
        gx: P g(x) with graph (see the module docstring).
        x: the input of g, requiring grad.
        n_terms: number of series terms n.
        mask: bool (B, N), True = present.
        n_samples: probes per set, averaged.
        probe: ``"rademacher"`` or ``"gaussian"``.
        grad: ``"backprop"`` (differentiate through every term) or ``"neumann"`` (Chen et al.
            2019, eq. 8: the gradient series, built without a graph through the powers).
        zero_com: restrict to the zero-centre-of-mass subspace.
        generator: source of the probes.
        create_graph: return a differentiable estimate.
        vjp_fn: the branch's own product w -> w^T P J, used instead of autograd VJPs.
        structure: ``"pointwise"`` if g_i depends on x_i only: with D < ``n_terms`` the powers
            are then taken of the D x D diagonal blocks of J, built from D products (the same
            estimate, at the cost of D products instead of ``n_terms``); otherwise ``"full"``.

    Returns:
        Tensor (B,).

    Examples:
        >>> x = torch.randn(2, 3, 2, requires_grad=True)
        >>> series_logdet(0.3 * torch.sin(x), x, n_terms=5).shape
        torch.Size([2])
    """
    _check_pair(gx, x, vjp_fn)
    if n_terms < 1:
        raise InputError(f"n_terms must be >= 1, got {n_terms}")
    if n_samples < 1:
        raise InputError(f"n_samples must be >= 1, got {n_samples}")
    def draw() -> tuple[Tensor, Tensor]:
        probes = sample_probes((n_samples, *x.shape), probe, mask, zero_com, generator,
                               x.device, x.dtype)
        return _series_coefficients(n_terms, x.dtype, x.device), probes

    product = _products(gx, x, vjp_fn)
    return _series_core(product, x, draw, mask, zero_com, grad, create_graph,
                        _pointwise(structure))


def precise_series_logdet(
    gx: Tensor,
    x: Tensor,
    n_terms: int,
    mask: Tensor | None = None,
    zero_com: bool = False,
    probe: str = "rademacher",
    generator: torch.Generator | None = None,
    create_graph: bool = False,
    vjp_fn: Callable[[Tensor], Tensor] | None = None,
    structure: str = "full",
    round_samples: int = 16,
    max_error: float = 2e-3,
    max_samples: int = 1024,
) -> tuple[Tensor, Tensor]:
    r"""The truncated series of :func:`series_logdet` with as many probes as a set needs.

    Probes are drawn in rounds of ``round_samples``; after each round the per-probe estimates
    e_s = sum_{k<=n} (-1)^(k+1) v_s^T J^k v_s / k of each set give the standard error of their
    mean, sqrt(var(e) / S), and drawing stops once it is at most ``max_error`` times the set's
    degrees of freedom (n D, or (n - 1) D with ``zero_com``) for every set, or after
    ``max_samples`` probes. Hutchinson's variance is 2 ||A||_F^2 - 2 sum_i A_ii^2 for Rademacher
    probes (A the symmetric part of the series' matrix; Hutchinson 1990), which grows with N D, so
    a fixed number of probes leaves large sets with a noisy log-det.

    Arguments as in :func:`series_logdet` (gradients by backprop through the terms, with
    ``create_graph``), and:
        round_samples: probes per round.
        max_error: the target standard error per degree of freedom.
        max_samples: the most probes per set.

    Returns:
        (estimate, variance): the mean over the probes (B,) and the variance of that mean (B,)
        (the squared standard error; the truncation bias is not included).

    Examples:
        >>> x = torch.randn(2, 40, 2, dtype=torch.float64, requires_grad=True)
        >>> gx = 0.3 * torch.sin(x @ torch.ones(2, 2, dtype=torch.float64) / 2)
        >>> value, variance = precise_series_logdet(gx, x, 20, max_error=1e-3)
        >>> bool((variance.sqrt() <= 1e-3 * 80).all())
        True
    """
    _check_pair(gx, x, vjp_fn)
    if round_samples < 1 or max_samples < 1:
        raise InputError(f"round_samples and max_samples must be >= 1, got {round_samples} and "
                         f"{max_samples}")
    product = _products(gx, x, vjp_fn)
    coeffs = _series_coefficients(n_terms, x.dtype, x.device)
    pointwise = _pointwise(structure)
    dims = present_weights(x, mask).sum(dim=1) - (1 if zero_com else 0)
    dims = dims.clamp_min(1) * x.shape[-1]
    estimates: list[Tensor] = []
    drawn = 0
    while drawn < max_samples:
        size = min(round_samples, max_samples - drawn)

        def draw(size: int = size) -> tuple[Tensor, Tensor]:
            probes = sample_probes((size, *x.shape), probe, mask, zero_com, generator,
                                   x.device, x.dtype)
            return coeffs, probes

        _, v, stacked = _draw_and_powers(draw, product, mask, zero_com, create_graph,
                                         pointwise)
        d = (stacked[1:] * v).sum(dim=(-2, -1))  # (K, [S], B)
        d = d if v.dim() == 4 else d.unsqueeze(1)
        estimates.append((coeffs.reshape(-1, 1, 1) * d).sum(dim=0))  # (S, B)
        drawn += size
        samples = torch.cat(estimates)
        variance = (samples.detach().var(dim=0) / drawn if drawn > 1
                    else torch.full_like(samples[0].detach(), math.inf))
        if bool((variance.sqrt() <= max_error * dims).all()):
            break
    return samples.mean(dim=0), variance


def check_roulette_param(distribution: str, param: float, name: str = "param") -> None:
    """Refuse a roulette law's parameter outside its range: the geometric p in (0, 1), the
    Poisson rate lambda finite and positive.

    Examples:
        >>> check_roulette_param("poisson", float("inf"))
        Traceback (most recent call last):
        ...
        flowattn.errors.InputError: param, the Poisson rate, must be a finite number > 0, got inf
    """
    if distribution == "geometric" and not 0 < param < 1:
        raise InputError(f"{name}, the geometric parameter p, must lie in (0, 1), got {param}")
    if distribution == "poisson" and not (math.isfinite(param) and param > 0):
        raise InputError(f"{name}, the Poisson rate, must be a finite number > 0, got {param}")


def roulette_tail_probability(distribution: str, param: float, m: int) -> float:
    """P(L >= m) for the number L >= 1 of random extra terms.

    ``"geometric"``: P(L = l) = p (1 - p)^(l - 1), l >= 1, so P(L >= m) = (1 - p)^(m - 1).
    ``"poisson"``: L = 1 + Poisson(lambda), so P(L >= m) = P(Poisson(lambda) >= m - 1), its
    terms summed in logarithms (no overflow of lambda^j / j! at large rates).

    Examples:
        >>> round(roulette_tail_probability("poisson", 2.0, 2), 6)  # 1 - e^-2
        0.864665
        >>> roulette_tail_probability("poisson", 400.0, 300) > 0.99999
        True
    """
    if m <= 1:
        return 1.0
    if distribution == "geometric":
        return (1.0 - param) ** (m - 1)
    if distribution == "poisson":
        log_rate = math.log(param)
        cdf = sum(math.exp(-param + j * log_rate - math.lgamma(j + 1)) for j in range(m - 1))
        return max(1.0 - cdf, 0.0)
    raise InputError(f"distribution must be 'geometric' or 'poisson', got {distribution!r}")


def sample_roulette_lengths(
    distribution: str,
    param: float,
    shape: Sequence[int] = (),
    generator: torch.Generator | None = None,
) -> Tensor:
    """Draw the number L >= 1 of random extra terms from torch's seeded RNG (CPU long tensor)."""
    gen_device = generator.device if generator is not None else torch.device("cpu")
    check_roulette_param(distribution, param)
    if distribution == "geometric":
        draws = torch.empty(tuple(shape), dtype=torch.float64, device=gen_device)
        draws.geometric_(param, generator=generator)
    elif distribution == "poisson":
        rates = torch.full(tuple(shape), float(param), dtype=torch.float64, device=gen_device)
        draws = 1 + torch.poisson(rates, generator=generator)
    else:
        raise InputError(f"distribution must be 'geometric' or 'poisson', got {distribution!r}")
    return draws.long().cpu()


def roulette_logdet(
    gx: Tensor,
    x: Tensor,
    n_exact_terms: int = 2,
    mask: Tensor | None = None,
    n_samples: int = 1,
    probe: str = "rademacher",
    grad: str = "backprop",
    distribution: str = "geometric",
    param: float = 0.5,
    lengths: str = "batch",
    zero_com: bool = False,
    generator: torch.Generator | None = None,
    create_graph: bool = False,
    max_terms: int = 1000,
    vjp_fn: Callable[[Tensor], Tensor] | None = None,
    structure: str = "full",
) -> Tensor:
    r"""Unbiased Russian-roulette estimate of log det(I + J) (Chen et al. 2019, Thm. 1):

    log det(I + J) = E_{n, v}[ sum_{k=1}^{n} (-1)^(k+1) v^T J^k v / (k P(n >= k)) ],

    where the first ``n_exact_terms`` terms are always computed (weight 1) and n = n_exact + L
    with L >= 1 drawn from ``distribution`` (see :func:`roulette_tail_probability`).

    Lengths: with ``lengths="batch"`` one L is drawn per call and shared by the whole batch (the
    cost is one draw's length; the batch-mean estimate carries the variance of a single draw of
    L); with ``"sample"`` every set draws its own L (less variance in the batch mean, but the call
    runs max_b L_b terms, sets that stopped earlier get zero weight). The variance of the
    estimator is finite when Lip(g)^2 / (1 - p) < 1 for the geometric law.

    Arguments:
        gx: P g(x) with graph.
        x: the input of g, requiring grad.
        n_exact_terms: terms always computed.
        mask: bool (B, N), True = present.
        n_samples: probes per set, averaged.
        probe: ``"rademacher"`` or ``"gaussian"``.
        grad: ``"backprop"`` or ``"neumann"``.
        distribution: ``"geometric"`` (parameter p) or ``"poisson"`` (rate lambda).
        param: p or lambda.
        lengths: ``"batch"`` or ``"sample"``.
        zero_com: restrict to the zero-centre-of-mass subspace.
        generator: source of the lengths and the probes.
        create_graph: return a differentiable estimate.
        max_terms: cap on the total number of terms (a truncation, hit with tiny probability).
        vjp_fn: the branch's own product w -> w^T P J, used instead of autograd VJPs.
        structure: ``"pointwise"`` or ``"full"``, as in :func:`series_logdet` (the blocks are
            used when D is below the drawn number of terms).

    The lengths are drawn on the generator's device and read on the host (the number of terms
    to run): with the default CPU generator that read costs no device synchronisation.

    Returns:
        Tensor (B,).

    Examples:
        >>> x = torch.randn(2, 3, 2, requires_grad=True)
        >>> gen = torch.Generator().manual_seed(0)
        >>> roulette_logdet(0.3 * torch.sin(x), x, generator=gen).shape
        torch.Size([2])
    """
    _check_pair(gx, x, vjp_fn)
    if n_exact_terms < 0:
        raise InputError(f"n_exact_terms must be >= 0, got {n_exact_terms}")
    if lengths not in ("batch", "sample"):
        raise InputError(f"lengths must be 'batch' or 'sample', got {lengths!r}")
    def draw() -> tuple[Tensor, Tensor]:  # the lengths first, then the probes
        coeffs = _roulette_coefficients(distribution, param, n_exact_terms, lengths, x.shape[0],
                                        generator, max_terms)
        probes = sample_probes((n_samples, *x.shape), probe, mask, zero_com, generator,
                               x.device, x.dtype)
        return coeffs.to(device=x.device, dtype=x.dtype), probes

    product = _products(gx, x, vjp_fn)
    return _series_core(product, x, draw, mask, zero_com, grad, create_graph,
                        _pointwise(structure))


def _roulette_coefficients(
    distribution: str,
    param: float,
    n_exact_terms: int,
    lengths: str,
    batch: int,
    generator: torch.Generator | None,
    max_terms: int,
) -> Tensor:
    """Draw the roulette lengths; the series weights, (K,) for ``"batch"``, (B, K) per set."""
    extra = sample_roulette_lengths(
        distribution, param, (batch,) if lengths == "sample" else (1,), generator
    )
    extra = extra.clamp(max=max(1, max_terms - n_exact_terms))
    K = n_exact_terms + int(extra.max())
    row = torch.tensor(_roulette_row(distribution, param, n_exact_terms, K), dtype=torch.float64)
    if lengths == "batch":  # every term up to K is active
        return row
    k = torch.arange(1, K + 1)  # set b keeps the terms k <= n_exact + L_b
    active = (k.unsqueeze(0) <= (n_exact_terms + extra).unsqueeze(1)).to(torch.float64)
    return active * row


@functools.lru_cache(maxsize=1024)
def _roulette_row(distribution: str, param: float, n_exact_terms: int, K: int) -> tuple:
    """The weights (-1)^(k+1) / (k P(n >= k)), k = 1..K, of the roulette estimator."""
    return tuple(
        ((-1.0) ** (k + 1) / k)
        * (1.0 / roulette_tail_probability(distribution, param, k - n_exact_terms))
        for k in range(1, K + 1)
    )


class _MemoryEfficientLogDet(torch.autograd.Function):
    """y = x + g(x) and the log-det, with the log-det's gradients taken in the forward pass."""

    @staticmethod
    def forward(ctx, branch_and_logdet, x, *params):  # noqa: D401
        branch, logdet_fn = branch_and_logdet
        with torch.enable_grad():
            x_ = x.detach().requires_grad_(True)
            gx = branch(x_)
            logdet = logdet_fn(gx, x_, True)
            # Differentiate the log-det now and free its graph: only the graph of one branch
            # evaluation survives until backward, whatever the number of series terms.
            wrt = (x_, *params)
            grads = torch.autograd.grad(logdet.sum(), wrt, retain_graph=True, allow_unused=True)
            # Per-set x-gradients: logdet_b depends on x_b only.
            grad_x_rows = grads[0]
        ctx.gx, ctx.x_ = gx, x_
        ctx.params = params
        ctx.grad_x = grad_x_rows
        ctx.grad_params = grads[1:]
        return x + gx.detach(), logdet.detach()

    @staticmethod
    def backward(ctx, grad_y, grad_logdet):
        gx, x_, params = ctx.gx, ctx.x_, ctx.params
        wrt = (x_, *params)
        if grad_y is None:
            grad_y = torch.zeros_like(gx)
        branch_grads = torch.autograd.grad(gx, wrt, grad_y, allow_unused=True)
        ctx.gx = ctx.x_ = None
        grad_x = grad_y + (branch_grads[0] if branch_grads[0] is not None else 0)
        if grad_logdet is not None:
            scale = grad_logdet.reshape(-1, *([1] * (x_.dim() - 1)))
            grad_x = grad_x + scale * ctx.grad_x
            first = grad_logdet.reshape(-1)[0]
            if not torch.allclose(grad_logdet, first.expand_as(grad_logdet), rtol=1e-5, atol=0):
                raise RuntimeError(
                    "memory_efficient=True needs the same loss weight on every set's log-det "
                    "(e.g. a batch mean of log-likelihoods); got weights varying from "
                    f"{float(grad_logdet.min())} to {float(grad_logdet.max())}"
                )
        param_grads = []
        for bg, lg in zip(branch_grads[1:], ctx.grad_params, strict=True):
            total = bg
            if lg is not None and grad_logdet is not None:
                extra = lg * first
                total = extra if total is None else total + extra
            param_grads.append(total)
        return (None, grad_x, *param_grads)


def memory_efficient_logdet(
    branch: Callable[[Tensor], Tensor],
    x: Tensor,
    logdet_fn: Callable[[Tensor, Tensor, bool], Tensor],
    params: Sequence[Tensor],
) -> tuple[Tensor, Tensor]:
    """y = x + g(x) and its log-det, with the log-det's gradient computed in the forward pass.

    References:
        Chen et al., "Residual Flows for Invertible Generative Modeling", NeurIPS 2019, §3.2.

    With a Neumann-gradient ``logdet_fn`` the peak memory of a training step does not grow with
    the number of series terms: the gradients of the log-det w.r.t. ``x`` and ``params`` are
    taken immediately and its graph is freed; only one branch graph is kept for backward. The
    parameter gradients are stored unweighted, so the loss must weight every set's log-det
    equally (a batch mean or sum); ``backward`` raises ``RuntimeError`` otherwise.

    Arguments:
        branch: x -> P g(x) (masked / projected).
        x: input (B, N, D).
        logdet_fn: (gx, x, create_graph) -> log-det (B,), differentiable when create_graph.
        params: the parameters of the branch that should receive gradients.

    Returns:
        (y, logdet).
    """
    params = tuple(p for p in params if p.requires_grad)
    return _MemoryEfficientLogDet.apply((branch, logdet_fn), x, *params)
