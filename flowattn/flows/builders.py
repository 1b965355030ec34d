"""Residual flows over sets and sequences: the flow object and its builders."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch
from nflows.transforms import CompositeTransform, Transform
from torch import Tensor, nn

from ..attention import shared_certificates
from ..branches import (
    ContractiveLiftedL2MHA,
    LipschitzMLP,
    NeighbourhoodInteraction,
    RadialInteraction,
)
from ..data.augment import reflection_signs
from ..errors import InputError
from ..validation import (
    check_count,
    check_deferred,
    check_precision,
    check_sets,
    inputs_trusted,
    present_weights,
    trusted_inputs,
)
from .base import sample_standard_normal, standard_normal_log_prob
from .geometry import check_centred, subtract_mean
from .inverse import InverseOptions
from .layers import ActNorm, EquivariantLinear, SetLocation
from .logdet import LogDetOptions
from .monotone import InverseMonotoneResidual, MonotoneResidual
from .pairs import PairSplines
from .residual import InvertibleResidual, TransformerResidualPair, points_only

__all__ = ["SetFlow", "set_flow", "sequence_flow", "INTERACTIONS", "SYMMETRIES"]

INTERACTIONS = ("attention", "radial", "linear", "none")
SYMMETRIES = ("none", "reflections")


class SetFlow(nn.Module):
    r"""A normalizing flow over sets or sequences with a standard normal per present element.

    log p(x) = log N(f(x); 0, I) + log|det J_f(x)|, summed over the present elements of each set
    (padded elements, ``mask`` False, are ignored). With ``zero_com=True`` the data are
    particle configurations: the density lives on the zero-centre-of-mass subspace, inputs are
    projected onto it (x_i - mean_j x_j), the flow keeps sum_i x_i = 0 and the base is N(0, I) on
    that (n - 1) D-dimensional subspace, including its -(n - 1) D / 2 log(2 pi) constant
    (the convention of Satorras et al. 2021, E(n) equivariant normalizing flows).

    The data first pass a fixed affine standardisation u_i = (x_i - m) / s, per feature, with m
    and s set from the training data by :meth:`standardise` (identity until then; m = 0 in
    zero-centre-of-mass mode) and saved with the flow's state. Its log-determinant,
    -n sum_d log s_d per set ((n - 1) in zero-centre-of-mass mode), is part of log p(x), and
    sampling maps back, x_i = m + s u_i, so the density is that of the data in their own units:
    data moved by c and scaled by a have log-likelihoods lower by exactly n D log|a|. The layers
    after it see data of unit scale near 0, whatever the offset and scale of the raw data.

    With ``symmetry="reflections"`` the density is the average of the flow's own density q
    (the one above) over the 2^D mirror images through the coordinate axes,

        p(X) = 2^-D sum_S q(X S),   S = diag(±1, ..., ±1),

    a density (each S has |det S| = 1) that is exactly invariant under those reflections, for
    data whose density is (such as ``shape-sets``). For such data its expected log-likelihood
    is never below q's: log p(X) >= 2^-D sum_S log q(X S) (Jensen), whose expectation over the
    data is q's expected log-likelihood. That bound, drawn with one random S per set, is what
    training maximises (:meth:`component_log_prob` on mirrored sets); :meth:`log_prob` costs
    2^D passes of the flow. Sampling draws X from q and mirrors it by a random S.

    Arguments:
        transform: an nflows transform on (B, N, D) taking the mask as ``context``.
        dim: feature width D.
        zero_com: zero-centre-of-mass mode.
        symmetry: ``"none"`` or ``"reflections"`` (the mirror average above).

    Examples:
        >>> flow = set_flow(dim=2, blocks=1, heads=1, logdet=LogDetOptions("exact")).eval()
        >>> flow.log_prob(torch.randn(3, 4, 2)).shape
        torch.Size([3])
        >>> mirrored = SetFlow(flow.transform, dim=2, symmetry="reflections").eval()
        >>> x = torch.randn(3, 4, 2)
        >>> bool(torch.allclose(mirrored.log_prob(x), mirrored.log_prob(-x)))
        True
    """

    def __init__(self, transform: Transform, dim: int, zero_com: bool = False,
                 symmetry: str = "none") -> None:
        super().__init__()
        self.transform = transform
        self.dim = check_count(dim, "dim")
        self.zero_com = bool(zero_com)
        self.standardisation = _fixed_actnorm(dim, self.zero_com)
        self.symmetry = symmetry

    @property
    def symmetry(self) -> str:
        """``"none"``, or ``"reflections"``: the density is the mirror average (class doc)."""
        return self._symmetry

    @symmetry.setter
    def symmetry(self, symmetry: str) -> None:
        if symmetry not in SYMMETRIES:
            raise InputError(f"symmetry must be one of {', '.join(SYMMETRIES)}, got {symmetry!r}")
        self._symmetry = symmetry
        # the 2^D sign patterns, the identity first; derived from the setting, not saved
        signs = reflection_signs(self.dim) if symmetry == "reflections" else None
        ref = next(self.parameters(), None)
        if signs is not None and ref is not None:
            signs = signs.to(ref.device)
        self.register_buffer("reflections", signs, persistent=False)

    def standardise(self, x: Tensor, mask: Tensor | None = None, isotropic: bool = False) -> None:
        """Set the standardisation from the present elements of training sets ``x`` (M, N, D).

        m is their mean and s their standard deviation per feature (float64,
        :func:`~flowattn.flows.layers.feature_moments`: a constant feature keeps s = 1); in
        zero-centre-of-mass mode m = 0 and s is the root mean square of the centred sets. With
        ``isotropic`` one s for every feature, the root mean square of the per-feature ones, so
        that the standardisation commutes with rotations (what ``alignment="euclidean"`` of
        :meth:`matching_loss` needs).

        Examples:
            >>> flow = set_flow(2, blocks=1, heads=1, logdet=LogDetOptions("exact")).double()
            >>> x = torch.randn(64, 4, 2, dtype=torch.float64)
            >>> flow.standardise(x)
            >>> before = flow.log_prob(x)
            >>> flow.standardise(10 * x + 1e6)  # the same data in other units: n D log 10 less
            >>> gap = before - flow.log_prob(10 * x + 1e6)
            >>> bool(torch.allclose(gap, gap.new_full((64,), 8 * math.log(10.0)), atol=1e-6))
            True
        """
        x, mask = self._prepare(x, mask)
        self.standardisation.initialise(x, mask)
        if isotropic:
            scale = self.standardisation.log_scale
            scale.fill_(-0.5 * torch.log(torch.exp(-2 * scale.double()).mean()).item())

    def initialise_location(self, x: Tensor, mask: Tensor | None = None) -> None:
        """Initialise a leading :class:`SetLocation`'s ActNorm from the training sets ``x``.

        Its input is the standardised sets u (see :meth:`standardise`), so their centroids
        (one per set) set its shift and scale (:meth:`SetLocation.initialise`); a flow without
        a leading SetLocation is left as it is.

        Examples:
            >>> flow = set_flow(2, blocks=1, heads=1, location=True)
            >>> flow.initialise_location(torch.randn(64, 5, 2))
            >>> bool(flow.transform._transforms[0].centroid_flow._transforms[0].initialized)
            True
        """
        first = getattr(self.transform, "_transforms", [None])[0]
        if not isinstance(first, SetLocation):
            return
        x, mask = self._prepare(x, mask)
        with torch.no_grad(), trusted_inputs():
            u, _ = self.standardisation(x, context=mask)
        first.initialise(u, mask)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        # A flow saved before the standardisation existed: its data were not standardised.
        for name, value in _fixed_actnorm(self.dim, self.zero_com).state_dict().items():
            state_dict.setdefault(f"{prefix}standardisation.{name}", value)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _forward(self, x: Tensor, mask: Tensor | None,
                 transform: Transform | None = None) -> tuple[Tensor, Tensor]:
        # checked once, in _prepare; the layers trust their caller
        with trusted_inputs(), self._shared_certificates(x, mask):
            u, scale_logdet = self.standardisation(x, context=mask)
            z, logdet = (transform or self.transform)(u, context=mask)
        logdet = scale_logdet + logdet
        check_deferred(x, "SetFlow", z, logdet)
        return z, logdet

    def _inverse(self, z: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
        with trusted_inputs(), self._shared_certificates(z, mask):
            u, logdet = self.transform.inverse(z, context=mask)
            x, scale_logdet = self.standardisation.inverse(u, context=mask)
        logdet = logdet + scale_logdet
        check_deferred(z, "SetFlow", x, logdet)
        return x, logdet

    def _shared_certificates(self, x: Tensor,
                             mask: Tensor | None) -> contextlib.AbstractContextManager:
        """For sets without padding, the certificates of the flow's contractive attention
        blocks from one evaluation batched over the blocks built alike
        (:func:`~flowattn.attention.shared_certificates`), for the kind of call its residual
        blocks make (causal or not): a deep flow's blocks otherwise evaluate theirs one by one,
        each a hundred small operations. With a mask each block evaluates its own table of
        counts, as before."""
        stack = contextlib.ExitStack()
        if mask is None:
            kinds = {block.causal for block in self.modules()
                     if isinstance(block, InvertibleResidual)}
            for causal in sorted(kinds):
                stack.enter_context(shared_certificates(self.modules(), x.shape[1], causal))
        return stack

    def _prepare(self, x: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor | None]:
        mask = check_sets(x, mask, dim=self.dim)
        check_precision(x, self)
        if self.zero_com and not inputs_trusted():
            _check_zero_com_sizes(x, mask)
        if self.zero_com:
            x = subtract_mean(x, mask)
        return x, mask

    def transform_to_noise(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """z = f(x), shape (B, N, D); padded elements pass through."""
        x, mask = self._prepare(x, mask)
        return self._forward(x, mask)[0]

    def log_prob(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """log p(x) per set, shape (B,): exact in eval mode where feasible, else an estimate;
        the mirror average for ``symmetry="reflections"``."""
        if self.reflections is None:
            return self._log_prob(x, mask, self.transform)
        x, mask = self._prepare(x, mask)  # checked once, then mirrored
        signs = self.reflections.to(x.dtype)
        with trusted_inputs():  # one image at a time: the memory of one pass, not of 2^D
            log_q = torch.stack([self._log_prob(x * s, mask, self.transform) for s in signs])
        return torch.logsumexp(log_q, dim=0) - math.log(signs.shape[0])

    def component_log_prob(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """log q(x), the flow's own density before any mirror average (:meth:`log_prob` for
        ``symmetry="none"``): what training maximises."""
        return self._log_prob(x, mask, self.transform)

    def _log_prob(self, x: Tensor, mask: Tensor | None, transform: Transform) -> Tensor:
        x, mask = self._prepare(x, mask)
        z, logdet = self._forward(x, mask, transform)
        return standard_normal_log_prob(z, mask, self.zero_com) + logdet

    def matching_loss(self, x: Tensor, mask: Tensor | None = None, noise: Tensor | None = None,
                      times: Tensor | None = None, generator: torch.Generator | None = None,
                      alignment: str = "none") -> Tensor:
        r"""The flow-matching loss of each set, shape (B,), for a flow that is one continuous
        flow (:meth:`CNF.matching_loss <flowattn.flows.CNF.matching_loss>` on the
        standardised sets u = (x - m) / s; ``noise``, ``times`` and ``alignment`` as there).

        A fixed standardisation changes the likelihood by a constant log-determinant, so
        matching in u trains the same density of x. Flows with other layers (a leading
        :class:`SetLocation`, residual blocks) have no such loss.

        Examples:
            >>> from flowattn.flows import CNF, EGNNField
            >>> flow = SetFlow(CNF(EGNNField(dim=2, hidden=8, layers=2)), dim=2, zero_com=True)
            >>> flow.matching_loss(torch.randn(6, 4, 2)).shape
            torch.Size([6])
        """
        matching = getattr(self.transform, "matching_loss", None)
        if matching is None:
            raise InputError("flow matching trains a flow that is one continuous flow (a CNF); "
                             f"this flow's transform is a {type(self.transform).__name__}")
        if alignment == "euclidean" and not inputs_trusted():
            scale = self.standardisation.log_scale
            if not bool((scale == scale[0]).all()):
                raise InputError("alignment='euclidean' turns base draws by orthogonal maps, "
                                 "which keeps the standardised data's law only if every "
                                 "direction is scaled alike: standardise with "
                                 "isotropic=True")
        x, mask = self._prepare(x, mask)
        with trusted_inputs():
            u, _ = self.standardisation(x, context=mask)
            return matching(u, mask, noise=noise, times=times, generator=generator,
                            alignment=alignment)

    def compiled_log_prob(self, **options: Any) -> Callable[..., Tensor]:
        """:meth:`component_log_prob` with each layer of the flow compiled on its own
        (``torch.compile(layer, **options)``), for training.

        Layers of one kind share their compiled code (their parameters are inputs of the
        graph), so a deep flow compiles a few small graphs, not one large one: about a minute
        on one CPU core for the 12 residual and 12 monotone blocks of the DW4 flow, against
        twelve for the whole log-density as one graph. The entry check and the base density
        stay eager; the flow itself is unchanged (the compiled layers share its parameters),
        so its evaluation, sampling and state dict are those of the eager flow. The first call
        also runs the flow once eagerly without gradients, so that one-time work (ActNorm's
        data-dependent initialisation, a monotone block's check of its branch) happens outside
        the compiled graphs, also for a flow loaded from a checkpoint.

        Examples:
            >>> from flowattn.branches.mlp import frozen_power_iteration
            >>> flow = set_flow(dim=2, blocks=1, heads=1)
            >>> log_prob = flow.compiled_log_prob(backend="eager")
            >>> x = torch.randn(3, 4, 2)
            >>> with frozen_power_iteration():  # a training pass would move sigma's estimate
            ...     bool(torch.allclose(log_prob(x), flow.log_prob(x)))
            True
        """
        layers = self.transform
        if isinstance(layers, CompositeTransform):
            layers = CompositeTransform([torch.compile(t, **options) for t in layers._transforms])
        else:
            layers = torch.compile(layers, **options)
        settled = False

        def log_prob(x: Tensor, mask: Tensor | None = None) -> Tensor:
            nonlocal settled
            if not settled:  # one-time work, eagerly
                with torch.no_grad():
                    self._log_prob(x, mask, self.transform)
                settled = True
            return self._log_prob(x, mask, layers)

        return log_prob

    def _reference_tensor(self) -> Tensor:
        for t in self.parameters():
            return t
        return torch.zeros(())

    def sample(
        self,
        num_samples: int,
        set_size: int | None = None,
        mask: Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Draw ``num_samples`` sets of ``set_size`` elements (or with the given ``mask``);
        with ``symmetry="reflections"`` each mirrored by one of the 2^D reflections at random."""
        z, mask = self._base_sample(num_samples, set_size, mask, generator)
        with points_only():  # the log-dets of the inverse are not wanted here
            x = self._inverse(z, mask)[0]
        if self.reflections is None:
            return x
        device = z.device if generator is None else generator.device
        pick = torch.randint(self.reflections.shape[0], (num_samples,), generator=generator,
                             device=device).to(z.device)
        return x * self.reflections.to(x.dtype)[pick].unsqueeze(1)

    def sample_and_log_prob(
        self,
        num_samples: int,
        set_size: int | None = None,
        mask: Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Samples and their log-densities, log p(x) = log N(z) - log|det dx/dz| (for
        ``symmetry="reflections"``, mirrored samples and their :meth:`log_prob`)."""
        if self.reflections is not None:
            x = self.sample(num_samples, set_size, mask, generator)
            return x, self.log_prob(x, mask)
        z, mask = self._base_sample(num_samples, set_size, mask, generator)
        return self._from_noise(z, mask)

    def from_noise(self, z: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Sets x = f⁻¹(z) from given base draws ``z`` (B, N, D), and log p(x) = log N(z) -
        log|det dx/dz|.

        Differentiable in the flow's parameters wherever its inverse is (residual blocks by
        implicit differentiation): what training by energy needs, E_q[E(x) + log q(x)] with
        z ~ N(0, I) fixed and the flow's parameters varying. In zero-centre-of-mass mode ``z``
        must lie on the subspace (as :meth:`sample` draws it; refused otherwise, as are sets of
        one element). These are the flow's own sets and density q, before any mirror average
        (``symmetry``).

        Examples:
            >>> flow = set_flow(dim=2, blocks=1, heads=1, logdet=LogDetOptions("exact")).eval()
            >>> x, log_q = flow.from_noise(torch.randn(3, 4, 2))
            >>> bool(torch.allclose(log_q, flow.log_prob(x), atol=1e-4))
            True
        """
        mask = check_sets(z, mask, dim=self.dim, name="z")
        if not inputs_trusted():
            check_precision(z, self, name="z")
            if self.zero_com:
                _check_zero_com_sizes(z, mask)
                check_centred(z, mask, name="z")
        return self._from_noise(z, mask)

    def _from_noise(self, z: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
        x, logdet_inv = self._inverse(z, mask)
        return x, standard_normal_log_prob(z, mask, self.zero_com) - logdet_inv

    def _base_sample(self, num_samples, set_size, mask, generator):
        num_samples = check_count(num_samples, "num_samples")
        if mask is not None:
            if mask.dtype != torch.bool or mask.dim() != 2 or mask.shape[0] != num_samples:
                raise InputError(
                    f"mask must be bool of shape ({num_samples}, N), got {tuple(mask.shape)}"
                )
            if set_size is not None and set_size != mask.shape[1]:
                raise InputError(f"set_size={set_size} disagrees with mask width {mask.shape[1]}")
            set_size = mask.shape[1]
        if set_size is None:
            raise InputError("set_size must be a positive integer, got None")
        set_size = check_count(set_size, "set_size")
        ref = self._reference_tensor()
        check_precision(ref, name="the flow's parameters")
        if mask is not None:
            mask = mask.to(ref.device)
        z = sample_standard_normal(
            (num_samples, set_size, self.dim),
            mask,
            self.zero_com,
            generator,
            ref.device,
            ref.dtype,
        )
        mask = check_sets(z, mask, dim=self.dim, name="samples")  # e.g. empty sets
        if self.zero_com:  # and sets of one element, which have no density there
            _check_zero_com_sizes(z, mask)
        return z, mask


def _check_zero_com_sizes(x: Tensor, mask: Tensor | None) -> None:
    sizes = present_weights(x, mask).sum(dim=1)
    smallest = int(sizes.min())
    if smallest < 2:
        first = int(torch.nonzero(sizes < 2)[0, 0])
        raise InputError(f"set {first} has {smallest} element(s): in zero-centre-of-mass mode a "
                         "set needs at least 2 (one element has no density in the "
                         "(n - 1) D = 0-dimensional subspace)")


def _fixed_actnorm(dim: int, zero_com: bool) -> ActNorm:
    """An ActNorm that starts as the identity and is never trained: the standardisation.

    Its shift and scale are buffers, not parameters: no optimiser or ``flow.parameters()``
    sees them, and they keep their names in the state dict.
    """
    layer = ActNorm(dim, zero_com=zero_com)
    for name in ("log_scale", "shift"):
        value = getattr(layer, name).detach().clone()
        delattr(layer, name)
        layer.register_buffer(name, value)
    layer.initialized.fill_(True)
    return layer


def _default_attention(dim: int, heads: int, coeff: float, norm: str) -> nn.Module:
    from ..attention import ContractiveL2MHA

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
            from .coupling import SetCoupling  # coupling builds on SetFlow, defined here

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
