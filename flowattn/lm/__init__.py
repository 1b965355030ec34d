"""Character-level language models with Lipschitz, contractive and invertible self-attention.

The names below are imported on first use, so that ``flowattn.lm.config`` (and the command
line built from it) loads without torch.
"""

from __future__ import annotations

import importlib

__all__ = [
    "CharCorpus",
    "CharVocab",
    "LMConfig",
    "LMRunConfig",
    "LSTMLM",
    "TransformerLM",
    "build_model",
    "load_corpus",
    "train",
]

_WHERE = {"CharCorpus": "data", "CharVocab": "data", "load_corpus": "data",
          "LMConfig": "config", "LMRunConfig": "config", "LSTMLM": "model",
          "TransformerLM": "model", "build_model": "model", "train": "train"}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
