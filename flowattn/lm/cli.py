"""The ``flowattn lm`` commands: train, eval, sample and invert-check character language models."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

from ..errors import InputError
from .data import DEFAULT_CORPUS, FORMATS, check_block_size, load_corpus
from .model import ATTENTIONS, INITS, MODELS, NORMS
from .train import SCHEDULES, TrainConfig, evaluate, load_checkpoint, train

__all__ = ["add_lm_subparsers", "EXIT_DIVERGED", "EXIT_CHECK_FAILED"]

EXIT_DIVERGED = 3  # training stopped on divergence (recorded in OUT/diverged.json)
EXIT_CHECK_FAILED = 1  # invert-check: reconstruction error above --threshold


def _emit(payload: dict, as_json: bool, lines: list[str]) -> None:
    """Print the human-readable lines, then (with --json) the payload as the last line."""
    for line in lines:
        print(line)
    if as_json:
        print(json.dumps(_finite(payload), allow_nan=False))


def _finite(d: dict) -> dict:
    """Replace non-finite floats by None: JSON has no NaN."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            v = _finite(v)
        elif isinstance(v, float) and not math.isfinite(v):
            v = None
        out[k] = v
    return out


# ----------------------------------------------------------------------------- train


def _add_train(sub) -> None:
    d = TrainConfig()
    p = sub.add_parser(
        "train",
        help="train a character language model",
        description="Train a character-level language model. Defaults reproduce nanoGPT's CPU "
        "configuration for Tiny Shakespeare. Without --data the model trains on the help "
        "topics that ship with Python.",
    )
    g = p.add_argument_group("data")
    g.add_argument("--data", metavar="PATH", help="UTF-8 text or PTB-char file (default: "
                   "the embedded corpus)")
    g.add_argument("--format", dest="data_format", choices=FORMATS, default=d.data_format,
                   help="file format; auto detects PTB-char (default: %(default)s)")
    g.add_argument("--val-data", metavar="PATH", help="separate validation file (default: "
                   "the last 10%% of --data)")
    g = p.add_argument_group("model")
    g.add_argument("--model", choices=MODELS, default=d.model, help="(default: %(default)s)")
    g.add_argument("--attention", choices=ATTENTIONS,
                   help="attention type (default: dp; contractive-l2 with --invertible)")
    g.add_argument("--layers", type=int, default=d.layers, help="(default: %(default)s)")
    g.add_argument("--dim", type=int, default=d.dim, help="model width (default: %(default)s)")
    g.add_argument("--heads", type=int, default=d.heads, help="(default: %(default)s)")
    g.add_argument("--block-size", type=int, default=d.block_size,
                   help="context length (default: %(default)s)")
    g.add_argument("--norm", choices=NORMS,
                   help="block normalisation (default: layernorm; actnorm with --invertible)")
    g.add_argument("--norm-position", choices=("pre", "post"), default=d.norm_position,
                   help="(default: %(default)s)")
    g.add_argument("--final-norm", choices=NORMS, help="normalisation before the output layer")
    g.add_argument("--weighted-residual", action="store_true",
                   help="LipsFormer residual x + alpha * f(x), alpha learnable per channel")
    g.add_argument("--residual-alpha", type=float, help="initial alpha (default: 1/layers)")
    g.add_argument("--init", choices=INITS, default=d.init, help="(default: %(default)s)")
    g.add_argument("--init-scale", type=float, default=d.init_scale,
                   help="scale s of L2 attention weights for --init glorot-l2 "
                   "(default: %(default)s)")
    g.add_argument("--ff-mult", type=int, default=d.ff_mult, help="(default: %(default)s)")
    g.add_argument("--dropout", type=float, default=d.dropout, help="(default: %(default)s)")
    g.add_argument("--bias", action=argparse.BooleanOptionalAction, default=d.bias,
                   help="biases in linear layers and norms (default: %(default)s)")
    g.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction,
                   default=d.tie_embeddings, help="(default: %(default)s)")
    g.add_argument("--invertible", action="store_true",
                   help="contractive blocks: embeddings -> hidden states is invertible")
    g.add_argument("--contractive-coeff", type=float, default=d.contractive_coeff,
                   help="Lipschitz coefficient of contractive branches (default: %(default)s)")
    g.add_argument("--ortho-attention", type=float, default=0.0, metavar="LAMBDA",
                   help="orthogonality loss on attention weights")
    g.add_argument("--ortho-ff", type=float, default=0.0, metavar="LAMBDA",
                   help="orthogonality loss on feed-forward weights")
    g.add_argument("--ortho-affinity", type=float, default=0.0, metavar="LAMBDA",
                   help="orthogonality loss on attention matrices")
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=int, default=d.steps, help="(default: %(default)s)")
    g.add_argument("--batch-size", type=int, default=d.batch_size, help="(default: %(default)s)")
    g.add_argument("--lr", type=float, default=d.lr, help="peak learning rate "
                   "(default: %(default)s)")
    g.add_argument("--schedule", choices=SCHEDULES, default=d.schedule,
                   help="(default: %(default)s)")
    g.add_argument("--warmup", type=int, default=d.warmup, help="(default: %(default)s)")
    g.add_argument("--min-lr", type=float, default=d.min_lr, help="(default: %(default)s)")
    g.add_argument("--beta1", type=float, default=d.beta1, help="(default: %(default)s)")
    g.add_argument("--beta2", type=float, default=d.beta2, help="(default: %(default)s)")
    g.add_argument("--weight-decay", type=float, default=d.weight_decay,
                   help="(default: %(default)s)")
    g.add_argument("--grad-clip", type=float, default=d.grad_clip,
                   help="0 disables clipping (default: %(default)s)")
    g = p.add_argument_group("run")
    g.add_argument("--out", default=d.out, metavar="DIR", help="(default: %(default)s)")
    g.add_argument("--resume", action="store_true", help="continue the checkpoint in --out")
    g.add_argument("--eval-interval", type=int, default=d.eval_interval,
                   help="(default: %(default)s)")
    g.add_argument("--eval-iters", type=int, default=d.eval_iters,
                   help="random validation batches per evaluation; 0 scores the whole split "
                   "(default: %(default)s)")
    g.add_argument("--log-interval", type=int, default=d.log_interval,
                   help="(default: %(default)s)")
    g.add_argument("--seed", type=int, default=d.seed, help="(default: %(default)s)")
    g.add_argument("--device", default=d.device, help="auto, cpu, cuda, ... "
                   "(default: %(default)s)")
    g.add_argument("--threads", type=int, help="torch CPU threads")
    g.add_argument("--divergence-factor", type=float, default=d.divergence_factor,
                   help="stop when the smoothed loss exceeds this multiple of its best "
                   "(default: %(default)s)")
    g.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar")
    g.add_argument("--no-tensorboard", dest="tensorboard", action="store_false",
                   help="do not write TensorBoard events")
    p.add_argument("--json", action="store_true", help="last stdout line: a JSON summary")
    p.set_defaults(handler=_train)


