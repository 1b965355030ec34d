"""Continuous normalizing flows: dz/dt = f(z, t) solved with torchdiffeq (FFJORD, RNODE)."""

from __future__ import annotations

import logging
import math

import torch
from nflows.transforms.base import Transform
from torch import Tensor, nn
from torchdiffeq import odeint, odeint_adjoint

from ...errors import InputError, ODESolverError
from ...validation import (
    check_count,
    check_deferred,
    check_finite,
    check_precision,
    check_sets,
    inputs_trusted,
    trusted_inputs,
)
from ..base import sample_standard_normal, standard_normal_log_prob
from ..geometry import (
    PROBES,
    check_centred,
    evaluation_generator,
    mask_from_context,
    project,
    sample_probes,
)
from .alignment import ALIGNMENTS, align
from .divergence import exact_divergence, hutchinson_divergence

__all__ = ["CNF", "ODESolverError", "ADAPTIVE_SOLVERS", "FIXED_GRID_SOLVERS"]

logger = logging.getLogger(__name__)

ADAPTIVE_SOLVERS = ("dopri5", "dopri8", "bosh3", "fehlberg2", "adaptive_heun")
FIXED_GRID_SOLVERS = ("euler", "midpoint", "heun2", "heun3", "rk4", "explicit_adams",
                      "implicit_adams")




class _Counter:
    """Function evaluations of one solve; ``backward`` grows while gradients flow."""

    def __init__(self) -> None:
        self.forward = 0
        self.backward = 0
        self.solving = True

    def count_backward(self, grad: Tensor) -> None:
        self.backward += 1


def _all_finite(y) -> bool:
    if isinstance(y, Tensor):
        return bool(torch.isfinite(y).all())
    return all(bool(torch.isfinite(part).all()) for part in y)


