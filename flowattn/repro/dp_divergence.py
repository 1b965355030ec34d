"""App. K of Kim et al. (2021): ||J||_inf of DP-MHA grows without bound under optimisation of X."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..errors import InputError
from ..lipschitz import jacobian_norm
from .common import (
    Count,
    NonNegative,
    Positive,
    ReproResult,
    finish_result,
    log_slope,
    new_figure,
    save_figure,
)
from .invertibility import LABELS, make_attention

__all__ = ["DivergenceConfig", "jacobian_norm_ascent", "run_dp_divergence"]

NAME = "dp-divergence"


@dataclass
class DivergenceConfig:
    """Settings of the App. K reproduction.

    Attributes:
        n: set size N.
        dim: model width D.
        heads: attention heads H.
        restarts: initial inputs, each optimised for both attentions (App. H initialisation:
            c ~ U[0, 10], X_ij ~ U[-c, c]).
        steps: Adam steps on -||J_f(X)||_inf.
        lr: Adam learning rate (App. H: 0.1).
        seed: seed of the weights and inputs.
    """

    n: Count = 8
    dim: Count = 4
    heads: Count = 2
    restarts: Count = 3
    steps: Count = 300
    lr: Positive = 0.1
    seed: NonNegative = 0


PRESETS = {
    "quick": dict(n=4, dim=2, heads=1, restarts=1, steps=80),
    "default": dict(),
    "full": dict(n=16, dim=8, heads=2, restarts=5, steps=1000),
}


def jacobian_norm_ascent(module: nn.Module, x0: Tensor, steps: int, lr: float) -> list[float]:
    """||J_f(X)||_inf along Adam ascent on X from ``x0`` (N, D), for f = ``module`` on one set.

    The Jacobian is the full (N D) x (N D) matrix of :func:`flowattn.lipschitz.jacobian_norm`,
    differentiated once more (on the composite attention kernel) for the ascent direction.

    Returns:
        the norm before each step and after the last: ``steps + 1`` floats.
    """
    x = x0.detach().clone().requires_grad_(True)
    optimiser = torch.optim.Adam([x], lr=lr)

    def f(z: Tensor) -> Tensor:
        return module(z.unsqueeze(0)).squeeze(0)

    values = []
    for step in range(steps + 1):
        value = jacobian_norm(f, x, "inf", create_graph=step < steps)
        values.append(float(value.detach()))
        if step == steps:
            break
        optimiser.zero_grad()
        (-value).backward()
        optimiser.step()
    return values


def run_dp_divergence(
    config: DivergenceConfig | None = None, out=None, grid: str = "custom"
) -> ReproResult:
    """Maximise ||J_f(X)||_inf over X for DP-MHA and tied L2-MHA with the same inputs.

    Reproduces Fig. 9 of Kim et al. (2021, App. K), with randomly initialised (Glorot) rather
    than trained weights: the DP norm keeps growing (Thm 3.1), the L2 norm levels off below its
    certificate (Thm 3.2). Writes ``dp_divergence.{png,csv,json}`` to ``out`` when given.

    Examples:
        >>> cfg = DivergenceConfig(n=3, dim=2, heads=1, restarts=1, steps=5)
        >>> result = run_dp_divergence(cfg)
        >>> result.summary["l2_below_bound"]
        True
    """
    config = config or DivergenceConfig()
    if config.n < 2 or config.restarts < 1 or config.steps < 1:
        raise InputError("need n >= 2, restarts >= 1 and steps >= 1")
    start = time.perf_counter()
    generator = torch.Generator().manual_seed(config.seed)
    modules = {k: make_attention(k, config.dim, config.heads, generator) for k in ("dp", "l2")}
    with torch.no_grad():
        l2_bound = float(modules["l2"].lipschitz_bound(config.n, "inf", method="thm3.2"))
    rows, traces, restarts = [], {}, []
    for r in range(config.restarts):
        c = 10 * torch.rand((), generator=generator, dtype=torch.float64)
        x0 = (
            2 * torch.rand(config.n, config.dim, generator=generator, dtype=torch.float64) - 1
        ) * c
        for kind, module in modules.items():
            traces[kind, r] = jacobian_norm_ascent(module, x0, config.steps, config.lr)
        dp, l2 = traces["dp", r], traces["l2", r]
        restarts.append(_restart_summary(r, float(c), dp, l2, l2_bound))
        rows.extend(
            {"restart": r, "step": k, "dp_norm": dp[k], "l2_norm": l2[k]}
            for k in range(config.steps + 1)
        )
    summary = {
        "l2_bound": l2_bound,
        "l2_below_bound": all(s["l2_max"] <= l2_bound for s in restarts),
        "dp_max": max(s["dp_max"] for s in restarts),
        "dp_max_over_initial": max(s["dp_max_over_initial"] for s in restarts),
        "dp_exceeds_l2_bound": any(s["dp_max"] > l2_bound for s in restarts),
        "restarts": restarts,
    }
    return finish_result(NAME, grid, config, rows, summary, start, out,
                         lambda png: _plot(traces, l2_bound, config, png), rows_in_json=False)


def _restart_summary(r: int, c: float, dp: list[float], l2: list[float], bound: float) -> dict:
    steps = len(dp) - 1
    running, best = [], -math.inf
    for v in dp:
        best = max(best, v)
        running.append(best)
    # growth per step of the best norm so far; on a log scale a straight line is exponential
    half = steps // 2
    late = (running[-1] - running[half]) / max(steps - half, 1)
    crossing = next((k for k, v in enumerate(dp) if v > bound), None)
    return {
        "restart": r,
        "c": c,
        "dp_initial": dp[0],
        "dp_final": dp[-1],
        "dp_max": running[-1],
        "dp_max_over_initial": running[-1] / dp[0],
        "dp_growth_per_step": (running[-1] - dp[0]) / steps,
        "dp_growth_per_step_second_half": late,
        # k in ||J|| ~ t^k over the second half: polynomial, not exponential, growth
        "dp_growth_exponent": log_slope(
            list(range(max(half, 1), steps + 1)), [math.log(v) for v in running[max(half, 1) :]]
        ),
        "dp_first_step_above_l2_bound": crossing,
        "l2_initial": l2[0],
        "l2_final": l2[-1],
        "l2_max": max(l2),
    }


def _plot(traces: dict, bound: float, config: DivergenceConfig, path) -> None:
    fig, axes = new_figure(width=5.2, height=3.6)
    ax = axes[0, 0]
    for r in range(config.restarts):
        ax.semilogy(traces["dp", r], color="C3", alpha=0.8, label=LABELS["dp"] if r == 0 else None)
        ax.semilogy(
            traces["l2", r],
            color="C0",
            alpha=0.8,
            label=LABELS["l2"] + " (tied)" if r == 0 else None,
        )
    ax.axhline(bound, color="C0", ls="--", label="L2-MHA certificate (Thm 3.2)")
    ax.set_xlabel("Adam steps on X")
    ax.set_ylabel(r"$\|J_f(X)\|_\infty$")
    ax.set_title(
        f"N = {config.n}, D = {config.dim}, H = {config.heads}, random weights", fontsize=9
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path)
