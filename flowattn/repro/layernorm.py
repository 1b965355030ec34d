"""App. N of Kim et al. (2021): the LayerNorm Lipschitz bound against measured Jacobian norms."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..errors import InputError
from ..lipschitz import jacobian_norm, layernorm_lipschitz_bound, lipschitz_lower_bound
from .common import (
    Count,
    Counts,
    NonNegative,
    Positive,
    ReproResult,
    finish_result,
    new_figure,
    save_figure,
)

__all__ = ["LayerNormConfig", "conjectured_layernorm_bound", "run_layernorm"]

NAME = "layernorm"
MEASUREMENTS = ("flat", "random", "random_small", "optimised", "optimised_small")


@dataclass
class LayerNormConfig:
    """Settings of the App. N reproduction.

    Attributes:
        dims: feature widths D.
        eps: LayerNorm's epsilon (PyTorch's default 1e-5).
        samples: random inputs per distribution.
        restarts: initialisations of the input optimisation.
        steps: Adam steps per initialisation.
        lr: Adam learning rate (App. H: 0.1).
        seed: seed of the inputs.
    """

    dims: Counts = (2, 3, 4, 8, 16, 32, 64)
    eps: Positive = 1e-5
    samples: Count = 100
    restarts: Count = 4
    steps: Count = 150
    lr: Positive = 0.1
    seed: NonNegative = 0


PRESETS = {
    "quick": dict(dims=(3, 8), samples=20, restarts=2, steps=40),
    "default": dict(),
    "full": dict(dims=(2, 3, 4, 8, 16, 32, 64, 128, 256), samples=1000, restarts=10, steps=500),
}


def conjectured_layernorm_bound(weight: Tensor | None, dim: int, eps: float) -> float:
    """eps^{-1/2} max|gamma| 4 (D - 1) / D: App. N's bound with its conjectured maximum.

    App. N proves ||Cov(x)||_inf / sigma^2 <= D (D - 2) and conjectures that the maximum is
    2 (D - 1); with it the bound's second term equals its first, 2 (D - 1) / D. Not a
    certificate: the conjecture is unproven.
    """
    gamma = 1.0 if weight is None else float(weight.detach().abs().max())
    return gamma * eps**-0.5 * 4 * (dim - 1) / dim


def _max_random_norm(f, shape, samples: int, scale: float, generator) -> float:
    best = -math.inf
    for _ in range(samples):
        x = scale * torch.randn(shape, generator=generator, dtype=torch.float64)
        best = max(best, float(jacobian_norm(f, x, "inf")))
    return best


def run_layernorm(
    config: LayerNormConfig | None = None, out=None, grid: str = "custom"
) -> ReproResult:
    """Measured ||J_LN(x)||_inf against the App. N certificate, for each width D.

    Five measurements per D: the norm at a constant input, the largest norm over random
    inputs x ~ N(0, I) and over x ~ N(0, eps I), and the best norm reached by optimising x
    (App. H procedure, :func:`flowattn.lipschitz.lipschitz_lower_bound`) from the App. H
    initialisation and at input scale sqrt(eps). The Jacobian norm peaks for inputs whose
    variance is of order eps, where Adam's step of 0.1 is far too coarse, so the second
    optimisation works on u with x = sqrt(eps) u (the Jacobian of u -> LN(sqrt(eps) u) /
    sqrt(eps) is J_LN(x)). Writes ``layernorm.{png,csv,json}`` to ``out`` when given.

    Examples:
        >>> result = run_layernorm(LayerNormConfig(dims=(3,), samples=2, restarts=1, steps=5))
        >>> result.summary["measured_below_bound"]
        True
    """
    config = config or LayerNormConfig()
    if min(config.dims) < 2 or config.eps <= 0 or config.samples < 1 or config.restarts < 1:
        raise InputError("need every D >= 2, eps > 0, samples >= 1 and restarts >= 1")
    start = time.perf_counter()
    generator = torch.Generator().manual_seed(config.seed)
    small = math.sqrt(config.eps)
    rows = []
    for dim in config.dims:
        norm = nn.LayerNorm(dim, eps=config.eps).to(torch.float64)
        shape = (1, dim)  # one element of D features: the map LN acts on

        def rescaled(u: Tensor, norm=norm) -> Tensor:
            return norm(small * u) / small

        optimised, _ = lipschitz_lower_bound(
            norm, shape, "inf", config.restarts, config.steps, config.lr, generator
        )
        optimised_small, _ = lipschitz_lower_bound(
            rescaled, shape, "inf", config.restarts, config.steps, config.lr, generator
        )
        row = {
            "dim": dim,
            "bound": float(layernorm_lipschitz_bound(norm.weight, dim, config.eps, "inf")),
            "conjectured": conjectured_layernorm_bound(norm.weight, dim, config.eps),
            # as sigma -> 0, J -> eps^{-1/2} (I - 11^T / D), whose norm is 2 (D - 1) / D
            "flat_input_limit": config.eps**-0.5 * 2 * (dim - 1) / dim,
            # measured at a constant input (sigma = 0), where that limit is attained
            "flat": float(jacobian_norm(norm, torch.zeros(shape, dtype=torch.float64), "inf")),
            "random": _max_random_norm(norm, shape, config.samples, 1.0, generator),
            "random_small": _max_random_norm(norm, shape, config.samples, small, generator),
            "optimised": optimised,
            "optimised_small": optimised_small,
        }
        row["measured"] = max(row[k] for k in MEASUREMENTS)
        row["bound_over_measured"] = row["bound"] / row["measured"]
        rows.append(row)
    summary = {
        "eps": config.eps,
        # at D = 2 the bound is attained (by constant inputs): allow for the last bit
        "measured_below_bound": all(r["measured"] <= r["bound"] * (1 + 1e-12) for r in rows),
        "measured_below_conjectured": all(r["measured"] <= r["conjectured"] for r in rows),
        "bound_over_measured": {str(r["dim"]): r["bound_over_measured"] for r in rows},
        "measured_over_flat_limit": {
            str(r["dim"]): r["measured"] / r["flat_input_limit"] for r in rows
        },
    }
    return finish_result(NAME, grid, config, rows, summary, start, out,
                         lambda png: _plot(rows, config, png))


def _plot(rows: list[dict], config: LayerNormConfig, path) -> None:
    fig, axes = new_figure(width=7.6, height=3.6)
    ax = axes[0, 0]
    dims = [r["dim"] for r in rows]
    unit = config.eps**-0.5
    ax.plot(
        dims,
        [r["bound"] / unit for r in rows],
        "o-",
        color="C3",
        label="bound (App. N), $(D^2-2)/D$",
    )
    ax.plot(
        dims,
        [r["conjectured"] / unit for r in rows],
        "--",
        color="C3",
        label="with the conjectured maximum, $4(D-1)/D$",
    )
    markers = {
        "flat": ("k", "o", "constant input ($\\sigma = 0$)"),
        "optimised_small": ("C0", "s", r"optimised at scale $\sqrt{\epsilon}$"),
        "optimised": ("C2", "^", "optimised, App. H initialisation"),
        "random_small": ("C1", "x", r"random, $x \sim N(0, \epsilon I)$"),
        "random": ("C4", "+", r"random, $x \sim N(0, I)$"),
    }
    for key, (color, marker, label) in markers.items():
        ax.plot(dims, [r[key] / unit for r in rows], marker, color=color, ls="none", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("D")
    ax.set_ylabel(r"$\|J_{LN}(x)\|_\infty \;/\; \epsilon^{-1/2}$")
    ax.set_title(f"LayerNorm, eps = {config.eps:g}, gamma = 1", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    save_figure(fig, path)
