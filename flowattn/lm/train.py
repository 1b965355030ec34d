"""Training loop for the character language models: one function, read top to bottom.

Configuration (:class:`TrainConfig`), then data, model, optimiser, resume, and the loop with
evaluation, checkpoints, metrics and divergence detection. Launched under ``torchrun`` it trains
with DistributedDataParallel (gloo on CPU, NCCL on GPUs).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from tqdm.auto import tqdm

from ..errors import InputError, NonFiniteError
from ..runs import atomic_torch_save, atomic_write_text, truncate_metrics
from .data import (
    DEFAULT_CORPUS,
    CharCorpus,
    CharVocab,
    check_block_size,
    eval_windows,
    get_batch,
    load_corpus,
)
from .model import LMConfig, build_model

__all__ = [
    "TrainConfig",
    "train",
    "learning_rate",
    "evaluate",
    "load_checkpoint",
    "model_config",
    "SCHEDULES",
    "CHECKPOINT",
]

SCHEDULES = ("constant", "cosine", "noam")
CHECKPOINT = "ckpt.pt"
METRICS = "metrics.jsonl"
DIVERGED = "diverged.json"

TENSORBOARD_TAGS = {
    "train_loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "train/tokens_per_s",
    "val_loss": "val/loss",
    "val_bpc": "val/bpc",
    "best_val_loss": "val/best_loss",
}

# Settings that may differ when a run is resumed; every other one must match the checkpoint.
RESUMABLE = {
    "out", "resume", "steps", "eval_interval", "eval_iters", "log_interval", "progress",
    "tensorboard", "threads", "device",
}


@dataclass
class TrainConfig:
    """Everything a training run depends on. The defaults are nanoGPT's CPU configuration for
    Tiny Shakespeare (4 layers, 4 heads, width 128, block 64, batch 12, 2000 steps, AdamW with
    learning rate 1e-3, 100 warm-up steps and cosine decay to 1e-4, beta2 0.99, weight decay
    0.1, gradient clipping at 1.0, no dropout).

    The model fields are those of :class:`~flowattn.lm.model.LMConfig`; ``data=None`` trains
    on the embedded corpus. ``eval_iters=0`` scores the whole validation split at every
    evaluation; a positive value averages that many random batches instead (as nanoGPT does).
    A run has diverged when a loss or gradient is not finite, or when the smoothed training
    loss exceeds ``divergence_factor`` times its best value.
    """

    # data
    data: str | None = None
    data_format: str = "auto"
    val_data: str | None = None
    # model
    model: str = "transformer"
    attention: str | None = None
    layers: int = 4
    dim: int = 128
    heads: int = 4
    block_size: int = 64
    norm: str | None = None
    norm_position: str = "pre"
    final_norm: str | None = None
    weighted_residual: bool = False
    residual_alpha: float | None = None
    init: str = "default"
    init_scale: float = 1.0 / 16
    ff_mult: int = 4
    dropout: float = 0.0
    bias: bool = False
    tie_embeddings: bool = False
    invertible: bool = False
    contractive_coeff: float = 0.9
    ortho_attention: float = 0.0
    ortho_ff: float = 0.0
    ortho_affinity: float = 0.0
    # optimisation
    steps: int = 2000
    batch_size: int = 12
    lr: float = 1e-3
    schedule: str = "cosine"
    warmup: int = 100
    min_lr: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.99
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    # evaluation, logging, run
    eval_interval: int = 250
    eval_iters: int = 0
    log_interval: int = 10
    out: str = "runs/lm"
    resume: bool = False
    seed: int = 1337
    device: str = "auto"
    threads: int | None = None
    progress: bool = True
    tensorboard: bool = True
    divergence_factor: float = 2.0

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise InputError(f"unknown schedule {self.schedule!r}: choose from {SCHEDULES}")
        positive = ("steps", "batch_size", "eval_interval", "log_interval")
        for name in positive:
            if getattr(self, name) < 1:
                raise InputError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise InputError(f"need 0 <= min_lr <= lr and lr > 0, got lr={self.lr}, "
                             f"min_lr={self.min_lr}")
        if self.warmup < 0 or self.eval_iters < 0 or self.weight_decay < 0 or self.grad_clip < 0:
            raise InputError("warmup, eval_iters, weight_decay and grad_clip must be >= 0")
        if self.schedule == "noam" and self.warmup < 1:
            raise InputError("the noam schedule needs warmup >= 1")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise InputError(f"betas must lie in [0, 1), got {self.beta1}, {self.beta2}")
        if self.divergence_factor <= 1:
            raise InputError(f"divergence_factor must exceed 1, got {self.divergence_factor}")


def model_config(cfg: TrainConfig, vocab_size: int) -> LMConfig:
    """The :class:`LMConfig` described by a training configuration."""
    names = {f.name for f in fields(LMConfig)} - {"vocab_size"}
    return LMConfig(vocab_size=vocab_size, **{n: getattr(cfg, n) for n in names})


def learning_rate(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimiser step ``step`` (0-based).

    * ``constant``: ``lr`` after a linear warm-up of ``warmup`` steps.
    * ``cosine`` (nanoGPT): linear warm-up lr (t + 1)/(warmup + 1), then cosine decay from
      ``lr`` to ``min_lr`` at the last step.
    * ``noam`` (Vaswani et al. 2017; Kim et al. 2021, App. H): lr min(sqrt(w/t), t/w) with
      t = step + 1 and w = ``warmup``: linear rise to ``lr`` at t = w, then decay as 1/sqrt(t);
      floored at ``min_lr``. The paper's gamma/sqrt(D) min(t^-1/2, t w^-3/2) is this with
      lr = gamma / sqrt(D w).

    Examples:
        >>> cfg = TrainConfig(steps=100, warmup=10, lr=1.0, min_lr=0.1)
        >>> round(learning_rate(99, cfg), 3), round(learning_rate(9, cfg), 3)
        (0.1, 0.909)
    """
    if cfg.schedule == "noam":
        t = step + 1
        return max(cfg.min_lr, cfg.lr * min(math.sqrt(cfg.warmup / t), t / cfg.warmup))
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / (cfg.warmup + 1)
    if cfg.schedule == "constant":
        return cfg.lr
    span = max(cfg.steps - 1 - cfg.warmup, 1)
    progress = min((step - cfg.warmup) / span, 1.0)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    data: torch.Tensor,
    block_size: int,
    batch_size: int,
    device: torch.device,
    eval_iters: int = 0,
    generator: torch.Generator | None = None,
    rank: int = 0,
    world: int = 1,
) -> float:
    """Mean cross-entropy (nats per character) of ``model`` on ``data``.

    ``eval_iters=0`` scores every non-overlapping window once (deterministic); otherwise the
    mean over ``eval_iters`` random batches. Under DDP every process scores a share and the
    sums are reduced. The model is put in evaluation mode and restored afterwards. A model
    whose activations overflow scores NaN.
    """
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)  # sum of losses, tokens
    if eval_iters == 0:
        batches = eval_windows(data, block_size, max(batch_size, 64), shard=rank, shards=world)
    else:
        batches = (get_batch(data, block_size, batch_size, generator) for _ in range(eval_iters))
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        try:
            logits, _ = model(x)
        except NonFiniteError:  # the attention modules refuse NaN/Inf activations
            total[0] = math.nan
            break
        loss = nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum"
        )
        total[0] += loss.to(torch.float64)
        total[1] += y.numel()
    if world > 1:
        dist.all_reduce(total)
    model.train(was_training)
    return float(total[0] / total[1])


