"""Fig. 5 of Kim et al. (2021): the spread of inputs and outputs of L2-MHA and DP-MHA."""

from __future__ import annotations

import contextlib
import io
import tempfile
import time
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..errors import InputError
from .common import (
    Count,
    Names,
    NonNegative,
    Positive,
    ReproResult,
    finish_result,
    new_figure,
    save_figure,
    uniform_sets,
)
from .invertibility import ATTENTION_TYPES, LABELS, make_attention

__all__ = [
    "HistogramConfig",
    "trained_attention",
    "output_statistics",
    "run_histograms",
    "SOURCES",
]

NAME = "histograms"
SOURCES = ("random", "trained")
LM_ATTENTION = {"l2": "l2-tied", "dp": "dp"}  # the paper's one-layer (L2), W^Q = W^K and (DP)


@dataclass
class HistogramConfig:
    """Settings of the Fig. 5 reproduction.

    Attributes:
        n: set size N (the inputs of Fig. 3: 64).
        dim: model width D (Fig. 3: 64).
        heads: attention heads (Fig. 3: 8).
        batch: number of input sets.
        spread: the inputs other than x_1 = 0 are U[-spread, spread].
        sources: where the weights come from: ``"random"`` (Glorot uniform) and/or
            ``"trained"`` (the attention of a one-layer character Transformer trained here).
        train_steps: training steps of each one-layer model.
        train_data: text file to train on (``None``: the corpus embedded in the library).
        bins: histogram bins.
        seed: seed of weights, inputs and training.
    """

    n: Count = 64
    dim: Count = 64
    heads: Count = 8
    batch: Count = 128
    spread: Positive = 3.0
    sources: Names = SOURCES
    train_steps: Count = 500
    train_data: str | None = None
    bins: Count = 80
    seed: NonNegative = 0


PRESETS = {
    "quick": dict(n=16, dim=16, heads=4, batch=16, train_steps=3),
    "default": dict(),
    "full": dict(train_steps=2000),
}


