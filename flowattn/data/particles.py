"""Particle systems (DW4, LJ13, LJ55) sampled by the library's own random-walk Metropolis sampler.

Energies at temperature 1, invariant to translations, rotations and permutations:

* DW4 (4 particles in 2-D, Köhler et al. 2020): E = sum_{i<j} 0.9 (d_ij - 4)^4 - 4 (d_ij - 4)^2.
* LJ13 (13 particles in 3-D): E = 2 sum_{i<j} [r_ij^{-12} - 2 r_ij^{-6}] + 1/2 sum_i ||x_i - x̄||^2
  (Lennard-Jones with the factor 2 and a harmonic term holding the cluster together).
* LJ55 (55 particles in 3-D, 165 dimensions): the same energy.

The sampler runs many chains in parallel inside the zero-centre-of-mass subspace (every
proposal is recentred, which keeps the proposal symmetric there), adapts each chain's step size
during burn-in only (x1.01 on acceptance, x0.995 on rejection, which settles at about 1/3
acceptance), then keeps every ``thin``-th state.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..errors import InputError
from ..progress import progress_range
from .sets import SetData, load_npz, save_npz

__all__ = [
    "dw4_energy",
    "lj13_energy",
    "lj55_energy",
    "ParticleSystem",
    "PARTICLE_SYSTEMS",
    "metropolis",
    "particle_data",
    "pairwise_distances",
]


def pairwise_distances(x: Tensor) -> Tensor:
    """Distances d_ij, i < j, of (..., n, dim) configurations: shape (..., n (n - 1) / 2)."""
    n = x.shape[-2]
    i, j = torch.triu_indices(n, n, 1, device=x.device)
    return (x[..., i, :] - x[..., j, :]).norm(dim=-1)


def dw4_energy(x: Tensor) -> Tensor:
    """Double-well energy of 4-particle 2-D configurations (..., 4, 2) -> (...); its pair sum
    applies as it is to any number of particles in any dimension (the partition-function
    tests use its pair term in one)."""
    d = pairwise_distances(x) - 4.0
    return (0.9 * d.pow(4) - 4.0 * d.pow(2)).sum(-1)


def _lj_pair(d: Tensor) -> Tensor:
    """The pair term of the Lennard-Jones clusters, 2 (d^-12 - 2 d^-6); 0 at d = inf."""
    inv6 = d.pow(-6)
    return 2.0 * (inv6.pow(2) - 2.0 * inv6)


def _harmonic(x: Tensor) -> Tensor:
    centred = x - x.mean(-2, keepdim=True)
    return 0.5 * centred.pow(2).sum((-2, -1))


def _lennard_jones_cluster(x: Tensor) -> Tensor:
    return _lj_pair(pairwise_distances(x)).sum(-1) + _harmonic(x)


def lj13_energy(x: Tensor) -> Tensor:
    """Lennard-Jones energy (factor 2) plus harmonic confinement, (..., 13, 3) -> (...)."""
    return _lennard_jones_cluster(x)


def lj55_energy(x: Tensor) -> Tensor:
    """LJ13's energy for 55 particles, (..., 55, 3) -> (...)."""
    return _lennard_jones_cluster(x)


def _grid_start(n: int, dim: int, spacing: float) -> Tensor:
    """The first n points of a cubic grid: a start without overlapping particles."""
    side = math.ceil(n ** (1 / dim))
    axes = [torch.arange(side, dtype=torch.float64)] * dim
    grid = torch.stack(torch.meshgrid(*axes, indexing="ij"), -1).reshape(-1, dim)[:n]
    return grid * spacing


@dataclass(frozen=True)
class ParticleSystem:
    """A particle system and the sampler settings that reproduce its equilibrium statistics."""

    name: str
    particles: int
    dim: int
    thin: int
    burn_in: int
    initial_step: float
    grid_spacing: float
    mean_energy: float  # the equilibrium mean energy the sampler is checked against
    # "all": every proposal moves the whole configuration (thin and burn_in count steps);
    # "particle": one particle at a time, in turn (they count sweeps of n moves; pair
    # energies with a harmonic term only)
    moves: str = "all"
    chains: int = 1000  # parallel chains of a data split

    @property
    def energy(self) -> Callable[[Tensor], Tensor]:
        return {"dw4": dw4_energy, "lj13": lj13_energy, "lj55": lj55_energy}[self.name]


PARTICLE_SYSTEMS = {
    "dw4": ParticleSystem("dw4", 4, 2, thin=50, burn_in=2000, initial_step=0.5,
                          grid_spacing=4.0, mean_energy=-22.5),
    "lj13": ParticleSystem("lj13", 13, 3, thin=200, burn_in=30000, initial_step=0.05,
                           grid_spacing=1.12, mean_energy=-43.1),
    # no published mean energy to check against: the value is the sampler's own, from
    # independent runs with longer burn-in (docs/sets.md, "LJ55")
    "lj55": ParticleSystem("lj55", 55, 3, thin=20, burn_in=3000, initial_step=0.1,
                           grid_spacing=1.12, mean_energy=-325.0, moves="particle",
                           chains=100),
}


