"""The ``flowattn lm`` commands: train, eval, sample and invert-check character language models.

The parsers are built without importing torch (``--help`` answers at once); each command
imports what it runs.
"""

from __future__ import annotations

import argparse
import math
import sys

from ..errors import InputError, InverseNotConverged, NonFiniteError
from ..training.cli import (
    add_run_arguments,
    add_threads,
    is_main_process,
    json_line,
    print_run_config,
    run_summary_lines,
    seed,
)
from ..training.config import add_arguments, from_sources, given_flags, read_config_file
from .config import DEFAULT_CORPUS, LMRunConfig, check_applicable

__all__ = ["add_lm_subparsers", "EXIT_CHECK_FAILED"]

EXIT_CHECK_FAILED = 1  # invert-check: reconstruction error above --threshold


def _emit(payload: dict, as_json: bool, lines: list[str]) -> None:
    """Print the human-readable lines, then (with --json) the payload as the last line."""
    for line in lines:
        print(line)
    if as_json:
        print(json_line(payload))


# ----------------------------------------------------------------------------- train


def _add_train(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a character language model",
        description="Train a character-level language model. Defaults reproduce nanoGPT's CPU "
        "configuration for Tiny Shakespeare. Without --data the model trains on the help "
        "topics that ship with Python. Settings come from the defaults, then --config FILE "
        "(JSON or YAML), then the flags; --print-config shows them all.",
    )
    add_run_arguments(p, default_out="runs/lm")
    add_arguments(p, LMRunConfig)
    p.set_defaults(handler=_train)


def _train(args: argparse.Namespace) -> int:
    flags = given_flags(args, LMRunConfig)
    if not args.resume:  # settings typed for a model that would not read them
        given = set(flags)
        if args.config:
            given |= {name for section in
                      LMRunConfig.nest(read_config_file(args.config), args.config).values()
                      for name in section}
        check_applicable(from_sources(LMRunConfig, args.config, flags).network, given)
    if args.print_config:  # (what training would refuse, it refuses too)
        return print_run_config(LMRunConfig, args, "lm")
    from ..training.loop import EXIT_DIVERGED
    from .train import train

    summary = train(out=args.out, resume=args.resume, file=args.config, flags=flags,
                    progress=args.progress, tensorboard=args.tensorboard)
    if not is_main_process():  # under torchrun only the first process reports
        return EXIT_DIVERGED if summary["diverged"] else 0
    lines = run_summary_lines(summary)
    if not summary["diverged"] and not summary.get("finished"):
        val, kept = summary["result_val_loss"], summary["result_step"]
        lines.append(
            f"{summary['step']} steps, val loss "
            + ("n/a" if val is None or not math.isfinite(val)
               else f"{val:.4f} nats/char ({summary['result_val_bpc']:.4f} bpc)")
            + (f" (step {kept}'s parameters, kept as the best)" if kept != summary["step"]
               else "")
            + f", {summary.get('tokens_per_s') or 0:.0f} tokens/s, checkpoint in "
            f"{summary['out']}")
    _emit(summary, args.json, lines)
    return EXIT_DIVERGED if summary["diverged"] else 0


# ----------------------------------------------------------------------------- eval


def _corpus_for(ckpt: dict, vocab, data: str | None):
    from ..errors import DataError
    from .data import load_corpus

    record = ckpt["corpus"]
    source = data if data is not None else record["source"]
    path = None if source == DEFAULT_CORPUS else source
    val = None if data is not None else record["val_source"]
    try:
        corpus = load_corpus(path, record["format"] if data is None else "auto", val, vocab=vocab)
    except DataError as err:
        if data is not None:  # the file the user named: its own message says what is wrong
            raise
        raise DataError(f"{err} (the checkpoint's corpus; pass --data PATH)") from None
    if data is None and corpus.sha256 != record["sha256"]:
        print(f"warning: {source} differs from the text the model was trained on",
              file=sys.stderr)
    return corpus


def _add_eval(sub) -> None:
    p = sub.add_parser("eval", help="validation loss of a checkpoint",
                       description="Score the whole validation split of the checkpoint's corpus "
                       "(or of --data) once: mean cross-entropy in nats per character and bits "
                       "per character.")
    p.add_argument("--checkpoint", required=True, metavar="RUN", help="run folder or checkpoint")
    p.add_argument("--data", metavar="FILE", help="score this file's validation split instead")
    p.add_argument("--split", choices=("val", "train"), default="val", help="(default: val)")
    p.add_argument("--batch-size", type=int, default=64, help="windows per batch (default: 64)")
    p.add_argument("--device", default="cpu", help="(default: cpu)")
    add_threads(p)
    p.add_argument("--json", action="store_true", help="last stdout line: a JSON object")
    p.set_defaults(handler=_eval)


