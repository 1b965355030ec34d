"""Self-attention modules for sets and sequences, with certified Lipschitz bounds where they exist.

All modules are batch-first and share one call signature, ``forward(x, mask=None, causal=False)``
with ``x`` of shape (B, N, D) and ``mask`` a bool (B, N) tensor, True where an element is present.
Modules with a certified bound expose it as ``lipschitz_bound(n, ...)`` (the contractive ones,
``ContractiveL2MHA`` and ``ContractiveScaledCosineMHA``, are certified below a coefficient c < 1
and serve as residual branches of invertible flows). Every module also gives
its attention matrices, ``attention_probabilities(x, mask=None, causal=False)`` (B, H, N, N), its
projection weight matrices with their roles, ``projections()`` (a list of :class:`Projection`),
and the kind of its logits, ``similarity``.

Every module computes its attention with :func:`~flowattn.attention.kernels.attend`: PyTorch's
fused kernels where they can serve, and derivatives of every order without any setting --
double backward, ``torch.autograd.functional.jacobian(..., create_graph=True)``,
``torch.func.jacrev`` and ``hessian`` (see :mod:`flowattn.attention.kernels`).
"""

from .contractive import frozen_certificates, shared_certificates
from .cosine import ContractiveScaledCosineMHA, ScaledCosineMHA
from .dot_product import DotProductMHA
from .induced import ContractiveInducedL2MHA, InducedL2MHA
from .l2 import L2MHA, ContractiveL2MHA
from .projections import Projection

__all__ = [
    "DotProductMHA",
    "L2MHA",
    "ContractiveL2MHA",
    "InducedL2MHA",
    "ContractiveInducedL2MHA",
    "ScaledCosineMHA",
    "ContractiveScaledCosineMHA",
    "Projection",
    "frozen_certificates",
    "shared_certificates",
]