def metropolis(
    system: ParticleSystem,
    num_samples: int,
    chains: int | None = None,
    generator: torch.Generator | None = None,
    progress: bool = False,
) -> tuple[Tensor, dict]:
    """Draw ``num_samples`` zero-centre-of-mass configurations of ``system`` (float64), from
    ``chains`` parallel chains (none: the system's own number).

    Returns:
        (samples (num_samples, n, dim), statistics: acceptance rate and mean final step size).
    """
    if generator is None:
        generator = torch.Generator().manual_seed(0)
    chains = min(chains or system.chains, num_samples)
    per_chain = math.ceil(num_samples / chains)
    n, dim = system.particles, system.dim
    start = _grid_start(n, dim, system.grid_spacing)
    x = start + 0.05 * torch.randn(chains, n, dim, generator=generator, dtype=torch.float64)
    x = x - x.mean(1, keepdim=True)
    energy = system.energy(x)
    step = torch.full((chains, 1, 1), system.initial_step, dtype=torch.float64)
    kept, accepted, total = [], 0.0, 0
    steps = system.burn_in + per_chain * system.thin
    move, proposals = ((_particle_sweep, chains * n) if system.moves == "particle"
                       else (_joint_move, chains))
    for t in progress_range(steps, f"sampling {system.name}", enabled=progress):
        adapt = t < system.burn_in
        x, energy, step, accept = move(system, x, energy, step, generator, adapt)
        if adapt:
            continue
        accepted += accept
        total += proposals
        if (t - system.burn_in + 1) % system.thin == 0:
            kept.append(x.clone())
    samples = torch.stack(kept, 1).reshape(-1, n, dim)[:num_samples]
    stats = {"acceptance": accepted / max(total, 1), "step": step.mean().item()}
    return samples, stats


def _joint_move(system: ParticleSystem, x: Tensor, energy: Tensor, step: Tensor,
                generator: torch.Generator, adapt: bool):
    """One proposal that moves every particle (a step of (chains, 1, 1) per chain)."""
    proposal = x + step * torch.randn(x.shape, generator=generator, dtype=x.dtype)
    proposal = proposal - proposal.mean(1, keepdim=True)
    proposed_energy = system.energy(proposal)
    log_u = torch.rand(x.shape[0], generator=generator, dtype=x.dtype).log()
    accept = log_u < energy - proposed_energy  # NaN energies (overlaps) are rejected
    x = torch.where(accept[:, None, None], proposal, x)
    energy = torch.where(accept, proposed_energy, energy)
    if adapt:
        step = step * torch.where(accept, 1.01, 0.995)[:, None, None]
    return x, energy, step, accept.double().sum().item()


def _particle_sweep(system: ParticleSystem, x: Tensor, energy: Tensor, step: Tensor,
                    generator: torch.Generator, adapt: bool):
    """n proposals, each moving one particle (in turn) and recentring: O(n) energy terms each.

    Each move is symmetric in the zero-centre-of-mass subspace (the reverse move of particle k
    is as likely) and accepted by its energy change, so every move keeps the Boltzmann density.
    """
    if system.name not in ("lj13", "lj55"):
        raise InputError(f"one-particle moves need a pair energy: {system.name!r} has none")
    chains, n, dim = x.shape
    accepted = x.new_zeros(())
    for k in range(n):
        others = torch.arange(n, device=x.device) != k
        moved = x[:, k] + step[:, :, 0] * torch.randn(chains, dim, generator=generator,
                                                     dtype=x.dtype)
        rest = x[:, others]
        pair_change = (_lj_pair((rest - moved[:, None]).norm(dim=-1))
                       - _lj_pair((rest - x[:, k:k + 1]).norm(dim=-1))).sum(-1)
        proposal = x.clone()
        proposal[:, k] = moved
        proposal = proposal - proposal.mean(1, keepdim=True)
        change = pair_change + _harmonic(proposal) - _harmonic(x)
        log_u = torch.rand(chains, generator=generator, dtype=x.dtype).log()
        accept = log_u < -change  # NaN changes (overlaps) are rejected
        x = torch.where(accept[:, None, None], proposal, x)
        if adapt:
            step = step * torch.where(accept, 1.01, 0.995)[:, None, None]
        accepted = accepted + accept.sum()
    return x, system.energy(x), step, accepted.item()


def particle_data(
    name: str,
    splits: dict[str, int],
    seed: int = 0,
    cache_dir: str | Path | None = None,
    chains: int | None = None,
    progress: bool = False,
) -> dict[str, SetData]:
    """Sampled, cached train/validation/test sets of a particle system.

    Each split is drawn from its own seeded chains (seed, split index), so splits are
    independent and a larger training split does not change the test split. Results are cached
    as ``.npz`` under ``cache_dir`` (default ``~/.cache/flowattn``), keyed by every setting.
    """
    system = PARTICLE_SYSTEMS[name]
    chains = chains or system.chains
    # the sampler settings that existed first are all a key had then: keys stay as they were
    spec = {key: value for key, value in asdict(system).items()
            if (key, value) not in (("moves", "all"), ("chains", 1000))}
    cache = Path(cache_dir or Path.home() / ".cache" / "flowattn")
    cache.mkdir(parents=True, exist_ok=True)
    out = {}
    for index, (split, count) in enumerate(splits.items()):
        settings = {"system": spec, "count": count, "seed": seed, "split": index,
                    "chains": chains, "version": 1}
        key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
        path = cache / f"{name}-{split}-{count}-{key}.npz"
        if path.exists():
            x = load_npz(path, dtype=torch.float64).x
        else:
            g = torch.Generator().manual_seed(seed * 1000 + index)
            x, _ = metropolis(system, count, chains, g, progress)
            save_npz(path, x)
        out[split] = SetData(x.float(), None, f"{name}/{split}", zero_com=True,
                             meta={"energy": name, "cache": str(path)})
    return out