def _write_json(obj, path: Path) -> None:
    atomic_write_text(json.dumps(obj, indent=2) + "\n", path)


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu"):
    """Load a checkpoint (a run directory or its ``ckpt.pt``) and rebuild its model.

    Returns:
        (model in evaluation mode, the checkpoint dict, the vocabulary).

    Raises:
        FileNotFoundError: if there is no checkpoint there.
        ValueError: if the file is not a language-model checkpoint.
    """
    path = Path(path)
    file = path / CHECKPOINT if path.is_dir() else path
    if not file.exists():
        raise FileNotFoundError(f"no checkpoint at {file}")
    ckpt = torch.load(file, map_location=device, weights_only=True)
    if not isinstance(ckpt, dict) or ckpt.get("kind") != "flowattn-lm":
        raise InputError(f"{file} is not a flowattn language-model checkpoint")
    config = LMConfig.from_dict(ckpt["model_config"])
    model = build_model(config).to(device)
    model.load_state_dict(ckpt["model"])
    return model.eval(), ckpt, CharVocab.from_dict(ckpt["vocab"])


def _resolve_device(name: str, local_rank: int) -> torch.device:
    if name == "auto":
        return torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank)
    return device


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    # nanoGPT: decay matrices and embeddings; not biases, gains, residual weights, ActNorm
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def _rng_state(generator: torch.Generator, device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state(), "batches": generator.get_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict, generator: torch.Generator, device: torch.device) -> None:
    torch.set_rng_state(state["torch"].cpu())
    generator.set_state(state["batches"].cpu())
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def _check_resumable(saved: dict, cfg: TrainConfig) -> None:
    current = asdict(cfg)
    changed = [
        f"{k} ({saved[k]!r} in the checkpoint, {current[k]!r} now)"
        for k in current
        if k not in RESUMABLE and k in saved and saved[k] != current[k]
    ]
    if changed:
        raise InputError("cannot resume with different settings: " + "; ".join(changed))


