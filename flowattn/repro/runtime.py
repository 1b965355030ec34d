"""App. E, Table 2 of Kim et al. (2021): wall-clock cost of L2 against dot-product attention."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..attention import L2MHA, ContractiveL2MHA, DotProductMHA
from ..errors import InputError
from ..lm.config import PLAIN_DEFAULTS
from ..lm.model import LMConfig, TransformerLM
from ..training.loop import adamw
from .common import (
    Count,
    Counts,
    Names,
    NonNegative,
    ReproResult,
    finish_result,
    new_figure,
    save_figure,
)

__all__ = ["RuntimeConfig", "time_per_call", "run_runtime", "PAPER_TABLE2", "MODULES"]

NAME = "runtime"

# Kim et al. (2021), App. E, Table 2: seconds per training epoch on PTB, 1 to 5 layers (V100).
PAPER_TABLE2 = {
    "dp": (37, 56, 77, 92, 110),
    "l2": (35, 56, 73, 99, 115),
    "l2-tied": (39, 58, 79, 91, 108),
    "contractive-l2": (37, 60, 81, 102, 127),
}

# attention modules timed on their own: name -> constructor (dim, heads)
MODULES: dict[str, Callable[[int, int], nn.Module]] = {
    "dp": lambda d, h: DotProductMHA(d, h),
    "l2": lambda d, h: L2MHA(d, h, tied=False),
    "l2-tied": lambda d, h: L2MHA(d, h, tied=True),
    "l2-tied-unfused": lambda d, h: L2MHA(d, h, tied=True, fused=False),
    "contractive-l2": lambda d, h: ContractiveL2MHA(d, h),
}


@dataclass
class RuntimeConfig:
    """Settings of the Table 2 reproduction.

    Attributes:
        attentions: language-model attention types (``flowattn.lm`` names).
        layers: Transformer depths (the paper: 1 to 5).
        dim: model width (the paper: 512).
        heads: attention heads (the paper: 8).
        block_size: context length of the language model.
        batch_size: sequences per training step.
        modules: attention modules timed alone (keys of ``MODULES``).
        lengths: set sizes N for the module timings.
        module_batch: sets per module call.
        steps: timed calls per measurement.
        warmup: untimed calls before each measurement.
        rounds: every measurement is repeated this many times, interleaved with the others,
            and the fastest round kept: load from other processes only ever adds time, so the
            minimum is the least disturbed estimate (as :mod:`timeit` advises).
        seed: seed of weights and data.
    """

    attentions: Names = ("dp", "l2", "l2-tied", "contractive-l2")
    layers: Counts = (1, 2, 3, 4, 5)
    dim: Count = 128
    heads: Count = 4
    block_size: Count = 64
    batch_size: Count = 12
    modules: Names = tuple(MODULES)
    lengths: Counts = (64, 256, 1024)
    module_batch: Count = 4
    steps: Count = 5
    warmup: NonNegative = 2
    rounds: Count = 3
    seed: NonNegative = 0


PRESETS = {
    "quick": dict(
        layers=(1, 2),
        dim=64,
        heads=4,
        block_size=32,
        batch_size=8,
        lengths=(16, 64),
        module_batch=2,
        steps=3,
        warmup=1,
        rounds=5,
    ),
    "default": dict(),
    "full": dict(dim=512, heads=8, block_size=256, batch_size=8, lengths=(64, 256, 1024, 2048)),
}


def time_per_call(fn: Callable[[], object], steps: int, warmup: int) -> float:
    """Mean wall-clock seconds of ``fn()`` over ``steps`` calls, after ``warmup`` untimed calls.

    CUDA work is synchronised before the clock is read; on the CPU, PyTorch returns when the
    work is done.
    """
    for _ in range(warmup):
        fn()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    sync()
    return (time.perf_counter() - start) / steps


def _lm_step(attention: str, layers: int, config: RuntimeConfig, generator: torch.Generator):
    vocab = 65  # Tiny Shakespeare's alphabet; the embedding size barely matters here
    model = TransformerLM(
        LMConfig(
            vocab_size=vocab,
            block_size=config.block_size,
            layers=layers,
            dim=config.dim,
            heads=config.heads,
            attention=attention,
            **PLAIN_DEFAULTS,  # Table 2's models: no logit offsets
        )
    )
    optimiser = adamw(model, 1e-3)
    shape = (config.batch_size, config.block_size)
    idx = torch.randint(vocab, shape, generator=generator)
    targets = torch.randint(vocab, shape, generator=generator)

    def step() -> None:
        _, losses = model(idx, targets)
        optimiser.zero_grad(set_to_none=True)
        losses["loss"].backward()
        optimiser.step()

    return step


def _module_call(name: str, n: int, config: RuntimeConfig, generator: torch.Generator):
    module = MODULES[name](config.dim, config.heads)
    x = torch.randn(config.module_batch, n, config.dim, generator=generator).requires_grad_(True)

    def call() -> None:
        module(x).square().sum().backward()

    return call


def run_runtime(
    config: RuntimeConfig | None = None, out=None, grid: str = "custom"
) -> ReproResult:
    """Time a training step of Transformer LMs and a forward + backward of attention alone.

    Reproduces the comparison of App. E, Table 2 of Kim et al. (2021), per training step rather
    than per epoch (an epoch is a fixed number of steps, so ratios carry over). All variants
    run in one process, interleaved round by round. Writes ``runtime.{png,csv,json}`` to
    ``out`` when given.

    Examples:
        >>> cfg = RuntimeConfig(attentions=("dp", "l2-tied"), layers=(1,), dim=8, heads=2,
        ...                     block_size=4, batch_size=2, modules=("dp",), lengths=(4,),
        ...                     steps=1, warmup=0, rounds=1)
        >>> [r["attention"] for r in run_runtime(cfg).rows]
        ['dp', 'l2-tied', 'dp']
    """
    config = config or RuntimeConfig()
    unknown = set(config.modules) - set(MODULES)
    if unknown:
        raise InputError(f"unknown module(s) {sorted(unknown)}: choose from {tuple(MODULES)}")
    if config.steps < 1 or config.rounds < 1 or config.warmup < 0:
        raise InputError("need steps >= 1, rounds >= 1 and warmup >= 0")
    start = time.perf_counter()
    generator = torch.Generator().manual_seed(config.seed)
    torch.manual_seed(config.seed)  # module initialisations draw from the global generator
    calls: dict[tuple, Callable[[], None]] = {}
    for layers in config.layers:
        for attention in config.attentions:
            calls["lm-step", attention, layers] = _lm_step(attention, layers, config, generator)
    for n in config.lengths:
        for name in config.modules:
            calls["attention-fwd-bwd", name, n] = _module_call(name, n, config, generator)
    times: dict[tuple, list[float]] = {key: [] for key in calls}
    for _ in range(config.rounds):
        for key, call in calls.items():
            times[key].append(time_per_call(call, config.steps, config.warmup))
    rows = []
    for (bench, name, size), values in times.items():
        seconds = min(values)
        dp = min(times[bench, "dp", size]) if (bench, "dp", size) in times else None
        rows.append(
            {
                "benchmark": bench,
                "attention": name,
                "layers": size if bench == "lm-step" else None,
                "n": size if bench != "lm-step" else None,
                "seconds": seconds,
                "ratio_to_dp": seconds / dp if dp else None,
                "median_seconds": statistics.median(values),
                "spread": (max(values) - seconds) / seconds,
            }
        )
    summary = {
        "threads": torch.get_num_threads(),
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "lm_ratio_to_dp": _ratios(rows, "lm-step"),
        "module_ratio_to_dp": _ratios(rows, "attention-fwd-bwd"),
        "paper_ratio_to_dp": {
            a: [round(t / d, 3) for t, d in zip(v, PAPER_TABLE2["dp"], strict=True)]
            for a, v in PAPER_TABLE2.items()
        },
    }
    return finish_result(NAME, grid, config, rows, summary, start, out,
                         lambda png: _plot(rows, config, png))


def _ratios(rows: list[dict], bench: str) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for r in rows:
        if r["benchmark"] == bench and r["ratio_to_dp"] is not None:
            out.setdefault(r["attention"], []).append(round(r["ratio_to_dp"], 3))
    return out


def _plot(rows: list[dict], config: RuntimeConfig, path) -> None:
    fig, axes = new_figure(1, 2, width=4.4, height=3.4)
    left, right = axes[0]
    for name in config.attentions:
        sel = [r for r in rows if r["benchmark"] == "lm-step" and r["attention"] == name]
        left.plot([r["layers"] for r in sel], [1e3 * r["seconds"] for r in sel], "o-", label=name)
    left.set_xlabel("layers")
    left.set_ylabel("ms per training step")
    left.set_title(
        f"LM step, D = {config.dim}, T = {config.block_size}, B = {config.batch_size}", fontsize=9
    )
    for name in config.modules:
        sel = [r for r in rows if r["benchmark"] == "attention-fwd-bwd" and r["attention"] == name]
        right.loglog([r["n"] for r in sel], [1e3 * r["seconds"] for r in sel], "o-", label=name)
    right.set_xlabel("N")
    right.set_ylabel("ms per forward + backward")
    right.set_title(
        f"attention alone, D = {config.dim}, H = {config.heads}, B = {config.module_batch}",
        fontsize=9,
    )
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, path)
