r"""Invertible blocks x + g(x) whose branch is a gradient field: only expansion is free.

If g = grad U has a symmetric Jacobian with eigenvalues in [-l, u] and l < 1, then x + g(x) is
the gradient of the strongly convex potential |x|^2 / 2 + U(x) and is invertible, however large
u is (Huang et al. 2021, "Convex potential flows"): contraction must stay bounded, expansion
need not. A contractive residual block asks for max(l, u) < 1 instead, which caps how sharply a
block can concentrate density.

The block is evaluated as a contractive residual block followed by a scaling about the centroid.
With a = (u - l + 2) / 2 and P the removal of each set's centroid,

    x + g(x) = c + a (P x + h(x)),    h(x) = (g(x) - (a - 1) P x) / a,    c = centroid of x,

and the eigenvalues of h's Jacobian lie in [(1 - a - l) / a, (1 - a + u) / a] =
[-q, q] with q = (u + l) / (u - l + 2) < 1. So h is a contractive branch for an ordinary
:class:`~flowattn.flows.InvertibleResidual` (fixed-point or Anderson inverse, every log-det
estimator), and log|det| gains (n - 1) D log a for a set of n elements in R^D.

Monotone blocks run in their inputs' precision also under ``torch.autocast``: their scale a and
Newton solves are certified for the exact branch, not a rounded one.
"""

from __future__ import annotations

from typing import Any

import torch
from nflows.transforms import Transform
from torch import Tensor, nn

from ..errors import InputError, InverseNotConverged
from ..validation import check_deferred, present_weights, trusted_inputs
from .geometry import checked_inputs, full_precision, project, subtract_mean
from .logdet import LogDetOptions, jacobian_logdet, residual_matrix
from .residual import InvertibleResidual

__all__ = ["MonotoneResidual", "InverseMonotoneResidual"]


def _spectrum(branch: nn.Module) -> tuple[Tensor, Tensor]:
    spectrum = getattr(branch, "spectrum", None)
    if not callable(spectrum):
        raise InputError(f"branch {type(branch).__name__} has no spectrum() method: a monotone "
                         "block needs certified bounds on the eigenvalues of a symmetric Jacobian")
    return spectrum()


