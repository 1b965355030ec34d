"""Certified Lipschitz bounds of tied L2 multi-head attention: Theorem 3.2 of Kim,
Papamakarios & Mnih (2021), and the tight certificate of ``docs/attention.md`` (a core constant
times norms of the products of each head's weights), in the ∞-, 2- and mixed norms."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from ..errors import InputError
from .checks import check_certificate_precision, check_counts, norm_name
from .core import (
    induced_core_constant,
    l2_core_column_constant,
    l2_core_kernel_constant,
    l2_core_row_constant,
    logit_margin_constant,
)
from .lambertw import phi_inverse, phi_inverse_of_count
from .norms import matrix_inf_norm, spectral_norm_exact, spectral_norm_function

__all__ = ["CERTIFICATES", "l2_attention_bound", "induced_attention_bound"]


CERTIFICATES = ("tight", "thm3.2")


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
    norm = norm_name(norm, mixed=method == "tight")
    spectral = spectral_norm_function(spectral_norms)
    heads, dim, head_dim = _checked_weights(w_q, w_v, w_o)
    # Counts given as numbers (or host tensors) are checked and turned into the constants on
    # the host, then moved: no read back from the weights' device.
    w0_of_count = None
    n = check_counts(n)
    if isinstance(n, (int, range)):  # the constants from a cache: no tensor read
        counts = [n] if isinstance(n, int) else list(n)
        w0_of_count = [phi_inverse_of_count(k) for k in counts]
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
    heads, dim, head_dim = _checked_weights(w_q, w_v, w_o)
    rank_one = induced_core_constant(n, inducing).to(device=w_q.device, dtype=w_q.dtype)
    m = w_q.transpose(1, 2) @ w_v @ w_o.reshape(heads, head_dim, dim) / math.sqrt(head_dim)
    c = (rank_one / 4).unsqueeze(-1).expand(*rank_one.shape, heads)
    return _mixed_norm_bound(c, w_q, m, spectral_norm_exact(w_q))


def _checked_weights(w_q: Tensor, w_v: Tensor, w_o: Tensor) -> tuple[int, int, int]:
    """(H, D, d) of the weights of H heads of width d (w_q, w_v: (H, D, d); w_o: (D, D),
    D = H d), refused where the shapes disagree or the precision is too low for a
    certificate."""
    check_certificate_precision(w_q, w_v, w_o)
    heads, dim, head_dim = w_q.shape
    if w_v.shape != w_q.shape or w_o.shape != (dim, dim) or heads * head_dim != dim:
        raise InputError(
            f"inconsistent weight shapes: w_q {tuple(w_q.shape)}, w_v {tuple(w_v.shape)}, "
            f"w_o {tuple(w_o.shape)}"
        )
    return heads, dim, head_dim


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
