"""Measured Lipschitz constants: the Jacobian of a map on one set and its norm at a point, and
a lower bound on the Lipschitz constant by maximising that norm over inputs (Kim et al. 2021,
App. H)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

import torch
from torch import Tensor

from ..errors import InputError, NonFiniteError
from ..validation import check_count
from .checks import norm_name
from .norms import matrix_inf_norm, spectral_norm_exact

__all__ = ["jacobian", "jacobian_norm", "mixed_operator_norm", "lipschitz_lower_bound"]


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
    name = norm_name(p, mixed=True)
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
        raise NonFiniteError(f"the Jacobian's {norm_name(p, mixed=True)} norm was NaN or Inf "
                             f"at every one of the {restarts * (steps + 1)} points tried")
    return best, best_x
