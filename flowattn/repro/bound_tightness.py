"""Fig. 2 of Kim et al. (2021): the Lip_inf bound of L2-MHA against an optimised lower bound."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from ..attention import L2MHA
from ..attention.dot_product import split_heads
from ..errors import InputError
from ..lipschitz import jacobian_norm, lambertw0
from .common import (
    Count,
    Counts,
    NonNegative,
    Positive,
    ReproResult,
    finish_result,
    log_slope,
    new_figure,
    save_figure,
)

__all__ = [
    "BoundTightnessConfig",
    "identity_l2_attention",
    "attention_row",
    "row_jacobian_norm",
    "maximise_row_jacobian_norm",
    "run_bound_tightness",
]

NAME = "bound-tightness"


@dataclass
class BoundTightnessConfig:
    """Settings of the Fig. 2 reproduction (App. H procedure).

    Attributes:
        ns: sequence lengths N.
        dim: model width D (the paper: 1).
        heads: number of heads H (the paper: 1).
        restarts: random initialisations of X per N (the paper: 50).
        steps: Adam steps per initialisation (the paper: "till convergence").
        lr: Adam learning rate (the paper: 0.1).
        c_max: X_ij ~ U[-c, c] with c ~ U[0, c_max] (the paper: 10).
        top: how many of the best restarts are drawn and stored (the paper: 5).
        full_jacobian_max_n: also evaluate the full (N D) x (N D) Jacobian at the best input
            for N up to this (a check of the row computation; memory grows like N^3).
        seed: seed of the initialisations.
    """

    ns: Counts = (100, 200, 300, 500, 700, 1000)
    dim: Count = 1
    heads: Count = 1
    restarts: Count = 50
    steps: Count = 500
    lr: Positive = 0.1
    c_max: Positive = 10.0
    top: Count = 5
    full_jacobian_max_n: NonNegative = 200
    seed: NonNegative = 0


PRESETS = {
    "quick": dict(ns=(8, 16, 32), restarts=4, steps=60, full_jacobian_max_n=32),
    "default": dict(),
    "full": dict(ns=tuple(range(100, 1001, 100)), restarts=50, steps=2000),
}


def identity_l2_attention(dim: int = 1, heads: int = 1, dtype=torch.float64) -> L2MHA:
    """Tied L2-MHA with W^Q = W^V = W^O = I, the module of Kim et al. (2021, §5.1, App. H).

    Examples:
        >>> attn = identity_l2_attention()
        >>> round(attn.lipschitz_bound(2, method="thm3.2").item(), 6)  # 4 W0(1/e) + 1
        2.113858
    """
    attn = L2MHA(dim, heads, tied=True).to(dtype)
    with torch.no_grad():
        for w in (attn.w_q, attn.w_v, attn.w_o):
            w.copy_(torch.eye(dim, dtype=dtype))
    return attn


def attention_row(attn: L2MHA, x: Tensor, i: int = 0) -> Tensor:
    r"""Output row i of tied L2-MHA for every set of ``x`` (B, N, D), in O(N D) per set.

    The module computes all N rows (O(N^2 D)); bounding one row of the Jacobian needs only
    f_i(X) = [P^h_{i:} X A_h W^{V,h}]_h W^O with P^h_{ij} \propto exp(-||q_i - q_j||^2/sqrt(d))
    (Kim et al. 2021, eq. (8)), which this evaluates with the module's own weights.

    Returns:
        (B, D) tensor, equal to ``attn(x)[:, i]``.
    """
    if not attn.tied:
        raise InputError("attention_row needs tied L2 attention (W^K = W^Q)")
    if x.dim() != 3 or x.shape[-1] != attn.dim:
        raise InputError(f"x must have shape (B, N, {attn.dim}), got {tuple(x.shape)}")
    if not -x.shape[1] <= i < x.shape[1]:
        raise InputError(f"row {i} is out of range for sets of {x.shape[1]} elements")
    i = i % x.shape[1]
    scale = math.sqrt(attn.head_dim)
    q = split_heads(x @ attn.w_q, attn.heads)  # (B, H, N, d)
    logits = -(q[:, :, i : i + 1] - q).pow(2).sum(-1) / scale  # (B, H, N)
    p = torch.softmax(logits, dim=-1)
    wq, wv = attn.head_weights(attn.w_q), attn.head_weights(attn.w_v)
    v = q @ (wq.transpose(1, 2) @ wv) / scale  # X A_h W^{V,h}, (B, H, N, d)
    heads = (p.unsqueeze(-2) @ v).squeeze(-2)  # (B, H, d)
    return heads.reshape(x.shape[0], attn.dim) @ attn.w_o


def row_jacobian_norm(attn: L2MHA, x: Tensor, i: int = 0, create_graph: bool = False) -> Tensor:
    """Largest absolute row sum of the Jacobian rows of output element i, per set: (B,).

    The rows of d vec f(X) / d vec X belonging to f_i are D of the N D rows, so this is a lower
    bound on ||J_f(X)||_inf; by permutation equivariance its supremum over X equals
    sup_X ||J_f(X)||_inf (any maximising row can be moved to position i).
    """
    with torch.enable_grad():
        if not x.requires_grad:
            x = x.detach().requires_grad_(True)
        out = attention_row(attn, x, i)
        norms = []
        for a in range(attn.dim):
            # sets are independent, so the gradient of the batch sum is each set's own gradient
            (grad,) = torch.autograd.grad(
                out[:, a].sum(), x, create_graph=create_graph, retain_graph=True
            )
            norms.append(grad.abs().sum(dim=(1, 2)))
    return torch.stack(norms, dim=-1).amax(dim=-1)


def maximise_row_jacobian_norm(
    attn: L2MHA,
    n: int,
    restarts: int,
    steps: int,
    lr: float = 0.1,
    c_max: float = 10.0,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Lower bounds on Lip_inf(attn) for sets of n elements by the App. H procedure.

    Each restart draws c ~ U[0, c_max] and X_ij ~ U[-c, c], then runs Adam (learning rate
    ``lr``) on -||J_{f_0}(X)||_1 (:func:`row_jacobian_norm`). All restarts form one batch: the
    loss is a sum of independent terms and Adam acts element-wise, so this is exactly
    ``restarts`` independent runs. :func:`flowattn.lipschitz.lipschitz_lower_bound` does the
    same with the full Jacobian, whose cost grows like N^3 and is out of reach at N = 1000.

    Returns:
        (best value reached by each restart (R,), the input where it was reached (R, N, D)).
    """
    w = attn.w_q
    if generator is None:
        generator = torch.Generator().manual_seed(0)
    c = c_max * torch.rand(restarts, 1, 1, generator=generator, dtype=w.dtype)
    x0 = (2 * torch.rand(restarts, n, attn.dim, generator=generator, dtype=w.dtype) - 1) * c
    x = x0.to(w.device).requires_grad_(True)
    best = torch.full((restarts,), -math.inf, dtype=w.dtype, device=w.device)
    best_x = x.detach().clone()
    optimiser = torch.optim.Adam([x], lr=lr)
    for _ in range(steps + 1):  # the last pass only records the final iterate
        value = row_jacobian_norm(attn, x, 0, create_graph=True)
        with torch.no_grad():
            better = value > best
            best = torch.where(better, value, best)
            best_x[better] = x[better]
        optimiser.zero_grad()
        (-value.sum()).backward()
        optimiser.step()
    return best.detach(), best_x


