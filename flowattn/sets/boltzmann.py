r"""Set flows as Boltzmann generators: samples of a particle system with importance weights.

A flow q fitted to configurations of a particle system with energy E draws configurations
cheaply, but not from the Boltzmann density p(x) = exp(-E(x) / kT) / Z. Importance weights

    log w(x) = -E(x) / kT - log q(x)

correct for that: E_p[f] ≈ Σ_i w_i f(x_i) / Σ_i w_i over draws x_i ~ q (self-normalised
importance sampling, Noé et al. 2019, *Boltzmann generators*, Science 365:eaaw1147), and
(1/n) Σ_i w_i estimates Z. kT = 1, the temperature of the built-in data
(:mod:`flowattn.data.particles`).

Both densities live on the zero-centre-of-mass subspace V = {Σ_i x_i = 0}: the flow's samples
lie on V and log q is its density there in orthonormal coordinates of V (base N(0, I) on V,
log-determinants of the maps restricted to V, :mod:`flowattn.flows.base`); E is translation
invariant, so exp(-E) restricted to V is the Boltzmann density of the configurations up to
translation, and its normaliser Z = ∫_V exp(-E) is the one :mod:`flowattn.data.partition`
computes. The weights compare two densities on the same (n - 1) D-dimensional space with the
same measure; no constant is missing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..data.particles import pairwise_distances
from ..errors import InputError, NonFiniteError
from ..flows.continuous.cnf import CNF
from ..flows.geometry import probe_stream
from ..flows.setflow import SetFlow
from ..importance import event_kl, kish_ess, log_mean_weight, self_normalised_mean
from ..progress import progress_batches

__all__ = ["BoltzmannSample", "boltzmann_sample", "boltzmann_summary", "regularised_energy",
           "HARD_CORE", "ENERGY_LIMIT"]

HARD_CORE = 0.85  # closer, an LJ13 pair's energy exceeds +3.4 (its minimum is -2 at r = 1)
#: energies above this (or not finite) give training by energy no gradient: their derivatives
#: (an LJ pair's 12 r^-13) would overflow float32 on the way back
ENERGY_LIMIT = 1e12


@dataclass
class BoltzmannSample:
    """Configurations drawn from a flow, with what reweighting them needs.

    Attributes:
        x: configurations (num, n, D), centre of mass zero.
        log_q: the flow's log-density of each, exact where the flow's evaluation mode is.
        energy: E(x) (+inf where E is NaN, particles on top of each other).
        log_w: -E(x) - log q(x), the log importance weights.
    """

    x: Tensor
    log_q: Tensor
    energy: Tensor
    log_w: Tensor


def boltzmann_sample(
    flow: SetFlow,
    energy: Callable[[Tensor], Tensor],
    num: int,
    particles: int,
    generator: torch.Generator | None = None,
    batch_size: int = 1000,
    progress: bool = False,
    divergence: str = "exact",
) -> BoltzmannSample:
    r"""Draw ``num`` configurations from ``flow`` and weight them against exp(-E).

    Samples come from inverting the flow; log q(x) is then scored by the forward pass at the
    returned x in evaluation mode (the exact log-determinant wherever the flow has one, as
    :func:`~flowattn.sets.train.evaluate` scores data), so the weight belongs to the very
    point it is attached to even though the inverse is only solved to a tolerance. The flow
    runs in its own dtype: convert it with ``flow.double()`` for float64 weights.

    A continuous flow's log q takes the exact trace here whatever its ``eval_divergence``
    says, unless ``divergence="hutchinson"``: a one-probe estimate log q̂ is unbiased, but the
    weight exp(-E - log q̂) is not (by Jensen, E[exp(-ε)] > exp(-E[ε]) for the probe's noise
    ε), so its ESS and reweighted estimates carry a bias that grows with the noise. The
    probed trace costs one vector-Jacobian product per field evaluation instead of N D: the
    only affordable one for large systems (LJ55), at that price.

    Arguments:
        flow: a set flow in zero-centre-of-mass mode (fitted to particle data).
        energy: E, (..., n, D) -> (...), at kT = 1.
        num: configurations to draw.
        particles: n, particles per configuration.
        generator: a seeded torch.Generator on the flow's device.
        batch_size: configurations per inversion.
        progress: report the configurations drawn and scored so far, a batch at a time
            (:class:`~flowattn.progress.Progress`: a bar on a terminal, a line a minute in a
            log): a continuous flow's exact log-density takes seconds per configuration.
        divergence: a continuous flow's trace in log q, ``"exact"`` or ``"hutchinson"``
            (the flow's own setting is restored afterwards).

    Returns:
        A :class:`BoltzmannSample`.

    Raises:
        InputError: a flow not in zero-centre-of-mass mode (exp(-E) is not normalisable over
            translations), or ``num``, ``particles``, ``batch_size`` below 1 (2 particles).
        NonFiniteError: a log-density that is not finite.

    Examples:
        >>> from flowattn.flows import set_flow
        >>> from flowattn.data import dw4_energy
        >>> flow = set_flow(2, 1, 1, zero_com=True, norm="2", interaction="radial")
        >>> flow = flow.double().eval()
        >>> s = boltzmann_sample(flow, dw4_energy, 8, 4, torch.Generator().manual_seed(0))
        >>> torch.allclose(s.log_w, -dw4_energy(s.x) - flow.log_prob(s.x))
        True
    """
    if not getattr(flow, "zero_com", False):
        raise InputError("importance weights against an energy need a flow in "
                         "zero-centre-of-mass mode (fitted to particle data): exp(-E) of a "
                         "translation-invariant E has no normaliser over translations")
    for name, value, least in (("num", num, 1), ("particles", particles, 2),
                               ("batch_size", batch_size, 1)):
        if int(value) != value or value < least:
            raise InputError(f"{name} must be an integer >= {least}, got {value}")
    if divergence not in ("exact", "hutchinson"):
        raise InputError(f"divergence must be 'exact' or 'hutchinson', got {divergence!r}")
    solvers = [m for m in flow.modules() if isinstance(m, CNF)]
    own = [cnf.eval_divergence for cnf in solvers]
    was_training = flow.training
    flow.eval()
    parts: list[tuple[Tensor, Tensor]] = []
    try:
        for cnf in solvers:
            cnf.eval_divergence = divergence
        with probe_stream():  # a probed trace: probes independent across batches
            for batch in progress_batches(num, batch_size, "sampling", progress,
                                          "configuration"):
                with torch.no_grad():
                    x = flow.sample(len(batch), particles, None, generator)
                    parts.append((x, flow.log_prob(x)))
    finally:
        flow.train(was_training)
        for cnf, setting in zip(solvers, own, strict=True):
            cnf.eval_divergence = setting
    x = torch.cat([p[0] for p in parts])
    log_q = torch.cat([p[1] for p in parts])
    if not torch.isfinite(log_q).all():
        bad = (~torch.isfinite(log_q)).nonzero().flatten()[:5].tolist()
        raise NonFiniteError(f"the flow's log-density is not finite at samples {bad}")
    e = energy(x)
    e = torch.where(torch.isnan(e), torch.full_like(e, float("inf")), e)
    return BoltzmannSample(x=x, log_q=log_q, energy=e, log_w=-e - log_q)


def boltzmann_summary(sample: BoltzmannSample, hard_core: float = HARD_CORE) -> dict:
    r"""What the weights say: Kish ESS, reweighted mean energy, log Z and close pairs.

    * ``ess``: (Σ w)^2 / (n Σ w^2), the effective sample size as a fraction of the samples
      (:func:`~flowattn.importance.kish_ess`); ``ess_samples`` = n · ``ess``.
    * ``mean_energy`` ± ``mean_energy_error``: Σ w_i E(x_i) / Σ w_i, the self-normalised
      estimate of E_p[E], with its delta-method standard error
      (:func:`~flowattn.importance.self_normalised_mean`); ``sample_mean_energy``: the
      unweighted mean over the samples, E_q[E].
    * ``log_z`` ± ``log_z_error``: log of the mean weight, an estimate of log Z on the
      zero-centre-of-mass subspace (:func:`~flowattn.importance.log_mean_weight`).
    * ``close_pairs``: the fraction of samples with a pair closer than ``hard_core``;
      ``close_pairs_reweighted`` ± its error: the same under p, by reweighting.
    * ``close_pairs_kl``: kl(p(A) || q(A)) for the event A "a pair closer than ``hard_core``"
      (:func:`~flowattn.importance.event_kl`), with p(A) the reweighted estimate and q(A) the
      share of samples, k of n, taken as (k + 1/2) / (n + 1) so that it is never 0 or 1. By
      the data-processing inequality KL(p || q) >= kl(p(A) || q(A)), and KL(p || q) is the
      test NLL minus the entropy floor: the mass the flow puts inside the hard core alone keeps
      its NLL at least this far (up to the sampling error of both estimates) above the floor.

    The errors are trustworthy only when the ESS is not tiny (a few effective samples give
    errors that are themselves far off).

    Examples:
        >>> x = torch.tensor([[[0.0, 0.0], [0.5, 0.0]], [[0.0, 0.0], [2.0, 0.0]]])
        >>> s = BoltzmannSample(x, torch.zeros(2), torch.tensor([1.0, 3.0]), torch.zeros(2))
        >>> r = boltzmann_summary(s)
        >>> r["ess"], r["mean_energy"], r["close_pairs"]
        (1.0, 2.0, 0.5)
    """
    log_w = sample.log_w.double()
    n = log_w.shape[0]
    close = (pairwise_distances(sample.x).amin(-1) < hard_core).double()
    ess = float(kish_ess(log_w))
    finite = torch.isfinite(sample.energy)
    mean_energy, mean_energy_error = self_normalised_mean(log_w, sample.energy.double())
    close_w, close_w_error = self_normalised_mean(log_w, close)
    log_z, log_z_error = log_mean_weight(log_w)
    return {
        "samples": n,
        "ess": ess,
        "ess_samples": ess * n,
        "mean_energy": float(mean_energy),
        "mean_energy_error": float(mean_energy_error),
        "sample_mean_energy": float(sample.energy[finite].double().mean()) if finite.any()
        else float("inf"),
        "log_z": float(log_z),
        "log_z_error": float(log_z_error),
        "hard_core": hard_core,
        "close_pairs": float(close.mean()),
        "close_pairs_reweighted": float(close_w),
        "close_pairs_reweighted_error": float(close_w_error),
        # a self-normalised mean of a 0/1 indicator lies in [0, 1] up to rounding
        "close_pairs_kl": event_kl(min(max(float(close_w), 0.0), 1.0),
                                   (float(close.sum()) + 0.5) / (n + 1)),
    }


def regularised_energy(energy: Callable[[Tensor], Tensor], x: Tensor, high: float) -> Tensor:
    r"""E(x) as training by energy uses it: itself up to ``high``, logarithmic above.

    E_reg(x) = E(x) where E(x) <= high, and high + log(1 + E(x) - high) above (the
    regularisation of Noé et al. 2019): a sample with two particles almost on top of each other
    (an LJ energy of 10⁹) still pulls them apart, but with a gradient of the size of a typical
    sample's rather than 10⁹ times it. A configuration whose energy is not finite or above
    :data:`ENERGY_LIMIT` counts as high + log(1 + ENERGY_LIMIT) and passes no gradient (its
    derivative would overflow): E is evaluated once without a graph to find such rows, and then
    on ``x`` with those rows detached.

    Arguments:
        energy: E, (..., n, D) -> (...), at kT = 1.
        x: configurations (B, n, D), usually drawn from a flow with a graph.
        high: where the logarithmic part begins.

    Returns:
        E_reg, shape (B,), finite, differentiable w.r.t. ``x``.

    Examples:
        >>> from flowattn.data import lj13_energy
        >>> x = torch.randn(2, 13, 3, dtype=torch.float64) * 2
        >>> x[1, 1] = x[1, 0] + 1e-3  # a pair at 0.001: E of order 10^36
        >>> e = regularised_energy(lj13_energy, x.requires_grad_(), 100.0)
        >>> bool(torch.isfinite(e).all()), round(e[1].item(), 2)  # 100 + log(1 + 10^12)
        (True, 127.63)
    """
    with torch.no_grad():
        blocked = ~(energy(x) <= ENERGY_LIMIT)  # NaN and +inf too
    flat = (-1,) + (1,) * (x.dim() - 1)
    e = energy(torch.where(blocked.reshape(flat), x.detach(), x))
    e = torch.where(blocked, torch.full_like(e, ENERGY_LIMIT), e)
    excess = (e - high).clamp(min=0)
    return torch.where(e > high, high + torch.log1p(excess), e)
