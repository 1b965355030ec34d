"""Fig. 3 and App. I of Kim et al. (2021): numerical invertibility of x + c f(x), L2 vs DP."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..attention import L2MHA, DotProductMHA
from ..errors import InputError, InverseNotConverged
from ..flows.inverse import fixed_point_inverse
from .common import (
    Coefficients,
    Count,
    NonNegative,
    Positive,
    Positives,
    ReproResult,
    Sizes,
    finish_result,
    glorot_init_,
    new_figure,
    save_figure,
    uniform_sets,
)

__all__ = [
    "InvertibilityConfig",
    "fixed_point_errors",
    "make_attention",
    "run_invertibility",
    "ATTENTION_TYPES",
]

NAME = "invertibility"
ATTENTION_TYPES = ("l2", "dp")
LABELS = {"l2": "L2-MHA", "dp": "DP-MHA"}


@dataclass
class InvertibilityConfig:
    """Settings of the Fig. 3 / App. I reproduction.

    Attributes:
        sizes: (N, D) pairs (the paper: (64, 64); App. I adds other sizes).
        heads: attention heads (the paper: 8).
        batch: sets inverted together; the error is the maximum over all of them (the paper: 128).
        coeffs: the c of g(x) = x + c f(x) (the paper: 0.5, 0.7, 0.9).
        spreads: the other inputs are U[-spread, spread]; the paper gives no range.
        iterations: fixed-point iterations x <- y - c f(x).
        tol: tolerance of the library inverse run beside the recorded loop.
        seed: seed of the weights and inputs.
    """

    sizes: Sizes = ((64, 64),)
    heads: Count = 8
    batch: Count = 128
    coeffs: Coefficients = (0.5, 0.7, 0.9)
    spreads: Positives = (1.0, 3.0)
    iterations: Count = 50
    tol: Positive = 1e-6
    seed: NonNegative = 0


PRESETS = {
    "quick": dict(sizes=((16, 16),), heads=4, batch=8, spreads=(3.0,), iterations=25),
    "default": dict(),
    "full": dict(sizes=((64, 64), (16, 16), (128, 128)), iterations=100),
}


def make_attention(kind: str, dim: int, heads: int, generator: torch.Generator) -> torch.nn.Module:
    """Tied L2-MHA (``"l2"``) or DP-MHA (``"dp"``), Glorot-uniform weights, float64."""
    if kind == "l2":
        module = L2MHA(dim, heads, tied=True)
    elif kind == "dp":
        module = DotProductMHA(dim, heads)
    else:
        raise InputError(f"unknown attention {kind!r}: choose from {ATTENTION_TYPES}")
    return glorot_init_(module.to(torch.float64), generator).eval()


@torch.no_grad()
def fixed_point_errors(f: Callable[[Tensor], Tensor], x: Tensor, c: float, iterations: int):
    """Reconstruction error of the fixed-point inverse of g(x) = x + c f(x), per iteration.

    With y = g(x), iterates z_0 = y, z_{k+1} = y - c f(z_k) (Behrmann et al. 2019; Kim et al.
    2021, §4.1); entry k of the result is max |z_k - x| over the whole batch. Unlike
    :func:`flowattn.flows.inverse.fixed_point_inverse`, which stops at convergence or raises,
    this runs every iteration and records the error, diverging or not; once an iterate is not
    finite the remaining errors are ``inf``.

    Returns:
        list of ``iterations + 1`` floats.
    """
    y = x + c * f(x)
    z = y.clone()
    errors = [float((z - x).abs().max())]
    for _ in range(iterations):
        z = y - c * f(z)
        err = float((z - x).abs().max())
        if not math.isfinite(err):
            errors.extend([math.inf] * (iterations + 1 - len(errors)))
            break
        errors.append(err)
    return errors


def _library_inverse(module, x: Tensor, c: float, config: InvertibilityConfig) -> dict:
    """Run the library's fixed-point inverse: converged (iterations) or InverseNotConverged."""
    with torch.no_grad():
        y = x + c * module(x)
    try:
        _, stats = fixed_point_inverse(
            lambda z, mask: c * module(z, mask),
            y,
            tol=config.tol,
            max_iter=config.iterations,
            return_stats=True,
        )
    except InverseNotConverged as err:
        return {"library_inverse": "not converged", "library_residual": err.residual}
    return {"library_inverse": "converged", "library_iterations": int(stats["iterations"].max())}


