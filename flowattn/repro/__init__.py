"""Reproductions of the experiments of Kim, Papamakarios & Mnih (2021): a PNG, a CSV, a JSON.

Every reproduction runs on one of three grids: ``"quick"`` (seconds; what the tests run),
``"default"`` (minutes on a laptop CPU) and ``"full"`` (the paper's settings where they are
known). From a shell: ``flowattn repro bound-tightness --out repro``; from Python:

    >>> from flowattn.repro import run_reproduction
    >>> result = run_reproduction("layernorm", grid="quick")  # doctest: +SKIP
    >>> result.summary["measured_below_bound"]  # doctest: +SKIP
    True
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import InputError

__all__ = ["Reproduction", "REPRODUCTIONS", "GRIDS", "run_reproduction"]

GRIDS = ("quick", "default", "full")


@dataclass(frozen=True)
class Reproduction:
    """One reproducible experiment.

    Attributes:
        name: the command-line name.
        paper: which figure or table of the paper it reproduces.
        description: one line on what it shows.
        module: the module of ``flowattn.repro`` that holds it, imported on first use (the
            command line lists the reproductions without importing torch).
        config_name: its configuration dataclass, in that module.
        run_name: ``run(config, out, grid) -> ReproResult``, in that module.
    """

    name: str
    paper: str
    description: str
    module: str
    config_name: str
    run_name: str

    def _module(self) -> Any:
        return importlib.import_module(f"{__name__}.{self.module}")

    @property
    def config(self) -> type:
        """The configuration dataclass."""
        return getattr(self._module(), self.config_name)

    @property
    def presets(self) -> dict:
        """Field values of the ``quick``, ``default`` and ``full`` grids."""
        return self._module().PRESETS

    @property
    def run(self) -> Callable[..., Any]:
        """``run(config, out, grid) -> ReproResult``."""
        return getattr(self._module(), self.run_name)


REPRODUCTIONS: dict[str, Reproduction] = {
    r.name: r
    for r in (
        Reproduction(
            "bound-tightness",
            "Fig. 2, App. H",
            "Lip_inf of L2-MHA: Thm 3.2 bound against an optimised lower bound",
            "bound_tightness",
            "BoundTightnessConfig",
            "run_bound_tightness",
        ),
        Reproduction(
            "invertibility",
            "Fig. 3, App. I",
            "fixed-point inversion of x + c f(x) for L2-MHA and DP-MHA",
            "invertibility",
            "InvertibilityConfig",
            "run_invertibility",
        ),
        Reproduction(
            "histograms",
            "Fig. 5",
            "spread of the outputs of L2-MHA and DP-MHA on the same inputs",
            "histograms",
            "HistogramConfig",
            "run_histograms",
        ),
        Reproduction(
            "runtime",
            "App. E, Table 2",
            "wall-clock cost of L2 against dot-product attention",
            "runtime",
            "RuntimeConfig",
            "run_runtime",
        ),
        Reproduction(
            "dp-divergence",
            "App. K, Fig. 9",
            "the Jacobian norm of DP-MHA grows without bound under optimisation",
            "dp_divergence",
            "DivergenceConfig",
            "run_dp_divergence",
        ),
        Reproduction(
            "layernorm",
            "App. N",
            "the LayerNorm Lipschitz bound against measured Jacobian norms",
            "layernorm",
            "LayerNormConfig",
            "run_layernorm",
        ),
    )
}


def run_reproduction(
    name: str,
    grid: str = "default",
    out: str | os.PathLike | None = None,
    seed: int | None = None,
    **overrides,
) -> Any:
    """Run reproduction ``name`` on ``grid``; write its files to ``out`` when given.

    Arguments:
        name: a key of ``REPRODUCTIONS``.
        grid: ``"quick"``, ``"default"`` or ``"full"``.
        out: folder for ``NAME.png``, ``NAME.csv`` and ``NAME.json``, NAME with ``-`` as
            ``_`` (created if needed).
        seed: replaces the grid's seed.
        overrides: configuration fields to change (e.g. ``ns=(100, 1000)``).
    """
    if name not in REPRODUCTIONS:
        raise InputError(f"unknown reproduction {name!r}: choose from {', '.join(REPRODUCTIONS)}")
    from .common import grid_config

    repro = REPRODUCTIONS[name]
    config = grid_config(repro.config, repro.presets, grid, seed, overrides)
    if out is not None:  # an unusable folder is refused before the work, not after it
        from ..training.run import prepare_out_dir

        prepare_out_dir(out)
    return repro.run(config, out, grid if not overrides else "custom")
