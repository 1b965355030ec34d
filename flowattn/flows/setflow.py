"""The flow object over sets and sequences: :class:`SetFlow`, a stack of ``nflows`` transforms
with a standard normal base per present element (the builders of
:mod:`flowattn.flows.builders` and :mod:`flowattn.flows.coupling` make its stacks)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch
from nflows.transforms import CompositeTransform, Transform
from torch import Tensor, nn

from ..attention import shared_certificates
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
from .layers import ActNorm, SetLocation
from .residual import InvertibleResidual, points_only

__all__ = ["SetFlow", "SYMMETRIES"]

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
        >>> from flowattn.flows import LogDetOptions, set_flow
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
            >>> from flowattn.flows import LogDetOptions, set_flow
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
            >>> from flowattn.flows import set_flow
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
            >>> from flowattn.flows import set_flow
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
            >>> from flowattn.flows import LogDetOptions, set_flow
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
