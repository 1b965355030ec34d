"""flowattn: invertible generative modelling with Lipschitz self-attention."""

from . import attention, lipschitz
from .attention import L2MHA, ContractiveL2MHA, DotProductMHA, ScaledCosineMHA

__version__ = "0.1.0"

__all__ = [
    "attention",
    "lipschitz",
    "DotProductMHA",
    "L2MHA",
    "ContractiveL2MHA",
    "ScaledCosineMHA",
    "__version__",
]
