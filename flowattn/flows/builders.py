"""Residual flows over sets and sequences: the builders of their :class:`SetFlow`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nflows.transforms import CompositeTransform, Transform
from torch import nn

from ..attention import ContractiveL2MHA
from ..branches import (
    ContractiveLiftedL2MHA,
    LipschitzMLP,
    NeighbourhoodInteraction,
    RadialInteraction,
)
from ..errors import InputError
from ..validation import check_count
from .coupling import SetCoupling
from .inverse import InverseOptions
from .layers import ActNorm, EquivariantLinear, SetLocation
from .logdet import LogDetOptions
from .monotone import InverseMonotoneResidual, MonotoneResidual
from .pairs import PairSplines
from .residual import InvertibleResidual, TransformerResidualPair
from .setflow import SetFlow

__all__ = ["set_flow", "sequence_flow", "INTERACTIONS"]

INTERACTIONS = ("attention", "radial", "linear", "none")


def _default_attention(dim: int, heads: int, coeff: float, norm: str) -> nn.Module:
    return ContractiveL2MHA(dim, heads, coeff=coeff, norm=norm)


def _lifted_attention(width: int) -> Callable[..., nn.Module]:
    """The attention factory of ``attention_width``: lifted attention of width ``width``
    (certified in the mixed norm, whatever norm the flow asks of its attention)."""

    def build(dim: int, heads: int, coeff: float, norm: str) -> nn.Module:
        return ContractiveLiftedL2MHA(dim, heads, coeff, width=width)

    return build


def _check(dim: int, blocks: int, heads: int, hidden: int | None, coeff: float) -> None:
    for name, value in (("dim", dim), ("blocks", blocks), ("heads", heads)):
        check_count(value, name)
    if hidden is not None:
        check_count(hidden, "hidden")
    if not 0 < coeff < 1:
        raise InputError(f"coeff must lie in (0, 1), got {coeff}")


def _attention_layer(
    dim: int,
    heads: int,
    hidden: int,
    coeff: float,
    mlp: bool,
    norm: str,
    attention: Callable[..., nn.Module] | None,
    residual: dict[str, Any],
    activation: str = "lipswish",
) -> Transform:
    """x + g_att(x), followed by x + g_mlp(x) with ``mlp``; ``residual`` goes to both blocks."""
    # In zero-COM mode the attention output is projected (x - mean x); that projection can
    # double an inf-norm Lipschitz constant (2 (n - 1) / n), so the coefficient is halved.
    att_coeff = coeff / 2 if (residual["zero_com"] and norm != "2") else coeff
    att = (attention or _default_attention)(dim, heads, att_coeff, norm)
    if mlp:
        return TransformerResidualPair(att, LipschitzMLP(dim, hidden, coeff,
                                                         activation=activation), **residual)
    return InvertibleResidual(att, **residual)


def set_flow(
    dim: int,
    blocks: int,
    heads: int,
    hidden: int | None = None,
    coeff: float = 0.9,
    mlp: bool = True,
    actnorm: bool = True,
    zero_com: bool = False,
    norm: str = "inf",
    attention: Callable[..., nn.Module] | None = None,
    linear: bool = True,
    interaction: str = "attention",
    location: bool = False,
    radial_basis: int = 64,
    radial_range: float = 4.0,
    manybody: bool = False,
    radial_max_slope: float | None = None,
    radial_inverse: bool = False,
    splines: bool = False,
    pair_splines: bool = False,
    attention_width: int | None = None,
    logdet: LogDetOptions | None = None,
    inverse: InverseOptions | None = None,
    activation: str = "lipswish",
) -> SetFlow:
    r"""A permutation-invariant residual flow over sets of any size.

    Each of the ``blocks`` blocks is ActNorm -> EquivariantLinear -> x + g_att(x) -> x + g_mlp(x)
    with a contractive L2 self-attention branch (Kim et al. 2021, §5.3) and a pointwise
    :class:`~flowattn.branches.LipschitzMLP`. The equivariant linear map (exact log-det and
    inverse) supplies the global linear coupling of elements, which contractive attention, held
    down by its certified bound, can only build up over many blocks.
    Without positional information the flow is permutation-equivariant and its density is
    exchangeable: log p(x[:, perm]) = log p(x) (exactly so with the exact log-det).

    Arguments:
        dim: feature width D.
        blocks: number of blocks.
        heads: attention heads (must divide ``dim``).
        hidden: MLP hidden width (default 4 D).
        coeff: contraction coefficient of every branch.
        mlp: add the pointwise MLP residual after each attention residual.
        actnorm: add an ActNorm before each block.
        zero_com: particle mode (zero centre of mass, E-NF convention); inf-norm attention
            coefficients are halved to stay contractive after the projection.
        norm: attention certification norm, ``"inf"`` or ``"2"``.
        attention: factory (dim, heads, coeff, norm) -> branch, default ``ContractiveL2MHA``.
        linear: add an :class:`EquivariantLinear` after each ActNorm.
        interaction: how elements interact: ``"attention"`` (the blocks above), ``"linear"``
            (no attention: ActNorm -> EquivariantLinear -> x + g_mlp(x)) or ``"none"`` (ActNorm
            -> x + g_mlp(x): each element transformed alone, the density of i.i.d. points).
            The last two are baselines that show what attention adds. ``"radial"`` replaces
            attention by :class:`~flowattn.branches.RadialInteraction`, an E(n)-equivariant
            pairwise interaction of particles with a tight certified bound: ActNorm ->
            EquivariantLinear -> x + g_radial(x) -> x + g_mlp(x) (the last only with ``mlp``).
        location: start (on the data side) with a :class:`SetLocation`, a spline flow of each
            set's centroid given its size. Attention and equivariant linear maps are affine
            along a translation of the whole set, so without it a multimodal distribution of
            set locations is out of reach. Not with ``zero_com``.
        radial_basis: number of Gaussian bumps of psi' (``interaction="radial"``).
        radial_range: the largest bump centre, in the units after ActNorm.
        manybody: with ``interaction="radial"``, follow each radial residual by one of
            :class:`~flowattn.branches.NeighbourhoodInteraction`, a many-body branch (the
            gradient of an embedding potential of soft neighbour counts in shells up to
            ``radial_range``).
        radial_max_slope: with ``interaction="radial"``, a number u makes the radial blocks
            monotone (:class:`MonotoneResidual`): psi' may reach u instead of ``coeff``, so one
            block expands by up to 1 + u; contraction stays bounded by ``coeff``.
        radial_inverse: with ``radial_max_slope``, every second radial block is an
            :class:`InverseMonotoneResidual` (contraction down to 1 / (1 + u), by a Newton solve).
        splines: after the equivariant map of every block, an element-wise spline coupling
            (:class:`~flowattn.flows.coupling.SetCoupling` with ``blocks=0``): half of each
            element's coordinates moved by monotone rational-quadratic splines (8 bins on
            [-5, 5]) whose parameters come from the element's other coordinates, alternating
            halves from block to block; exact log-det and inverse. A residual block stretches
            space by at most 1 + ``coeff``, so a multimodal distribution of the elements takes
            many of them; a spline bends it at once, and leaves the interaction blocks the
            dependence between elements. Needs D >= 2; not with ``zero_com`` (these splines
            are not re-centred; for particles see
            :func:`~flowattn.flows.coupling.coupling_stack` with ``zero_com=True``).
        pair_splines: after the equivariant map of every block, a
            :class:`~flowattn.flows.pairs.PairSplines`: every pair of elements moved along its
            axis by a monotone spline of its log-distance (midpoints kept, exact log-det and
            inverse), the pairs in round-robin order. A residual block changes a pair's
            distance by a bounded factor; a pair spline maps a hard core (a gap in the pair
            distances) onto short distances at once. The density stays E(n)-invariant but is
            no longer exactly exchangeable (the rounds follow the elements' order).
        attention_width: with ``interaction="attention"``, a number W makes every attention
            branch a :class:`~flowattn.branches.ContractiveLiftedL2MHA`: tied L2 attention
            (``heads`` heads, which must divide W) among W learnt features of each element,
            read back to D, certified in the mixed norm as a product. For narrow elements
            (points in 2-D), where attention on the coordinates compares them by a D x D
            metric per head. Not with ``attention`` nor ``zero_com``.
        logdet: how every :class:`InvertibleResidual` computes its log-det (default
            ``LogDetOptions()``).
        inverse: how every :class:`InvertibleResidual` is inverted (default
            ``InverseOptions()``).
        activation: of every :class:`~flowattn.branches.LipschitzMLP`: ``"lipswish"`` or
            ``"clipswish"`` (:class:`~flowattn.branches.mlp.CLipSwish`, the concatenated LipSwish,
            which passes on the negative half of its input as well).

    Examples:
        >>> import torch
        >>> flow = set_flow(dim=2, blocks=2, heads=1, logdet=LogDetOptions("exact"))
        >>> flow.log_prob(torch.randn(5, 4, 2)).shape
        torch.Size([5])
    """
    _check(dim, blocks, heads, hidden, coeff)
    if interaction not in INTERACTIONS:
        raise InputError(f"interaction must be one of {INTERACTIONS}, got {interaction!r}")
    if manybody and interaction != "radial":
        raise InputError("manybody=True adds NeighbourhoodInteraction blocks to "
                         f"interaction='radial', not {interaction!r}")
    if radial_inverse and (radial_max_slope is None or interaction != "radial"):
        raise InputError("radial_inverse=True inverts every second monotone radial block: it "
                         "needs interaction='radial' and a radial_max_slope")
    if location and zero_com:
        raise InputError("location=True models the centroid, which zero_com fixes at 0")
    if splines and (zero_com or dim < 2):
        raise InputError("splines=True moves some coordinates of each element by splines of "
                         "the others: it needs D >= 2 and no zero_com (here D="
                         f"{dim}, zero_com={zero_com})")
    if attention_width is not None:
        if interaction != "attention" or attention is not None or zero_com:
            raise InputError("attention_width makes the attention branches lifted attention: "
                             "it needs interaction='attention', no attention factory and no "
                             f"zero_com (here {interaction!r}, "
                             f"{'a factory' if attention is not None else 'no factory'}, "
                             f"zero_com={zero_com})")
        attention = _lifted_attention(attention_width)
    hidden = hidden or 4 * dim
    residual = dict(logdet=logdet, inverse=inverse, causal=False, zero_com=zero_com)
    layers: list[Transform] = [SetLocation(dim)] if location else []
    for index in range(blocks):
        if actnorm:
            layers.append(ActNorm(dim, zero_com=zero_com))
        if linear and interaction != "none":
            layers.append(EquivariantLinear(dim, zero_com=zero_com))
        if splines:
            layers.append(SetCoupling(dim, index % 2, hidden, blocks=0))
        if pair_splines:
            layers.append(PairSplines(dim))
        if interaction == "attention":
            layers.append(
                _attention_layer(dim, heads, hidden, coeff, mlp, norm, attention, residual,
                                 activation)
            )
            continue
        if interaction == "radial":
            radial = RadialInteraction(coeff, radial_basis, radial_range, radial_max_slope)
            if radial_max_slope is None:
                layers.append(InvertibleResidual(radial, **residual))
            elif radial_inverse and index % 2 == 1:
                layers.append(InverseMonotoneResidual(radial, zero_com=zero_com))
            else:
                layers.append(MonotoneResidual(radial, **residual))
            if manybody:
                many = NeighbourhoodInteraction(coeff, r_max=radial_range)
                layers.append(InvertibleResidual(many, **residual))
        # no attention: pointwise MLP residuals
        if mlp or interaction != "radial":
            mlp_branch = LipschitzMLP(dim, hidden, coeff, activation=activation)
            layers.append(InvertibleResidual(mlp_branch, **residual))
    return SetFlow(CompositeTransform(layers), dim, zero_com)


def sequence_flow(
    dim: int,
    blocks: int,
    heads: int,
    causal: bool = True,
    hidden: int | None = None,
    coeff: float = 0.9,
    mlp: bool = True,
    actnorm: bool = True,
    norm: str = "inf",
    attention: Callable[..., nn.Module] | None = None,
    logdet: LogDetOptions | None = None,
    inverse: InverseOptions | None = None,
) -> SetFlow:
    r"""A residual flow over sequences, with causal attention by default.

    Each block is ActNorm -> x + g_att(x) -> x + g_mlp(x). With ``causal=True`` element i
    attends to j <= i, the Jacobian of every block is block lower-triangular and the exact
    log-det is sum_i log det(I + J_ii) over D x D blocks, cheap for any length
    (``LogDetOptions("exact")`` or the default ``"auto"``). Arguments as in :func:`set_flow`.

    Examples:
        >>> import torch
        >>> flow = sequence_flow(dim=2, blocks=1, heads=1).eval()
        >>> flow.log_prob(torch.randn(2, 6, 2)).shape
        torch.Size([2])
    """
    _check(dim, blocks, heads, hidden, coeff)
    hidden = hidden or 4 * dim
    residual = dict(logdet=logdet, inverse=inverse, causal=causal, zero_com=False)
    layers: list[Transform] = []
    for _ in range(blocks):
        if actnorm:
            layers.append(ActNorm(dim))
        layers.append(_attention_layer(dim, heads, hidden, coeff, mlp, norm, attention, residual))
    return SetFlow(CompositeTransform(layers), dim)
