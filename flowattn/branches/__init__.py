"""Residual branches with certified Lipschitz constants: the g of an invertible block x + g(x).

Every branch is called as ``branch(x, mask=None, causal=False)`` on sets or sequences x of shape
(B, N, D) and reports a certified ``lipschitz_bound(n)`` for sets of n elements; the blocks of
:mod:`flowattn.flows` check it before they trust the branch. The attention branches
(:class:`~flowattn.attention.ContractiveL2MHA`) live in :mod:`flowattn.attention`.

* :class:`LipschitzMLP` -- pointwise, spectrally normalised (module :mod:`flowattn.branches.mlp`,
  with its ``SpectralLinear`` layers and ``LipSwish`` or ``CLipSwish`` activations);
* :class:`RadialInteraction` -- an E(n)-equivariant pairwise interaction of particles;
* :class:`NeighbourhoodInteraction` -- an E(n)-equivariant many-body interaction;
* :class:`ContractiveLiftedL2MHA` -- tied L2 attention among learnt features of narrow elements
  (points in 2-D or 3-D), certified as a product (:class:`LiftedL2MHA` is its F).
"""

from .lifted import ContractiveLiftedL2MHA, LiftedL2MHA
from .manybody import NeighbourhoodInteraction
from .mlp import LipschitzMLP
from .radial import RadialInteraction

__all__ = ["LipschitzMLP", "RadialInteraction", "NeighbourhoodInteraction", "LiftedL2MHA",
           "ContractiveLiftedL2MHA"]