def _load(args: argparse.Namespace):
    """The checkpoint's model on ``--device`` (checked first: a one-line error without CUDA),
    with ``--threads`` set."""
    from ..training.device import resolve_device, set_threads
    from .train import load_checkpoint

    device = resolve_device(args.device)
    set_threads(args.threads)
    return (*load_checkpoint(args.checkpoint, device), device)


def _eval(args: argparse.Namespace) -> int:
    import torch  # noqa: F401  (the model's dependencies)

    from .data import check_block_size
    from .train import evaluate

    if args.batch_size < 1:
        raise InputError(f"--batch-size must be >= 1, got {args.batch_size}")
    model, ckpt, vocab, device = _load(args)
    corpus = _corpus_for(ckpt, vocab, args.data)
    block = model.config.block_size
    check_block_size(corpus, block)
    data = corpus.val if args.split == "val" else corpus.train
    loss = evaluate(model, data, block, args.batch_size, device)
    if not math.isfinite(loss):  # a diverged or damaged model: no score to report
        raise NonFiniteError(
            f"the model's {args.split} loss on this text is {loss} (step {ckpt['step']} of "
            f"{args.checkpoint}): its activations overflow, as a diverged run's do; evaluate an "
            "earlier checkpoint, or train again with a smaller learning rate")
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
    p.add_argument("--checkpoint", required=True, metavar="RUN", help="run folder or checkpoint")
    p.add_argument("--prompt", default=None, help="text to continue (default: a newline, or a "
                   "space, or the first character of the vocabulary, whichever the model saw)")
    p.add_argument("--max-new-tokens", type=int, default=500, help="(default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="divides the logits before sampling; > 0 (--top-k 1 picks the most "
                   "likely character) (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest")
    p.add_argument("--seed", type=seed, default=0, help="(default: %(default)s)")
    p.add_argument("--device", default="cpu", help="(default: cpu)")
    add_threads(p)
    p.add_argument("--no-progress", action="store_true", help="no report of the characters "
                   "drawn (on standard error: a bar on a terminal, else a line a minute)")
    p.add_argument("--json", action="store_true", help="last stdout line: a JSON object")
    p.set_defaults(handler=_sample)


def _sample(args: argparse.Namespace) -> int:
    import torch

    if args.max_new_tokens < 0:
        raise InputError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if args.prompt == "":
        raise InputError("--prompt must not be empty")
    if not (math.isfinite(args.temperature) and args.temperature > 0):
        raise InputError(f"--temperature must be a positive number, got {args.temperature} "
                         "(for the most likely character at every step, --top-k 1)")
    if args.top_k is not None and args.top_k < 1:
        raise InputError(f"--top-k must be >= 1, got {args.top_k}")
    model, _, vocab, device = _load(args)
    if args.prompt is None:  # a corpus without line breaks still samples without a prompt
        args.prompt = next((c for c in ("\n", " ") if c in vocab.index), vocab.chars[0])
    missing = vocab.missing(args.prompt)
    if missing:
        raise InputError(f"the prompt holds characters the model never saw: {''.join(missing)!r}")
    idx = vocab.encode(args.prompt).unsqueeze(0).to(device)
    generator = torch.Generator().manual_seed(args.seed)
    unknown = () if vocab.unknown_id is None else (vocab.unknown_id,)  # U+FFFD: never drawn
    out = model.generate(idx, args.max_new_tokens, args.temperature, args.top_k, generator,
                         exclude=unknown, progress=not args.no_progress)
    text = vocab.decode(out[0])
    _emit({"prompt": args.prompt, "text": text}, args.json, [text])
    return 0


# ----------------------------------------------------------------------------- ngram


def _add_ngram(sub) -> None:
    p = sub.add_parser(
        "ngram", help="count-based n-gram baselines on a corpus",
        description="Validation loss of add-alpha smoothed character n-gram models of each "
        "order, on the split the neural models are scored on (alpha chosen on the last tenth "
        "of the training split): the floor a language model should clear.")
    p.add_argument("--data", metavar="FILE", help="UTF-8 text or PTB-char file (default: the "
                   "embedded corpus)")
    p.add_argument("--data-format", "--format", dest="data_format",
                   choices=("auto", "text", "ptb-char"), default="auto",
                   help="(default: %(default)s)")
    p.add_argument("--val-data", metavar="FILE", help="separate validation file")
    p.add_argument("--orders", type=int, nargs="+", default=[1, 2, 3, 4, 5],
                   help="n of each model (default: 1 2 3 4 5)")
    add_threads(p)
    p.add_argument("--json", action="store_true", help="last stdout line: a JSON object")
    p.set_defaults(handler=_ngram)


def _ngram(args: argparse.Namespace) -> int:
    from ..training.device import set_threads
    from .data import load_corpus
    from .ngram import ngram_baselines

    if any(order < 1 for order in args.orders):
        raise InputError(f"--orders must be positive, got {args.orders}")
    set_threads(args.threads)
    corpus = load_corpus(args.data, args.data_format, args.val_data)
    records = ngram_baselines(corpus.train, corpus.val, corpus.vocab.size,
                              tuple(sorted(set(args.orders))))
    lines = [f"data: {corpus.describe()}"]
    lines += [f"{r['order']}-gram (alpha {r['alpha']:g}): val loss {r['val_loss']:.4f} "
              f"nats/char ({r['val_bpc']:.4f} bpc)" for r in records]
    _emit({"source": corpus.source, "ngrams": records}, args.json, lines)
    return 0


# ----------------------------------------------------------------------------- invert-check


def _add_invert_check(sub) -> None:
    p = sub.add_parser(
        "invert-check",
        help="reconstruct embeddings from hidden states of an invertible LM",
        description="Embed held-out text, run the invertible stack, invert it by fixed-point "
        "iteration and report the largest reconstruction error of the embeddings.",
    )
    p.add_argument("--checkpoint", required=True, metavar="RUN", help="run folder or checkpoint")
    p.add_argument("--data", metavar="FILE", help="take the held-out text from this file")
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
    add_threads(p)
    p.add_argument("--json", action="store_true", help="last stdout line: a JSON object")
    p.set_defaults(handler=_invert_check)


def _invert_check(args: argparse.Namespace) -> int:
    import torch

    from .data import check_block_size
    from .invertible import reconstruction_report

    if args.sequences < 1:
        raise InputError(f"--sequences must be >= 1, got {args.sequences}")
    for flag, value in (("--tol", args.tol), ("--threshold", args.threshold)):
        if not (math.isfinite(value) and value > 0):
            raise InputError(f"{flag} must be a positive number, got {value}")
    if args.max_iter < 1:
        raise InputError(f"--max-iter must be >= 1, got {args.max_iter}")
    model, ckpt, vocab, device = _load(args)
    if not model.config.invertible:
        raise InputError(
            f"{args.checkpoint} holds a non-invertible model: train with --invertible"
        )
    model = model.to(getattr(torch, args.dtype))
    corpus = _corpus_for(ckpt, vocab, args.data)
    block = model.config.block_size
    check_block_size(corpus, block)
    n = min(args.sequences, (len(corpus.val) - 1) // block)
    idx = corpus.val[: n * block].reshape(n, block).to(device)  # held-out text
    try:
        report = reconstruction_report(model, idx, args.tol, args.max_iter, args.method)
    except InverseNotConverged as err:  # the check failed: report it as such, not as bad input
        _emit({"passed": False, "converged": False, "residual": err.residual,
               "iterations": err.iterations, "dtype": args.dtype, "sequences": n}, args.json, [
            f"the inverse did not converge: a relative residual of {err.residual:.3e} after "
            f"{err.iterations} iterations (--tol {args.tol:g}); raise --max-iter, loosen "
            "--tol, or use --method anderson"])
        return EXIT_CHECK_FAILED
    report.update(dtype=args.dtype, threshold=args.threshold, sequences=n, converged=True,
                  passed=report["max_error"] <= args.threshold)
    verdict = ("passed" if report["passed"] else "FAILED") + f" (--threshold {args.threshold:g})"
    _emit(report, args.json, [
        f"max reconstruction error {report['max_error']:.3e} over {report['tokens']} tokens "
        f"({args.dtype}); tokens recovered {100 * report['token_accuracy']:.2f}%; largest "
        f"certified branch constant {report['max_branch_bound']:.4f}: {verdict}",
    ])
    return 0 if report["passed"] else EXIT_CHECK_FAILED


def add_lm_subparsers(subparsers) -> None:
    """Register ``lm`` and its commands ``train``, ``eval``, ``sample``, ``invert-check`` and
    ``ngram`` on the sub-command set of a top-level parser. Each command stores its function
    as ``args.handler``, which returns the exit status."""
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
    _add_ngram(sub)