def _corpus_record(corpus: CharCorpus) -> dict:
    def absolute(path: str | None) -> str | None:
        return path if path in (None, DEFAULT_CORPUS) else os.path.abspath(path)

    return {
        "source": absolute(corpus.source),
        "format": corpus.format,
        "val_source": absolute(corpus.val_source),
        "sha256": corpus.sha256,
    }


def train(cfg: TrainConfig) -> dict:
    """Train a character language model as ``cfg`` says; return a summary dict.

    Writes to ``cfg.out``: ``ckpt.pt`` (model, optimiser, configuration, vocabulary, step and
    random states; replaced atomically at every evaluation), ``metrics.jsonl`` (one JSON
    record per log line and per evaluation), TensorBoard events under ``tensorboard/`` when
    the ``tensorboard`` package is installed, and ``diverged.json`` if training diverged.
    A resumed run (``resume=True``) continues exactly where the checkpoint left off: the same
    batches, dropout masks and parameters as an uninterrupted run.

    Divergence (a non-finite loss or gradient, or an exploding smoothed loss) stops training
    without crashing: the summary has ``diverged: True`` and the reason, the event is recorded
    in the metrics and in ``diverged.json``, and the checkpoint keeps the last good state.

    Returns:
        dict with ``out``, ``step``, ``val_loss`` (last evaluation, nats/char), ``val_bpc``,
        ``best_val_loss``, ``train_loss``, ``tokens_per_s``, ``train_time_s``, ``params``,
        ``diverged`` and ``divergence`` (None or a dict with step, reason, loss).
    """
    # ------------------------------------------------------------------ distributed setup
    ddp = int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ
    own_group = ddp and not dist.is_initialized()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = _resolve_device(cfg.device, local_rank)
    if own_group:
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if ddp else (0, 1)
    master = rank == 0
    try:
        summary = _train(cfg, device, rank, world, master)
        if own_group:
            # Rank 0 may still be writing its last checkpoint; tearing the group down under it
            # (rank 0 also hosts the rendezvous store) can abort the other ranks.
            dist.barrier()
        return summary
    finally:
        if own_group:
            dist.destroy_process_group()


