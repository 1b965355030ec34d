"""flowattn: invertible generative modelling with Lipschitz self-attention.

Subpackages (``flowattn.attention``, ``flowattn.flows``, ...) and the convenience names below
are imported on first use: ``import flowattn`` alone loads no torch.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_SUBMODULES = ("attention", "branches", "data", "errors", "flows", "lipschitz", "lm", "nn",
               "repro", "sets", "training")
_NAMES = {"DotProductMHA": "attention", "L2MHA": "attention", "ContractiveL2MHA": "attention",
          "ScaledCosineMHA": "attention"}

__all__ = [*_SUBMODULES, *_NAMES, "__version__"]


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _NAMES:
        return getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
