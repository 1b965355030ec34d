"""Continuous normalizing flows: an ODE dz/dt = f(z, t) on sets, and the fields f.

* :mod:`~flowattn.flows.continuous.divergence` -- tr(df/dz), exact or Hutchinson;
* :mod:`~flowattn.flows.continuous.cnf` -- :class:`CNF`, the flow solved with torchdiffeq;
* :mod:`~flowattn.flows.continuous.fields` -- attention fields, certified
  (:class:`AttentionField`) or not (:class:`DotProductField`);
* :mod:`~flowattn.flows.continuous.egnn` -- :class:`EGNNField`, an E(n)-equivariant graph
  network for particles.
"""

from .cnf import CNF
from .egnn import EGNNField
from .fields import AttentionField, DotProductField

__all__ = ["CNF", "AttentionField", "DotProductField", "EGNNField"]
