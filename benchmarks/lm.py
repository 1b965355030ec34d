"""Character-level language-model benchmarks on Tiny Shakespeare.

Three studies, each writing a JSON file and printing a Markdown table:

* ``peer``: the dot-product Transformer in nanoGPT's CPU configuration for Tiny Shakespeare
  (4 layers, 4 heads, width 128, block 64, batch 12, 2000 steps, AdamW lr 1e-3 with 100
  warm-up steps and cosine decay to 1e-4, beta2 0.99, weight decay 0.1, clipping 1.0, no
  dropout), against nanoGPT's 1.886 nats/char.
* ``attention``: the same budget for every attention type, the same model without attention
  (``none``), the invertible LM and the LSTM: validation loss and training throughput, beside
  count-based character n-gram models (add-alpha, orders 1-5) on the same split, so that the
  table shows how much context each model uses. Throughput is also timed in interleaved rounds
  of training steps (so that a changing machine load hits every model alike), with its ratio
  to dot-product attention.
* ``ngram``: only the n-gram rows.
* ``throughput``: only the interleaved timing of training steps, for ``--variants``;
  ``--compile`` times each model also through ``torch.compile`` (each compiled alone in
  dynamo's caches, in rounds of its own beside the eager rows), ``--own-certificates``
  each Lipschitz model also with every layer evaluating its own certificate (no
  ``shared_certificates`` batch over the layers), ``--constant-certificates`` also with its
  contractive layers dividing by a constant (what the model would cost if its certificate
  were free; not a certified model), ``--nanogpt PATH`` adds
  nanoGPT's ``GPT`` (imported from a checkout at PATH) in the same configuration.
* ``certificates``: forward and backward of the certificates of every layer's contractive
  attention for one training batch, each layer evaluating its own against one evaluation
  batched over the layers (``shared_certificates``, what the models do), interleaved.
* ``self-weight``: for finished ``attention`` runs of ``--variants`` (in ``--out``), how each
  layer spreads its attention over 32 validation windows: the mean weight a token puts on
  itself, the mean largest weight on another token, and the share of rows (positions 1 to 63)
  where another token outweighs the token itself -- 0 % by construction for tied L2 attention
  without logit offsets (``l2-tied-legacy``).
* ``budget``: for finished invertible ``attention`` runs of ``--variants`` (in ``--out``), each
  block's certified branch constants against the largest Jacobian norms measured at the
  branches' inputs on the first validation window (float64; about 5 minutes of one core and
  6 GiB): how much of its Lipschitz budget each contractive branch spends on real text.
* ``depth``: constant learning rate, no warm-up (``--depth-warmup`` adds a linear one), 2 to
  12 layers of post-norm Transformers with dot-product, tied-L2 and contractive-L2 attention
  (Kim et al. 2021, §5.4, Table 1): divergences and the best validation loss per depth, with
  a plot. Its default rows are the tied models with their former defaults
  (``--depth-variants``).

Variants are named settings (``VARIANTS``): ``l2-tied``, ``contractive-l2`` and
``invertible`` are today's defaults of those models; every variant measured before tied L2
attention had defaults of its own spells out the settings it ran with, so that its name keeps
meaning what was measured (``l2-tied-legacy`` etc. are the former defaults).

    python benchmarks/lm.py peer                     # ~3 min on two quiet cores
    python benchmarks/lm.py attention
    python benchmarks/lm.py ngram                    # ~30 s
    python benchmarks/lm.py throughput --variants dp l2-tied contractive-l2 invertible
    python benchmarks/lm.py throughput --compile --nanogpt ../nanoGPT --variants dp l2-tied
    python benchmarks/lm.py throughput --own-certificates --variants dp contractive-l2 invertible
    python benchmarks/lm.py throughput --constant-certificates --variants dp contractive-l2
    python benchmarks/lm.py certificates --variants contractive-l2 invertible
    python benchmarks/lm.py self-weight --variants l2-tied-legacy l2-tied-offsets
    python benchmarks/lm.py budget --variants invertible-s2 --out runs/lm-inv-s2
    python benchmarks/lm.py depth --depths 2 4 6 8 10 12
    python benchmarks/lm.py all --quick              # a fast smoke run of everything
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import platform
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch
from entry import positive_int, run_main
from machine import cpu_name

from flowattn.attention import shared_certificates
from flowattn.attention.contractive import ContractiveAttention
from flowattn.lipschitz import jacobian_norm
from flowattn.lm import model as lm_model
from flowattn.lm.config import LMConfig, LMRunConfig
from flowattn.lm.data import eval_windows, get_batch, load_corpus
from flowattn.lm.model import attention_probabilities, build_model
from flowattn.lm.train import load_checkpoint, train
from flowattn.training.loop import adamw

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"
NANOGPT_VAL_LOSS = 1.886  # nanoGPT, same configuration, this machine class
PEER_TARGET = 1.89
THROUGHPUT_TARGET = 0.85  # tied-L2 tokens/s relative to dot product

# nanoGPT's config/train_shakespeare_char.py with its README's CPU overrides.
NANOGPT = dict(
    layers=4, heads=4, dim=128, block_size=64, batch_size=12, steps=2000, lr=1e-3,
    schedule="cosine", warmup=100, min_lr=1e-4, beta2=0.99, weight_decay=0.1, grad_clip=1.0,
    dropout=0.0, bias=False, eval_every=250, checkpoint_every=250,
)
# The settings of every model before tied L2 attention got defaults of its own
# (defaults_version 1), spelt out: every variant measured before then keeps them, so that its
# name still means what was measured (docs/benchmarks.md).
# They also keep defaults_version 2: offsets certified by their margin alone, LayerNorm gain 1.
OLD = dict(self_offset=0.0, position_bias=0.0, init="default", init_scale=1 / 16,
           contractive_norm="inf", defaults_version=2)
OFFSETS = dict(self_offset=4.0, position_bias=4.0)
# contractive attention with the caps it had until version 3 raised them to 8 (its scans below)
CAPS4 = dict(attention="contractive-l2", **OFFSETS)
VARIANTS = {
    "dp": dict(attention="dp"),
    "l2": dict(attention="l2"),
    # today's defaults of tied L2 attention (flowattn.lm.config.TIED_L2_DEFAULTS)
    "l2-tied": dict(attention="l2-tied"),
    "contractive-l2": dict(attention="contractive-l2"),
    # (its network defaults include the number of heads, 8, where nanoGPT's settings say 4)
    "invertible": dict(invertible=True, heads="auto"),
    # today's models with the certificate's spectral norms from matrix products (squarings)
    # instead of the eigensolver: the same models to about 1e-6, for speed on a GPU
    "contractive-l2-squarings": dict(attention="contractive-l2", spectral_norms="squarings"),
    "invertible-squarings": dict(invertible=True, heads="auto", spectral_norms="squarings"),
    # the invertible model of version 4, the feed-forward readout alone (version 5 adds 8
    # heads and s = 1 to it: invertible-readout-h8-s1-lr6-warmup400 is version 5's row), and
    # dot-product attention with the same readout (what the readout gives a free model)
    "invertible-v4": dict(invertible=True, defaults_version=4),
    "invertible-readout": dict(invertible=True, readout="feed-forward", init_scale=0.5),
    "invertible-readout-lr6-warmup400": dict(invertible=True, readout="feed-forward",
                                             init_scale=0.5, lr=6e-3, warmup=400),
    "invertible-readout-h8-s1-lr6-warmup400": dict(invertible=True, readout="feed-forward",
                                                   heads=8, init_scale=1.0, lr=6e-3,
                                                   warmup=400),
    # version 5's invertible model at 7e-3 (between its 6e-3 and the 8e-3 whose float32 inverse
    # fails)
    "invertible-readout-h8-s1-lr7-warmup400": dict(invertible=True, readout="feed-forward",
                                                   heads=8, init_scale=1.0, lr=7e-3,
                                                   warmup=400),
    "dp-readout": dict(attention="dp", readout="feed-forward"),
    # the same models with the settings that were their defaults before
    "l2-tied-legacy": dict(attention="l2-tied", **OLD),
    "contractive-l2-legacy": dict(attention="contractive-l2", **OLD),
    "invertible-legacy": dict(invertible=True, **OLD),
    # tied L2 attention with learnt, bounded logit offsets (self-offset and position bias <= 4)
    "l2-tied-offsets": dict(attention="l2-tied", **{**OLD, **OFFSETS}),
    "contractive-l2-offsets": dict(attention="contractive-l2", **{**OLD, **OFFSETS}),
    # the same with Kim et al.'s App. H initialisation scale of L2 attention weights
    "l2-tied-glorot": dict(attention="l2-tied", **{**OLD, "init": "glorot-l2"}),
    "l2-tied-offsets-glorot": dict(attention="l2-tied", **{**OLD, **OFFSETS,
                                                           "init": "glorot-l2"}),
    "l2-tied-offsets8-glorot": dict(attention="l2-tied", **{**OLD, "init": "glorot-l2",
                                                            "self_offset": 8.0,
                                                            "position_bias": 8.0}),
    "l2-tied-offsets-glorot-s8": dict(attention="l2-tied", **{**OLD, **OFFSETS,
                                                              "init": "glorot-l2",
                                                              "init_scale": 1 / 8}),
    "l2-tied-offsets-glorot-s4": dict(attention="l2-tied", **{**OLD, **OFFSETS,
                                                              "init": "glorot-l2",
                                                              "init_scale": 1 / 4}),
    "l2-tied-offsets-glorot-s2": dict(attention="l2-tied", **{**OLD, **OFFSETS,
                                                              "init": "glorot-l2",
                                                              "init_scale": 1 / 2}),
    "l2-tied-offsets8-glorot-s4": dict(attention="l2-tied", **{**OLD, "init": "glorot-l2",
                                                               "init_scale": 1 / 4,
                                                               "self_offset": 8.0,
                                                               "position_bias": 8.0}),
    "contractive-l2-mixed-s4": dict(attention="contractive-l2", **{**OLD, **OFFSETS,
                                                                   "init": "glorot-l2",
                                                                   "init_scale": 1 / 4,
                                                                   "contractive_norm": "2,inf"}),
    "contractive-l2-offsets-glorot": dict(attention="contractive-l2",
                                          **{**OLD, **OFFSETS, "init": "glorot-l2"}),
    "scaled-cosine": dict(attention="scaled-cosine"),
    "none": dict(attention="none"),
    "invertible-offsets": dict(invertible=True, **{**OLD, **OFFSETS}),
    "contractive-l2-mixed": dict(attention="contractive-l2", **{**OLD, **OFFSETS,
                                                                "init": "glorot-l2",
                                                                "contractive_norm": "2,inf"}),
    "invertible-mixed": dict(invertible=True, **{**OLD, **OFFSETS, "init": "glorot-l2",
                                                 "contractive_norm": "2,inf"}),
    "lstm": dict(model="lstm"),
    # defaults_version 3 (docs/benchmarks.md, "Contractive attention: the weighted count and the
    # LayerNorm gain"): the version-2 defaults, then each change alone and the gain's scan
    "contractive-l2-v2": dict(attention="contractive-l2", defaults_version=2),
    "invertible-v2": dict(invertible=True, defaults_version=2),
    "contractive-l2-weighted": dict(CAPS4, norm_gain=1.0, init_scale=1 / 4),
    "contractive-l2-gain2": dict(CAPS4, norm_gain=2.0, init_scale=1 / 8),
    "contractive-l2-gain4": dict(CAPS4, norm_gain=4.0, init_scale=1 / 16),
    "contractive-l2-gain4-s8": dict(CAPS4, norm_gain=4.0, init_scale=1 / 8),
    "contractive-l2-gain4-s4": dict(CAPS4, norm_gain=4.0, init_scale=1 / 4),
    "contractive-l2-gain8": dict(CAPS4, norm_gain=8.0, init_scale=1 / 32),
    "contractive-l2-gain8-s16": dict(CAPS4, norm_gain=8.0,
                                     init_scale=1 / 16),
    "contractive-l2-gain2-s4": dict(CAPS4, norm_gain=2.0, init_scale=1 / 4),
    # version-3 contractive attention with other caps of its logit offsets (the constant of
    # the certificate grows with them), another scale, a larger learning rate
    "contractive-l2-caps1": dict(attention="contractive-l2", self_offset=1.0, position_bias=1.0),
    "contractive-l2-caps2": dict(attention="contractive-l2", self_offset=2.0, position_bias=2.0),
    "contractive-l2-caps8": dict(attention="contractive-l2", self_offset=8.0, position_bias=8.0),
    "contractive-l2-caps16": dict(attention="contractive-l2", self_offset=16.0,
                                  position_bias=16.0),
    "contractive-l2-caps6": dict(attention="contractive-l2", self_offset=6.0, position_bias=6.0),
    "contractive-l2-caps8-lr2": dict(attention="contractive-l2", self_offset=8.0,
                                     position_bias=8.0, lr=2e-3),
    "contractive-l2-caps8-lr3": dict(attention="contractive-l2", self_offset=8.0,
                                     position_bias=8.0, lr=3e-3),
    "contractive-l2-caps8-lr2-warmup400": dict(attention="contractive-l2", self_offset=8.0,
                                               position_bias=8.0, lr=2e-3, warmup=400),
    "contractive-l2-caps8-lr3-warmup400": dict(attention="contractive-l2", self_offset=8.0,
                                               position_bias=8.0, lr=3e-3, warmup=400),
    "contractive-l2-caps8-h8": dict(attention="contractive-l2", self_offset=8.0,
                                    position_bias=8.0, heads=8),
    "contractive-l2-caps8-h2": dict(attention="contractive-l2", self_offset=8.0,
                                    position_bias=8.0, heads=2),
    "contractive-l2-gain4-s6": dict(CAPS4, norm_gain=4.0, init_scale=1 / 6),
    "contractive-l2-lr2": dict(CAPS4, lr=2e-3),
    "invertible-weighted": dict(invertible=True, defaults_version=3, init_scale=1 / 16),
    "invertible-s4": dict(invertible=True, defaults_version=3, init_scale=1 / 4),
    "invertible-s2": dict(invertible=True, defaults_version=3, init_scale=1 / 2),
    # the invertible model (version 3's defaults) with contractive attention's caps, a larger
    # rate
    "invertible-caps8": dict(invertible=True, defaults_version=3,
                             self_offset=8.0, position_bias=8.0),
    "invertible-lr2": dict(invertible=True, defaults_version=3, lr=2e-3),
    "invertible-lr3": dict(invertible=True, defaults_version=3, lr=3e-3),
    "invertible-lr4": dict(invertible=True, defaults_version=3, lr=4e-3),
    "invertible-lr6": dict(invertible=True, defaults_version=3, lr=6e-3),
    "invertible-lr8": dict(invertible=True, defaults_version=3, lr=8e-3),
    "invertible-lr12": dict(invertible=True, defaults_version=3, lr=1.2e-2),
    "invertible-lr16": dict(invertible=True, defaults_version=3, lr=1.6e-2),
    "invertible-lr8-warmup400": dict(invertible=True, defaults_version=4, lr=8e-3, warmup=400),
    # around 8e-3 with 400 warm-up steps: the rate, the warm-up, the schedule's floor, decay
    "invertible-lr6-warmup400": dict(invertible=True, defaults_version=4, lr=6e-3, warmup=400),
    "invertible-lr12-warmup400": dict(invertible=True, defaults_version=4, lr=1.2e-2, warmup=400),
    "invertible-lr8-warmup800": dict(invertible=True, defaults_version=4, lr=8e-3, warmup=800),
    "invertible-lr16-warmup400": dict(invertible=True, defaults_version=4, lr=1.6e-2, warmup=400),
    "invertible-lr12-warmup800": dict(invertible=True, defaults_version=4, lr=1.2e-2, warmup=800),
    # at 1.2e-2 with 400 warm-up steps: a larger contraction coefficient, Adam's beta2 at 0.95
    "invertible-lr12-warmup400-coeff97": dict(invertible=True, defaults_version=4,
                                              lr=1.2e-2, warmup=400,
                                              contractive_coeff=0.97),
    "invertible-lr12-warmup400-beta95": dict(invertible=True, defaults_version=4,
                                             lr=1.2e-2, warmup=400, beta2=0.95),
    "l2-tied-warmup400": dict(attention="l2-tied", warmup=400),
    "l2-tied-lr2-warmup400": dict(attention="l2-tied", lr=2e-3, warmup=400),
    "dp-lr2-warmup400": dict(attention="dp", lr=2e-3, warmup=400),
    "l2-lr2-warmup400": dict(attention="l2", lr=2e-3, warmup=400),
    "scaled-cosine-lr2-warmup400": dict(attention="scaled-cosine", lr=2e-3, warmup=400),
    # a smaller contraction coefficient: the inverse's error grows at most like 1/(1 - coeff)
    # per block, so a larger rate may keep float32 invertibility
    "invertible-lr12-warmup400-coeff80": dict(invertible=True, defaults_version=4,
                                              lr=1.2e-2, warmup=400,
                                              contractive_coeff=0.8),
    "invertible-lr8-warmup400-coeff85": dict(invertible=True, defaults_version=4,
                                             lr=8e-3, warmup=400,
                                             contractive_coeff=0.85),
    "invertible-lr8-warmup400-floor": dict(invertible=True, defaults_version=4,
                                           lr=8e-3, warmup=400, min_lr=8e-4),
    "invertible-lr8-warmup400-wd0": dict(invertible=True, defaults_version=4, lr=8e-3, warmup=400,
                                         weight_decay=0.0),
}
# the depth study's rows as measured (docs/benchmarks.md); --depth-variants picks others
DEPTH_VARIANTS = ("dp", "l2-tied-legacy", "contractive-l2-legacy")


def machine() -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def run_one(name: str, cfg: dict, out: Path, reuse: bool) -> dict:
    """Train one configuration (flat settings) into its own folder, or reuse a finished run's
    summary."""
    config = LMRunConfig.build(cfg)
    summary_file = out / "benchmark.json"
    if reuse and summary_file.exists():
        saved = json.loads(summary_file.read_text())
        if saved.get("config") == config.to_dict():
            print(f"[{name}] reusing {summary_file}", file=sys.stderr)
            return saved
    shutil.rmtree(out, ignore_errors=True)
    print(f"[{name}] training ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):  # keep stdout for the tables
        summary = train(config, out, progress=False, tensorboard=False)
    summary["wall_s"] = time.perf_counter() - start
    summary["config"] = config.to_dict()
    summary["load_average_after"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    summary_file.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    val = summary["val_loss"]
    print(f"[{name}] val loss {val:.4f}, {summary['tokens_per_s']:.0f} tokens/s, "
          f"{summary['wall_s']:.0f} s" + (" DIVERGED" if summary["diverged"] else ""),
          file=sys.stderr, flush=True)
    return summary


@dataclass
class Timed:
    """One timed row: a model, the callable a training step runs it through (the model, or
    its ``torch.compile`` wrapper) and its optimiser."""

    name: str
    mode: str  # "eager", "compiled", "own certificates" or "constant certificates"
    model: torch.nn.Module
    forward: Callable
    optimizer: torch.optim.Optimizer
    compile_s: float = 0.0  # the first (warm-up) batch of steps, compilation included


def _optimizer(model: torch.nn.Module, base: dict) -> torch.optim.Optimizer:
    """AdamW as the training loop builds it (matrices decay, vectors do not; nanoGPT's rule)."""
    return adamw(model, base["lr"], (0.9, base["beta2"]), base["weight_decay"])


def load_nanogpt(path: Path):
    """nanoGPT's ``model.py`` from a checkout at ``path``, imported as a module (not copied)."""
    file = Path(path) / "model.py"
    if not file.is_file():
        raise SystemExit(f"--nanogpt {path}: no model.py there (a checkout of "
                         "github.com/karpathy/nanoGPT is expected)")
    spec = importlib.util.spec_from_file_location("nanogpt_model", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def nanogpt_model(module, base: dict, vocab_size: int) -> torch.nn.Module:
    """nanoGPT's ``GPT`` in the configuration of ``base`` (bias and dropout as ours)."""
    config = module.GPTConfig(block_size=base["block_size"], vocab_size=vocab_size,
                              n_layer=base["layers"], n_head=base["heads"], n_embd=base["dim"],
                              dropout=base["dropout"], bias=base["bias"])
    with contextlib.redirect_stdout(sys.stderr):  # it prints its parameter count
        return module.GPT(config)


def _settle(row: Timed, step: Callable[[Timed], float], passes: int = 4) -> None:
    """Warm a compiled row up again until a whole batch of steps compiles nothing new, so that
    no timed round holds a compilation (a first GPU run, before this, timed recompilations:
    compiled dot product at 0.07x its eager rate)."""
    from torch._dynamo.utils import counters

    for _ in range(passes):
        before = counters["stats"]["unique_graphs"]
        row.compile_s += step(row)
        if counters["stats"]["unique_graphs"] == before:
            return
    raise RuntimeError(f"{row.name} (compiled) still recompiled after {passes} warm-up passes")


def interleaved_throughput(base: dict, names: list[str], rounds: int, steps: int,
                           compile: bool = False, nanogpt: Path | None = None,
                           own_certificates: bool = False,
                           constant_certificates: bool = False) -> list[dict]:
    """Median training tokens/s of each variant over ``rounds`` interleaved rounds of ``steps``
    optimiser steps (forward, backward, clipping and AdamW update) on Tiny Shakespeare batches.

    With ``compile``, every model is timed twice, eagerly and through ``torch.compile(model)``:
    each compiled model alone in dynamo's caches (compiled after a reset), in rounds of its own
    that interleave it with every uncompiled row (those rows are timed in all such rounds);
    with ``nanogpt`` (a nanoGPT checkout), nanoGPT's ``GPT`` in the same configuration joins
    the rounds; with ``own_certificates`` every model but dot product's is timed again with
    each layer evaluating its own certificate, as before ``shared_certificates``; with
    ``constant_certificates`` every model but dot product's is timed again with each
    contractive layer dividing by a constant (:func:`_constant_certificates`: what a free
    certificate would give). Returns one dict per row: ``name``, ``mode``, ``tokens_per_s``,
    ``params`` and ``compile_s`` (the warm-up, compilation included)."""
    corpus = load_corpus(base["data"])
    vocab = corpus.vocab.size
    device = torch.device(base["device"])
    models: dict[str, torch.nn.Module] = {}
    for name in names:
        torch.manual_seed(0)
        network = LMRunConfig.build({**base, **VARIANTS[name]}).network
        models[name] = build_model(LMConfig(vocab_size=vocab, **network.to_dict()))
    if nanogpt is not None:
        torch.manual_seed(0)
        models["nanoGPT"] = nanogpt_model(load_nanogpt(nanogpt), base, vocab)
    models = {name: model.to(device).train() for name, model in models.items()}
    eager = [Timed(n, "eager", m, m, _optimizer(m, base)) for n, m in models.items()]
    # compiled when its turn comes (below), each model alone in dynamo's caches
    compiled = [Timed(n, "compiled", m, m, _optimizer(m, base))
                for n, m in models.items()] if compile else []
    altered = [Timed(n, mode, m, m, _optimizer(m, base))  # eager, with altered certificates
               for mode, wanted in (("own certificates", own_certificates),
                                    ("constant certificates", constant_certificates))
               if wanted for n, m in models.items() if n not in ("dp", "nanoGPT")]
    rows = eager + altered  # the uncompiled rows, in every round
    kept: dict = {}  # the constant rows' certificates
    contexts = {"own certificates": _own_certificates,
                "constant certificates": lambda: _constant_certificates(kept)}
    generator = torch.Generator().manual_seed(0)
    batches = [tuple(t.contiguous().to(device) for t in  # nanoGPT views targets
                     get_batch(corpus.train, base["block_size"], base["batch_size"], generator))
               for _ in range(steps)]

    def step(row: Timed) -> float:
        _sync(device)
        start = time.perf_counter()
        with contexts.get(row.mode, contextlib.nullcontext)():
            for x, y in batches:
                _, loss = row.forward(x, y)
                loss = loss["loss"] if isinstance(loss, dict) else loss  # nanoGPT: the loss
                row.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(row.model.parameters(), 1.0)
                row.optimizer.step()
        _sync(device)
        return time.perf_counter() - start

    def warm(row: Timed) -> None:
        print(f"warming up {row.name} ({row.mode}) ...", file=sys.stderr, flush=True)
        row.compile_s = step(row)

    for row in rows:  # warm-up
        warm(row)
    times: dict[int, list[float]] = {id(row): [] for row in rows + compiled}

    def timed_rounds(timed: list[Timed], label: str) -> None:
        for r in range(rounds):
            print(f"round {r + 1}/{rounds}{label}", file=sys.stderr, flush=True)
            for row in timed:
                times[id(row)].append(step(row))

    if not compiled:
        timed_rounds(rows, "")
    for row in compiled:
        # Compiled models of one class share their code, and dynamo keeps its graphs per code
        # object: beside each other they ran as many small graphs (dot product: 14 compiled
        # functions a step instead of 3, docs/benchmarks.md). So each is compiled after a
        # reset and timed alone among the compiled models, interleaved with the eager rows.
        torch._dynamo.reset()
        row.forward = torch.compile(row.model)
        warm(row)  # compilation
        _settle(row, step)
        timed_rounds(rows + [row], f" ({row.name} compiled)")
    tokens = steps * base["batch_size"] * base["block_size"]
    return [{"name": row.name, "mode": row.mode,
             "tokens_per_s": tokens / statistics.median(times[id(row)]),
             "params": sum(p.numel() for p in row.model.parameters()),
             "compile_s": row.compile_s, "seconds": times[id(row)]}
            for row in eager + compiled + altered]


def _own_certificates():
    """The language models with every layer evaluating its own certificate: their residual
    stack's ``shared_certificates`` replaced by a context that does nothing."""
    return mock.patch.object(lm_model, "shared_certificates",
                             lambda *args, **kwargs: contextlib.nullcontext())


def _constant_certificates(kept: dict) -> contextlib.ExitStack:
    """The language models with every contractive layer dividing by a constant: its own
    certificate, evaluated at the first call (kept in ``kept``) and then reused, detached, at
    every step while the weights train on. Not a certified model; the cost floor of the
    certificate (how fast the model would train if the certificate were free)."""
    bound = ContractiveAttention._bound

    def constant(module, length, every_count, causal=False):
        key = (module, length, every_count, causal)
        if key not in kept:
            kept[key] = bound(module, length, every_count, causal).detach()
        return kept[key]

    stack = contextlib.ExitStack()
    stack.enter_context(_own_certificates())
    stack.enter_context(mock.patch.object(ContractiveAttention, "_bound", constant))
    return stack


def rates(rows: list[dict], mode: str = "eager") -> dict[str, float]:
    """``name -> tokens/s`` of the rows of one mode."""
    return {r["name"]: r["tokens_per_s"] for r in rows if r["mode"] == mode}


def table(rows: list[list], header: list[str]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(x, digits=4) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "—"
    return f"{x:.{digits}f}"


# ----------------------------------------------------------------------------- studies


def peer(args, base: dict) -> dict:
    s = run_one("peer dp", {**base, "attention": "dp"}, args.out / "peer-dp", args.reuse)
    result = {"study": "peer", "machine": machine(), "summary": s,
              "nanogpt_val_loss": NANOGPT_VAL_LOSS, "target": PEER_TARGET,
              "met": s["val_loss"] <= PEER_TARGET}
    print(table([["nanoGPT (reference)", NANOGPT_VAL_LOSS, "", ""],
                 ["flowattn dp", fmt(s["val_loss"]), f"{s['train_seconds']:.0f}",
                  f"{s['tokens_per_s']:.0f}"]],
                ["model", "val loss (nats/char)", "train time (s)", "tokens/s"]))
    return result


def ngram_rows(data: str) -> list[dict]:
    """Add-alpha character n-gram models of orders 1-5 on the split the LMs are scored on."""
    from flowattn.lm.ngram import ngram_baselines

    corpus = load_corpus(data)
    return ngram_baselines(corpus.train, corpus.val, corpus.vocab.size, (1, 2, 3, 4, 5))


def ngram(args, base: dict) -> dict:
    rows = ngram_rows(base["data"])
    print(table([[f"{r['order']}-gram", f"{r['alpha']:g}", fmt(r["val_loss"]),
                  fmt(r["val_bpc"])] for r in rows],
                ["model", "alpha", "val loss (nats/char)", "bpc"]))
    return {"study": "ngram", "machine": machine(), "ngrams": rows}


@torch.no_grad()
def branch_inputs(model, record: dict, vocab, windows: int, parts=("attn",)) -> dict:
    """What each block's ``parts`` (``attn``, ``ff``) of ``model`` read on the first ``windows``
    validation windows of its checkpoint's corpus, keyed (part, block index): captured by
    forward pre-hooks during one forward pass."""
    corpus = load_corpus(record["corpus"]["source"], vocab=vocab)
    x, _ = next(eval_windows(corpus.val, model.config.block_size, windows))
    inputs, hooks = {}, []
    for i, block in enumerate(model.blocks):
        for part in parts:
            hooks.append(getattr(block, part).register_forward_pre_hook(
                lambda module, args, key=(part, i): inputs.__setitem__(key, args[0].detach())))
    with torch.no_grad():
        model(x)
    for hook in hooks:
        hook.remove()
    return inputs


def self_weight_rows(run: Path, windows: int = 32) -> list[dict]:
    """Per layer of the model in ``run``: how attention weights a token against the others, on
    the first ``windows`` validation windows (each block's attention applied to its own input,
    :func:`branch_inputs`), positions 1 to T - 1 (position 0 sees only itself)."""
    model, record, vocab = load_checkpoint(run)
    inputs = branch_inputs(model, record, vocab, windows)
    rows = []
    for i, block in enumerate(model.blocks):
        p = attention_probabilities(block.attn, inputs[("attn", i)])[:, :, 1:]  # (B, H, T-1, T)
        own = p.diagonal(offset=1, dim1=-2, dim2=-1)  # row r is position r + 1
        others = p.clone()
        rows_index = torch.arange(p.shape[-2])
        others[..., rows_index, rows_index + 1] = 0.0
        largest = others.amax(-1)
        rows.append({"layer": i + 1, "self": float(own.mean()), "other": float(largest.mean()),
                     "outweighs": float((largest > own).double().mean())})
    return rows


def budget_rows(run: Path, windows: int = 1) -> list[dict]:
    """Per block of the invertible model in ``run``: each residual branch's certified constant
    against the largest Jacobian norm measured at its inputs (captured by forward pre-hooks) on
    the first ``windows`` validation windows (:func:`branch_inputs`), in float64. Attention in
    its own norm
    (``contractive_norm``; for "2,inf" an ascent, so a lower bound on the local norm);
    feed-forward per token: its Jacobian is block diagonal, so the largest token's spectral norm
    is its exact norm in the "2,inf" norm."""
    model, record, vocab = load_checkpoint(run)
    if not model.config.invertible:
        raise SystemExit(f"{run} holds a non-invertible model: the budget study needs one")
    model = model.double().eval()
    inputs = branch_inputs(model, record, vocab, windows, parts=("attn", "ff"))
    rows = []
    for i, block in enumerate(model.blocks):
        certified_attn, certified_ff = block.lipschitz_bounds(model.config.block_size)
        attn, ff = [], []
        for w in range(inputs[("attn", i)].shape[0]):
            attn.append(float(jacobian_norm(
                lambda z, block=block: block.attention_branch(z[None])[0],
                inputs[("attn", i)][w], block.attn.norm)))
            per_token = torch.func.vmap(torch.func.jacrev(
                lambda v, block=block: block.ff_branch(v[None, None])[0, 0]))(inputs[("ff", i)][w])
            ff.append(float(torch.linalg.matrix_norm(per_token.detach(), ord=2).max()))
        rows.append({"block": i + 1, "norm": block.attn.norm,
                     "attention": {"certified": certified_attn, "measured": max(attn)},
                     "feed_forward": {"certified": certified_ff, "measured": max(ff)}})
    return rows


def budget(args, base: dict) -> dict:
    out, lines = {}, []
    for n in args.variants:
        rows = budget_rows(args.out / f"attn-{n}")
        out[n] = rows
        for r in rows:
            a, f = r["attention"], r["feed_forward"]
            lines.append([n, str(r["block"]), f"{a['certified']:.3f}", f"{a['measured']:.3f}",
                          f"{a['measured'] / a['certified']:.2f}", f"{f['certified']:.3f}",
                          f"{f['measured']:.3f}", f"{f['measured'] / f['certified']:.2f}"])
    print(table(lines, ["model", "block", "attention: certified", "measured", "spent",
                        "feed-forward: certified", "measured", "spent"]))
    return {"study": "budget", "machine": machine(), "runs": out}


def self_weight(args, base: dict) -> dict:
    out = {}
    lines = []
    for n in args.variants:
        run = args.out / f"attn-{n}"
        rows = self_weight_rows(run)
        out[n] = rows
        lines.append([n, " / ".join(str(r["layer"]) for r in rows),
                      " / ".join(f"{r['self']:.2f}" for r in rows),
                      " / ".join(f"{r['other']:.2f}" for r in rows),
                      " / ".join(f"{100 * r['outweighs']:.0f} %" for r in rows)])
    print(table(lines, ["model", "layer", "mean weight on itself",
                        "mean of the largest weight on another token",
                        "rows where another token outweighs itself"]))
    return {"study": "self-weight", "machine": machine(), "runs": out}


def attention(args, base: dict) -> dict:
    names = args.variants
    runs = {n: run_one(n, {**base, **VARIANTS[n]}, args.out / f"attn-{n}", args.reuse)
            for n in names}
    timed = {}
    if args.rounds > 0:
        print("timing interleaved training steps ...", file=sys.stderr, flush=True)
        timed = rates(interleaved_throughput(base, names, args.rounds, args.timing_steps))
    dp_rate = timed.get("dp")
    rows = []
    for n in names:
        s = runs[n]
        rate = timed.get(n)
        rows.append([n, fmt(s["val_loss"]), fmt(s["best_val_loss"]), f"{s['tokens_per_s']:.0f}",
                     "—" if rate is None else f"{rate:.0f}",
                     "—" if rate is None or dp_rate is None else f"{rate / dp_rate:.2f}",
                     f"{s['params']:,}", "yes" if s["diverged"] else "no"])
    grams = ngram_rows(base["data"])
    rows += [[f"{r['order']}-gram (add-{r['alpha']:g})", fmt(r["val_loss"]), "—", "—", "—", "—",
              "—", "—"] for r in grams]
    print(table(rows, ["model", "val loss", "best val", "tokens/s (run)",
                       "tokens/s (interleaved)", "× dp", "params", "diverged"]))
    return {"study": "attention", "machine": machine(), "runs": runs, "throughput": timed,
            "throughput_ratio_target": THROUGHPUT_TARGET, "ngrams": grams}


def throughput(args, base: dict) -> dict:
    names = args.variants
    rows = interleaved_throughput(base, names, max(args.rounds, 1), args.timing_steps,
                                  compile=args.compile, nanogpt=args.nanogpt,
                                  own_certificates=args.own_certificates,
                                  constant_certificates=args.constant_certificates)
    reference = "dp" if "dp" in names else names[0]
    modes = ("eager", "compiled") if args.compile else ("eager",)
    by_mode = {mode: rates(rows, mode) for mode in modes}
    for mode in ("own certificates", "constant certificates"):
        by_mode[mode] = by_mode["eager"]  # against eager dot product
    lines = []
    for row in rows:
        same = by_mode[row["mode"]]
        rate = row["tokens_per_s"]
        lines.append([row["name"], row["mode"], f"{rate:.0f}", f"{rate / same[reference]:.2f}",
                      f"{rate / same['nanoGPT']:.2f}" if "nanoGPT" in same else "—",
                      f"{rate / by_mode['eager'][row['name']]:.2f}",
                      f"{row['compile_s']:.0f}", f"{row['params']:,}"])
    print(table(lines, ["model", "mode", "tokens/s (interleaved)", f"× {reference}",
                        "× nanoGPT", "× eager", "first step batch (s)", "params"]))
    below = [f"{r['name']} ({r['mode']})" for r in rows if r["name"] not in (reference, "nanoGPT")
             and r["tokens_per_s"] < THROUGHPUT_TARGET * by_mode[r["mode"]][reference]]
    print(f"\nbelow {THROUGHPUT_TARGET}× {reference} in the same mode: "
          f"{', '.join(below) if below else 'none'}")
    return {"study": "throughput", "machine": {**machine(), "cpu": cpu_name()}, "rows": rows,
            "rounds": args.rounds, "timing_steps": args.timing_steps, "compile": args.compile,
            "own_certificates": args.own_certificates,
            "constant_certificates": args.constant_certificates,
            "nanogpt": str(args.nanogpt) if args.nanogpt else None,
            "throughput_ratio_target": THROUGHPUT_TARGET, "below_target": below}


def certificates(args, base: dict) -> dict:
    """Milliseconds per training step spent on the certificates of the contractive attention
    of every layer (forward and backward; the denominators the layers divide by), each layer
    evaluating its own against one evaluation batched over the layers, interleaved; medians
    over ``--rounds`` x ``--timing-steps`` calls."""
    device = torch.device(args.device)
    length = base["block_size"]
    rows = []
    for name in args.variants:
        torch.manual_seed(0)
        network = LMRunConfig.build({**base, **VARIANTS[name]}).network
        model = build_model(LMConfig(vocab_size=65, **network.to_dict())).to(device)
        layers = [m for m in model.blocks.modules() if isinstance(m, ContractiveAttention)]
        if not layers:
            print(f"{name}: no contractive attention, skipped")
            continue
        x = torch.zeros(1, length, layers[0].dim, device=device)
        for shared in (False, True, False, True):  # warm-up
            _time_certificates(model, layers, x, shared)
        times = {False: [], True: []}
        for _ in range(max(args.rounds, 1) * args.timing_steps):
            for shared in (False, True):
                times[shared].append(_time_certificates(model, layers, x, shared))
        own, batched = (1e3 * statistics.median(times[k]) for k in (False, True))
        rows.append({"name": name, "layers": len(layers), "own_ms": own, "shared_ms": batched})
    print(table([[r["name"], r["layers"], f"{r['own_ms']:.2f}", f"{r['shared_ms']:.2f}",
                  f"{r['shared_ms'] / r['own_ms']:.2f}"] for r in rows],
                ["model", "contractive layers", "each its own (ms)", "batched (ms)",
                 "batched / own"]))
    return {"study": "certificates", "machine": {**machine(), "cpu": cpu_name()},
            "device": args.device, "rows": rows}


def _time_certificates(model, layers: list, x: torch.Tensor, shared: bool) -> float:
    """Seconds for the causal denominators of ``layers`` on sequences like ``x`` and their
    backward pass, with the certificates batched over the layers or not."""
    context = (shared_certificates(model.blocks.modules(), x.shape[1], causal=True)
               if shared else contextlib.nullcontext())
    _sync(x.device)
    start = time.perf_counter()
    with context:
        total = sum(m._denominator(x, None, True).sum() for m in layers)
    total.backward()
    _sync(x.device)
    return time.perf_counter() - start


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def depth(args, base: dict) -> dict:
    base = {**base, "schedule": "constant", "warmup": args.depth_warmup, "min_lr": 0.0,
            "lr": args.depth_lr, "norm_position": args.depth_norm_position}
    results = {}
    for name in args.depth_variants:
        for layers in args.depths:
            cfg = {**base, **VARIANTS[name], "layers": layers}
            s = run_one(f"{name} x{layers}", cfg, args.out / f"depth-{name}-{layers}",
                        args.reuse)
            results[f"{name}/{layers}"] = {
                "variant": name, "layers": layers, "best_val_loss": s["best_val_loss"],
                "val_loss": s["val_loss"], "diverged": s["diverged"],
                "divergence": s["divergence"], "tokens_per_s": s["tokens_per_s"],
            }
    rows = []
    for name in args.depth_variants:
        row = [name]
        for layers in args.depths:
            r = results[f"{name}/{layers}"]
            cell = fmt(r["best_val_loss"], 3)
            row.append(cell + (" (diverged)" if r["diverged"] else ""))
        rows.append(row)
    print(table(rows, ["model"] + [f"{d} layers" for d in args.depths]))
    plot_depth(results, args.depth_variants, args.depths, args.out / "depth.png", base)
    return {"study": "depth", "machine": machine(), "lr": base["lr"], "warmup": base["warmup"],
            "norm_position": base["norm_position"], "results": results}


def plot_depth(results: dict, names, depths, path: Path, base: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, marker in zip(names, "osD^vP*X" * len(names), strict=False):
        rs = [results[f"{name}/{d}"] for d in depths]
        best = [r["best_val_loss"] if math.isfinite(r["best_val_loss"]) else math.nan for r in rs]
        line, = ax.plot(depths, best, marker=marker, label=name)
        bad = [(d, b) for d, b, r in zip(depths, best, rs, strict=True) if r["diverged"]]
        if bad:
            ax.scatter([d for d, _ in bad], [b if math.isfinite(b) else ax.get_ylim()[1]
                                             for _, b in bad],
                       marker="x", s=80, color=line.get_color(), zorder=3)
    ax.set_xticks(list(depths))
    ax.set_xlabel("layers")
    ax.set_ylabel("best validation loss (nats/char)")
    warmup = f"{base['warmup']} warm-up steps" if base["warmup"] else "no warm-up"
    ax.set_title(f"constant lr {base['lr']:g}, {warmup}, {base['norm_position']}-norm, "
                 f"{base['steps']} steps\n(x: diverged)", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}", file=sys.stderr)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("study", choices=("peer", "attention", "throughput", "certificates",
                                          "depth", "ngram", "self-weight", "budget", "all",
                                          "variants"),
                        help="what to run; 'variants' lists the models by name with the "
                        "settings each adds to nanoGPT's configuration")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 150 steps, depths 2 4 6, fewer timing rounds")
    parser.add_argument("--steps", type=int, help="override the number of training steps")
    parser.add_argument("--data", type=Path, default=DATA, help="Tiny Shakespeare input.txt")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-lm")
    parser.add_argument("--threads", type=positive_int, help="torch CPU threads")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dim", type=int, help="model width (default 128; 512 on a GPU)")
    parser.add_argument("--heads", type=int, help="heads (default 4)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                        metavar="NAME", help="models to train or time (default: all of them; "
                        "the study 'variants' lists the names)")
    parser.add_argument("--depths", nargs="+", type=int, default=[2, 4, 6, 8, 10, 12])
    parser.add_argument("--depth-variants", nargs="+", default=list(DEPTH_VARIANTS),
                        choices=list(VARIANTS), metavar="NAME",
                        help=f"models of the depth study (default: {' '.join(DEPTH_VARIANTS)})")
    parser.add_argument("--depth-lr", type=float, default=1e-3)
    parser.add_argument("--depth-warmup", type=int, default=0,
                        help="depth study: linear warm-up steps before the constant rate "
                        "(default 0, Kim et al.'s protocol)")
    parser.add_argument("--depth-norm-position", choices=("pre", "post"), default="post")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    parser.add_argument("--timing-steps", type=int, default=20)
    parser.add_argument("--own-certificates", action="store_true",
                        help="throughput: time each Lipschitz model also with every layer "
                        "evaluating its own certificate (no batch over the layers)")
    parser.add_argument("--constant-certificates", action="store_true",
                        help="throughput: time each Lipschitz model also with its contractive "
                        "layers dividing by a constant (the cost floor of the certificate)")
    parser.add_argument("--compile", action="store_true",
                        help="throughput: also time every model through torch.compile")
    parser.add_argument("--nanogpt", type=Path, metavar="PATH",
                        help="throughput: also time nanoGPT's GPT from the checkout at PATH")
    parser.add_argument("--reuse", action="store_true", help="reuse finished runs in --out")
    parser.add_argument("--seed", type=int, default=1337, help="seed of every run")
    args = parser.parse_args(argv)
    if args.study == "variants":
        print(table([[name, ", ".join(f"{k}={v}" for k, v in settings.items())]
                     for name, settings in VARIANTS.items()], ["variant", "settings"]))
        return 0
    if not args.data.exists():
        parser.error(f"Tiny Shakespeare not found at {args.data} (pass --data)")
    if args.threads:
        torch.set_num_threads(args.threads)
    base = {"data": str(args.data), "device": args.device, "seed": args.seed, **NANOGPT}
    if args.quick:
        base = {**base, "steps": 150, "eval_every": 150, "checkpoint_every": 150}
        if args.depths == parser.get_default("depths"):
            args.depths = [2, 4, 6]
        args.rounds, args.timing_steps = min(args.rounds, 2), min(args.timing_steps, 5)
    if args.steps:
        every = min(base["eval_every"], args.steps)
        base = {**base, "steps": args.steps, "eval_every": every, "checkpoint_every": every}
    if args.dim:
        base = {**base, "dim": args.dim}
    if args.heads:
        base = {**base, "heads": args.heads}
    args.out.mkdir(parents=True, exist_ok=True)
    studies = ["peer", "attention", "depth"] if args.study == "all" else [args.study]
    for study in studies:
        print(f"\n## {study}\n", flush=True)
        studies_by_name = {"peer": peer, "attention": attention, "throughput": throughput,
                           "depth": depth, "ngram": ngram, "self-weight": self_weight,
                           "budget": budget, "certificates": certificates}
        result = studies_by_name[study](args, base)
        result.update(quick=args.quick, steps=base["steps"], command=" ".join(sys.argv))
        path = args.out / f"lm_{study}.json"
        path.write_text(json.dumps(result, indent=2, default=str) + "\n")
        print(f"\nresults: {path}", flush=True)
    return 0


if __name__ == "__main__":
    run_main(main)
