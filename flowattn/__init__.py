"""flowattn: invertible generative modelling with Lipschitz self-attention.

The package is a thin namespace: ``import flowattn`` loads no subpackage (and not torch), and
each of ``flowattn.attention``, ``flowattn.flows``, ``flowattn.branches``, ... is imported on
first access. The convenience names ``flowattn.L2MHA`` and friends resolve the same way.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_SUBPACKAGES = (
    "attention",
    "branches",
    "cli",
    "data",
    "errors",
    "flows",
    "lipschitz",
    "lm",
    "repro",
    "sets",
    "training",
    "validation",
)
# convenience name -> the subpackage that defines it
_NAMES = {
    "DotProductMHA": "attention",
    "L2MHA": "attention",
    "ContractiveL2MHA": "attention",
    "ScaledCosineMHA": "attention",
    "ContractiveScaledCosineMHA": "attention",
}

__all__ = [
    "attention",
    "lipschitz",
    "DotProductMHA",
    "L2MHA",
    "ContractiveL2MHA",
    "ScaledCosineMHA",
    "ContractiveScaledCosineMHA",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _NAMES:
        value = getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_SUBPACKAGES) | set(_NAMES))
