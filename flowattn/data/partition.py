r"""Partition functions of particle systems by annealed importance sampling, and entropy floors.

A particle system with a translation-invariant energy E has, at kT = 1, the density
p(x) = exp(-E(x)) / Z on the zero-centre-of-mass subspace V = {Σ_i x_i = 0} of R^{nD}, a space
of dimension d = (n - 1) D. Z = ∫_V exp(-E) dx is taken with the Lebesgue measure of V itself
(orthonormal coordinates of V): the measure of the set flows' densities, whose base is
N(0, I) on V with the constant -d/2 log 2π (:mod:`flowattn.flows.base`). Integrating over
the first n - 1 particles instead (x_n = -Σ_{i<n} x_i) would give Z / n^{D/2}.

The entropy floor is the NLL a perfect model scores, E_p[-log p] = E_p[E] + log Z, in nats per
configuration: the mean energy of the data plus log Z (:func:`entropy_floor`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import DataError, InputError
from ..importance import kish_ess, log_mean_weight, self_normalised_mean
from ..progress import progress_range
from .particles import PARTICLE_SYSTEMS

__all__ = ["AnnealingOptions", "PartitionEstimate", "annealed_log_partition", "EntropyFloor",
           "entropy_floor", "harmonic_log_partition", "FLOOR_SETTINGS", "system_floor"]


@dataclass(frozen=True)
class AnnealingOptions:
    """Settings of :func:`annealed_log_partition`.

    Attributes:
        chains: independent annealing runs, each with its own weight.
        stages: intermediate densities, β_t = (t / stages)^exponent.
        steps: random-walk Metropolis steps per stage.
        exponent: of the β schedule (large: small steps at the start, where E is steep).
        base_scale: σ of the base N(0, σ^2 I) on the zero-centre-of-mass subspace.
        pilot_chains: chains of the pilot run that sets the Metropolis step of every stage.
        acceptance: the acceptance rate the pilot run steers each stage's step towards.

    Examples:
        >>> AnnealingOptions(chains=100).stages
        1000
    """

    chains: int = 1000
    stages: int = 1000
    steps: int = 2
    exponent: float = 4.0
    base_scale: float = 1.0
    pilot_chains: int = 200
    acceptance: float = 0.3

    def __post_init__(self) -> None:
        for name in ("chains", "stages", "steps", "pilot_chains"):
            value = getattr(self, name)
            if int(value) != value or value < 1 or (name == "chains" and value < 2):
                least = 2 if name == "chains" else 1
                raise InputError(f"AnnealingOptions.{name} must be an integer >= {least}, "
                                 f"got {value}")
        for name in ("exponent", "base_scale"):
            if not getattr(self, name) > 0:
                raise InputError(f"AnnealingOptions.{name} must be positive, got "
                                 f"{getattr(self, name)}")
        if not 0 < self.acceptance < 1:
            raise InputError(f"AnnealingOptions.acceptance must lie in (0, 1), got "
                             f"{self.acceptance}")


@dataclass(frozen=True)
class PartitionEstimate:
    """log Z of a particle system, with what the annealing run says about its reliability.

    Attributes:
        log_z: log Ẑ, the log of the mean annealed-importance weight.
        log_z_error: its delta-method standard error.
        ess: Kish's effective sample size of the final weights, as a fraction of the chains.
        mean_energy: E_p[E] estimated from the weighted final states.
        mean_energy_error: its standard error (self-normalised, delta method).
        chains: number of annealing runs.
        dims: (n - 1) D, the dimension of the zero-centre-of-mass subspace.
    """

    log_z: float
    log_z_error: float
    ess: float
    mean_energy: float
    mean_energy_error: float
    chains: int
    dims: int


def annealed_log_partition(
    energy: Callable[[Tensor], Tensor],
    particles: int,
    dim: int,
    options: AnnealingOptions | None = None,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float64,
    progress: bool = False,
) -> PartitionEstimate:
    r"""log Z = log ∫_V exp(-E(x)) dx over the zero-centre-of-mass subspace V, by AIS.

    Annealed importance sampling (Neal 2001, *Statistics and Computing* 11:125) moves each
    chain through the densities γ_t(x) = q_0(x)^{1 - β_t} exp(-β_t E(x)), 0 = β_0 < ... <
    β_T = 1, from the base q_0 = N(0, σ^2 I) on V (normalised in the coordinates of V,
    so Z_0 = 1). A chain starts at x_0 ~ q_0 and before each stage's transition adds

        log w += (β_t - β_{t-1}) (-E(x) - log q_0(x)),

    then takes ``steps`` random-walk Metropolis steps that leave γ_t invariant (proposals
    x + s ε recentred onto V, symmetric there, as the data's sampler does). The mean of the
    weights w is an unbiased estimate of Z. The step s of every stage is set beforehand by a
    pilot run with its own chains (steered towards ``acceptance``), so the kernels of the
    weighted run do not depend on its own chains and the estimate stays unbiased.
    Configurations where E is NaN (particles on top of each other) count as E = +inf.

    Arguments:
        energy: E, (..., n, dim) -> (...), translation invariant.
        particles: n.
        dim: D.
        options: chains, stages, schedule, base width (:class:`AnnealingOptions`).
        generator: a seeded torch.Generator (default: CPU, seed 0); the chains run on its
            device.
        dtype: of the computation (float64 by default).
        progress: show progress bars (pilot and weighted run).

    Returns:
        A :class:`PartitionEstimate`.

    Examples:
        >>> harmonic = lambda x: 0.5 * x.pow(2).sum((-2, -1))  # on V: N(0, I), Z = (2π)^{d/2}
        >>> est = annealed_log_partition(harmonic, 3, 2, AnnealingOptions(chains=50, stages=5))
        >>> round(est.log_z, 6) == round(2 * math.log(2 * math.pi), 6)  # base = target: exact
        True
    """
    options = options or AnnealingOptions()
    if int(particles) != particles or particles < 2 or int(dim) != dim or dim < 1:
        raise InputError(f"need at least 2 particles in at least 1 dimension, got "
                         f"particles={particles}, dim={dim}")
    if generator is None:
        generator = torch.Generator().manual_seed(0)
    pilot_generator = torch.Generator(generator.device).manual_seed(
        int(torch.randint(2**62, (), generator=generator, device=generator.device)))
    betas = torch.linspace(0, 1, options.stages + 1, dtype=dtype).pow(options.exponent)
    run = _Annealing(energy, particles, dim, options, betas, dtype, progress)
    _, _, _, steps = run(options.pilot_chains, pilot_generator, None)
    x, e, log_w, _ = run(options.chains, generator, steps)
    log_z, log_z_error = log_mean_weight(log_w)
    mean_energy, mean_energy_error = self_normalised_mean(log_w, e)
    return PartitionEstimate(
        log_z=float(log_z), log_z_error=float(log_z_error), ess=float(kish_ess(log_w)),
        mean_energy=float(mean_energy), mean_energy_error=float(mean_energy_error),
        chains=options.chains, dims=(particles - 1) * dim)


def harmonic_log_partition(particles: int, dim: int, stiffness: float) -> float:
    r"""Exact log Z on V of the harmonic pair energy E = k/2 Σ_{i<j} ||x_i - x_j||^2.

    Since Σ_{i<j} ||x_i - x_j||^2 = n Σ_i ||x_i - x̄||^2, E = (k n / 2) ||x||^2 on V and

        log Z = d/2 log(2π / (k n)),    d = (n - 1) D.

    Arguments:
        particles: n.
        dim: D.
        stiffness: k > 0.

    Examples:
        >>> round(harmonic_log_partition(2, 1, 0.5), 6)  # one coordinate, E = x^2 / 2
        0.918939
    """
    if not stiffness > 0:
        raise InputError(f"stiffness must be positive, got {stiffness}")
    return 0.5 * (particles - 1) * dim * math.log(2 * math.pi / (stiffness * particles))


@dataclass(frozen=True)
class EntropyFloor:
    """The NLL a perfect model scores on a set of configurations, E[E] + log Z, in nats.

    Attributes:
        nll: mean energy of the configurations + log Z, per configuration.
        error: standard error of ``nll`` as an estimate of the entropy (mean energy and log Z
            errors added in quadrature).
        mean_energy: mean energy of the configurations.
        mean_energy_error: its standard error (batch means over blocks of consecutive
            configurations, which absorb correlations along a Markov chain).
        partition: the log Z estimate.
        configurations: how many configurations were scored.
    """

    nll: float
    error: float
    mean_energy: float
    mean_energy_error: float
    partition: PartitionEstimate
    configurations: int

    @property
    def nll_per_dim(self) -> float:
        """``nll`` per degree of freedom, (n - 1) D."""
        return self.nll / self.partition.dims


def entropy_floor(
    energy: Callable[[Tensor], Tensor],
    x: Tensor,
    partition: PartitionEstimate,
    block: int = 1,
) -> EntropyFloor:
    r"""The entropy E_p[-log p] = E_p[E] + log Z at kT = 1, with E_p[E] the mean over ``x``.

    With p = exp(-E) / Z on the zero-centre-of-mass subspace, -log p(x) = E(x) + log Z, so the
    NLL a perfect model scores on configurations x_1 ... x_m (in the set flows' convention) is
    (1/m) Σ_j E(x_j) + log Z. Its error as an estimate of the entropy combines the standard
    error of log Z and that of the mean energy; the latter is computed from means over blocks
    of ``block`` consecutive configurations (one block per sampler chain for the built-in
    data), so correlations within a chain do not shrink it.

    Arguments:
        energy: E, (..., n, D) -> (...).
        x: configurations, (m, n, D), with m a multiple of ``block`` and m / block >= 2.
        partition: log Z from :func:`annealed_log_partition`, same system.
        block: consecutive configurations per batch mean.

    Examples:
        >>> harmonic = lambda x: 0.5 * x.pow(2).sum((-2, -1))
        >>> g = torch.Generator().manual_seed(0)
        >>> z = torch.randn(4000, 3, 2, generator=g, dtype=torch.float64)
        >>> x = z - z.mean(1, keepdim=True)  # N(0, I) on V, entropy d/2 (1 + log 2π), d = 4
        >>> est = annealed_log_partition(harmonic, 3, 2, AnnealingOptions(stages=2))
        >>> floor = entropy_floor(harmonic, x, est)
        >>> abs(floor.nll - 2 * (1 + math.log(2 * math.pi))) < 3 * floor.error
        True
    """
    if not isinstance(x, Tensor) or x.dim() != 3:
        shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise InputError(f"configurations must have shape (m, n, D), got {shape}")
    m = x.shape[0]
    if int(block) != block or block < 1 or m % block or m // block < 2:
        raise InputError(f"block={block} must divide the {m} configurations into at least 2 "
                         "blocks")
    if (x.shape[1] - 1) * x.shape[2] != partition.dims:
        raise InputError(f"configurations of shape {tuple(x.shape[1:])} have "
                         f"{(x.shape[1] - 1) * x.shape[2]} degrees of freedom, log Z was "
                         f"estimated for {partition.dims}")
    e = energy(x.to(torch.float64))
    if not torch.isfinite(e).all():
        raise InputError(f"{int((~torch.isfinite(e)).sum())} configurations have a "
                         "non-finite energy")
    means = e.reshape(-1, block).mean(1)
    mean_energy = float(means.mean())
    mean_energy_error = float(means.std() / math.sqrt(means.shape[0]))
    return EntropyFloor(
        nll=mean_energy + partition.log_z,
        error=math.hypot(mean_energy_error, partition.log_z_error),
        mean_energy=mean_energy, mean_energy_error=mean_energy_error, partition=partition,
        configurations=m)


# Annealing settings of the built-in systems' floors; the base width matches the spread of
# each system's configurations (DW4: pair distances 2.5 to 5.5; LJ13: its harmonic term).
FLOOR_SETTINGS = {
    "dw4": AnnealingOptions(chains=2000, stages=2000, base_scale=2.0),
    "lj13": AnnealingOptions(chains=1000, stages=20000, base_scale=1.0),
}


def system_floor(
    name: str,
    chains: int | None = None,
    stages: int | None = None,
    seed: int = 0,
    progress: bool = False,
) -> EntropyFloor:
    """The entropy floor of the test split of a built-in particle system (``dw4``, ``lj13``).

    log Z by :func:`annealed_log_partition` with the system's :data:`FLOOR_SETTINGS` (``chains``
    and ``stages`` override them), the mean energy over the default test split
    (:func:`~flowattn.data.load_dataset`, generated and cached on first use), in blocks of one
    sampler chain each.

    Raises:
        DataError: a name that is not a built-in particle system.

    Examples:
        >>> system_floor("argon")  # the floors need a known energy
        Traceback (most recent call last):
        ...
        flowattn.errors.DataError: 'argon' has no known energy: use one of dw4, lj13
    """
    from .registry import load_dataset

    if name not in FLOOR_SETTINGS:
        known = ", ".join(sorted(FLOOR_SETTINGS))
        if name in PARTICLE_SYSTEMS:
            raise DataError(f"{name!r} has no annealing settings for its floor (measured only "
                            f"for {known})")
        raise DataError(f"{name!r} has no known energy: use one of {known}")
    system = PARTICLE_SYSTEMS[name]
    options = FLOOR_SETTINGS[name]
    changes = {k: v for k, v in (("chains", chains), ("stages", stages)) if v is not None}
    options = AnnealingOptions(**{**options.__dict__, **changes})
    test = load_dataset(name, progress=progress)["test"]
    partition = annealed_log_partition(system.energy, system.particles, system.dim, options,
                                       torch.Generator().manual_seed(seed), progress=progress)
    per_chain = math.ceil(len(test) / min(system.chains, len(test)))  # particle_data's chains
    return entropy_floor(system.energy, test.x, partition, block=per_chain)


class _Annealing:
    """One AIS sweep over the schedule: fixed steps (the weighted run) or adapted (the pilot)."""

    def __init__(self, energy, particles, dim, options, betas, dtype, progress):
        self.energy, self.n, self.dim, self.progress = energy, particles, dim, progress
        self.options, self.betas, self.dtype = options, betas, dtype
        self.dims = (particles - 1) * dim
        self.scale = options.base_scale

    def _energy(self, x: Tensor) -> Tensor:
        e = self.energy(x)
        return torch.where(torch.isnan(e), torch.full_like(e, math.inf), e)

    def _base_log_prob(self, x: Tensor) -> Tensor:
        s2 = self.scale**2
        return -0.5 * x.pow(2).sum((-2, -1)) / s2 - 0.5 * self.dims * math.log(2 * math.pi * s2)

    def _noise(self, chains: int, generator: torch.Generator) -> Tensor:
        z = torch.randn(chains, self.n, self.dim, generator=generator, dtype=self.dtype,
                        device=generator.device)
        return z - z.mean(1, keepdim=True)

    def __call__(self, chains: int, generator: torch.Generator, steps: Tensor | None):
        opt = self.options
        x = self.scale * self._noise(chains, generator)
        e, lq = self._energy(x), self._base_log_prob(x)
        log_w = torch.zeros(chains, dtype=self.dtype, device=x.device)
        step = 2.38 * self.scale / math.sqrt(self.dims)  # RWM's optimum for the base
        used = torch.empty(opt.stages, dtype=self.dtype)
        what = "pilot" if steps is None else "annealing"
        for t in progress_range(opt.stages, what, enabled=self.progress, first=1):
            beta, increment = self.betas[t], self.betas[t] - self.betas[t - 1]
            log_w = log_w + increment * (-e - lq)
            s = step if steps is None else steps[t - 1]
            used[t - 1] = s
            log_gamma = (1 - beta) * lq - beta * e
            accepted = torch.zeros((), dtype=self.dtype, device=x.device)
            for _ in range(opt.steps):
                proposal = x + s * self._noise(chains, generator)
                e_new, lq_new = self._energy(proposal), self._base_log_prob(proposal)
                log_gamma_new = (1 - beta) * lq_new - beta * e_new
                log_u = torch.rand(chains, generator=generator, dtype=self.dtype,
                                   device=x.device).log()
                accept = log_u < log_gamma_new - log_gamma  # NaN (both -inf) rejects
                x = torch.where(accept[:, None, None], proposal, x)
                e, lq = torch.where(accept, e_new, e), torch.where(accept, lq_new, lq)
                log_gamma = torch.where(accept, log_gamma_new, log_gamma)
                accepted = accepted + accept.to(self.dtype).mean()
            if steps is None:  # the pilot: steer the step towards the wanted acceptance
                step = step * math.exp(float(accepted) / opt.steps - opt.acceptance)
        return x, e, log_w, used
