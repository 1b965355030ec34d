"""Normalizing flows over sets and sequences: invertible residual flows with Lipschitz branches.

The transforms are ``nflows`` transforms on (B, N, D) sets that take the padding mask as
``context``; the builders stack them into a :class:`SetFlow` with a standard normal base.
The layers of the package, each using only those below it:

* :mod:`~flowattn.flows.geometry` -- masks, the zero-centre-of-mass projection, probes, VJPs;
  :mod:`~flowattn.flows.base` -- the base densities; :mod:`~flowattn.flows.splines` -- the
  rational-quadratic spline of every spline layer, without branches on the data;
* :mod:`~flowattn.flows.logdet` and :mod:`~flowattn.flows.inverse` -- the log-determinant
  estimators and the inverses of residual blocks, with their options;
* :mod:`~flowattn.flows.residual`, :mod:`~flowattn.flows.monotone` -- residual blocks
  x + g(x) around a branch of :mod:`flowattn.branches` or :mod:`flowattn.attention`;
  :mod:`~flowattn.flows.layers` -- exact layers (ActNorm, equivariant linear, set location);
  :mod:`~flowattn.flows.pairs` -- pair splines (every pair of particles moved along its axis);
  :mod:`~flowattn.flows.continuous` -- continuous flows and their vector fields;
* :mod:`~flowattn.flows.setflow` -- :class:`SetFlow`, the flow object;
  :mod:`~flowattn.flows.builders` -- :func:`set_flow`, :func:`sequence_flow`;
  :mod:`~flowattn.flows.coupling` -- :class:`SetCoupling` (splines conditioned by attention
  over the set) and :func:`coupling_flow`.

Estimators, inverses and helpers are imported from their own modules
(``from flowattn.flows.logdet import series_logdet``).
"""

from .builders import sequence_flow, set_flow
from .continuous import CNF, AttentionField, DotProductField, EGNNField
from .coupling import SetCoupling, coupling_flow
from .inverse import InverseOptions
from .layers import ActNorm, EquivariantLinear, SetLocation
from .logdet import LogDetOptions
from .monotone import InverseMonotoneResidual, MonotoneResidual
from .pairs import PairSplines
from .residual import InvertibleResidual, TransformerResidualPair
from .setflow import SetFlow

__all__ = [
    # residual blocks and their options
    "InvertibleResidual",
    "TransformerResidualPair",
    "MonotoneResidual",
    "InverseMonotoneResidual",
    "LogDetOptions",
    "InverseOptions",
    # exact layers
    "ActNorm",
    "EquivariantLinear",
    "SetLocation",
    "SetCoupling",
    "PairSplines",
    # continuous flows and their fields
    "CNF",
    "AttentionField",
    "DotProductField",
    "EGNNField",
    # flows and builders
    "SetFlow",
    "set_flow",
    "sequence_flow",
    "coupling_flow",
]
