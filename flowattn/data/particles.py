"""Particle systems (DW4, LJ13) sampled by the library's own random-walk Metropolis sampler.

Energies at temperature 1, invariant to translations, rotations and permutations:

* DW4 (4 particles in 2-D, Köhler et al. 2020): E = sum_{i<j} 0.9 (d_ij - 4)^4 - 4 (d_ij - 4)^2.
* LJ13 (13 particles in 3-D): E = 2 sum_{i<j} [r_ij^{-12} - 2 r_ij^{-6}] + 1/2 sum_i ||x_i - x̄||^2
  (Lennard-Jones with the factor 2 and a harmonic term holding the cluster together).

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
from tqdm.auto import tqdm

from .sets import SetData, load_npz, save_npz

__all__ = [
    "dw4_energy",
    "lj13_energy",
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
    """Double-well energy of 4-particle 2-D configurations (..., 4, 2) -> (...)."""
    d = pairwise_distances(x) - 4.0
    return (0.9 * d.pow(4) - 4.0 * d.pow(2)).sum(-1)


def lj13_energy(x: Tensor) -> Tensor:
    """Lennard-Jones energy (factor 2) plus harmonic confinement, (..., 13, 3) -> (...)."""
    inv6 = pairwise_distances(x).pow(-6)
    lj = 2.0 * (inv6.pow(2) - 2.0 * inv6).sum(-1)
    centred = x - x.mean(-2, keepdim=True)
    return lj + 0.5 * centred.pow(2).sum((-2, -1))


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

    @property
    def energy(self) -> Callable[[Tensor], Tensor]:
        return {"dw4": dw4_energy, "lj13": lj13_energy}[self.name]


PARTICLE_SYSTEMS = {
    "dw4": ParticleSystem("dw4", 4, 2, thin=50, burn_in=2000, initial_step=0.5,
                          grid_spacing=4.0, mean_energy=-22.5),
    "lj13": ParticleSystem("lj13", 13, 3, thin=200, burn_in=30000, initial_step=0.05,
                           grid_spacing=1.12, mean_energy=-43.1),
}


def metropolis(
    system: ParticleSystem,
    num_samples: int,
    chains: int = 1000,
    generator: torch.Generator | None = None,
    progress: bool = False,
) -> tuple[Tensor, dict]:
    """Draw ``num_samples`` zero-centre-of-mass configurations of ``system`` (float64).

    Returns:
        (samples (num_samples, n, dim), statistics: acceptance rate and mean final step size).
    """
    if generator is None:
        generator = torch.Generator().manual_seed(0)
    chains = min(chains, num_samples)
    per_chain = math.ceil(num_samples / chains)
    n, dim = system.particles, system.dim
    start = _grid_start(n, dim, system.grid_spacing)
    x = start + 0.05 * torch.randn(chains, n, dim, generator=generator, dtype=torch.float64)
    x = x - x.mean(1, keepdim=True)
    energy = system.energy(x)
    step = torch.full((chains, 1, 1), system.initial_step, dtype=torch.float64)
    kept, accepted, total = [], 0.0, 0
    steps = system.burn_in + per_chain * system.thin
    for t in tqdm(range(steps), desc=f"sampling {system.name}", disable=not progress):
        proposal = x + step * torch.randn(x.shape, generator=generator, dtype=torch.float64)
        proposal = proposal - proposal.mean(1, keepdim=True)
        proposed_energy = system.energy(proposal)
        log_u = torch.rand(chains, generator=generator, dtype=torch.float64).log()
        accept = log_u < energy - proposed_energy  # NaN energies (overlaps) are rejected
        x = torch.where(accept[:, None, None], proposal, x)
        energy = torch.where(accept, proposed_energy, energy)
        if t < system.burn_in:
            step = step * torch.where(accept, 1.01, 0.995)[:, None, None]
            continue
        accepted += accept.double().sum().item()
        total += chains
        if (t - system.burn_in + 1) % system.thin == 0:
            kept.append(x.clone())
    samples = torch.stack(kept, 1).reshape(-1, n, dim)[:num_samples]
    stats = {"acceptance": accepted / max(total, 1), "step": step.mean().item()}
    return samples, stats


def particle_data(
    name: str,
    splits: dict[str, int],
    seed: int = 0,
    cache_dir: str | Path | None = None,
    chains: int = 1000,
    progress: bool = False,
) -> dict[str, SetData]:
    """Sampled, cached train/validation/test sets of a particle system.

    Each split is drawn from its own seeded chains (seed, split index), so splits are
    independent and a larger training split does not change the test split. Results are cached
    as ``.npz`` under ``cache_dir`` (default ``~/.cache/flowattn``), keyed by every setting.
    """
    system = PARTICLE_SYSTEMS[name]
    cache = Path(cache_dir or Path.home() / ".cache" / "flowattn")
    cache.mkdir(parents=True, exist_ok=True)
    out = {}
    for index, (split, count) in enumerate(splits.items()):
        settings = {"system": asdict(system), "count": count, "seed": seed, "split": index,
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
