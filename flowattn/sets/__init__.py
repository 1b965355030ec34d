"""Density estimation on sets, end to end: settings, training, evaluation, sampling, plots."""

from .config import SetsConfig, build_flow
from .train import evaluate, fit, load_flow

__all__ = ["SetsConfig", "build_flow", "fit", "evaluate", "load_flow"]