def _train(args: argparse.Namespace) -> int:
    names = set(TrainConfig.__dataclass_fields__)
    cfg = TrainConfig(**{k: v for k, v in vars(args).items() if k in names})
    if cfg.data is None:
        print(f"no --data given: training on the embedded corpus ({DEFAULT_CORPUS})",
              file=sys.stderr)
    summary = _finite(train(cfg))
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun only the first process reports
        return EXIT_DIVERGED if summary["diverged"] else 0
    lines = []
    if summary["diverged"]:
        lines.append(f"diverged: {summary['divergence']['reason']} "
                     f"(step {summary['divergence']['step']})")
    val = summary["val_loss"]
    lines.append(
        f"{summary['step']} steps, val loss "
        + ("n/a" if val is None else f"{val:.4f} nats/char ({summary['val_bpc']:.4f} bpc)")
        + f", {summary['tokens_per_s'] or 0:.0f} tokens/s, checkpoint in {summary['out']}"
    )
    _emit(summary, args.json, lines)
    return EXIT_DIVERGED if summary["diverged"] else 0


# ----------------------------------------------------------------------------- eval


def _corpus_for(ckpt: dict, vocab, data: str | None):
    record = ckpt["data"]
    source = data if data is not None else record["source"]
    path = None if source == DEFAULT_CORPUS else source
    val = None if data is not None else record["val_source"]
    try:
        corpus = load_corpus(path, record["format"] if data is None else "auto", val, vocab=vocab)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"{err} (the checkpoint's corpus; pass --data PATH)") from None
    if data is None and corpus.sha256 != record["sha256"]:
        print(f"warning: {source} differs from the text the model was trained on",
              file=sys.stderr)
    return corpus


def _add_eval(sub) -> None:
    p = sub.add_parser("eval", help="validation loss of a checkpoint",
                       description="Score the whole validation split of the checkpoint's corpus "
                       "(or of --data) once: mean cross-entropy in nats per character and bits "
                       "per character.")
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="run directory or ckpt.pt")
    p.add_argument("--data", metavar="PATH", help="score this file's validation split instead")
    p.add_argument("--split", choices=("val", "train"), default="val", help="(default: val)")
    p.add_argument("--batch-size", type=int, default=64, help="windows per batch (default: 64)")
    p.add_argument("--device", default="cpu", help="(default: cpu)")
    p.add_argument("--json", action="store_true", help="last stdout line: a JSON object")
    p.set_defaults(handler=_eval)


def _eval(args: argparse.Namespace) -> int:
    model, ckpt, vocab = load_checkpoint(args.checkpoint, args.device)
    corpus = _corpus_for(ckpt, vocab, args.data)
    block = model.config.block_size
    check_block_size(corpus, block)
    data = corpus.val if args.split == "val" else corpus.train
    loss = evaluate(model, data, block, args.batch_size, torch.device(args.device))
    result = {
        "val_loss" if args.split == "val" else "train_loss": loss,
        "bpc": loss / math.log(2),
        "split": args.split,
        "characters": len(data),
        "step": ckpt["step"],
        "checkpoint": str(args.checkpoint),
    }
    _emit(result, args.json, [f"{args.split} loss {loss:.4f} nats/char "
                              f"({loss / math.log(2):.4f} bpc) at step {ckpt['step']}"])
    return 0


