"""Data for density estimation on sets: users' ``.npz`` files, particles, synthetic sets."""

from ..errors import DataError
from .augment import (
    random_orthogonal,
    random_signs,
    reflect_sets,
    reflection_signs,
    rotate_sets,
)
from .particles import (
    PARTICLE_SYSTEMS,
    ParticleSystem,
    dw4_energy,
    lj13_energy,
    lj55_energy,
    metropolis,
    pairwise_distances,
    particle_data,
)
from .registry import DATASETS, SIZED_DATASETS, load_dataset, split_sets
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
from .surfaces import SURFACES, random_rotations, surface_clouds, surface_distance
from .synthetic import cluster_sets, cluster_sets_log_prob, gaussian_sets, gaussian_sets_log_prob

__all__ = [
    "DataError",
    "random_orthogonal",
    "random_signs",
    "reflect_sets",
    "reflection_signs",
    "rotate_sets",
    "SetData",
    "load_npz",
    "save_npz",
    "DATASETS",
    "SIZED_DATASETS",
    "load_dataset",
    "split_sets",
    "PARTICLE_SYSTEMS",
    "ParticleSystem",
    "dw4_energy",
    "lj13_energy",
    "lj55_energy",
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
    "SURFACES",
    "surface_clouds",
    "surface_distance",
    "random_rotations",
]
