"""Data for density estimation on sets: users' ``.npz`` files, particle systems, synthetic sets."""

from ..errors import DataError
from .particles import (
    PARTICLE_SYSTEMS,
    ParticleSystem,
    dw4_energy,
    lj13_energy,
    metropolis,
    pairwise_distances,
    particle_data,
)
from .registry import DATASETS, load_dataset, split_sets
from .sets import SetData, load_npz, save_npz
from .synthetic import cluster_sets, cluster_sets_log_prob, gaussian_sets, gaussian_sets_log_prob

__all__ = [
    "DataError",
    "SetData",
    "load_npz",
    "save_npz",
    "DATASETS",
    "load_dataset",
    "split_sets",
    "PARTICLE_SYSTEMS",
    "ParticleSystem",
    "dw4_energy",
    "lj13_energy",
    "metropolis",
    "pairwise_distances",
    "particle_data",
    "gaussian_sets",
    "gaussian_sets_log_prob",
    "cluster_sets",
    "cluster_sets_log_prob",
]
