"""Inverting y = x + g(x) by fixed-point or Anderson-accelerated iteration, per set, or failing."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import Any

import torch
from torch import Tensor

from ..attention.contractive import frozen_certificates
from ..errors import InputError, InverseNotConverged
from .geometry import project

__all__ = [
    "InverseOptions",
    "fixed_point_inverse",
    "anderson_inverse",
    "residual_inverse",
    "INVERSE_METHODS",
]

INVERSE_METHODS = ("anderson", "fixed-point")


@dataclass(frozen=True)
class InverseOptions:
    """How an invertible residual block solves x + g(x) = y (:func:`residual_inverse`).

    Attributes:
        method: ``"anderson"`` (:func:`anderson_inverse`) or ``"fixed-point"``
            (:func:`fixed_point_inverse`).
        tol: relative residual tolerance, per set.
        max_iter: iteration budget; then :class:`~flowattn.errors.InverseNotConverged`.

    Examples:
        >>> InverseOptions("fixed-point", tol=1e-8).max_iter
        1000
    """

    method: str = "anderson"
    _: KW_ONLY
    tol: float = 1e-6
    max_iter: int = 1000

    def __post_init__(self) -> None:
        if self.method not in INVERSE_METHODS:
            raise InputError(
                f"InverseOptions.method must be one of {INVERSE_METHODS}, got {self.method!r}"
            )
        if not self.tol > 0:
            raise InputError(f"InverseOptions.tol must be positive, got {self.tol}")
        if int(self.max_iter) != self.max_iter or self.max_iter < 1:
            raise InputError(
                f"InverseOptions.max_iter must be an integer >= 1, got {self.max_iter}"
            )
        object.__setattr__(self, "tol", float(self.tol))
        object.__setattr__(self, "max_iter", int(self.max_iter))


def _residual_norm(r: Tensor, scale: Tensor) -> Tensor:
    return r.abs().amax(dim=(1, 2)) / scale


def _prepare(y: Tensor, x0: Tensor | None, mask: Tensor | None, zero_com: bool):
    if x0 is None:
        x = y.clone()
    else:
        if x0.shape != y.shape:
            raise InputError(
                f"x0 must have the shape of y {tuple(y.shape)}, got {tuple(x0.shape)}"
            )
        x = x0.detach().clone()
    if mask is not None:
        # padded coordinates are fixed points x = y (the branch output is zero there)
        keep = mask.unsqueeze(-1)
        x = torch.where(keep, x, y)
    if zero_com:
        # stay on the affine subspace of y: x = y + P(x - y)
        x = y + project(x - y, mask, True)
    scale = torch.clamp(y.detach().abs().amax(dim=(1, 2)), min=1.0)
    return x, scale


def _check_args(tol: float, max_iter: int) -> None:
    if not tol > 0:
        raise InputError(f"tol must be positive, got {tol}")
    if max_iter < 1:
        raise InputError(f"max_iter must be >= 1, got {max_iter}")


@torch.no_grad()
def fixed_point_inverse(
    branch: Callable[[Tensor, Tensor | None], Tensor],
    y: Tensor,
    mask: Tensor | None = None,
    x0: Tensor | None = None,
    tol: float = 1e-6,
    max_iter: int = 1000,
    zero_com: bool = False,
    return_stats: bool = False,
):
    r"""Solve x + g(x) = y by the Banach iteration x <- y - g(x), each set on its own.

    References:
        Behrmann et al., "Invertible Residual Networks", ICML 2019, Alg. 1.

    A set is converged when ||x + g(x) - y||_inf <= tol * max(1, ||y||_inf); it then leaves the
    active batch (its branch is no longer evaluated) and its last iterate x' = y - g(x) is
    returned, whose residual is <= Lip(g) times the tested one. For Lip(g) < 1 the iteration
    converges geometrically at rate Lip(g).

    Arguments:
        branch: (x, mask) -> g(x) for a sub-batch of sets; it must act on each set independently.
        y: outputs, (B, N, D).
        mask: bool (B, N), True = present; padded coordinates are returned equal to ``y``.
        x0: warm start (e.g. the previous solution); default ``y``.
        tol: relative tolerance on the residual.
        max_iter: iteration budget.
        zero_com: iterate on the zero-centre-of-mass subspace.
        return_stats: also return a dict with ``"iterations"`` (per set) and ``"evaluations"``
            (total branch evaluations of single sets).

    Raises:
        InverseNotConverged: when some set misses ``tol`` after ``max_iter`` iterations.

    Examples:
        >>> g = lambda x, mask: 0.5 * torch.tanh(x)
        >>> y = torch.randn(4, 3, 2)
        >>> x = fixed_point_inverse(g, y)
        >>> bool(((x + g(x, None)) - y).abs().max() < 1e-5)
        True
    """
    _check_args(tol, max_iter)
    x, scale = _prepare(y, x0, mask, zero_com)
    B = y.shape[0]
    iterations = torch.zeros(B, dtype=torch.long, device=y.device)
    active = torch.arange(B, device=y.device)
    evaluations = 0
    worst = float("inf")
    for it in range(1, max_iter + 1):
        ma = None if mask is None else mask[active]
        ya, xa = y[active], x[active]
        g = branch(xa, ma)
        evaluations += len(active)
        x_new = ya - g
        res = _residual_norm(xa - x_new, scale[active])
        x[active] = x_new
        iterations[active] = it
        done = res <= tol
        worst = float(res[~done].max()) if (~done).any() else 0.0
        active = active[~done]
        if len(active) == 0:
            break
    if len(active) > 0:
        raise InverseNotConverged(worst, max_iter, len(active), tol)
    if return_stats:
        return x, {"iterations": iterations, "evaluations": evaluations}
    return x


@torch.no_grad()
def anderson_inverse(
    branch: Callable[[Tensor, Tensor | None], Tensor],
    y: Tensor,
    mask: Tensor | None = None,
    x0: Tensor | None = None,
    tol: float = 1e-6,
    max_iter: int = 1000,
    zero_com: bool = False,
    memory: int = 5,
    beta: float = 1.0,
    reg: float = 1e-10,
    return_stats: bool = False,
):
    r"""Solve x + g(x) = y with Anderson acceleration of x <- G(x) = y - g(x), per set.

    References:
        Anderson, "Iterative procedures for nonlinear integral equations", J. ACM 1965;
        Walker & Ni, "Anderson acceleration for fixed-point iterations", SIAM J. Numer. Anal.
        2011 (type-II form used here).

    With the last m iterates x_j and residuals f_j = G(x_j) - x_j, each set solves
    min_alpha ||sum_j alpha_j f_j||_2 subject to sum_j alpha_j = 1 (a regularised m x m system)
    and moves to x <- sum_j alpha_j (beta G(x_j) + (1 - beta) x_j). Convergence is tested per set
    exactly as in :func:`fixed_point_inverse`, and a converged set returns G(x) at its last
    iterate. Sets whose Anderson step is not finite fall back to the plain step.

    Arguments:
        branch: as in :func:`fixed_point_inverse`.
        y: as in :func:`fixed_point_inverse`.
        mask: as in :func:`fixed_point_inverse`.
        x0: as in :func:`fixed_point_inverse`.
        tol: as in :func:`fixed_point_inverse`.
        max_iter: as in :func:`fixed_point_inverse`.
        zero_com: as in :func:`fixed_point_inverse`.
        return_stats: as in :func:`fixed_point_inverse`.
        memory: history length m.
        beta: mixing (damping) parameter.
        reg: Tikhonov regularisation of the least-squares system, relative to its scale.

    Raises:
        InverseNotConverged: when some set misses ``tol`` after ``max_iter`` iterations.

    Examples:
        >>> g = lambda x, mask: 0.9 * torch.tanh(x)
        >>> y = torch.randn(4, 3, 2)
        >>> x = anderson_inverse(g, y)
        >>> bool(((x + g(x, None)) - y).abs().max() < 1e-5)
        True
    """
    _check_args(tol, max_iter)
    if memory < 1:
        raise InputError(f"memory must be >= 1, got {memory}")
    x, scale = _prepare(y, x0, mask, zero_com)
    B = y.shape[0]
    M = y[0].numel()
    X = y.new_zeros(B, memory, M)  # iterates
    Gs = y.new_zeros(B, memory, M)  # G(iterates)
    iterations = torch.zeros(B, dtype=torch.long, device=y.device)
    active = torch.arange(B, device=y.device)
    evaluations = 0
    worst = float("inf")
    for it in range(1, max_iter + 1):
        ma = None if mask is None else mask[active]
        ya, xa = y[active], x[active]
        g_val = branch(xa, ma)
        evaluations += len(active)
        ga = ya - g_val
        res = _residual_norm(ga - xa, scale[active])
        iterations[active] = it
        done = res <= tol
        x[active[done]] = ga[done]
        worst = float(res[~done].max()) if (~done).any() else 0.0
        keep = ~done
        active, xa, ga = active[keep], xa[keep], ga[keep]
        if len(active) == 0:
            break
        slot = (it - 1) % memory
        X[active, slot] = xa.reshape(len(active), M)
        Gs[active, slot] = ga.reshape(len(active), M)
        n = min(it, memory)
        Xa, Ga = X[active, :n], Gs[active, :n]
        Fa = Ga - Xa  # (b, n, M)
        H = Fa @ Fa.transpose(1, 2)
        # Repeated residual directions make H rank-deficient; a regulariser below the dtype's
        # resolution would leave it exactly singular, so it is floored at a few epsilons.
        rel = max(reg, 100 * torch.finfo(H.dtype).eps)
        lam = rel * H.diagonal(dim1=1, dim2=2).amax(dim=1).clamp(min=torch.finfo(H.dtype).tiny)
        H = H + lam.reshape(-1, 1, 1) * torch.eye(n, dtype=H.dtype, device=H.device)
        ones = H.new_ones(len(active), n, 1)
        sol, info = torch.linalg.solve_ex(H, ones)
        alpha = sol / sol.sum(dim=1, keepdim=True)
        step = (alpha.transpose(1, 2) @ (beta * Ga + (1 - beta) * Xa)).reshape(ga.shape)
        # a failed solve or a non-finite mixture falls back to the plain fixed-point step
        bad = (info != 0) | ~torch.isfinite(step).reshape(len(active), -1).all(dim=1)
        if bad.any():
            step[bad] = ga[bad]
        if mask is not None:
            step = torch.where(mask[active].unsqueeze(-1), step, y[active])
        x[active] = step
    if len(active) > 0:
        raise InverseNotConverged(worst, max_iter, len(active), tol)
    if return_stats:
        return x, {"iterations": iterations, "evaluations": evaluations}
    return x


def residual_inverse(
    branch: Callable[[Tensor, Tensor | None], Tensor],
    y: Tensor,
    mask: Tensor | None = None,
    method: str = "anderson",
    **kwargs: Any,
) -> Tensor:
    r"""Inverse of y = x + g(x), differentiable by implicit differentiation.

    The solution x* is found without a graph by ``method``; when gradients are enabled it is
    re-attached as x = y - g(x*) with the upstream gradient u replaced by the solution of
    w (I + J_g(x*)) = u (itself a contractive fixed point, w <- u - w J), so that the gradients
    w.r.t. ``y`` and the branch's parameters are exactly those of the implicit function
    (dx/dy = (I + J)^-1, dx/dθ = -(I + J)^-1 dg/dθ).

    Arguments:
        branch: (x, mask) -> g(x).
        y: outputs (B, N, D).
        mask: bool (B, N).
        method: ``"anderson"`` or ``"fixed-point"``.
        kwargs: passed to the solver (``x0``, ``tol``, ``max_iter``, ``zero_com``, ...).

    Raises:
        InverseNotConverged: if the solver or the gradient's fixed point does not converge.
    """
    if method == "anderson":
        solver = anderson_inverse
    elif method == "fixed-point":
        solver = fixed_point_inverse
    else:
        raise InputError(f"method must be one of {INVERSE_METHODS}, got {method!r}")
    with frozen_certificates():  # one branch, fixed weights: each bound computed once
        x_star = solver(branch, y, mask, **kwargs)
    if not torch.is_grad_enabled():
        return x_star
    x_req = x_star.detach().requires_grad_(True)
    gx = branch(x_req, mask)
    out = y - gx
    if not out.requires_grad:
        return x_star
    tol = kwargs.get("tol", 1e-6)
    max_iter = kwargs.get("max_iter", 1000)

    def implicit_grad(u: Tensor) -> Tensor:
        # Solve w + w J = u, i.e. w <- u - w J (J^T has the same contraction rate). gx is
        # already the masked / projected branch, so w J is the VJP of the restricted map.
        if u is None:
            return u
        w = u
        scale = float(torch.clamp(u.detach().abs().amax(), min=1e-30))
        delta = float("inf")
        for _ in range(max_iter):
            wj = torch.autograd.grad(gx, x_req, w, retain_graph=True)[0]
            w_new = u - wj
            delta = float((w_new - w).detach().abs().amax()) / scale
            w = w_new
            if delta <= tol:
                return w
        raise InverseNotConverged(delta, max_iter, 1, tol)

    out.register_hook(implicit_grad)
    return out
