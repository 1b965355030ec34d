"""Lipschitz constants: certified upper bounds and measured lower bounds.

Upper bounds (certificates) are closed-form functions of the weights:

* Theorem 3.2 of Kim, Papamakarios & Mnih (2021) for tied L2 multi-head attention,
* Appendix N of the same paper for LayerNorm, and the exact constant of LipsFormer's CenterNorm,
* matrix norms: the max-row-sum norm and the spectral norm (exact, or power iteration).

Lower bounds are measured: ``jacobian_norm`` at a point, and ``lipschitz_lower_bound`` which
maximises it over inputs as in Kim et al. (2021), Appendix H.

Conventions: a map f acts on one set X in R^{N x D}; its Jacobian is the (N D) x (N D) matrix
d vec(f(X)) / d vec(X) with row-major vec. ``p = "inf"`` is the max-row-sum norm of that matrix
(the operator norm for the max-abs vector norm); ``p = 2`` is its largest singular value.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from .errors import InputError

__all__ = [
    "lambertw0",
    "phi_inverse",
    "matrix_inf_norm",
    "spectral_norm_exact",
    "power_iteration",
    "PowerIteration",
    "l2_attention_bound",
    "layernorm_lipschitz_bound",
    "centernorm_lipschitz_bound",
    "jacobian",
    "jacobian_norm",
    "lipschitz_lower_bound",
]

_INF_NAMES = ("inf", float("inf"), math.inf)


def _norm_name(p) -> str:
    if p in _INF_NAMES:
        return "inf"
    if p in (2, "2", 2.0):
        return "2"
    raise InputError(f"norm must be 'inf' or 2, got {p!r}")


# ----------------------------------------------------------------------------- Lambert W


def lambertw0(x: Tensor | float, iterations: int = 8) -> Tensor:
    """Principal branch W_0 of the Lambert W function, w e^w = x, for x >= 0.

    Winitzki's approximation W(x) ~ L (1 - log(1 + L) / (2 + L)), L = log(1 + x) (relative error
    below 2% on [0, inf)) is refined by Halley's method, which converges cubically:

        w <- w - f / (e^w (w + 1) - (w + 2) f / (2 w + 2)),   f = w e^w - x.

    Eight iterations reach machine precision in float64 over [0, 1e300].

    Arguments:
        x: non-negative values (tensor or float).
        iterations: number of Halley steps.

    Examples:
        >>> float(lambertw0(math.e))
        1.0
    """
    x = torch.as_tensor(x, dtype=torch.get_default_dtype() if not torch.is_tensor(x) else None)
    if not x.is_floating_point():
        x = x.to(torch.get_default_dtype())
    if (x < 0).any() or torch.isnan(x).any():
        raise InputError("lambertw0 is implemented for x >= 0 only")
    log1p = torch.log1p(x)
    w = log1p * (1 - torch.log1p(log1p) / (2 + log1p))
    for _ in range(iterations):
        ew = torch.exp(w)
        f = w * ew - x
        w = w - f / (ew * (w + 1) - (w + 2) * f / (2 * w + 2))
    return torch.where(x == 0, torch.zeros_like(w), w)


def phi_inverse(n_minus_one: Tensor | float) -> Tensor:
    """phi^{-1}(N - 1) = W_0((N - 1) / e), where phi(x) = x exp(x + 1) (Kim et al. 2021, Thm 3.2).

    Solving x e^{x + 1} = N - 1 gives x e^x = (N - 1) / e; the paper prints W_0(N / e), which is
    larger and so also a valid, looser bound.
    """
    return lambertw0(torch.as_tensor(n_minus_one, dtype=torch.float64) / math.e)


# ----------------------------------------------------------------------------- matrix norms


def matrix_inf_norm(w: Tensor) -> Tensor:
    """||W||_inf = max_i sum_j |W_ij| (over the last two dimensions)."""
    return w.abs().sum(dim=-1).amax(dim=-1)


def spectral_norm_exact(w: Tensor) -> Tensor:
    """||W||_2 = sigma_max(W) from the singular values (exact; batched over leading dims)."""
    return torch.linalg.matrix_norm(w, ord=2)


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
    n: int | Tensor,
    w_q: Tensor,
    w_v: Tensor,
    w_o: Tensor,
    norm: str | int = "inf",
) -> Tensor:
    """Certified Lipschitz bound of tied L2 multi-head attention (Kim et al. 2021, Thm 3.2).

    With H heads of width d = D / H, per-head W^{Q,h}, W^{V,h} in R^{D x d}, W^O in R^{D x D}:

        Lip_inf <= (4 phi^{-1}(N-1) + 1/sqrt(d)) ||W^O^T||_inf
                   max_h ||W^{Q,h}||_inf ||W^{Q,h}^T||_inf  max_h ||W^{V,h}^T||_inf
        Lip_2   <= sqrt(N)/sqrt(d) (4 phi^{-1}(N-1) + 1)
                   sqrt(sum_h ||W^{Q,h}||_2^2 ||W^{V,h}||_2^2) ||W^O||_2

    With masking (App. G) the bound holds with N the number of unmasked inputs of a row, so
    ``n`` may be a tensor of per-row counts; the result then has its shape.

    Arguments:
        n: sequence length(s) N >= 1.
        w_q: (H, D, d) query (= key) weights, row convention x^T W.
        w_v: (H, D, d) value weights.
        w_o: (D, D) output weights, applied as [heads] W^O.
        norm: "inf" or 2.

    Examples:
        >>> eye = torch.eye(1, dtype=torch.float64)
        >>> b = l2_attention_bound(2, eye[None], eye[None], eye)
        >>> round(float(b), 6)  # 4 W0(1/e) + 1
        2.113858
    """
    norm = _norm_name(norm)
    heads, dim, head_dim = w_q.shape
    if w_v.shape != w_q.shape or w_o.shape != (dim, dim):
        raise InputError(
            f"inconsistent weight shapes: w_q {tuple(w_q.shape)}, w_v {tuple(w_v.shape)}, "
            f"w_o {tuple(w_o.shape)}"
        )
    n = torch.as_tensor(n, device=w_q.device)
    if (n < 1).any():
        raise InputError(f"sequence length must be >= 1, got {n}")
    w0 = phi_inverse((n - 1).to(torch.float64)).to(device=w_q.device, dtype=w_q.dtype)
    if norm == "inf":
        q_term = (matrix_inf_norm(w_q) * matrix_inf_norm(w_q.transpose(1, 2))).amax()
        v_term = matrix_inf_norm(w_v.transpose(1, 2)).amax()
        o_term = matrix_inf_norm(w_o.t())
        return (4 * w0 + head_dim**-0.5) * o_term * q_term * v_term
    qv = torch.sqrt((spectral_norm_exact(w_q) ** 2 * spectral_norm_exact(w_v) ** 2).sum())
    sqrt_n = torch.sqrt(n.to(w_q.dtype))
    return sqrt_n * head_dim**-0.5 * (4 * w0 + 1) * qv * spectral_norm_exact(w_o)


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
    ``create_graph=True`` the Jacobian is itself differentiable; attention inside ``f`` then runs
    on the composite kernel (see :func:`flowattn.attention.twice_differentiable`).
    """
    if create_graph:  # fused attention kernels have no double backward
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.MATH]):
            jac = torch.autograd.functional.jacobian(f, x, create_graph=True, vectorize=True)
    else:
        jac = torch.autograd.functional.jacobian(f, x, vectorize=True)
    out_numel = jac.numel() // x.numel()
    return jac.reshape(out_numel, x.numel())


def jacobian_norm(f: Callable[[Tensor], Tensor], x: Tensor, p="inf", create_graph=False) -> Tensor:
    """||J_f(X)||_p for p in {2, "inf"}: the local Lipschitz constant of f at X."""
    jac = jacobian(f, x, create_graph=create_graph)
    if _norm_name(p) == "inf":
        return matrix_inf_norm(jac)
    return spectral_norm_exact(jac)


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
    """
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
            opt.zero_grad()
            (-value).backward()
            opt.step()
    return best, best_x