class _Dynamics(nn.Module):
    """The augmented right-hand side (dz, d logdet[, d kinetic, d frobenius]) for one solve."""

    def __init__(
        self,
        field: nn.Module,
        mask: Tensor | None,
        probe: Tensor | None,
        zero_com: bool,
        regularise: bool,
        counter: _Counter,
        adjoint: bool,
    ):
        super().__init__()
        self.field = field
        self.mask, self.probe, self.zero_com = mask, probe, zero_com
        self.regularise, self.counter, self.adjoint = regularise, counter, adjoint

    def _field(self, t: Tensor, z: Tensor, mask: Tensor | None) -> Tensor:
        f = self.field(t, z) if mask is None else self.field(t, z, mask=mask)
        if f.shape != z.shape:
            raise InputError(
                f"the vector field must return the state's shape {tuple(z.shape)}, "
                f"got {tuple(f.shape)}"
            )
        # padded elements stay where they are; zero_com keeps the centre of mass
        return project(f, mask, self.zero_com)

    def forward(self, t: Tensor, state: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        counter = self.counter
        if counter.solving:
            counter.forward += 1
        elif self.adjoint:
            counter.backward += 1
        # The graph is kept only when someone will differentiate the result: the direct
        # (backprop-through-solver) pass under grad mode, or the adjoint's backward solve.
        create_graph = torch.is_grad_enabled()
        z = state[0]
        with torch.enable_grad():
            if not z.requires_grad:
                z = z.detach().requires_grad_(True)
            if self.probe is None:
                f, div, frob = exact_divergence(
                    lambda y, m: self._field(t, y, m),
                    z,
                    self.mask,
                    self.zero_com,
                    frobenius=self.regularise,
                    create_graph=create_graph,
                )
            else:
                f = self._field(t, z, self.mask)
                div, frob = hutchinson_divergence(
                    f, z, self.probe, self.mask, self.zero_com, self.regularise, create_graph
                )
        if not bool(torch.isfinite(f).all()):
            raise ODESolverError(
                "ODE solve failed: non-finite vector field (NaN or Inf) at "
                f"t={float(t.detach()):.6g}",
                "non-finite vector field",
            )
        if not create_graph:
            f, div = f.detach(), div.detach()
            frob = None if frob is None else frob.detach()
        elif counter.solving and not self.adjoint and f.requires_grad:
            f.register_hook(counter.count_backward)
        derivatives = (f, div)
        if self.regularise:
            kinetic = f.pow(2).reshape(f.shape[0], -1).sum(dim=1)
            derivatives = derivatives + (kinetic, frob)
        return derivatives

    # torchdiffeq calls these before each step (forward and adjoint solves), ahead of its own
    # assertions, so failures are reported with their cause and the time they happened.
    def callback_step(self, t0: Tensor, y0, dt: Tensor) -> None:
        if not _all_finite(y0):
            raise ODESolverError(
                f"ODE solve failed: non-finite state (NaN or Inf) at t={float(t0.detach()):.6g}",
                "non-finite state",
            )
        if not bool(t0 + dt > t0):
            raise ODESolverError(
                f"ODE solve failed: step size underflow at t={float(t0.detach()):.6g} "
                f"(dt={float(dt.detach()):.3g}); the vector field is too stiff there or the "
                "solution blows up",
                "step size underflow",
            )

    callback_step_adjoint = callback_step


def _state_norm(present: Tensor | None, count: Tensor | None):
    """RMS norm of z over present coordinates and of log-det; regularisers are left out."""

    def norm(state: tuple[Tensor, ...]) -> Tensor:
        z, logdet = state[0], state[1]
        if present is None:
            z_norm = z.pow(2).mean().sqrt()
        else:
            z_norm = (z.pow(2) * present).sum().div(count).sqrt()
        return torch.maximum(z_norm, logdet.pow(2).mean().sqrt())

    return norm


def _described(value) -> str:
    """A tensor's shape, or what else the value is, for a message."""
    return f"shape {tuple(value.shape)}" if isinstance(value, Tensor) else \
        f"a {type(value).__name__}"


class CNF(Transform):
    r"""Continuous normalizing flow on sets, sequences or vectors (Chen et al. 2018; FFJORD,
    Grathwohl et al. 2019; RNODE, Finlay et al. 2020).

    ``forward`` maps data x = z(0) to noise z(t1) by solving

    .. math:: \frac{dz}{dt} = f(z, t), \qquad
              \frac{d}{dt}\log\left|\det\frac{\partial z(t)}{\partial x}\right|
              = \mathrm{tr}\,\frac{\partial f}{\partial z}

    (the instantaneous change of variables, d log p / dt = -tr(df/dz)), and returns
    (z(t1), logabsdet) so that log p(x) = log p_base(z(t1)) + logabsdet, the nflows
    convention. ``inverse`` integrates from t1 back to 0 (sampling) and returns minus the
    log-determinant.

    **Sets and padding.** Inputs are (B, N, D) sets or sequences (or (B, D) vectors). A padding
    mask (bool (B, N), True = present) reaches the flow either as ``mask=`` or, so that it
    passes through nflows' ``(inputs, context)`` signature (``CompositeTransform``, ``Flow``),
    as the ``context`` argument. Padded elements stay fixed (their velocity is zeroed) and are
    left out of the divergence, the regularisers and the solver's error norm, so a padded set
    follows the same dynamics as the set alone. Any other context is rejected.

    **Divergence.** ``"exact"``: tr(df/dz) from N D vector-Jacobian products computed in one
    batched backward pass (small N D only). ``"hutchinson"``: eps^T (df/dz) eps with one probe
    eps per sample drawn (from ``generator``) at the start of each solve and held fixed for the
    whole solve, so the solver sees a smooth ODE and the estimate of the integrated
    log-determinant is unbiased. In evaluation mode the probes come from a fresh generator
    seeded with ``eval_seed`` at every solve, so a score is reproducible: the same inputs give
    the same estimate, and evaluating leaves torch's global RNG as it was.

    **Zero centre of mass.** With ``zero_com`` (default: the field's ``zero_com`` attribute)
    the state lives on {sum_i z_i = 0}; inputs must be centred, the field's output is
    projected onto the subspace and the divergence is the trace on the subspace, so log-
    densities follow the E(n)-flow convention of
    ``standard_normal_log_prob(z, mask, zero_com=True)``.

    **Regularisers.** With ``regularise=True`` the forward solve also integrates RNODE's
    kinetic energy int ||f||^2 dt and Jacobian Frobenius norm int ||df/dz||_F^2 dt (exact, or
    Hutchinson's ||eps^T df/dz||^2 from the same vjp). They are extra states the step-size
    control ignores and are exposed as ``kinetic_energy`` and ``jacobian_frobenius``, (B,)
    tensors of the latest forward call.

    **Counters.** ``nfe_forward`` counts the field evaluations of the latest solve;
    ``nfe_backward`` the evaluations of its backward pass (adjoint solve evaluations with
    ``adjoint=True``; evaluations whose graph was backpropagated otherwise). Each is also
    logged at DEBUG level by the ``flowattn.flows.continuous.cnf`` logger.

    **Failures** raise :class:`ODESolverError` (a RuntimeError) whose ``cause`` names the
    reason (step size underflow, non-finite state or field, too many steps); bad inputs raise
    ValueError naming the problem.

    Arguments:
        field: ``nn.Module`` called as ``field(t, z)`` or ``field(t, z, mask=mask)``, returning
            dz/dt of z's shape; batch entries must not interact.
        t1: integration time T > 0.
        solver: a torchdiffeq method, adaptive (``ADAPTIVE_SOLVERS``) or fixed-grid
            (``FIXED_GRID_SOLVERS``, which need ``solver_options={"step_size": h}``).
        atol: absolute tolerance of the adaptive solver.
        rtol: relative tolerance of the adaptive solver.
        adjoint: backpropagate by solving the adjoint ODE (memory independent of the steps).
        adjoint_params: parameters the adjoint computes gradients for (default: the field's).
        seminorm: let the adjoint's step-size control ignore the parameter-gradient states
            (Kidger et al. 2021); fewer backward evaluations, same gradients to tolerance.
        adjoint_atol: absolute tolerance of the adjoint solve (default: atol).
        adjoint_rtol: relative tolerance of the adjoint solve (default: rtol).
        divergence: ``"exact"`` or ``"hutchinson"``.
        eval_divergence: the divergence in evaluation mode (``None``: ``divergence``); e.g.
            Hutchinson to train and the exact trace to report likelihoods (E-NF's practice).
        probe: Hutchinson probe distribution, ``"rademacher"`` or ``"gaussian"``.
        generator: torch.Generator the training-mode probes are drawn from (default: the
            global RNG).
        eval_seed: seed of the evaluation-mode probes, re-seeded at every solve or, inside
            :func:`~flowattn.flows.geometry.probe_stream`, drawn on from one stream
            (``None``: draw them from ``generator`` too, so that repeated evaluations differ).
        regularise: integrate the RNODE regularisers during ``forward``.
        zero_com: zero-centre-of-mass mode; ``None`` takes ``field.zero_com`` (or False).
        max_steps: maximum number of adaptive steps per solve (``None``: unlimited; refused
            with a fixed-grid solver, whose steps are t1 / step_size).
        solver_options: further options for the torchdiffeq solver.

    Examples:
        >>> class Field(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.lin = nn.Linear(2, 2)
        ...     def forward(self, t, z, mask=None):
        ...         return torch.tanh(self.lin(z))
        >>> cnf = CNF(Field())
        >>> x = torch.randn(4, 3, 2)
        >>> z, logabsdet = cnf(x)
        >>> x_back, _ = cnf.inverse(z)
        >>> bool((x - x_back).abs().max() < 1e-3), logabsdet.shape
        (True, torch.Size([4]))
    """

    def __init__(
        self,
        field: nn.Module,
        t1: float = 1.0,
        solver: str = "dopri5",
        atol: float = 1e-5,
        rtol: float = 1e-5,
        adjoint: bool = False,
        adjoint_params: tuple[Tensor, ...] | None = None,
        seminorm: bool = True,
        adjoint_atol: float | None = None,
        adjoint_rtol: float | None = None,
        divergence: str = "exact",
        eval_divergence: str | None = None,
        probe: str = "rademacher",
        generator: torch.Generator | None = None,
        eval_seed: int | None = 0,
        regularise: bool = False,
        zero_com: bool | None = None,
        max_steps: int | None = None,
        solver_options: dict | None = None,
    ):
        super().__init__()
        if not isinstance(field, nn.Module):
            raise InputError(f"field must be an nn.Module, got {type(field).__name__}")
        if not (isinstance(t1, (int, float)) and math.isfinite(t1) and t1 > 0):
            raise InputError(f"t1 must be a finite number > 0, got {t1!r}")
        if solver not in ADAPTIVE_SOLVERS + FIXED_GRID_SOLVERS:
            raise InputError(
                f"unknown solver {solver!r}; choose one of {ADAPTIVE_SOLVERS + FIXED_GRID_SOLVERS}"
            )
        for name, tol in (("atol", atol), ("rtol", rtol), ("adjoint_atol", adjoint_atol),
                          ("adjoint_rtol", adjoint_rtol)):
            if tol is not None and not (math.isfinite(tol) and tol > 0):
                raise InputError(f"{name} must be a finite number > 0, got {tol!r}")
        if divergence not in ("exact", "hutchinson"):
            raise InputError(f"divergence must be 'exact' or 'hutchinson', got {divergence!r}")
        if eval_divergence not in (None, "exact", "hutchinson"):
            raise InputError("eval_divergence must be None, 'exact' or 'hutchinson', got "
                             f"{eval_divergence!r}")
        if probe not in PROBES:
            raise InputError(f"probe must be 'rademacher' or 'gaussian', got {probe!r}")
        if eval_seed is not None and not isinstance(eval_seed, int):
            raise InputError(f"eval_seed must be an int or None, got {eval_seed!r}")
        if max_steps is not None:
            max_steps = check_count(max_steps, "max_steps")
        if solver in FIXED_GRID_SOLVERS:
            if "step_size" not in (solver_options or {}):
                raise InputError(
                    f"fixed-grid solver {solver!r} needs solver_options={{'step_size': h}}"
                )
            if max_steps is not None:
                raise InputError(f"max_steps bounds the steps of an adaptive solver; the "
                                 f"fixed-grid solver {solver!r} takes t1 / step_size of them: "
                                 "drop max_steps")
            step = solver_options["step_size"]
            if isinstance(step, bool) or not isinstance(step, (int, float)) or not (
                    math.isfinite(step) and step > 0):
                raise InputError(f"the step size of solver {solver!r} must be a finite number "
                                 f"> 0, got {step!r}")
        self.field = field
        self.t1, self.solver, self.atol, self.rtol = float(t1), solver, atol, rtol
        self.adjoint, self.seminorm = adjoint, seminorm
        self.adjoint_params = None if adjoint_params is None else tuple(adjoint_params)
        self.adjoint_atol = atol if adjoint_atol is None else adjoint_atol
        self.adjoint_rtol = rtol if adjoint_rtol is None else adjoint_rtol
        self.divergence, self.probe, self.generator = divergence, probe, generator
        self.eval_divergence = divergence if eval_divergence is None else eval_divergence
        self.eval_seed = eval_seed
        self.regularise = regularise
        self.zero_com = bool(getattr(field, "zero_com", False)) if zero_com is None else zero_com
        self.max_steps = max_steps
        self.solver_options = dict(solver_options or {})
        self.kinetic_energy: Tensor | None = None
        self.jacobian_frobenius: Tensor | None = None
        self._counter = _Counter()

    # ------------------------------------------------------------------ counters

    @property
    def nfe_forward(self) -> int:
        """Field evaluations of the latest solve (forward or inverse)."""
        return self._counter.forward

    @property
    def nfe_backward(self) -> int:
        """Field evaluations spent backpropagating through the latest solve, so far."""
        return self._counter.backward

    # ------------------------------------------------------------------ input handling

    def _resolve_mask(self, inputs: Tensor, context, mask: Tensor | None) -> Tensor | None:
        if not isinstance(inputs, Tensor):
            raise InputError(f"inputs must be a torch.Tensor, got {type(inputs).__name__}")
        if isinstance(context, dict):  # {"mask": mask}, as every set transform takes it
            context = mask_from_context(context, inputs)
        if context is not None:
            is_mask = (
                isinstance(context, Tensor)
                and context.dtype == torch.bool
                and inputs.dim() == 3
                and context.shape == inputs.shape[:2]
            )
            if not is_mask:
                shape = tuple(context.shape) if isinstance(context, Tensor) else type(context)
                raise InputError(
                    "CNF takes no conditioning context: context may only carry the padding "
                    f"mask, a bool tensor of shape (B, N) = {tuple(inputs.shape[:2])}; got "
                    f"{shape}"
                )
            if mask is not None and not torch.equal(mask.to(context.device), context):
                raise InputError("mask and context are both given and differ")
            mask = context
        if inputs.dim() == 3:
            return check_sets(inputs, mask, getattr(self.field, "dim", None), name="inputs",
                              module=self.field)
        if inputs.dim() != 2 or getattr(self.field, "takes_sets", False):
            shapes = "(B, N, D)" if getattr(self.field, "takes_sets", False) else \
                "(B, N, D) or (B, D)"
            raise InputError(
                f"inputs must have shape {shapes} for the field {type(self.field).__name__}, "
                f"got shape "
                f"{tuple(inputs.shape)}"
            )
        if not inputs.is_floating_point():
            raise InputError(f"inputs must be floating point, got dtype {inputs.dtype}")
        if mask is not None:
            raise InputError(
                f"a padding mask needs (B, N, D) inputs, got shape {tuple(inputs.shape)}"
            )
        if self.zero_com:
            raise InputError("zero_com needs (B, N, D) inputs")
        check_finite(inputs, "inputs")
        check_precision(inputs, self.field, name="inputs")
        return None

    # ------------------------------------------------------------------ solving

    def _solve(self, z0: Tensor, mask: Tensor | None, reverse: bool, regularise: bool):
        counter = _Counter()
        self._counter = counter
        probe = None
        if (self.divergence if self.training else self.eval_divergence) == "hutchinson":
            generator = self.generator
            if not self.training and self.eval_seed is not None:
                generator = evaluation_generator(z0.device, self.eval_seed)
            probe = sample_probes(z0.shape, self.probe, mask, self.zero_com, generator,
                                  z0.device, z0.dtype)
        dynamics = _Dynamics(
            self.field, mask, probe, self.zero_com, regularise, counter, self.adjoint
        )
        zeros = z0.new_zeros(z0.shape[0])
        state = (z0, zeros) + ((zeros, zeros) if regularise else ())
        times = [self.t1, 0.0] if reverse else [0.0, self.t1]
        t = torch.tensor(times, dtype=z0.dtype, device=z0.device)

        options = dict(self.solver_options)
        if self.solver in ADAPTIVE_SOLVERS:
            present, count = None, None
            if mask is not None:
                present = mask.unsqueeze(-1).to(z0.dtype)
                count = present.sum() * z0.shape[-1]
            options["norm"] = _state_norm(present, count)
            if self.max_steps is not None:
                options["max_num_steps"] = self.max_steps
        try:
            if self.adjoint:
                params = self.adjoint_params
                if params is None:
                    params = tuple(p for p in self.field.parameters() if p.requires_grad)
                adjoint_options = {k: v for k, v in options.items() if k != "norm"}
                if self.seminorm and self.solver in ADAPTIVE_SOLVERS:
                    adjoint_options["norm"] = "seminorm"
                solution = odeint_adjoint(
                    dynamics, state, t, rtol=self.rtol, atol=self.atol, method=self.solver,
                    options=options, adjoint_rtol=self.adjoint_rtol,
                    adjoint_atol=self.adjoint_atol, adjoint_method=self.solver,
                    adjoint_options=adjoint_options, adjoint_params=params,
                )
            else:
                solution = odeint(
                    dynamics, state, t, rtol=self.rtol, atol=self.atol, method=self.solver,
                    options=options,
                )
        except AssertionError as error:
            raise _translate(error) from error
        finally:
            counter.solving = False
        logger.debug(
            "CNF %s solve: %d field evaluations", "inverse" if reverse else "forward",
            counter.forward,
        )
        return tuple(s[-1] for s in solution)

    def forward(
        self, inputs: Tensor, context: Tensor | None = None, mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Map data to noise: returns (z(t1), log|det dz(t1)/dx|), shapes (B, ...) and (B,)."""
        mask = self._resolve_mask(inputs, context, mask)
        if self.zero_com:
            check_centred(inputs, mask)
        with trusted_inputs():  # checked here: the field trusts the solver's states
            out = self._solve(inputs, mask, reverse=False, regularise=self.regularise)
        check_deferred(inputs, "CNF", out[0], out[1])
        out = (_keep_padding(out[0], inputs, mask),) + out[1:]
        if self.regularise:
            self.kinetic_energy, self.jacobian_frobenius = out[2], out[3]
        else:
            self.kinetic_energy = self.jacobian_frobenius = None
        return out[0], out[1]

    def inverse(
        self, inputs: Tensor, context: Tensor | None = None, mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Map noise to data: returns (z(0), log|det dz(0)/dz(t1)|) = (x, -forward logabsdet)."""
        mask = self._resolve_mask(inputs, context, mask)
        if self.zero_com:
            check_centred(inputs, mask)
        with trusted_inputs():
            out = self._solve(inputs, mask, reverse=True, regularise=False)
        check_deferred(inputs, "CNF", out[0], out[1])
        return _keep_padding(out[0], inputs, mask), out[1]

    # ------------------------------------------------------------------ flow matching

    def matching_loss(
        self,
        inputs: Tensor,
        mask: Tensor | None = None,
        noise: Tensor | None = None,
        times: Tensor | None = None,
        generator: torch.Generator | None = None,
        alignment: str = "none",
    ) -> Tensor:
        r"""The conditional flow-matching loss of each set, shape (B,): training without a solve.

        For data x, a base draw z (independent of x) and a time t ~ U(0, T), the straight path
        x_t = x + (t / T)(z - x) moves x to z at constant velocity u = (z - x) / T, and

        .. math:: \ell(x) = \big\| f(x_t, t) - (z - x) / T \big\|^2

        summed over the present coordinates. Its expectation over (x, z, t) differs from
        E ||f(x_t, t) - v(x_t, t)||^2 by a constant, where v(y, t) = E[(z - x) / T | x_t = y]
        is the velocity of the marginal path from the data (t = 0) to the base (t = T)
        (Lipman et al. 2023, Thm 2; Liu et al. 2023; Albergo & Vanden-Eijnden 2023): its
        minimiser is the field whose flow carries the data distribution onto the base, this
        CNF's ``forward`` direction. One field evaluation per set, no ODE solve and no
        divergence; the likelihood is still that of the ODE (``log_prob``).

        With ``zero_com`` the inputs must be centred and the base draws are centred too, so
        the path and the target stay on the zero-centre-of-mass subspace; padded elements
        (``mask`` False) have zero noise, target and velocity and add nothing.

        ``alignment`` pairs each set with a base draw moved towards it (the draw's elements
        permuted, and with ``"euclidean"`` also turned by an orthogonal map:
        :func:`~flowattn.flows.continuous.alignment.align`) before the path is drawn. The loss
        keeps its minimiser's meaning when the data's law and the base are invariant under
        those maps (exchangeable sets; for ``"euclidean"`` also rotations and reflections about
        the origin, as for particle systems): the aligned draws are still standard normal
        (Klein et al. 2023, equivariant flow matching), and the straighter paths train faster.

        Arguments:
            inputs: data sets (B, N, D) (or vectors (B, D)).
            mask: padding mask (B, N), True = present.
            noise: base draws of ``inputs``' shape (default: drawn from ``generator``).
            times: (B,) times in [0, T] (default: uniform, from ``generator``).
            generator: torch.Generator for the draws not given.
            alignment: ``"none"``, ``"permutation"`` or ``"euclidean"`` (sets (B, N, D) only).

        The field must accept a (B,) tensor of times, one per set (both built-in fields do).

        Examples:
            >>> from flowattn.flows import EGNNField
            >>> cnf = CNF(EGNNField(dim=2, hidden=8, layers=2))
            >>> x = torch.randn(5, 4, 2)
            >>> cnf.matching_loss(x - x.mean(dim=1, keepdim=True)).shape
            torch.Size([5])
        """
        if alignment not in ALIGNMENTS:
            raise InputError(f"alignment must be one of {ALIGNMENTS}, got {alignment!r}")
        if alignment != "none" and inputs.dim() != 3:
            raise InputError(f"alignment={alignment!r} permutes the elements of sets: inputs "
                             f"must be (B, N, D), got {tuple(inputs.shape)}")
        mask = self._resolve_mask(inputs, None, mask)
        if self.zero_com:
            check_centred(inputs, mask)
        sets = inputs if inputs.dim() == 3 else inputs.reshape(inputs.shape[0], 1, -1)
        sets = project(sets, mask)  # padded elements: zero, as their noise and velocity
        if noise is None:
            noise = sample_standard_normal(tuple(sets.shape), mask, self.zero_com, generator,
                                           sets.device, sets.dtype)
        elif not isinstance(noise, Tensor) or noise.shape != inputs.shape:
            raise InputError(f"noise must be a tensor of the inputs' shape "
                             f"{tuple(inputs.shape)}, got {_described(noise)}")
        elif noise.dtype != inputs.dtype:
            raise InputError(f"noise has dtype {noise.dtype}, the inputs {inputs.dtype}: give "
                             "both in one dtype")
        else:
            if not inputs_trusted():
                check_finite(noise, "noise")
            noise = project(noise.reshape(sets.shape), mask, self.zero_com)
        if alignment != "none":
            noise = align(noise, sets, mask, rotations=alignment == "euclidean")
        if times is None:
            times = self.t1 * torch.rand(sets.shape[0], generator=generator,
                                         dtype=sets.dtype, device=sets.device)
        elif not isinstance(times, Tensor) or times.shape != sets.shape[:1]:
            raise InputError(f"times must be a tensor of shape ({sets.shape[0]},), one per "
                             f"set, got {_described(times)}")
        elif not inputs_trusted():  # read back: the task's own draws (trusted) are not
            check_finite(times, "times")
            if bool((times < 0).any()) or bool((times > self.t1).any()):
                raise InputError(f"times must lie in [0, t1] = [0, {self.t1:g}], got values "
                                 f"from {float(times.min()):g} to {float(times.max()):g}")
        times = times.to(sets.dtype)  # numbers: a float32 draw serves a float64 flow
        target = (noise - sets) / self.t1
        path = sets + times.reshape(-1, 1, 1) * target
        with trusted_inputs():  # checked here: the field trusts its caller
            velocity = self.field(times, path.reshape(inputs.shape)) if mask is None else \
                self.field(times, path, mask=mask)
        if velocity.shape != inputs.shape:
            raise InputError(f"the vector field must return the state's shape "
                             f"{tuple(inputs.shape)}, got {tuple(velocity.shape)}")
        velocity = project(velocity.reshape(sets.shape), mask, self.zero_com)
        return (velocity - target).pow(2).sum(dim=(1, 2))

    # ------------------------------------------------------------------ densities

    def log_prob(self, inputs: Tensor, mask: Tensor | None = None) -> Tensor:
        """log p(x) under a standard-normal base per present element, shape (B,).

        In ``zero_com`` mode the base is the standard normal on the zero-centre-of-mass
        subspace (E(n)-flow convention, see ``flowattn.flows.base``).
        """
        z, logabsdet = self.forward(inputs, mask=mask)
        sets = z if z.dim() == 3 else z.reshape(z.shape[0], 1, -1)
        return standard_normal_log_prob(sets, mask, self.zero_com) + logabsdet

    def sample(
        self,
        shape: tuple[int, ...],
        mask: Tensor | None = None,
        generator: torch.Generator | None = None,
        device=None,
        dtype=None,
    ) -> tuple[Tensor, Tensor]:
        """Draw samples of ``shape`` (B, N, D) and their log-densities, shape (B,)."""
        if len(shape) != 3:
            raise InputError(f"sample shape must be (B, N, D), got {tuple(shape)}")
        z = sample_standard_normal(tuple(shape), mask, self.zero_com, generator, device, dtype)
        base = standard_normal_log_prob(z, mask, self.zero_com)
        x, logabsdet = self.inverse(z, mask=mask)
        return x, base - logabsdet


def _keep_padding(z: Tensor, inputs: Tensor, mask: Tensor | None) -> Tensor:
    """Return padded elements exactly as they came in.

    Their velocity is zero, so only the solver's dense-output interpolation could move them,
    by rounding errors.
    """
    if mask is None:
        return z
    return torch.where(mask.unsqueeze(-1), z, inputs)


def _translate(error: AssertionError) -> Exception:
    """Turn torchdiffeq's assertion failures into an ODESolverError naming the cause."""
    text = str(error)
    if "underflow in dt" in text:
        return ODESolverError(
            f"ODE solve failed: step size underflow ({text}); the vector field is too stiff "
            "or the solution blows up",
            "step size underflow",
        )
    if "non-finite values in state" in text:
        return ODESolverError(
            "ODE solve failed: non-finite state (NaN or Inf)", "non-finite state"
        )
    if "max_num_steps exceeded" in text:
        return ODESolverError(f"ODE solve failed: too many steps ({text})", "too many steps")
    return ODESolverError(f"ODE solve failed: {text}", "solver assertion")
