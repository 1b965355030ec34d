"""Training a character language model: the model, data and loss the shared loop trains.

:func:`train` plans the run folder (fresh, resumed or refused, see
:mod:`flowattn.training.run`), builds an :class:`LMTask` — the corpus, the model and its
cross-entropy — and hands it to :func:`flowattn.training.loop.train`, which does everything
else the same way as for every other command. Launched under ``torchrun`` it trains with
DistributedDataParallel (gloo on CPU, NCCL on GPUs).
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..attention import ContractiveL2MHA, frozen_certificates
from ..errors import CheckpointError, ConfigError, NonFiniteError
from ..training.checkpoint import read_model, unbuildable
from ..training.device import check_compilable
from ..training.distributed import Distributed
from ..training.loop import train as train_loop
from ..training.memory import check_fits, check_model_fits, pass_bytes, state_bytes
from ..training.run import data_fingerprint, plan_run
from .config import DEFAULT_CORPUS, LMConfig, LMRunConfig
from .data import CharCorpus, CharVocab, check_block_size, eval_windows, get_batch, load_corpus
from .model import build_model

__all__ = ["LMTask", "train", "evaluate", "load_checkpoint", "eager_state_dict"]


class LMTask:
    """A character language model on a corpus: next-character cross-entropy in nats.

    Arguments:
        config: the run's settings.
        dist: this process's place in the run (device, rank).
        vocab: the vocabulary of a resumed run (a fresh run takes the training text's).
    """

    items = "tokens"
    units = {"loss": "nats/char"}  # of the validation metrics, as printed (bpc is its own)

    def __init__(self, config: LMRunConfig, dist: Distributed, vocab: CharVocab | None = None):
        self.config, self.dist = config, dist
        data, net, train = config.data, config.network, config.train
        if train.batch_size % dist.world:
            raise ConfigError(f"batch_size={train.batch_size} must be a multiple of the "
                              f"{dist.world} processes")
        self.corpus = load_corpus(data.data, data.data_format, data.val_data, vocab=vocab)
        check_block_size(self.corpus, net.block_size)
        self.model_config = LMConfig(vocab_size=self.corpus.vocab.size, **net.to_dict())
        check_model_fits(lambda k: build_model(LMConfig(**{**self.model_config.to_dict(),
                                                             "layers": k})),
                         net.layers, dist.device, average=train.ema is not None,
                         smaller="a smaller --dim or fewer --layers")
        torch.manual_seed(train.seed)  # identical initial weights in every process
        self.model = build_model(self.model_config).to(dist.device)
        if train.compile:
            # The loop trains through the compiled wrapper, which shares the model's parameters,
            # and saves self.model's state dict: the checkpoint's keys are those of an eager run
            # (no "_orig_mod." prefix). Validation and sampling stay eager.
            check_compilable(dist.device)
            self.forward_module = torch.compile(self.model)

    def describe(self) -> list[str]:
        net = self.model_config
        kind = f"{net.model} {net.attention}" if net.model == "transformer" else net.model
        lines = [f"data: {self.corpus.describe()}",
                 f"model: {self.model.num_parameters():,} parameters, {kind}"]
        hint = spectral_norms_hint(self.model, self.dist.device)
        return lines if hint is None else [*lines, hint]

    def initialise(self) -> None:
        pass

    def check_memory(self) -> None:
        """Refuse a batch whose training step would not fit in the device's memory
        (:mod:`flowattn.training.memory`): the tensors a sequence's loss saves for the
        backward pass, times the sequences of this process's step, what the pass saves
        whatever its batch, and the gradients and optimiser state."""
        state = state_bytes(self.model, self.config.train.ema is not None)
        block = self.config.network.block_size
        x, y = (t.to(self.dist.device) for t in
                (self.corpus.train[:block].unsqueeze(0), self.corpus.train[1:block + 1]
                 .unsqueeze(0)))
        saved = pass_bytes(self.model,
                           lambda k: self.model(x.repeat(k, 1), y.repeat(k, 1))[1]["loss"])
        check_fits(saved, self.config.train.batch_size, self.dist.device,
                   processes=self.dist.world, hints=("a smaller --block-size, --dim or --layers",),
                   state=state)

    def batch(self, generator: torch.Generator, dist: Distributed):
        cfg = self.config
        x, y = get_batch(self.corpus.train, cfg.network.block_size, cfg.train.batch_size,
                         generator)
        share = slice(dist.rank, None, dist.world)
        return x[share].to(dist.device), y[share].to(dist.device)

    def loss(self, module: nn.Module, batch):
        x, y = batch
        _, losses = module(x, y)
        return losses["loss"], losses["nll"], y.numel()

    def evaluate(self, dist: Distributed) -> dict[str, float]:
        cfg = self.config
        loss = evaluate(self.model, self.corpus.val, cfg.network.block_size,
                        cfg.train.batch_size, dist.device, cfg.data.eval_iters,
                        rank=dist.rank, world=dist.world)
        return {"loss": loss, "bpc": loss / math.log(2)}

    def finish(self, out: Path) -> dict[str, Any]:
        return {}

    def state(self) -> dict[str, Any]:
        return {"model_config": self.model_config.to_dict(),
                "vocab": self.corpus.vocab.to_dict(), "corpus": corpus_record(self.corpus)}


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
    with frozen_certificates():  # fixed weights: each attention bound computed once
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


def corpus_record(corpus: CharCorpus) -> dict:
    """Where a corpus came from (absolute paths), its format and its digest."""

    def absolute(path: str | None) -> str | None:
        return path if path in (None, DEFAULT_CORPUS) else os.path.abspath(path)

    return {"source": absolute(corpus.source), "format": corpus.format,
            "val_source": absolute(corpus.val_source), "sha256": corpus.sha256}


def load_checkpoint(path: str | Path,
                    device: str | torch.device = "cpu") -> tuple[nn.Module, dict, CharVocab]:
    """Rebuild the model of a checkpoint (a run folder or its checkpoint file).

    Returns:
        ``(model in evaluation mode, record, vocabulary)``; the record has at least ``step``,
        ``corpus`` (source, format, val_source, sha256) and ``version``.

    Raises:
        CheckpointError: naming the file, if it is missing, unreadable or not a language-model
            checkpoint.
    """
    record = read_model(path, "lm", map_location=device)
    try:
        if record["version"] == 1:  # format 1: the model's settings and vocabulary at the top
            task = {"model_config": record["model_config"], "vocab": record["vocab"],
                    "corpus": record["data"]}
        else:
            task = record["task"]
        config = LMConfig.from_dict(task["model_config"])
        model = build_model(config).to(device)
        model.load_state_dict(eager_state_dict(record["model"]))
    except (KeyError, TypeError, RuntimeError) as err:
        raise unbuildable(record, "a language model", err) from None
    record = {**record, "corpus": task["corpus"], "model_config": config}
    return model.eval(), record, CharVocab.from_dict(task["vocab"])


def eager_state_dict(state: Mapping[str, Any]) -> dict:
    """``state`` with the ``_orig_mod.`` prefix that ``torch.compile(model).state_dict()``
    puts before every key removed: the state dict of the model itself.

    Checkpoints written by :func:`train` never carry the prefix (the loop saves the model, not
    its compiled wrapper); this lets a state dict saved from a compiled wrapper load as well.

    Examples:
        >>> sorted(eager_state_dict({"_orig_mod.head.weight": 1, "tok_emb.weight": 2}))
        ['head.weight', 'tok_emb.weight']
    """
    prefix = "_orig_mod."
    if not any(key.startswith(prefix) for key in state):
        return state  # as it is: a copy would lose the modules' versions (``_metadata``)
    out = OrderedDict((key.removeprefix(prefix), value) for key, value in state.items())
    metadata = getattr(state, "_metadata", None)
    if metadata is not None:  # module versions, keyed by module path: "_orig_mod.blocks.0" ...
        out._metadata = type(metadata)(
            ("" if key == prefix[:-1] else key.removeprefix(prefix), value)
            for key, value in metadata.items())
    return out


def _fingerprint(config: LMRunConfig) -> dict:
    return data_fingerprint(config.data.data, config.data.val_data)


def train(
    config: LMRunConfig | None = None,
    out: str | Path = "runs/lm",
    *,
    resume: bool = False,
    file: str | Path | None = None,
    flags: Mapping[str, Any] | None = None,
    progress: bool = True,
    tensorboard: bool | None = None,
) -> dict:
    """Train a character language model; return the summary (also in ``out/summary.json``).

    From Python, pass ``config`` (an :class:`LMRunConfig`); the command line passes the config
    file and the flags the user typed instead. ``resume=True`` continues the run in ``out``
    exactly where its checkpoint left off — the same batches, dropout masks and parameters as
    an uninterrupted run; only the settings in ``LMRunConfig.RESUMABLE`` may differ from the
    stored ones. A finished run is not trained again: the summary of the finished run comes
    back with ``finished: True``.

    Writes to ``out``: ``run.json``, ``config.json``, ``checkpoint.pt`` (atomically, every
    ``checkpoint_every`` steps), ``metrics.jsonl``, TensorBoard events, ``summary.json`` and,
    if training diverged, ``diverged.json``.

    Returns:
        dict with ``out``, ``step``, ``val_loss`` (last evaluation, nats/char), ``val_bpc``,
        ``result_step``, ``result_val_loss`` and ``result_val_bpc`` (the state the run leaves:
        with ``keep_best`` the best validation's, else the last step's), ``best_val_loss``,
        ``train_loss``, ``tokens_per_s``, ``train_seconds``, ``params``, ``world_size``,
        ``diverged`` and ``divergence`` (None or a dict with step, reason, loss).
    """
    if config is not None:
        flags = {**config.flat(), **(flags or {})}
    plan = plan_run(out, "lm", LMRunConfig, resume=resume, file=file, flags=flags,
                    fingerprint=_fingerprint)
    if plan.finished:
        return _finished(plan)
    if plan.config.train.threads is not None:
        torch.set_num_threads(plan.config.train.threads)
    ctx = Distributed.join(plan.config.train.device)
    try:
        vocab = None
        if plan.checkpoint is not None:
            vocab = CharVocab.from_dict(plan.checkpoint["task"]["vocab"])
        task = LMTask(plan.config, ctx, vocab)
        if plan.checkpoint is not None:
            _check_same_model(task.model_config, plan.checkpoint)
        if ctx.is_main:
            for line in task.describe():
                print(line, flush=True)
        summary = train_loop(task, plan, ctx, progress=progress, tensorboard=tensorboard)
    except BaseException:
        if ctx.owns_group and dist.is_initialized():
            dist.destroy_process_group()
        raise
    summary["val_bpc"] = summary["val_loss"] / math.log(2)
    summary["result_val_bpc"] = summary["result_val_loss"] / math.log(2)
    return summary


def spectral_norms_hint(model: nn.Module, device: torch.device) -> str | None:
    """A line for the run's log where the certificates of ``model`` take their spectral norms
    from the eigensolver on a GPU (slow there: cuSOLVER synchronises with the host at every
    sweep) and ``--spectral-norms squarings`` would be faster; None otherwise.

    Examples:
        >>> from flowattn.lm.config import LMConfig
        >>> model = build_model(LMConfig(vocab_size=5, attention="contractive-l2", layers=1))
        >>> spectral_norms_hint(model, torch.device("cpu")) is None
        True
        >>> spectral_norms_hint(model, torch.device("cuda")).startswith("note:")
        True
    """
    if device.type != "cuda":
        return None
    if not any(isinstance(m, ContractiveL2MHA) and m.attention.spectral_norms == "eigh"
               for m in model.modules()):
        return None
    return ("note: contractive attention's certificate takes its spectral norms from the "
            "eigensolver, which is slow on a GPU; --spectral-norms squarings (a certified "
            "bound from matrix products) trains up to 4.9x faster (docs/lm.md)")


def _check_same_model(config: LMConfig, checkpoint: dict) -> None:
    """Refuse to resume if the run's settings no longer build the checkpoint's model (a
    stored config whose ``"auto"`` settings would resolve otherwise today). Settings a resumed
    run may change (``LMRunConfig.RESUMABLE``, e.g. how certificates take their spectral
    norms) are not compared."""
    stored = LMConfig.from_dict(checkpoint["task"]["model_config"]).to_dict()
    now = config.to_dict()
    changed = {k: (v, now[k]) for k, v in stored.items()
               if now[k] != v and k not in LMRunConfig.RESUMABLE}
    if changed:
        listed = "; ".join(f"{k} ({a!r} in the checkpoint, {b!r} now)"
                           for k, (a, b) in changed.items())
        raise CheckpointError(f"{checkpoint['path']}: the run's settings build another model "
                              f"than the one it trained: {listed}")


def _finished(plan) -> dict:
    import json

    summary = json.loads((plan.out / "summary.json").read_text())
    return {**summary, "finished": True}
