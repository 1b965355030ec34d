"""Normalizing flows over sets and sequences: invertible residual flows with Lipschitz branches."""

from ..errors import InverseNotConverged, ODESolverError
from .base import sample_standard_normal, set_dims, standard_normal_log_prob
from .builders import SetFlow, sequence_flow, set_flow
from .continuous import CNF, AttentionField, DotProductField, EGNNField
from .continuous.divergence import exact_divergence, hutchinson_divergence
from .geometry import subtract_mean
from .inverse import anderson_inverse, fixed_point_inverse, residual_inverse
from .layers import ActNorm, EquivariantLinear, SetLocation, size_features
from .logdet import exact_logdet, memory_efficient_logdet, roulette_logdet, series_logdet
from .monotone import InverseMonotoneResidual, MonotoneResidual
from .residual import InvertibleResidual, TransformerResidualPair

__all__ = [
    "ActNorm",
    "AttentionField",
    "CNF",
    "DotProductField",
    "EGNNField",
    "ODESolverError",
    "exact_divergence",
    "hutchinson_divergence",
    "EquivariantLinear",
    "InverseNotConverged",
    "InverseMonotoneResidual",
    "InvertibleResidual",
    "MonotoneResidual",
    "SetFlow",
    "SetLocation",
    "TransformerResidualPair",
    "anderson_inverse",
    "exact_logdet",
    "fixed_point_inverse",
    "memory_efficient_logdet",
    "residual_inverse",
    "roulette_logdet",
    "sample_standard_normal",
    "sequence_flow",
    "series_logdet",
    "set_dims",
    "set_flow",
    "size_features",
    "standard_normal_log_prob",
    "subtract_mean",
]