def _train(cfg: TrainConfig, device: torch.device, rank: int, world: int, master: bool) -> dict:
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    out = Path(cfg.out)
    ckpt_path = out / CHECKPOINT
    ckpt = None
    if ckpt_path.exists():
        if not cfg.resume:
            raise InputError(
                f"{out} already holds a checkpoint: pass --resume to continue it, or choose "
                "another --out"
            )
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True)
        _check_resumable(ckpt["train_config"], cfg)

    # ------------------------------------------------------------------ data
    vocab = None if ckpt is None else CharVocab.from_dict(ckpt["vocab"])
    corpus = load_corpus(cfg.data, cfg.data_format, cfg.val_data, vocab=vocab)
    check_block_size(corpus, cfg.block_size)
    generator = torch.Generator().manual_seed(cfg.seed + rank)  # batches differ per process

    # ------------------------------------------------------------------ model, optimiser
    torch.manual_seed(cfg.seed)  # identical initial weights in every process
    mconfig = model_config(cfg, corpus.vocab.size)
    model = build_model(mconfig).to(device)
    torch.manual_seed(cfg.seed + rank)  # dropout masks differ per process
    optimizer = torch.optim.AdamW(
        _param_groups(model, cfg.weight_decay),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        fused=device.type == "cuda",
    )
    step, best_val, val_loss, elapsed, tokens_seen = 0, math.inf, math.nan, 0.0, 0
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        step, best_val, val_loss = ckpt["step"], ckpt["best_val_loss"], ckpt["val_loss"]
        elapsed, tokens_seen = ckpt["train_time_s"], ckpt["tokens_seen"]
        states = ckpt["rng"]
        if len(states) == world:
            _set_rng_state(states[rank], generator, device)
        elif master:
            tqdm.write(f"resuming on {world} process(es) from {len(states)}: random streams "
                       "restart, so the run will not repeat an uninterrupted one exactly")
    raw_model = model
    if world > 1:
        ids = [device.index] if device.type == "cuda" else None
        model = nn.parallel.DistributedDataParallel(model, device_ids=ids)

    # ------------------------------------------------------------------ outputs
    writer = None
    if master:
        out.mkdir(parents=True, exist_ok=True)
        _trim_metrics(out / METRICS, step)
        (out / DIVERGED).unlink(missing_ok=True)
        if cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                writer = SummaryWriter(log_dir=str(out / "tensorboard"), purge_step=step)
            except ImportError:  # the tensorboard package is optional
                writer = None

    def record(entry: dict) -> None:
        if not master:
            return
        with open(out / METRICS, "a") as f:
            f.write(json.dumps(entry) + "\n")
        if writer is not None and "event" not in entry:
            for key, value in entry.items():
                if key in TENSORBOARD_TAGS:
                    writer.add_scalar(TENSORBOARD_TAGS[key], value, entry["step"])

    def save() -> None:
        states = _rng_state(generator, device)
        if world > 1:
            gathered = [None] * world
            dist.all_gather_object(gathered, states)
            states = gathered
        else:
            states = [states]
        if not master:
            return
        atomic_torch_save(
            {
                "kind": "flowattn-lm",
                "version": 1,
                "model_config": mconfig.to_dict(),
                "train_config": asdict(cfg),
                "vocab": corpus.vocab.to_dict(),
                "data": _corpus_record(corpus),
                "model": raw_model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "step": step,
                "val_loss": val_loss,
                "best_val_loss": best_val,
                "train_time_s": elapsed,
                "tokens_seen": tokens_seen,
                "world_size": world,
                "rng": states,
                "loop": {"smoothed": smoothed, "best_smoothed": best_smoothed,
                         "window_loss": window_loss, "window_steps": window_steps},
            },
            ckpt_path,
        )

    if master:
        tqdm.write(f"data: {corpus.describe()}")
        tqdm.write(f"model: {raw_model.num_parameters():,} parameters, {mconfig.model} "
                   f"{mconfig.attention if mconfig.model == 'transformer' else ''}".rstrip())

    # ------------------------------------------------------------------ the loop
    bar = tqdm(total=cfg.steps, initial=step, disable=not (master and cfg.progress),
               dynamic_ncols=True, desc="train")
    model.train()
    tokens_per_step = cfg.batch_size * cfg.block_size * world
    smoothed, best_smoothed, divergence, last_train = None, math.inf, None, math.nan
    window_loss, window_steps, window_time = 0.0, 0, 0.0
    if ckpt is not None:  # the running statistics continue too
        loop = ckpt["loop"]
        smoothed, best_smoothed = loop["smoothed"], loop["best_smoothed"]
        window_loss, window_steps = loop["window_loss"], loop["window_steps"]
    while step < cfg.steps:
        t0 = time.perf_counter()
        lr = learning_rate(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = get_batch(corpus.train, cfg.block_size, cfg.batch_size, generator, device)
        failed = torch.zeros((), device=device)
        try:
            _, losses = model(x, y)
        except NonFiniteError:  # the attention modules refuse NaN/Inf activations
            failed += 1
        if world > 1:  # every process stops if one does
            dist.all_reduce(failed)
        if failed > 0:
            divergence = {"step": step + 1, "loss": math.nan, "grad_norm": math.nan,
                          "reason": "non-finite activations"}
            break
        optimizer.zero_grad(set_to_none=True)
        losses["loss"].backward()
        grad_norm = nn.utils.clip_grad_norm_(
            raw_model.parameters(), cfg.grad_clip if cfg.grad_clip > 0 else math.inf
        )
        stats = torch.stack([losses["nll"].detach(), grad_norm.detach().to(losses["nll"].dtype)])
        if world > 1:
            dist.all_reduce(stats)
            stats /= world
        nll, gnorm = (float(v) for v in stats)
        if not math.isfinite(nll) or not math.isfinite(gnorm):
            divergence = {"step": step + 1, "loss": nll, "grad_norm": gnorm,
                          "reason": "non-finite loss" if not math.isfinite(nll)
                          else "non-finite gradient"}
            break
        optimizer.step()
        step += 1
        dt = time.perf_counter() - t0
        elapsed += dt
        tokens_seen += tokens_per_step
        window_loss += nll
        window_steps += 1
        window_time += dt
        smoothed = nll if smoothed is None else 0.9 * smoothed + 0.1 * nll
        best_smoothed = min(best_smoothed, smoothed)
        if smoothed > cfg.divergence_factor * best_smoothed:
            divergence = {"step": step, "loss": nll, "grad_norm": gnorm,
                          "reason": f"smoothed loss {smoothed:.3f} exceeds "
                          f"{cfg.divergence_factor:g} x its best {best_smoothed:.3f}"}
            break
        bar.update(1)
        if step % cfg.log_interval == 0 or step == cfg.steps:
            bar.set_postfix(loss=f"{nll:.4f}", lr=f"{lr:.2e}")
            record({"step": step, "train_loss": window_loss / window_steps, "lr": lr,
                    "grad_norm": gnorm,
                    "tokens_per_s": tokens_per_step * window_steps / max(window_time, 1e-9)})
            last_train = window_loss / window_steps
            window_loss, window_steps, window_time = 0.0, 0, 0.0
        if step % cfg.eval_interval == 0 or step == cfg.steps:
            val_loss = evaluate(raw_model, corpus.val, cfg.block_size, cfg.batch_size, device,
                                cfg.eval_iters, generator=None, rank=rank, world=world)
            best_val = min(best_val, val_loss)
            record({"step": step, "val_loss": val_loss, "val_bpc": val_loss / math.log(2),
                    "best_val_loss": best_val})
            if master:
                tqdm.write(f"step {step}: val loss {val_loss:.4f} nats/char "
                           f"({val_loss / math.log(2):.4f} bpc)")
            if not math.isfinite(val_loss):
                divergence = {"step": step, "loss": val_loss, "grad_norm": gnorm,
                              "reason": "non-finite validation loss"}
                break
            save()
    bar.close()

    # ------------------------------------------------------------------ summary
    if divergence is not None and master:
        message = (f"training diverged at step {divergence['step']}: {divergence['reason']}; "
                   f"the checkpoint keeps the last evaluated state")
        tqdm.write(message)
        record({"step": divergence["step"], "event": "diverged", **divergence})
        _write_json({**divergence, "message": message}, out / DIVERGED)
    if writer is not None:
        writer.close()
    return {
        "out": str(out),
        "step": step,
        "val_loss": val_loss,
        "val_bpc": val_loss / math.log(2),
        "best_val_loss": best_val,
        "train_loss": last_train,
        "tokens_per_s": tokens_seen / elapsed if elapsed > 0 else math.nan,
        "train_time_s": elapsed,
        "params": raw_model.num_parameters(),
        "world_size": world,
        "diverged": divergence is not None,
        "divergence": divergence,
    }



def _trim_metrics(path: Path, step: int) -> None:
    """Drop records past ``step`` (logged after the checkpoint a run resumes from)."""
    if step == 0:
        path.unlink(missing_ok=True)
    else:
        truncate_metrics(path, step)