class _Recentred(nn.Module):
    """h(x) = (g(x) - (a - 1) P x) / a, contractive with Lip_2(h) <= q (module docstring)."""

    norm = "2"

    def __init__(self, branch: nn.Module) -> None:
        super().__init__()
        self.branch = branch
        if not callable(getattr(branch, "jacobian", None)):
            self.jacobian = None  # the residual block then differentiates h itself

    def scale(self) -> Tensor:
        lower, upper = _spectrum(self.branch)
        return (upper - lower + 2) / 2

    def lipschitz_bound(self, n: int | None = None) -> Tensor:
        lower, upper = _spectrum(self.branch)
        if lower >= 1:
            return lower  # not monotone: the residual block refuses it
        return (upper + lower) / (upper - lower + 2)

    def forward(self, x: Tensor, mask: Tensor | None = None, causal: bool = False) -> Tensor:
        a = self.scale().to(x)
        return (self.branch(x, mask=mask, causal=causal) - (a - 1) * subtract_mean(x, mask)) / a

    def jacobian(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        a = self.scale().to(x)
        B, N, D = x.shape
        present = present_weights(x, mask)
        n = present.sum(1).clamp_min(1.0)
        same = torch.eye(N, dtype=x.dtype, device=x.device)
        centring = present[:, :, None] * (same - present[:, None, :] / n[:, None, None])
        eye = torch.eye(D, dtype=x.dtype, device=x.device)
        centring = centring[:, :, None, :, None] * eye[None, None, :, None, :]  # P, (B,N,D,N,D)
        return (self.branch.jacobian(x, mask) - (a - 1) * centring) / a


class MonotoneResidual(Transform):
    r"""y = x + g(x) for a gradient-field branch with Jacobian eigenvalues in [-l, u], l < 1.

    The branch provides ``spectrum() -> (l, u)`` (certified, for every set size) and a
    symmetric Jacobian, e.g. :class:`~flowattn.branches.RadialInteraction` with ``max_slope=u``.
    Only l must stay below 1; u sets how far one block can expand. The branch must also sum to
    zero over each set and be translation-invariant (:meth:`verify_branch` checks both on the
    first call and raises ``InputError`` otherwise). Keyword arguments go to the
    inner :class:`~flowattn.flows.InvertibleResidual` (``logdet``, ``zero_com``, inverse
    settings, ...); its inverse iterations converge at the rate q = (u + l) / (u - l + 2).

    Examples:
        >>> from flowattn.branches import RadialInteraction
        >>> branch = RadialInteraction(coeff=0.9, max_slope=3.0)
        >>> block = MonotoneResidual(branch, logdet=LogDetOptions("exact"), zero_com=True).eval()
        >>> x = torch.randn(2, 4, 2)
        >>> x = x - x.mean(1, keepdim=True)
        >>> y, logdet = block(x)
        >>> bool((block.inverse(y)[0] - x).abs().max() < 1e-4)
        True
    """

    def __init__(self, branch: nn.Module, **residual_kwargs: Any) -> None:
        super().__init__()
        if residual_kwargs.get("causal"):
            raise InputError("a monotone block needs a symmetric Jacobian: no causal mask")
        self.residual = InvertibleResidual(_Recentred(branch), **residual_kwargs)
        self._verified = False  # the branch's invariances, checked on the first call

    def verify_branch(self, x: Tensor, mask: Tensor | None = None) -> None:
        """Check on ``x`` that g sums to zero over each set and ignores a translation of it.

        The decomposition of the module docstring needs both: sum_i g_i(x) = 0 keeps the
        centroid c where the scaling about it puts it, and g(x + 1 t^T) = g(x) makes J_g
        vanish along translations, so that h's eigenvalues lie in [-q, q]. Gradient fields of
        functions of pairwise differences (:class:`~flowattn.branches.RadialInteraction`) have
        both. Run once, on the first call, in the inputs' precision.

        Raises:
            InputError: naming the branch and the size of the violation.
        """
        with torch.no_grad(), full_precision(x):
            w = present_weights(x, mask).unsqueeze(-1)
            g = self.branch(x, mask=mask) * w
            shift = 0.5 + 0.25 * torch.arange(x.shape[-1], dtype=x.dtype, device=x.device)
            moved = self.branch(x + shift * w, mask=mask) * w
            scale = 1 + float(g.abs().max()) + float((x * w).abs().max())
            tol = torch.finfo(x.dtype).eps ** 0.5 * scale
            total = float(g.sum(dim=1).abs().max())
            drift = float((moved - g).abs().max())
        name = type(self.branch).__name__
        if total > tol:
            raise InputError(f"branch {name} of a monotone block must sum to zero over each "
                             f"set (sum_i g_i(x) = 0), but a sum reaches {total:.3g}")
        if drift > tol:
            raise InputError(f"branch {name} of a monotone block must be translation-invariant "
                             f"(g(x + t) = g(x)), but moving the set changes g by {drift:.3g}")
        self._verified = True

    @property
    def branch(self) -> nn.Module:
        """The gradient-field branch g."""
        return self.residual.branch.branch

    def _scale_logdet(self, x: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
        a = self.residual.branch.scale().to(x)
        n = present_weights(x, mask).sum(1)
        return a, (n - 1).clamp_min(0.0) * x.shape[-1] * torch.log(a)

    def forward(self, inputs: Tensor, context=None) -> tuple[Tensor, Tensor]:
        """y = x + g(x) and log|det dy/dx| per set, shape (B,)."""
        mask = checked_inputs(inputs, context, self)
        if not self._verified:
            self.verify_branch(inputs, mask)
        with trusted_inputs(), full_precision(inputs):  # see the module docstring
            z, logdet = self.residual(inputs, context=mask)
        check_deferred(inputs, "MonotoneResidual", z, logdet)
        a, scale_logdet = self._scale_logdet(inputs, mask)
        centroid = z - subtract_mean(z, mask)
        y = centroid + a * (z - centroid)
        return y, logdet + scale_logdet

    def inverse(self, inputs: Tensor, context=None) -> tuple[Tensor, Tensor]:
        """x with x + g(x) = inputs, and log|det dx/dy|."""
        mask = checked_inputs(inputs, context, self)
        if not self._verified:
            self.verify_branch(inputs, mask)
        a, scale_logdet = self._scale_logdet(inputs, mask)
        centroid = inputs - subtract_mean(inputs, mask)
        with trusted_inputs():
            x, logdet = self.residual.inverse(centroid + (inputs - centroid) / a, context=mask)
        check_deferred(inputs, "MonotoneResidual", x, logdet)
        return x, logdet - scale_logdet


class InverseMonotoneResidual(Transform):
    r"""The inverse of a :class:`MonotoneResidual` as a layer: x -> z with z + g(z) = x.

    Its Jacobian (I + J_g)^-1 has eigenvalues in [1 / (1 + u), 1 / (1 - l)]: contraction down
    to 1 / (1 + u), expansion at most 1 / (1 - l) -- the mirror image of the monotone block.
    Stacked with monotone blocks, a flow can both expand and contract steeply, which is what
    sharp wells separated by empty regions ask for. The forward pass solves z + g(z) = x by
    Newton's method with the branch's closed-form Jacobian (``jacobian(x, mask)`` is required;
    the residual norm is a merit function for it, since I + J_g is positive definite), then
    takes one more Newton step with the graph attached: at the solution this step has the value
    z* and exactly the implicit gradients dz/dx = (I + J)^-1 and dz/dθ = -(I + J)^-1 dg/dθ.
    Sampling runs the monotone block forward.

    Arguments:
        branch: a gradient-field branch with ``spectrum()`` and ``jacobian(x, mask)``.
        zero_com: keep sum_i x_i = 0.
        tol: relative residual tolerance of the Newton solve (at least 16 machine epsilons of
            the inputs' dtype).
        max_iter: Newton iterations before ``InverseNotConverged``.
        residual_kwargs: passed to the :class:`MonotoneResidual` of the sampling direction
            (``logdet`` defaults to ``LogDetOptions("exact")``).

    Examples:
        >>> from flowattn.branches import RadialInteraction
        >>> layer = InverseMonotoneResidual(RadialInteraction(coeff=0.9, max_slope=3.0)).eval()
        >>> x = torch.randn(2, 4, 2)
        >>> z, logdet = layer(x)
        >>> bool((layer.inverse(z)[0] - x).abs().max() < 1e-5)
        True
    """

    def __init__(self, branch: nn.Module, zero_com: bool = False, tol: float = 1e-9,
                 max_iter: int = 50, **residual_kwargs: Any) -> None:
        super().__init__()
        if not callable(getattr(branch, "jacobian", None)):
            raise InputError(f"branch {type(branch).__name__} has no closed-form jacobian(x, "
                             "mask): the Newton solve of an inverse monotone block needs one")
        if not tol > 0 or max_iter < 1:
            raise InputError(f"need tol > 0 and max_iter >= 1, got {tol}, {max_iter}")
        residual_kwargs.setdefault("logdet", LogDetOptions("exact"))
        self.block = MonotoneResidual(branch, zero_com=zero_com, **residual_kwargs)
        self.zero_com = bool(zero_com)
        self.tol = float(tol)
        self.max_iter = int(max_iter)

    @property
    def branch(self) -> nn.Module:
        """The gradient-field branch g."""
        return self.block.branch

    def _residual(self, z: Tensor, x: Tensor, mask: Tensor | None) -> Tensor:
        return z + project(self.branch(z, mask=mask), mask, self.zero_com) - x

    @torch.no_grad()
    def _solve(self, x: Tensor, mask: Tensor | None) -> Tensor:
        z = project(x, mask, self.zero_com) if self.zero_com else x.clone()
        B = x.shape[0]
        scale = x.abs().amax(dim=(1, 2)).clamp_min(1.0)
        tol = max(self.tol, 16 * torch.finfo(x.dtype).eps)  # reachable in the working precision
        r = self._residual(z, x, mask)
        for _ in range(self.max_iter):
            norm = r.flatten(1).norm(dim=1)
            if bool((r.abs().amax(dim=(1, 2)) <= tol * scale).all()):
                return z
            matrix = residual_matrix(self.branch.jacobian(z, mask), mask, self.zero_com)
            step = torch.linalg.solve(matrix, r.reshape(B, -1, 1)).reshape(z.shape)
            t = torch.ones(B, 1, 1, dtype=z.dtype, device=z.device)
            for _ in range(30):  # backtrack until the residual norm falls (per set)
                r_new = self._residual(z - t * step, x, mask)
                worse = r_new.flatten(1).norm(dim=1) > (1 - 1e-4 * t.flatten()) * norm
                if not bool(worse.any()):
                    break
                t = torch.where(worse[:, None, None], t / 2, t)
            z, r = z - t * step, r_new
        worst = float((r.abs().amax(dim=(1, 2)) / scale).max())
        unconverged = int((r.abs().amax(dim=(1, 2)) > tol * scale).sum())
        raise InverseNotConverged(worst, self.max_iter, unconverged, tol)

    def forward(self, inputs: Tensor, context=None) -> tuple[Tensor, Tensor]:
        """z with z + g(z) = inputs, and log|det dz/dx| = -log det(I + J_g(z))."""
        mask = checked_inputs(inputs, context, self)
        if not self.block._verified:
            self.block.verify_branch(inputs, mask)
        with trusted_inputs(), full_precision(inputs):  # a Newton solve
            z, logdet = self._forward(inputs, mask)
        check_deferred(inputs, "InverseMonotoneResidual", z, logdet)
        return z, logdet

    def _forward(self, inputs: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
        z_star = self._solve(inputs, mask).detach()
        if not torch.is_grad_enabled():
            jac = self.branch.jacobian(z_star, mask)
            return z_star, -jacobian_logdet(jac, mask, self.zero_com)
        # One Newton step with the graph: value z*, gradients of the implicit function.
        matrix = residual_matrix(self.branch.jacobian(z_star, mask), mask, self.zero_com)
        r = self._residual(z_star, inputs, mask)
        step = torch.linalg.solve(matrix.detach(), r.reshape(r.shape[0], -1, 1))
        z = z_star - step.reshape(z_star.shape)
        return z, -jacobian_logdet(self.branch.jacobian(z, mask), mask, self.zero_com)

    def inverse(self, inputs: Tensor, context=None) -> tuple[Tensor, Tensor]:
        """x = z + g(z) and log|det dx/dz|."""
        return self.block(inputs, context=context)
