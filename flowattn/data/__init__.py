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
from .repulsive import (
    repulsive_log_normaliser,
    repulsive_sets,
    repulsive_sets_iid_log_prob,
    repulsive_sets_log_prob,
)
from .sets import SetData, load_npz, save_npz
from .shapes import (
    SHAPES,
    shape_sets,
    shape_sets_iid_log_prob,
    shape_sets_log_joint,
    shape_sets_log_prob,
)
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
    "SHAPES",
    "shape_sets",
    "shape_sets_log_prob",
    "shape_sets_iid_log_prob",
    "shape_sets_log_joint",
    "repulsive_sets",
    "repulsive_sets_log_prob",
    "repulsive_sets_iid_log_prob",
    "repulsive_log_normaliser",
]