def run_invertibility(
    config: InvertibilityConfig | None = None, out=None, grid: str = "custom"
) -> ReproResult:
    """Maximum reconstruction error of x + c f(x) against fixed-point iterations.

    Reproduces Fig. 3 (and the size sweep of App. I, Fig. 7) of Kim et al. (2021) with randomly
    initialised L2-MHA and DP-MHA, on inputs with x_1 = 0 and the other elements uniform.
    Writes ``invertibility.{png,csv,json}`` to ``out`` when given.

    Examples:
        >>> cfg = InvertibilityConfig(sizes=((8, 8),), heads=2, batch=2, spreads=(1.0,),
        ...                           coeffs=(0.5,), iterations=30)
        >>> result = run_invertibility(cfg)
        >>> result.summary["cases"][0]["final_error"] < 1e-8  # L2-MHA, c = 0.5
        True
    """
    config = config or InvertibilityConfig()
    if config.iterations < 1 or config.batch < 1:
        raise InputError("need iterations >= 1 and batch >= 1")
    for c in config.coeffs:
        if not c > 0:
            raise InputError(f"coefficients must be positive, got {c}")
    start = time.perf_counter()
    generator = torch.Generator().manual_seed(config.seed)
    rows, cases, curves = [], [], []
    for n, dim in config.sizes:
        modules = {
            kind: make_attention(kind, dim, config.heads, generator) for kind in ATTENTION_TYPES
        }
        for spread in config.spreads:
            x = uniform_sets(config.batch, n, dim, spread, generator)
            for kind, module in modules.items():
                for c in config.coeffs:
                    errors = fixed_point_errors(module, x, c, config.iterations)
                    below = [k for k, e in enumerate(errors) if e < 1e-5]
                    case = {
                        "n": n,
                        "dim": dim,
                        "spread": spread,
                        "attention": kind,
                        "c": c,
                        "initial_error": errors[0],
                        "final_error": errors[-1],
                        "min_error": min(errors),
                        "first_iteration_below_1e-5": below[0] if below else None,
                    }
                    case.update(_library_inverse(module, x, c, config))
                    cases.append(case)
                    curves.append((n, dim, spread, kind, c, errors))
                    rows.extend(
                        {
                            "n": n,
                            "dim": dim,
                            "spread": spread,
                            "attention": kind,
                            "c": c,
                            "iteration": k,
                            "max_error": e,
                        }
                        for k, e in enumerate(errors)
                    )
    summary = {
        "cases": cases,
        "l2_converged_below_1e-5": {
            _key(case): case["first_iteration_below_1e-5"] is not None
            for case in cases
            if case["attention"] == "l2"
        },
        "dp_min_error": {
            _key(case): case["min_error"] for case in cases if case["attention"] == "dp"
        },
    }
    return finish_result(NAME, grid, config, rows, summary, start, out,
                         lambda png: _plot(curves, config, png), rows_in_json=False)


def _key(case: dict) -> str:
    return f"N={case['n']} D={case['dim']} spread={case['spread']} c={case['c']}"


def _plot(curves, config: InvertibilityConfig, path) -> None:
    panels = [(n, d, s) for n, d in config.sizes for s in config.spreads]
    fig, axes = new_figure(len(panels), 2, width=3.8, height=2.7)
    for r, (n, d, s) in enumerate(panels):
        for col, kind in enumerate(ATTENTION_TYPES):
            ax = axes[r, col]
            for cn, cd, cs, ck, c, errors in curves:
                if (cn, cd, cs, ck) == (n, d, s, kind):
                    shown = [e if math.isfinite(e) else float("nan") for e in errors]
                    ax.semilogy(
                        range(len(errors)), [max(e, 1e-17) for e in shown], label=f"c = {c}"
                    )
            ax.set_title(f"{LABELS[kind]}, N = {n}, D = {d}, U[-{s:g}, {s:g}]", fontsize=9)
            ax.set_xlabel("fixed-point iterations")
            ax.set_ylabel("max reconstruction error")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    save_figure(fig, path)
