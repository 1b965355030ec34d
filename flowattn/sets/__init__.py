"""Density estimation on sets, end to end: settings, training, evaluation, sampling, plots.

The names below are imported on first use, so that ``flowattn.sets.config`` (and the command
line built from it) loads without torch.
"""

from __future__ import annotations

import importlib

__all__ = ["SetsRunConfig", "build_flow", "fit", "evaluate", "load_flow"]

_WHERE = {"SetsRunConfig": "config", "build_flow": "config", "fit": "train",
          "evaluate": "train", "load_flow": "train"}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
