"""Divergence tr(df/dz) of a vector field on sets: exact by batched vjps, or Hutchinson."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..geometry import project, vjp

__all__ = ["exact_divergence", "hutchinson_divergence"]


def _event_sum(x: Tensor) -> Tensor:
    """Sum over every dimension but the first (the batch)."""
    return x.reshape(x.shape[0], -1).sum(dim=1)


def exact_divergence(
    field: Callable[[Tensor, Tensor | None], Tensor],
    z: Tensor,
    mask: Tensor | None = None,
    zero_com: bool = False,
    frobenius: bool = False,
    create_graph: bool = False,
) -> tuple[Tensor, Tensor, Tensor | None]:
    r"""Evaluate a field and its exact divergence tr(P J P) with one batched vjp.

    The state is replicated once per coordinate k = 1..K (K = N D), the field runs once on the
    (K B)-sized batch and a single backward pass with the probes v_k = P e_k returns every
    row v_k^T J. Then

    .. math:: \mathrm{tr}(P J P) = \sum_k (v_k^\top J) \cdot v_k, \qquad
              \|P J P\|_F^2 = \sum_k \|P J^\top v_k\|^2,

    where P projects onto the present coordinates (and, with ``zero_com``, onto the
    zero-centre-of-mass subspace, the setting of E(n)-equivariant flows, Satorras et al. 2021).
    Padded elements thus contribute nothing. The cost is K forward passes in one batch, so
    this is meant for small N D; use :func:`hutchinson_divergence` otherwise. The field must
    treat batch entries independently (no batch statistics).

    Arguments:
        field: callable ``(z, mask) -> f`` with ``f`` of ``z``'s shape (B, *event).
        z: the state; must require grad.
        mask: optional bool (B, N) padding mask (True = present) for (B, N, D) states.
        zero_com: restrict to the zero-centre-of-mass subspace.
        frobenius: also return ||P J P||_F^2 (the RNODE Jacobian regulariser).
        create_graph: keep the graph so the results can be differentiated.

    Returns:
        (f, divergence, frobenius or None); f has z's shape, the others shape (B,).

    Examples:
        >>> z = torch.randn(2, 3, 2, requires_grad=True)
        >>> f, div, _ = exact_divergence(lambda x, m: 2 * x, z)
        >>> div.tolist()
        [12.0, 12.0]
    """
    batch, event = z.shape[0], z.shape[1:]
    k = event.numel()
    eye = torch.eye(k, dtype=z.dtype, device=z.device).reshape(k, 1, *event)
    probes = eye.expand(k, batch, *event).reshape(k * batch, *event)
    mask_rep = None if mask is None else mask.repeat(k, 1)
    probes = project(probes, mask_rep, zero_com)
    z_rep = z.repeat(k, *([1] * len(event)))
    f_rep = field(z_rep, mask_rep)
    rows = vjp(f_rep, z_rep, probes, create_graph)
    div = _event_sum(rows * probes).reshape(k, batch).sum(dim=0)
    frob = None
    if frobenius:
        tangent = project(rows, mask_rep, zero_com)
        frob = _event_sum(tangent.pow(2)).reshape(k, batch).sum(dim=0)
    return f_rep[:batch], div, frob


def hutchinson_divergence(
    f: Tensor,
    z: Tensor,
    probe: Tensor,
    mask: Tensor | None = None,
    zero_com: bool = False,
    frobenius: bool = False,
    create_graph: bool = False,
) -> tuple[Tensor, Tensor | None]:
    r"""Hutchinson's estimate eps^T J eps of tr(P J P) (Hutchinson 1989; FFJORD, Grathwohl 2019).

    With a probe eps = P u, E[u u^T] = I, the estimate is unbiased: E[eps^T J eps] =
    tr(J P) = tr(P J P) for a field whose output lies in the range of P. The same vjp gives
    ||P J^T eps||^2, an unbiased estimate of ||P J P||_F^2 (the RNODE regulariser, Finlay et
    al. 2020).

    Arguments:
        f: the field's output at z.
        z: the state, requiring grad, that f was computed from.
        probe: eps, already projected (see :func:`~flowattn.flows.geometry.sample_probes`).
        mask: optional bool (B, N) padding mask, used to project the regulariser.
        zero_com: zero-centre-of-mass mode, used to project the regulariser.
        frobenius: also return the Frobenius estimate.
        create_graph: keep the graph so the results can be differentiated.

    Returns:
        (divergence estimate, Frobenius estimate or None), each of shape (B,).

    Examples:
        >>> z = torch.randn(2, 3, requires_grad=True)
        >>> eps = torch.ones(2, 3)
        >>> hutchinson_divergence(2 * z, z, eps)[0].tolist()
        [6.0, 6.0]
    """
    row = vjp(f, z, probe, create_graph)
    div = _event_sum(row * probe)
    frob = None
    if frobenius:
        frob = _event_sum(project(row, mask, zero_com).pow(2))
    return div, frob