# ----------------------------------------------------------------------------- sample


def _add_sample(sub) -> None:
    p = sub.add_parser("sample", help="generate text from a checkpoint")
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="run directory or ckpt.pt")
    p.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    p.add_argument("--max-new-tokens", type=int, default=500, help="(default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.8, help="(default: %(default)s)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest")
    p.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    p.add_argument("--device", default="cpu", help="(default: cpu)")
    p.add_argument("--json", action="store_true", help="last stdout line: a JSON object")
    p.set_defaults(handler=_sample)


def _sample(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 0:
        raise InputError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if not args.prompt:
        raise InputError("--prompt must not be empty")
    model, _, vocab = load_checkpoint(args.checkpoint, args.device)
    missing = vocab.missing(args.prompt)
    if missing:
        raise InputError(f"the prompt holds characters the model never saw: {''.join(missing)!r}")
    idx = vocab.encode(args.prompt).unsqueeze(0).to(args.device)
    generator = torch.Generator().manual_seed(args.seed)
    out = model.generate(idx, args.max_new_tokens, args.temperature, args.top_k, generator)
    text = vocab.decode(out[0])
    _emit({"prompt": args.prompt, "text": text}, args.json, [text])
    return 0


# ----------------------------------------------------------------------------- invert-check


def _add_invert_check(sub) -> None:
    p = sub.add_parser(
        "invert-check",
        help="reconstruct embeddings from hidden states of an invertible LM",
        description="Embed held-out text, run the invertible stack, invert it by fixed-point "
        "iteration and report the largest reconstruction error of the embeddings.",
    )
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="run directory or ckpt.pt")
    p.add_argument("--data", metavar="PATH", help="take the held-out text from this file")
    p.add_argument("--sequences", type=int, default=16,
                   help="validation windows to reconstruct (default: %(default)s)")
    p.add_argument("--tol", type=float, default=1e-6,
                   help="relative residual tolerance of each inverse (default: %(default)s)")
    p.add_argument("--max-iter", type=int, default=500, help="(default: %(default)s)")
    p.add_argument("--method", choices=("fixed-point", "anderson"), default="fixed-point",
                   help="(default: %(default)s)")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                   help="(default: %(default)s)")
    p.add_argument("--threshold", type=float, default=1e-4,
                   help="exit with status 1 when the max error exceeds it (default: %(default)s)")
    p.add_argument("--device", default="cpu", help="(default: cpu)")
    p.add_argument("--json", action="store_true", help="last stdout line: a JSON object")
    p.set_defaults(handler=_invert_check)


def _invert_check(args: argparse.Namespace) -> int:
    from .invertible import reconstruction_report

    if args.sequences < 1:
        raise InputError(f"--sequences must be >= 1, got {args.sequences}")
    model, ckpt, vocab = load_checkpoint(args.checkpoint, args.device)
    if not model.config.invertible:
        raise InputError(
            f"{args.checkpoint} holds a non-invertible model: train with --invertible"
        )
    model = model.to(getattr(torch, args.dtype))
    corpus = _corpus_for(ckpt, vocab, args.data)
    block = model.config.block_size
    check_block_size(corpus, block)
    n = min(args.sequences, (len(corpus.val) - 1) // block)
    idx = corpus.val[: n * block].reshape(n, block).to(args.device)  # held-out text
    report = reconstruction_report(model, idx, args.tol, args.max_iter, args.method)
    report.update(dtype=args.dtype, threshold=args.threshold, sequences=n,
                  passed=report["max_error"] <= args.threshold)
    _emit(report, args.json, [
        f"max reconstruction error {report['max_error']:.3e} over {report['tokens']} tokens "
        f"({args.dtype}); tokens recovered {100 * report['token_accuracy']:.2f}%; largest "
        f"certified branch constant {report['max_branch_bound']:.4f}",
    ])
    return 0 if report["passed"] else EXIT_CHECK_FAILED


def add_lm_subparsers(subparsers) -> None:
    """Register ``lm`` and its commands ``train``, ``eval``, ``sample`` and ``invert-check`` on
    the sub-command set of a top-level parser. Each command stores its function as
    ``args.handler``, which returns the exit status."""
    lm = subparsers.add_parser(
        "lm",
        help="character-level language models",
        description="Character-level language models with dot-product, L2, contractive and "
        "scaled-cosine attention, an LSTM baseline and a fully invertible Transformer.",
    )
    sub = lm.add_subparsers(dest="lm_command", metavar="COMMAND", required=True)
    _add_train(sub)
    _add_eval(sub)
    _add_sample(sub)
    _add_invert_check(sub)
