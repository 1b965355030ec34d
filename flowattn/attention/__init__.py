"""Self-attention modules for sets and sequences, with certified Lipschitz bounds where they exist.

All modules are batch-first and share one call signature, ``forward(x, mask=None, causal=False)``
with ``x`` of shape (B, N, D) and ``mask`` a bool (B, N) tensor, True where an element is present.
Modules with a certified bound expose it as ``lipschitz_bound(n, ...)`` (the contractive ones,
``ContractiveL2MHA`` and ``ContractiveScaledCosineMHA``, are certified below a coefficient c < 1
and serve as residual branches of invertible flows). Every module also gives
its attention matrices, ``attention_probabilities(x, mask=None, causal=False)`` (B, H, N, N), its
projection weight matrices with their roles, ``projections()`` (a list of :class:`Projection`),
and the kind of its logits, ``similarity``.

The fused CPU attention kernels cannot be differentiated twice: code that differentiates a
derivative through these modules (Hutchinson log-det training, CNF divergences, Jacobian-norm
optimisation) runs them inside ``with twice_differentiable():``.
"""

from .cosine import ContractiveScaledCosineMHA, ScaledCosineMHA
from .dot_product import DotProductMHA
from .kernels import twice_differentiable
from .l2 import L2MHA, ContractiveL2MHA
from .projections import Projection

__all__ = [
    "DotProductMHA",
    "L2MHA",
    "ContractiveL2MHA",
    "ScaledCosineMHA",
    "ContractiveScaledCosineMHA",
    "Projection",
    "twice_differentiable",
]
