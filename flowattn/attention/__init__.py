"""Self-attention modules for sets and sequences, with certified Lipschitz bounds where they exist.

All modules are batch-first and share one call signature, ``forward(x, mask=None, causal=False)``
with ``x`` of shape (B, N, D) and ``mask`` a bool (B, N) tensor, True where an element is present.
Modules with a certified bound expose it as ``lipschitz_bound(n, ...)``.
"""

from .cosine import ScaledCosineMHA
from .dot_product import DotProductMHA
from .l2 import ContractiveL2MHA, L2MHA

__all__ = ["DotProductMHA", "L2MHA", "ContractiveL2MHA", "ScaledCosineMHA"]