def printed_bound(attn: L2MHA, n: int) -> float:
    """Thm 3.2 as printed, with W0(N/e) for phi^{-1}(N-1): valid, slightly looser."""
    with torch.no_grad():
        exact = float(attn.lipschitz_bound(n, "inf", method="thm3.2"))
    inv_d = attn.head_dim**-0.5
    w_exact = float(lambertw0(torch.tensor((n - 1) / math.e, dtype=torch.float64)))
    w_printed = float(lambertw0(torch.tensor(n / math.e, dtype=torch.float64)))
    return exact * (4 * w_printed + inv_d) / (4 * w_exact + inv_d)


def run_bound_tightness(
    config: BoundTightnessConfig | None = None, out=None, grid: str = "custom"
) -> ReproResult:
    """Upper bound (Thm 3.2) and optimised lower bound of Lip_inf of L2-MHA for each N.

    Reproduces Fig. 2 of Kim et al. (2021): H = D = 1, W^Q = W^V = W^O = I, inputs optimised
    as in App. H. Writes ``bound_tightness.{png,csv,json}`` to ``out`` when given.

    Examples:
        >>> cfg = BoundTightnessConfig(ns=(4, 8), restarts=2, steps=10)
        >>> result = run_bound_tightness(cfg)
        >>> result.summary["upper_above_lower_everywhere"]
        True
    """
    config = config or BoundTightnessConfig()
    if min(config.ns) < 2 or config.restarts < 1 or config.steps < 0 or config.top < 1:
        raise InputError("need every N >= 2, restarts >= 1, steps >= 0 and top >= 1")
    start = time.perf_counter()
    attn = identity_l2_attention(config.dim, config.heads)
    generator = torch.Generator().manual_seed(config.seed)
    rows = []
    for n in config.ns:
        best, best_x = maximise_row_jacobian_norm(
            attn, n, config.restarts, config.steps, config.lr, config.c_max, generator
        )
        order = torch.argsort(best, descending=True)
        top = [float(best[k]) for k in order[: config.top]]
        with torch.no_grad():
            upper = float(attn.lipschitz_bound(n, "inf", method="thm3.2"))
        row = {
            "n": n,
            "upper_bound": upper,
            "upper_bound_printed": printed_bound(attn, n),
            "lower_bound": top[0],
            "lower_over_upper": top[0] / upper,
            "full_jacobian_norm": math.nan,
        }
        row.update({f"lower_top{k + 1}": v for k, v in enumerate(top)})
        if n <= config.full_jacobian_max_n:
            x_star = best_x[order[0]]
            f = lambda z: attn(z.unsqueeze(0)).squeeze(0)  # noqa: E731
            row["full_jacobian_norm"] = float(jacobian_norm(f, x_star, "inf"))
        rows.append(row)
    ns = [r["n"] for r in rows]
    checked = [r for r in rows if math.isfinite(r["full_jacobian_norm"])]
    summary = {
        "upper_above_lower_everywhere": all(r["upper_bound"] >= r["lower_bound"] for r in rows),
        # the optimised row is one row of the full Jacobian: its norm can only be larger
        "full_jacobian_at_least_row": all(
            r["full_jacobian_norm"] >= r["lower_bound"] * (1 - 1e-12) for r in checked
        ),
        "upper_slope_per_log_n": log_slope(ns, [r["upper_bound"] for r in rows]),
        "lower_slope_per_log_n": log_slope(ns, [r["lower_bound"] for r in rows]),
        "lower_over_upper": {str(r["n"]): r["lower_over_upper"] for r in rows},
    }
    return finish_result(NAME, grid, config, rows, summary, start, out,
                         lambda png: _plot(rows, config, png))


def _plot(rows: list[dict], config: BoundTightnessConfig, path) -> None:
    fig, axes = new_figure(width=5.2, height=3.6)
    ax = axes[0, 0]
    ns = [r["n"] for r in rows]
    ax.plot(
        ns,
        [r["upper_bound"] for r in rows],
        "o-",
        color="C3",
        label="upper bound (Thm 3.2, $W_0((N-1)/e)$)",
    )
    ax.plot(
        ns,
        [r["upper_bound_printed"] for r in rows],
        ":",
        color="C3",
        label="upper bound as printed ($W_0(N/e)$)",
    )
    for k in range(config.top):
        key = f"lower_top{k + 1}"
        ax.plot(
            [r["n"] for r in rows if key in r],
            [r[key] for r in rows if key in r],
            ".",
            color="C0",
            alpha=0.6,
            label=f"lower bound (top {config.top})" if k == 0 else None,
        )
    ax.plot(ns, [r["lower_bound"] for r in rows], "-", color="C0")
    ax.set_xscale("log")
    ax.set_xlabel("N")
    ax.set_ylabel(r"Lip$_\infty$")
    ax.set_title(f"L2-MHA, H = {config.heads}, D = {config.dim}, identity weights")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    save_figure(fig, path)