def trained_attention(kind: str, config: HistogramConfig) -> tuple[nn.Module, dict]:
    """The attention module of a one-layer character Transformer trained for a few steps.

    Stands in for the one-layer PTB models of Kim et al. (2021, §5.4): width ``config.dim``,
    ``config.heads`` heads, the paper's initialisation (``glorot-l2``, App. H), AdamW with
    nanoGPT's defaults, on ``config.train_data`` or the embedded corpus.

    Returns:
        (the attention module in float64 and evaluation mode, the training summary).
    """
    from ..lm.config import PLAIN_DEFAULTS, LMRunConfig
    from ..lm.train import load_checkpoint, train

    with tempfile.TemporaryDirectory() as folder:
        cfg = LMRunConfig.build({
            **PLAIN_DEFAULTS,  # the paper's models: no logit offsets, s = 1/16, inf-norm
            "data": config.train_data,
            "layers": 1,
            "dim": config.dim,
            "heads": config.heads,
            "block_size": config.n,
            "attention": LM_ATTENTION[kind],
            "init": "glorot-l2",
            "steps": config.train_steps,
            "eval_every": config.train_steps,
            "checkpoint_every": config.train_steps,
            "eval_iters": 5,
            "warmup": min(100, config.train_steps // 10),
            "seed": config.seed,
        })
        with contextlib.redirect_stdout(io.StringIO()):  # keep the training log off the console
            summary = train(cfg, folder, progress=False, tensorboard=False)
        model, _, _ = load_checkpoint(folder)
    module = model.blocks[0].attn.to(torch.float64).eval()
    keep = ("step", "val_loss", "train_loss", "train_seconds")
    return module, {k: summary[k] for k in keep if k in summary}


def output_statistics(x: Tensor, y: Tensor) -> dict:
    """Spread of the flattened inputs ``x`` and outputs ``y``: std, max |.|, 99.9% of |.|."""
    out = {}
    for name, t in (("input", x), ("output", y)):
        flat = t.detach().reshape(-1).to(torch.float64)
        out[f"{name}_std"] = float(flat.std())
        out[f"{name}_absmax"] = float(flat.abs().max())
        out[f"{name}_abs_q999"] = float(torch.quantile(flat.abs(), 0.999))
    out["output_over_input_absmax"] = out["output_absmax"] / out["input_absmax"]
    out["output_over_input_std"] = out["output_std"] / out["input_std"]
    return out


def run_histograms(
    config: HistogramConfig | None = None, out=None, grid: str = "custom"
) -> ReproResult:
    """Histograms of the inputs and outputs of L2-MHA and DP-MHA on the inputs of Fig. 3.

    Reproduces Fig. 5 of Kim et al. (2021). The paper uses trained one-layer PTB models; here
    ``"trained"`` weights come from short runs on a local corpus and ``"random"`` weights are
    Glorot uniform. Attention is applied to whole sets (no causal mask): the construction of
    Thm 3.1 needs x_1 = 0 to attend to the spread-out other elements. Writes
    ``histograms.{png,csv,json}`` to ``out`` when given.

    Examples:
        >>> cfg = HistogramConfig(n=8, dim=8, heads=2, batch=4, sources=("random",))
        >>> result = run_histograms(cfg)
        >>> [r["attention"] for r in result.rows]
        ['l2', 'dp']
    """
    config = config or HistogramConfig()
    unknown = set(config.sources) - set(SOURCES)
    if unknown or not config.sources:
        raise InputError(f"sources must be a non-empty subset of {SOURCES}, got {config.sources}")
    if config.train_steps < 1 or config.bins < 2:
        raise InputError("need train_steps >= 1 and bins >= 2")
    start = time.perf_counter()
    generator = torch.Generator().manual_seed(config.seed)
    x = uniform_sets(config.batch, config.n, config.dim, config.spread, generator)
    rows, histograms, training = [], {}, {}
    for source in config.sources:
        for kind in ATTENTION_TYPES:
            if source == "random":
                module = make_attention(kind, config.dim, config.heads, generator)
            else:
                module, training[kind] = trained_attention(kind, config)
            with torch.no_grad():
                y = module(x)
            rows.append({"source": source, "attention": kind, **output_statistics(x, y)})
            histograms[source, kind] = (x.reshape(-1), y.reshape(-1))
    by = {(r["source"], r["attention"]): r for r in rows}
    summary = {
        "dp_wider_than_l2": {
            s: by[s, "dp"]["output_absmax"] > by[s, "l2"]["output_absmax"] for s in config.sources
        },
        "l2_output_within_input_range": {
            s: by[s, "l2"]["output_absmax"] <= by[s, "l2"]["input_absmax"] for s in config.sources
        },
        "dp_over_l2_output_std": {
            s: by[s, "dp"]["output_std"] / by[s, "l2"]["output_std"] for s in config.sources
        },
        "training": training,
    }
    return finish_result(NAME, grid, config, rows, summary, start, out,
                         lambda png: {"histograms": _plot(histograms, config, png)})


def _plot(histograms: dict, config: HistogramConfig, path) -> dict:
    fig, axes = new_figure(len(config.sources), 2, width=3.8, height=2.7)
    counts = {}
    for r, source in enumerate(config.sources):
        for c, kind in enumerate(ATTENTION_TYPES):
            x, y = histograms[source, kind]
            ax = axes[r, c]
            lo = float(torch.minimum(x.min(), y.min()))
            hi = float(torch.maximum(x.max(), y.max()))
            edges = torch.linspace(lo, hi, config.bins + 1, dtype=torch.float64)
            hx = torch.histogram(x, edges).hist
            hy = torch.histogram(y, edges).hist
            ax.stairs(
                hx.tolist(), edges.tolist(), label="inputs", color="0.5", fill=True, alpha=0.5
            )
            ax.stairs(
                hy.tolist(),
                edges.tolist(),
                label="outputs",
                color="C3" if kind == "dp" else "C0",
                lw=1.5,
            )
            ax.set_yscale("log")
            ax.set_title(f"{LABELS[kind]}, {source} weights", fontsize=9)
            ax.set_xlabel("value")
            ax.set_ylabel("count")
            ax.legend(fontsize=8)
            counts[f"{source}/{kind}"] = {
                "edges": edges.tolist(),
                "inputs": hx.tolist(),
                "outputs": hy.tolist(),
            }
    save_figure(fig, path)
    return counts
