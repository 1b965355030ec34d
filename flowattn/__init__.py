"""flowattn: invertible generative modelling with Lipschitz self-attention."""

from . import attention, lipschitz
from .attention import ContractiveL2MHA, DotProductMHA, L2MHA, ScaledCosineMHA

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
