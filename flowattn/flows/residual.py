"""Invertible residual blocks y = x + g(x) (i-ResNet / Residual Flows) as nflows transforms."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from nflows.transforms import CompositeTransform, Transform
from torch import Tensor, nn

from ..attention.contractive import frozen_certificates
from ..branches.mlp import frozen_power_iteration
from ..errors import InputError
from ..validation import (
    check_deferred,
    trusted_inputs,
)
from .geometry import (
    checked_inputs,
    evaluation_generator,
    full_precision,
    project,
)
from .inverse import InverseOptions, residual_inverse
from .logdet import (
    LogDetOptions,
    exact_logdet,
    jacobian_logdet,
    memory_efficient_logdet,
    precise_series_logdet,
    roulette_logdet,
    series_logdet,
)

__all__ = ["InvertibleResidual", "TransformerResidualPair", "branch_bound", "points_only"]


class _PointsOnly(threading.local):
    def __init__(self) -> None:  # instance attributes: dynamo guards them without a fault
        self.on = False


_POINTS_ONLY = _PointsOnly()


@contextmanager
def points_only() -> Iterator[None]:
    """Within this context the inverse of every :class:`InvertibleResidual` solves for its
    points and does not compute its log-det: it returns zeros in its place.

    Sampling wants the points alone, and the log-det of an inverse is a series of Jacobian
    products (at evaluation accuracy up to a hundred per block, each holding a batch's N x N
    attention weights), which costs far more than the fixed-point solve itself and is what
    limits the set size a sample can have. :meth:`~flowattn.flows.setflow.SetFlow.sample`
    enters it; a caller that needs log-densities of samples must not.

    Examples:
        >>> from flowattn.branches import LipschitzMLP
        >>> block = InvertibleResidual(LipschitzMLP(2, 8)).eval()
        >>> y = torch.randn(4, 3, 2)
        >>> with torch.no_grad(), points_only():
        ...     x, logdet = block.inverse(y)
        >>> bool((logdet == 0).all()), torch.allclose(block(x)[0], y, atol=1e-5)
        (True, True)
    """
    previous = _POINTS_ONLY.on
    _POINTS_ONLY.on = True
    try:
        yield
    finally:
        _POINTS_ONLY.on = previous

def branch_bound(branch: nn.Module, n: int, zero_com: bool = False,
                 any_size: bool = False) -> float:
    """The certified Lipschitz constant of ``branch`` on sets of ``n`` elements, as a float.

    In zero-centre-of-mass mode the branch is followed by the projection x -> x - mean(x), which
    is non-expansive in the 2-norm but has infinity-norm 2 (n - 1) / n; a branch whose
    ``norm`` attribute is not ``"2"`` is charged that factor, or its limit 2 with ``any_size``
    (the factor of large sets, for a check made on ``n`` elements only).

    Raises:
        ValueError: if the branch has no ``lipschitz_bound`` method or its bound is not finite.
    """
    fn = getattr(branch, "lipschitz_bound", None)
    if not callable(fn):
        raise InputError(
            f"branch {type(branch).__name__} has no lipschitz_bound(n) method: an invertible "
            "residual block needs a certified Lipschitz constant below 1"
        )
    with torch.no_grad():
        bound = float(fn(n))
    if zero_com and getattr(branch, "norm", None) != "2" and (n > 1 or any_size):
        bound *= 2.0 if any_size else 2.0 * (n - 1) / n
    if not math.isfinite(bound):
        raise InputError(f"branch {type(branch).__name__} reports a non-finite bound {bound}")
    return bound


class InvertibleResidual(Transform):
    r"""Invertible residual block y = x + g(x) with Lip(g) < 1, an ``nflows`` transform.

    References:
        Behrmann et al., "Invertible Residual Networks", ICML 2019;
        Chen et al., "Residual Flows for Invertible Generative Modeling", NeurIPS 2019;
        Kim et al., "The Lipschitz Constant of Self-Attention", ICML 2021, §5.

    Inputs are sets or sequences of shape (B, N, D) (a (B, D) batch is treated as sets of one
    element). The padding mask travels in nflows' ``context`` argument (a bool (B, N) tensor, or
    ``{"mask": mask}``), so the block composes with ``CompositeTransform`` and ``Flow``; causal
    attention is a constructor flag (``causal=True``), passed to the branch on every call.
    Padded elements pass through unchanged and do not enter the log-determinant.

    The branch must provide ``forward(x, mask=None, causal=False)`` and a certified
    ``lipschitz_bound(n)`` < 1; it is checked at construction (on ``check_size`` elements; with
    ``zero_com`` a branch not certified in the 2-norm must be below 1/2 there, as the
    centring's factor 2 (n - 1) / n reaches 2 on large sets), in evaluation mode and before
    every inverse (on the actual N). It may declare
    ``jacobian_structure = "pointwise"`` (block-diagonal Jacobian: exact log-det from D VJPs),
    or a closed-form ``jacobian(x, mask)`` of shape (B, N, D, N, D), which the exact path then
    uses instead of N D VJPs, or ``linearise(x, mask=None, causal=False)`` returning g(x) and
    its product w -> w^T J (as :meth:`~flowattn.branches.LipschitzMLP.linearise`), which every
    log-det estimator then uses instead of autograd VJPs: no double backward, and
    ``torch.compile`` traces it.
    Training differentiates VJPs of the branch (double backward): the branch must be twice
    differentiable, as every :mod:`flowattn.attention` module is.

    Log-determinant (``logdet``, a :class:`~flowattn.flows.LogDetOptions`):
        ``"exact"`` -- full Jacobian by batched VJPs, or the block-triangular path for causal /
        pointwise branches (sum_i log det(I + J_ii)); ``"series"`` -- ``n_terms`` terms of the
        power series with ``n_samples`` Hutchinson probes; ``"roulette"`` -- unbiased Russian
        roulette with ``n_exact_terms`` fixed terms and geometric / Poisson lengths;
        ``"auto"`` -- exact when the Jacobian is block-structured or N D <= ``exact_max_dim``,
        roulette otherwise. ``grad="neumann"`` uses the Neumann gradient series;
        ``memory_efficient=True`` takes the log-det gradient in the forward pass so the peak
        memory does not grow with the number of terms.

    Evaluation mode (``.eval()``) always gives a deterministic, high-accuracy log-det: exact
    where N D <= ``eval_exact_max_dim`` or the Jacobian is block-structured, otherwise
    ``eval_n_terms`` terms with probes from a generator seeded with ``eval_seed``, drawn until
    the standard error per degree of freedom is at most ``eval_max_error``
    (:func:`~flowattn.flows.logdet.precise_series_logdet`); that estimate's variance is kept in
    ``logdet_variance`` (``None`` after an exact log-det). In training mode the returned log-det
    is the honest estimate (its value), while its gradient is the chosen surrogate (Neumann or
    backprop).

    Arguments:
        branch: the contractive module g.
        logdet: how the log-det is computed (default ``LogDetOptions()``: ``"auto"``).
        inverse: how the inverse is solved (default ``InverseOptions()``: Anderson, tolerance
            1e-6, at most 1000 iterations).
        causal: call the branch with ``causal=True`` and use the block-triangular exact path.
        zero_com: keep sum_i x_i = 0 (project the branch output; log-det on the subspace).
        check_size: set size at which the branch bound is checked at construction.

    Examples:
        >>> from flowattn.branches import LipschitzMLP
        >>> branch = LipschitzMLP(2, 16, coeff=0.9)
        >>> block = InvertibleResidual(branch, logdet=LogDetOptions("exact")).eval()
        >>> x = torch.randn(4, 3, 2)
        >>> y, logdet = block(x)
        >>> x_back, _ = block.inverse(y)
        >>> bool((x_back - x).abs().max() < 1e-4)
        True
    """

    def __init__(
        self,
        branch: nn.Module,
        *,
        logdet: LogDetOptions | None = None,
        inverse: InverseOptions | None = None,
        causal: bool = False,
        zero_com: bool = False,
        check_size: int = 2,
    ) -> None:
        super().__init__()
        if not isinstance(branch, nn.Module):
            raise InputError(f"branch must be an nn.Module, got {type(branch).__name__}")
        logdet = LogDetOptions() if logdet is None else logdet
        inverse = InverseOptions() if inverse is None else inverse
        if not isinstance(logdet, LogDetOptions):
            raise InputError(f"logdet must be a LogDetOptions, got {type(logdet).__name__}")
        if not isinstance(inverse, InverseOptions):
            raise InputError(f"inverse must be an InverseOptions, got {type(inverse).__name__}")
        # with zero_com, the centring's factor at its limit 2: larger sets than check_size
        # would otherwise train on a map that is not a contraction
        bound = branch_bound(branch, check_size, zero_com, any_size=True)
        if bound >= 1:
            centring = zero_com and getattr(branch, "norm", None) != "2"
            raise InputError(
                f"branch {type(branch).__name__} is not contractive: certified Lipschitz bound "
                f"{bound:.4f} >= 1 on sets of {check_size} elements"
                + (" and more, the zero-centre-of-mass centring's factor 2 (n - 1) / n taken "
                   "at its limit 2: outside the 2-norm the branch's own bound must be below "
                   "1/2 (a coeff below 0.5, as set_flow takes; in the 2-norm the centring "
                   "costs nothing)" if centring else "")
            )
        self.branch = branch
        self.logdet_options = logdet
        self.inverse_options = inverse
        self.causal = bool(causal)
        self.zero_com = bool(zero_com)
        #: the variance (B,) of the latest log-det where it was estimated in evaluation mode
        #: (the squared standard error of :func:`precise_series_logdet`), else ``None``
        self.logdet_variance: Tensor | None = None

    # -- helpers -------------------------------------------------------------------------------
    @property
    def structure(self) -> str:
        """Jacobian structure of the exact path: ``"full"``, ``"causal"`` or ``"pointwise"``."""
        if self.zero_com:
            return "full"
        if getattr(self.branch, "jacobian_structure", "full") == "pointwise":
            return "pointwise"
        return "causal" if self.causal else "full"

    def _g(self, x: Tensor, mask: Tensor | None) -> Tensor:
        out = self.branch(x, mask=mask, causal=self.causal)
        if out.shape != x.shape:
            raise InputError(
                f"branch {type(self.branch).__name__} returned shape {tuple(out.shape)} "
                f"for input shape {tuple(x.shape)}"
            )
        return project(out, mask, self.zero_com)

    def _linearised(self, x: Tensor, mask: Tensor | None):
        """(P g(x), w -> w^T P J) from the branch's ``linearise``."""
        out, branch_vjp = self.branch.linearise(x, mask=mask, causal=self.causal)
        if out.shape != x.shape:
            raise InputError(
                f"branch {type(self.branch).__name__} returned shape {tuple(out.shape)} "
                f"for input shape {tuple(x.shape)}"
            )
        mask_, zero_com = mask, self.zero_com

        def vjp_fn(w: Tensor) -> Tensor:  # d(P g)/dx = P J_g, so w^T P J_g = (P w)^T J_g
            return branch_vjp(project(w, mask_, zero_com))

        return project(out, mask, zero_com), vjp_fn

    def _check_contractive(self, n: int) -> float:
        bound = branch_bound(self.branch, n, self.zero_com)
        if bound >= 1:
            raise InputError(
                f"branch {type(self.branch).__name__} is not contractive on sets of {n} "
                f"elements: certified Lipschitz bound {bound:.4f} >= 1"
            )
        return bound

    def _exact_logdet(self, gx: Tensor, x: Tensor, mask: Tensor | None, create_graph: bool,
                      vjp_fn=None):
        if self._has_jacobian():  # the branch's closed form: one pass
            return jacobian_logdet(self.branch.jacobian(x, mask).to(x.dtype), mask, self.zero_com)
        return exact_logdet(gx, x, mask, self.structure, self.zero_com, create_graph,
                            chunk_size=_chunk_size(*x.shape), vjp_fn=vjp_fn)

    def _closed_form(self, n: int, d: int) -> bool:
        """Whether the log-det of the current mode is the determinant of the branch's own
        closed-form ``jacobian``: no VJP, so no double backward in its gradient."""
        return self._has_jacobian() and self._method(n, d) == "exact"

    def _has_jacobian(self) -> bool:
        """Whether the branch gives its Jacobian in closed form (``jacobian(x, mask)``) for
        this block: not under a causal mask, which that Jacobian does not take."""
        return callable(getattr(self.branch, "jacobian", None)) and not self.causal

    def _method(self, n: int, d: int) -> str:
        """The log-det estimator of the current mode for sets of n elements of dimension d:
        ``"exact"``, ``"series"`` or ``"roulette"`` in training (``auto`` resolved), ``"exact"``
        or ``"eval-series"`` (the high-accuracy series) in evaluation."""
        if not self.training:
            return "exact" if self._exact_feasible(n, d) else "eval-series"
        method = self.logdet_options.method
        if method == "auto":
            return "exact" if self._exact_feasible(n, d) else "roulette"
        return method

    def _exact_feasible(self, n: int, d: int) -> bool:
        opt = self.logdet_options
        max_dim = opt.exact_max_dim if self.training else opt.eval_exact_max_dim
        if self._has_jacobian():
            return n * d <= 8 * max_dim  # no VJPs: only the determinant's cost
        return self.structure != "full" or n * d <= max_dim

    def _logdet_fn(self, x_shape, mask: Tensor | None):
        """(gx, x, create_graph, vjp_fn=None) -> log-det (B,) for the current mode."""
        _, n, d = x_shape
        zc = self.zero_com
        opt = self.logdet_options
        structure = "pointwise" if self.structure == "pointwise" else "full"
        self.logdet_variance = None
        method = self._method(n, d)
        if method == "eval-series":
            bound = self._check_contractive(n)
            terms = opt.eval_n_terms or _terms_for_bound(bound)

            def eval_series(gx, x, cg, vjp_fn=None):
                gen = evaluation_generator(x.device, opt.eval_seed)
                value, variance = precise_series_logdet(
                    gx, x, terms, mask, zc, opt.probe, gen, cg, vjp_fn=vjp_fn,
                    structure=structure, round_samples=opt.eval_n_samples,
                    max_error=opt.eval_max_error, max_samples=opt.eval_max_samples,
                )
                self.logdet_variance = variance
                return value

            return eval_series
        if method == "exact":
            return lambda gx, x, cg, vjp_fn=None: self._exact_logdet(gx, x, mask, cg, vjp_fn)
        if method == "series":
            return lambda gx, x, cg, vjp_fn=None: series_logdet(
                gx, x, opt.n_terms, mask, opt.n_samples, opt.probe, opt.grad, zc,
                opt.generator, cg, vjp_fn=vjp_fn, structure=structure,
            )
        return lambda gx, x, cg, vjp_fn=None: roulette_logdet(
            gx, x, opt.n_exact_terms, mask, opt.n_samples, opt.probe, opt.grad,
            opt.roulette, opt.roulette_param, opt.roulette_lengths, zc, opt.generator, cg,
            vjp_fn=vjp_fn, structure=structure,
        )

    @staticmethod
    def _as_sets(inputs: Tensor) -> tuple[Tensor, bool]:
        if isinstance(inputs, Tensor) and inputs.dim() == 2:
            return inputs.unsqueeze(1), True
        return inputs, False

    # -- nflows interface ----------------------------------------------------------------------
    def forward(self, inputs: Tensor, context=None) -> tuple[Tensor, Tensor]:
        """y = x + g(x) and log|det dy/dx| per set, shape (B,)."""
        x_in, flat = self._as_sets(inputs)
        mask = checked_inputs(x_in, context, self.branch, getattr(self.branch, "dim", None))
        with trusted_inputs():  # the branch trusts its caller
            y, logdet = self._checked_forward(x_in, mask)
        check_deferred(x_in, "InvertibleResidual", y, logdet)
        return (y.squeeze(1) if flat else y), logdet

    def _checked_forward(self, x_in: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
        if not self.training:
            self._check_contractive(x_in.shape[1])
        logdet_fn = self._logdet_fn(x_in.shape, mask)
        need_graph = torch.is_grad_enabled() and (
            x_in.requires_grad or any(p.requires_grad for p in self.branch.parameters())
        )
        return self._forward(x_in, mask, logdet_fn, need_graph)

    def _forward(self, x_in, mask, logdet_fn, need_graph):
        if callable(getattr(self.branch, "linearise", None)) and not (
            need_graph and self.logdet_options.memory_efficient
        ):
            # The branch's own products: no graph unless the result needs one, and no
            # backward (let alone a double backward) inside the log-det; torch.compile traces it.
            with torch.set_grad_enabled(need_graph):
                gx, vjp_fn = self._linearised(x_in, mask)
                logdet = logdet_fn(gx, x_in, need_graph, vjp_fn)
            return x_in + gx, logdet
        if self._closed_form(*x_in.shape[1:]) and not (
            need_graph and self.logdet_options.memory_efficient
        ):
            # The determinant of the branch's closed-form Jacobian: plain differentiable code,
            # which torch.compile traces (with the branch) in one graph.
            with torch.set_grad_enabled(need_graph):
                gx = self._g(x_in, mask)
                logdet = logdet_fn(gx, x_in, need_graph)
            return x_in + gx, logdet
        return self._autograd_forward(x_in, mask, logdet_fn, need_graph)

    @torch.compiler.disable
    def _autograd_forward(self, x_in, mask, logdet_fn, need_graph):
        """The log-det from autograd VJPs of the branch, eagerly also under ``torch.compile``:
        its gradient is a double backward, which compiled (AOT) graphs do not provide."""
        if need_graph and self.logdet_options.memory_efficient:
            params = [p for p in self.branch.parameters() if p.requires_grad]
            return memory_efficient_logdet(lambda x: self._g(x, mask), x_in, logdet_fn, params)
        with torch.enable_grad():
            x = x_in if (need_graph and x_in.requires_grad) else x_in.detach()
            if not x.requires_grad:
                x = x.requires_grad_(True)
            gx = self._g(x, mask)
            logdet = logdet_fn(gx, x, need_graph)
        if need_graph:
            return x + gx, logdet
        return x_in + gx.detach(), logdet.detach()

    def inverse(self, inputs: Tensor, context=None, x0: Tensor | None = None):
        """x with x + g(x) = inputs (per-set convergence), and log|det dx/dy| = -log|det dy/dx|.

        ``x0`` is an optional warm start. Raises ``InverseNotConverged`` (a ``RuntimeError``)
        when the solver misses the tolerance within the iteration budget of ``inverse``.
        Spectral-norm power iterations are frozen meanwhile, so one fixed map is inverted,
        attention certificates are computed once (:func:`~flowattn.attention.frozen_certificates`),
        and ``torch.autocast`` is off: the solve runs in the inputs' precision.
        """
        y_in, flat = self._as_sets(inputs)
        mask = checked_inputs(y_in, context, self.branch, getattr(self.branch, "dim", None))
        # Under torch.autocast too the inverse solves in the inputs' precision: a branch
        # evaluated in bfloat16 is not smooth at the solver's tolerance.
        with frozen_power_iteration(), frozen_certificates(), trusted_inputs(), \
                full_precision(y_in):
            x, logdet = self._inverse(y_in, mask, flat, x0)
        check_deferred(y_in, "InvertibleResidual", x, logdet)
        return (x.squeeze(1) if flat else x), logdet

    def _inverse(self, y_in: Tensor, mask: Tensor | None, flat: bool, x0: Tensor | None):
        self._check_contractive(y_in.shape[1])
        if x0 is not None and flat:
            x0 = x0.unsqueeze(1)
        if self.zero_com:
            y_in = project(y_in, mask, True)  # the identity on the zero-centre-of-mass subspace
        x = residual_inverse(
            lambda z, m: self._g(z, m),
            y_in,
            mask,
            method=self.inverse_options.method,
            x0=x0,
            tol=self.inverse_options.tol,
            max_iter=self.inverse_options.max_iter,
            zero_com=self.zero_com,
        )
        if _POINTS_ONLY.on:
            return x, x.new_zeros(x.shape[0])
        logdet_fn = self._logdet_fn(y_in.shape, mask)
        need_graph = torch.is_grad_enabled() and x.requires_grad
        if callable(getattr(self.branch, "linearise", None)):
            with torch.set_grad_enabled(need_graph):
                gx, vjp_fn = self._linearised(x, mask)
                logdet = logdet_fn(gx, x, need_graph, vjp_fn)
            return x, -logdet
        return x, -self._autograd_inverse_logdet(x, mask, logdet_fn, need_graph)

    @torch.compiler.disable  # a double backward, as in _autograd_forward
    def _autograd_inverse_logdet(self, x, mask, logdet_fn, need_graph):
        with torch.enable_grad():
            # A fresh alias: the VJPs of the log-det must not pass through the implicit-gradient
            # hook that residual_inverse put on x (it only belongs to the outer backward).
            xr = x.view_as(x) if need_graph else x.detach().requires_grad_(True)
            gx = self._g(xr, mask)
            logdet = logdet_fn(gx, xr, need_graph)
        return logdet if need_graph else logdet.detach()

    def extra_repr(self) -> str:
        opt = self.logdet_options
        return (
            f"logdet={opt.method!r}, grad={opt.grad!r}, memory_efficient={opt.memory_efficient}, "
            f"inverse={self.inverse_options.method!r}, causal={self.causal}, "
            f"zero_com={self.zero_com}"
        )


def _chunk_size(b: int, n: int, d: int) -> int:
    """Basis vectors per batched VJP of the exact log-det: 256, fewer for large batches of sets.

    A batched VJP through attention holds (vectors x B x N x N) weights; the chunk keeps that
    near 2^22 numbers (16 MiB in float32) per tensor, so an evaluation batch of 256 sets of 128
    elements does not need gigabytes.
    """
    return max(8, min(256, 2**22 // max(1, b * n * max(n, d))))


def _terms_for_bound(bound: float) -> int:
    """Terms n with bound^(n+1) / ((n+1)(1 - bound)) below 1e-6, clipped to [20, 100]."""
    n = 20
    while n < 100 and bound ** (n + 1) / ((n + 1) * (1 - bound)) > 1e-6:
        n += 1
    return n


class TransformerResidualPair(CompositeTransform):
    r"""A Transformer-style pair of invertible residual blocks: attention, then a pointwise MLP.

    x -> x + g_att(x) -> (.) + g_mlp(.), each a :class:`InvertibleResidual` sharing the
    keyword arguments (log-det estimator, inverse settings, ``causal``, ``zero_com``). The
    composition of two invertible maps is invertible and the log-dets add.

    References:
        Kim et al., "The Lipschitz Constant of Self-Attention", ICML 2021, §5.3 (invertible
        self-attention: Contractive-L2-MHA residual followed by an MLP residual).

    Arguments:
        attention: contractive attention branch (e.g. ``ContractiveL2MHA``).
        mlp: contractive pointwise branch (e.g. ``LipschitzMLP``).
        kwargs: passed to both :class:`InvertibleResidual` blocks.

    Examples:
        >>> from flowattn.branches import LipschitzMLP
        >>> exact = LogDetOptions("exact")
        >>> pair = TransformerResidualPair(LipschitzMLP(2, 8), LipschitzMLP(2, 8), logdet=exact)
        >>> pair(torch.randn(3, 4, 2))[1].shape
        torch.Size([3])
    """

    def __init__(self, attention: nn.Module, mlp: nn.Module, **kwargs: Any) -> None:
        super().__init__(
            [InvertibleResidual(attention, **kwargs), InvertibleResidual(mlp, **kwargs)]
        )

    @property
    def blocks(self) -> list[InvertibleResidual]:
        """The two residual blocks, attention first."""
        return list(self._transforms)
