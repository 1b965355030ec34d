"""The training loop every command shares, read top to bottom.

A command supplies a :class:`Task` — its model, its batches, its loss, its validation and its
final report — and :func:`train` does the rest the same way for all: random state, the
optimiser (AdamW; matrices decay, vectors do not), the learning-rate schedule, gradient
clipping, an optional moving average of the parameters, DistributedDataParallel under
``torchrun``, divergence detection, atomic checkpoints,
metrics, TensorBoard, the progress bar, exact resume and the summary.

Divergence has one behaviour: a non-finite loss, activation (:class:`~flowattn.errors.
NonFiniteError`), gradient or validation loss — or a smoothed training loss above
``divergence_factor`` times its best, when that is set — stops training; the event is recorded
in metrics.jsonl and diverged.json, the checkpoint keeps the last state saved before it was
detected (its step is named: the divergence may have begun before it), the summary says
``diverged`` and the command exits with status :data:`EXIT_DIVERGED`.

Ctrl-C (SIGINT) or SIGTERM during training stops the run at the end of the step it is in, once
a checkpoint holds that step (resume then repeats nothing); a second one stops it at once.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from ..errors import ConfigError, NonFiniteError
from ..files import HeldSignals, atomic_write_text
from ..progress import Progress
from .average import ParameterAverage
from .checkpoint import BEST, CHECKPOINT, read_checkpoint, save_checkpoint
from .distributed import Distributed
from .metrics import MetricsLog, json_safe
from .run import DIVERGED_FILE, SUMMARY_FILE, RunPlan
from .schedule import learning_rate

__all__ = ["Task", "train", "EXIT_DIVERGED", "adamw", "parameter_groups"]

EXIT_DIVERGED = 3  # the exit status of a command whose training diverged


class Task(Protocol):
    """What a command brings to the loop.

    Attributes:
        model: the module whose parameters are trained and saved (built on every process from
            the same seed, before any state is loaded). A task may also have a
            ``forward_module`` (sharing the parameters) that :meth:`loss` calls and that
            DistributedDataParallel wraps, when ``model``'s own forward is not the loss's.
        items: what a batch is counted in, for throughput (``"tokens"``, ``"sets"``).
        units: optionally, the unit of each validation metric that has one (``{"loss":
            "nats/char"}``), printed after its value.
    """

    model: nn.Module
    items: str

    def initialise(self) -> None:
        """Data-dependent initialisation of a fresh model (e.g. ActNorm); may do nothing."""

    def check_memory(self) -> None:
        """Refuse a step that would not fit in the device's memory
        (:func:`flowattn.training.memory.check_fits`), before the first step of a fresh or
        resumed run; it must leave the model as it was (random streams are seeded after it)."""

    def batch(self, generator: torch.Generator, dist: Distributed) -> Any:
        """This process's share of the next batch, on its device."""

    def loss(self, module: nn.Module, batch: Any) -> tuple[Tensor, Tensor, int]:
        """``(objective, reported loss, items)``: the scalar to minimise through ``module``
        (the model, or its DDP wrapper), the loss to report (both may be the same tensor) and
        how many items the batch held."""

    def evaluate(self, dist: Distributed) -> dict[str, float]:
        """Validation metrics with at least ``loss`` (run on every process)."""

    def finish(self, out: Path) -> dict[str, Any]:
        """The final report of a finished run (test metrics, plots); first process only."""

    def state(self) -> dict[str, Any]:
        """What the checkpoint needs besides the model to rebuild it (vocabulary, data)."""


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Matrices and embeddings decay; biases, gains and scalars do not (nanoGPT's rule)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def adamw(model: nn.Module, lr: float, betas: tuple[float, float] = (0.9, 0.999),
          weight_decay: float = 0.0) -> torch.optim.AdamW:
    """AdamW over ``model``'s trainable parameters in :func:`parameter_groups`, with the fused
    kernel (one pass over all tensors) wherever this torch has it for their device.

    A flow or a language model here holds tens to hundreds of small tensors, and the per-tensor
    loop of the default implementation costs more than the arithmetic: on one idle CPU thread
    the fused step of the sets ``large`` preset (494 tensors) takes 5.1 ms against 21.1 ms
    (``benchmarks/optimizer.py``). The CPU has the fused kernel from torch 2.4 on; where it
    is missing (older torch, another device) the default implementation is used. AdamW with
    ``weight_decay = 0`` is Adam.

    Examples:
        >>> opt = adamw(nn.Linear(3, 2), lr=1e-3)
        >>> opt.param_groups[0]["fused"]
        True
    """
    groups = parameter_groups(model, weight_decay)
    try:
        return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=True)
    except RuntimeError:  # no fused kernel for these parameters' device in this torch
        # fresh groups: the refused constructor has already written fused=True into ``groups``
        return torch.optim.AdamW(parameter_groups(model, weight_decay), lr=lr, betas=betas)


def _check_memory(task: Task) -> None:
    """``task.check_memory()``, whose pass is the run's first: a model that overflows there,
    before any step, does so because of its settings, and is refused as such."""
    try:
        task.check_memory()
    except NonFiniteError as err:
        found = str(err).split("; ")[0]  # what overflowed, without advice meant for inputs
        raise ConfigError(
            f"before its first step, on the run's own data: {found}. A setting takes the "
            "activations beyond the range of the dtype: one that scales the weights or the "
            "residual branches (e.g. init_scale, residual_alpha, norm_gain), or data of a huge "
            "scale") from None


def _shown(value: float) -> str:
    """A loss as the loop prints it: four decimals, or three significant digits where it is
    too large for those to mean anything (a diverging run's 1.71e+35).

    Examples:
        >>> _shown(1.23456), _shown(170553415671303525535148947430965248.0), _shown(math.inf)
        ('1.2346', '1.71e+35', 'inf')
    """
    return f"{value:.4f}" if abs(value) < 1e5 or not math.isfinite(value) else f"{value:.3g}"


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


def _stop_notice(name: str):
    """What the first Ctrl-C or SIGTERM of a training run prints (from its signal handler)."""
    def notice(signum: int) -> None:
        what, again = (("interrupt (Ctrl-C)", "Ctrl-C again") if signum == signal.SIGINT
                       else ("SIGTERM", "a second SIGTERM"))
        message = (f"\n{name}: {what} received: stopping after this step, once a checkpoint "
                   f"holds it ({again} stops at once)\n")
        try:
            sys.stderr.write(message)
            sys.stderr.flush()
        except (RuntimeError, OSError, ValueError):  # the handler ran inside a write to it
            os.write(2, message.encode())
    return notice


def train(task: Task, plan: RunPlan, dist: Distributed, *, progress: bool = True,
          tensorboard: bool | None = None, log=Progress.write) -> dict:
    """Train ``task`` as ``plan`` says; return the summary (also written to summary.json).

    The run continues bit-exactly from ``plan.checkpoint`` when there is one: model,
    optimiser, step, every random state and the loop's running statistics are restored.
    ``tensorboard`` None writes TensorBoard events in a new run, and in a resumed one only if
    it wrote them before (its folder holds ``tensorboard/``).

    With ``ema`` set, a :class:`~flowattn.training.average.ParameterAverage` follows the
    parameters; validations score it, and a checkpoint's ``model`` is the average (what
    evaluation and sampling of the run folder load) while ``training_model`` keeps the
    parameters as trained, from which a resumed run continues.
    """
    cfg = plan.config.training()
    out, main = plan.out, dist.is_main

    # ------------------------------------------------------------------ optimiser and state
    model = task.model
    optimizer = adamw(model, cfg.lr, (cfg.beta1, cfg.beta2), cfg.weight_decay)
    generator = torch.Generator().manual_seed(cfg.seed)  # the same batches on every process
    loop = {"smoothed": None, "best_smoothed": math.inf, "val_loss": math.nan,
            "best_val_loss": math.inf, "best_step": None, "train_loss": math.nan, "seconds": 0.0,
            "items": 0}
    step = plan.start_step
    if plan.checkpoint is not None:
        record = plan.checkpoint
        model.load_state_dict(record.get("training_model", record["model"]))
        _check_memory(task)
        optimizer.load_state_dict(record["optimizer"])
        loop.update(record["loop"])
        states = record["rng"]
        if len(states) == dist.world:
            _set_rng_state(states[dist.rank], generator, dist.device)
        elif main:
            log(f"resuming on {dist.world} process(es) from {len(states)}: random streams "
                "restart, so the run will not repeat an uninterrupted one exactly")
    else:
        task.initialise()
        _check_memory(task)
        torch.manual_seed(cfg.seed + dist.rank)  # dropout and probes differ per process
    average = None if cfg.ema is None else ParameterAverage(model, cfg.ema)
    if average is not None and plan.checkpoint is not None:
        average.load(plan.checkpoint["model"])

    def result_state() -> dict:
        """The model a checkpoint offers for evaluation: the average when there is one."""
        state = model.state_dict()  # in place: its metadata carries the modules' versions
        state.update(average.state() if average is not None else {})
        return state

    def scored():
        return average.swapped() if average is not None else contextlib.nullcontext()
    if cfg.compile:
        # inductor's lowering warns about a deprecation inside torch itself at every graph
        warnings.filterwarnings("ignore", message=r"`torch\._prims_common\.check` is deprecated",
                                category=FutureWarning)
    if main:
        plan.prepare()
        for note in plan.notes:
            log(note)
        if cfg.warmup >= cfg.steps and cfg.schedule != "noam" and step < cfg.steps:
            last = learning_rate(cfg.steps - 1, lr=cfg.lr, steps=cfg.steps,
                                 schedule=cfg.schedule, warmup=cfg.warmup, min_lr=cfg.min_lr)
            log(f"note: the warm-up ({cfg.warmup} steps) is as long as the run ({cfg.steps} "
                f"steps), so the learning rate never reaches lr {cfg.lr:g} (it ends at "
                f"{last:.3g}); a shorter --warmup gives a short run its rate")
        if cfg.compile and step < cfg.steps:
            log("torch.compile: the first steps compile the model (a minute or more on a CPU)")
    dist.barrier()
    module = dist.wrap(getattr(task, "forward_module", model))
    if tensorboard is None:  # on, but a resumed run started without it stays without it
        tensorboard = plan.checkpoint is None or (out / "tensorboard").is_dir()
    metrics = MetricsLog(out, step, enabled=main, tensorboard=tensorboard)

    saved_step = plan.start_step if plan.checkpoint is not None else None

    def save() -> None:
        nonlocal saved_step
        saved_step = step
        states = dist.gather(_rng_state(generator, dist.device))
        if main:
            trained = {} if average is None else {"training_model": model.state_dict()}
            save_checkpoint({"kind": plan.kind, "config": plan.config.to_dict(),
                             "data_fingerprint": plan.data, "step": step,
                             "model": result_state(), **trained,
                             "optimizer": optimizer.state_dict(), "rng": states,
                             "loop": dict(loop), "task": task.state(),
                             "world_size": dist.world}, out / CHECKPOINT)

    # ------------------------------------------------------------------ the loop
    bar = Progress(cfg.steps, step, f"{plan.kind} train", enabled=main and progress)
    divergence = None
    window = {"loss": 0.0, "steps": 0, "seconds": 0.0, "items": 0}
    units = getattr(task, "units", {})  # of the validation metrics, for their line
    model.train()
    # Ctrl-C and SIGTERM: the first stops the run after its step, saved; a second at once
    stop = HeldSignals(noted=_stop_notice(f"{plan.kind} train") if main else None,
                       second_at_once=True)
    stopping = False
    with stop:
        while step < cfg.steps:
            t0 = time.perf_counter()
            lr = learning_rate(step, lr=cfg.lr, steps=cfg.steps, schedule=cfg.schedule,
                               warmup=cfg.warmup, min_lr=cfg.min_lr)
            for group in optimizer.param_groups:
                group["lr"] = lr
            batch = task.batch(generator, dist)
            try:
                objective, reported, items = task.loss(module, batch)
                failed = False
            except NonFiniteError:  # the modules refuse NaN/Inf activations
                failed = True
            if dist.any(failed):
                divergence = {"step": step + 1, "loss": math.nan, "grad_norm": math.nan,
                              "reason": "non-finite activations"}
                break
            optimizer.zero_grad(set_to_none=True)
            objective.backward()
            grad_norm = nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or math.inf)
            stats = [reported.detach().double(), grad_norm.detach().double()]
            if dist.active:  # the processes agree on a stop request in the same exchange
                stats.append(torch.tensor(float(stop.received is not None), dtype=torch.float64,
                                          device=reported.device))
            stats = dist.mean(torch.stack(stats)).tolist()  # one host sync per step
            loss, gnorm = stats[:2]
            if not math.isfinite(loss) or not math.isfinite(gnorm):
                divergence = {"step": step + 1, "loss": loss, "grad_norm": gnorm,
                              "reason": "non-finite loss" if not math.isfinite(loss)
                              else "non-finite gradient"}
                break
            optimizer.step()
            step += 1
            if average is not None:
                average.update(step)
            seconds = time.perf_counter() - t0
            items *= dist.world
            loop["seconds"] += seconds
            loop["items"] += items
            for key, value in (("loss", loss), ("steps", 1), ("seconds", seconds),
                               ("items", items)):
                window[key] += value
            smoothed = loss if loop["smoothed"] is None else \
                0.9 * loop["smoothed"] + 0.1 * loss
            loop["smoothed"] = smoothed
            loop["best_smoothed"] = min(loop["best_smoothed"], smoothed)
            if cfg.divergence_factor is not None and \
                    smoothed > cfg.divergence_factor * loop["best_smoothed"]:
                divergence = {"step": step, "loss": loss, "grad_norm": gnorm,
                              "reason": f"smoothed loss {smoothed:.3f} exceeds "
                              f"{cfg.divergence_factor:g} x its best {loop['best_smoothed']:.3f}"}
                break
            bar.update(1)
            if step % cfg.log_every == 0 or step == cfg.steps:
                loop["train_loss"] = window["loss"] / window["steps"]
                bar.set_postfix(loss=_shown(loop["train_loss"]), lr=f"{lr:.2e}")
                rate = window["items"] / max(window["seconds"], 1e-9)
                metrics.log(step, "train", loss=loop["train_loss"], lr=lr, grad_norm=gnorm,
                            **{f"{task.items}_per_s": rate},
                            **getattr(task, "train_stats", dict)())
                window = {"loss": 0.0, "steps": 0, "seconds": 0.0, "items": 0}
            if step % cfg.eval_every == 0 or step == cfg.steps:
                with scored():
                    result = task.evaluate(dist)
                loop["val_loss"] = result["loss"]
                if result["loss"] < loop["best_val_loss"]:
                    loop["best_val_loss"], loop["best_step"] = result["loss"], step
                    if cfg.keep_best and main:  # no collective: the model alone is what it keeps
                        save_checkpoint({"kind": plan.kind, "config": plan.config.to_dict(),
                                         "data_fingerprint": plan.data, "step": step,
                                         "model": result_state(), "loop": dict(loop),
                                         "task": task.state(), "world_size": dist.world},
                                        out / BEST)
                metrics.log(step, "val", **result, best_loss=loop["best_val_loss"])
                if main:
                    (bar.write if progress else log)(
                        f"step {step}: validation "
                        + ", ".join(f"{k} {_shown(v)}" + (f" {units[k]}" if k in units else "")
                                    for k, v in result.items()
                                    if k == "loss" or isinstance(v, float)))
                if not math.isfinite(result["loss"]):
                    divergence = {"step": step, "loss": result["loss"], "grad_norm": gnorm,
                                  "reason": "non-finite validation loss"}
                    break
            if step % cfg.checkpoint_every == 0 or step == cfg.steps:
                save()
            stopping = stats[2] > 0 if dist.active else stop.received is not None
            if stopping:
                if saved_step != step:
                    save()
                break
    if window["steps"]:  # steps since the last report: the last line shows them, not it
        bar.set_postfix(loss=_shown(window["loss"] / window["steps"]), lr=f"{lr:.2e}")
    bar.close()
    if stopping:
        if main:
            log(f"stopped after step {step}; the checkpoint in {out} holds it")
        metrics.close()
        stop.deliver()  # Ctrl-C's KeyboardInterrupt, or the command line's stop for SIGTERM
        raise KeyboardInterrupt  # a handler that let it pass: the run has stopped all the same

    # ------------------------------------------------------------------ summary
    summary = {"kind": plan.kind, "out": str(out), "step": step, "steps": cfg.steps,
               "train_loss": loop["train_loss"], "val_loss": loop["val_loss"],
               "best_val_loss": loop["best_val_loss"], "best_step": loop.get("best_step"),
               "train_seconds": loop["seconds"],
               f"{task.items}_per_s": loop["items"] / loop["seconds"] if loop["seconds"] else
               math.nan, "params": sum(p.numel() for p in model.parameters()),
               "world_size": dist.world, "diverged": divergence is not None,
               "divergence": divergence,
               # the state the run leaves as its result (eval, sample and the final report's)
               "result_step": step, "result_val_loss": loop["val_loss"]}
    if divergence is not None:
        # what the run leaves: the last state saved, unless it diverged before its first save;
        # that state is only as good as the loss says (a step can break the weights before a
        # loss shows it)
        divergence["note"] = (
            f"the checkpoint in {out} holds step {saved_step}, the last state saved before "
            "the divergence was detected (`eval` scores it)" if saved_step is not None
            else f"it diverged before its first checkpoint, so {out} holds no trained state")
        loss = divergence["loss"]
        shown = _shown(loss) if loss is not None else "nan"
        message = (f"training diverged at step {divergence['step']}: {divergence['reason']} "
                   f"(loss {shown}); {divergence['note']}")
        summary["message"] = message
        metrics.log(divergence["step"], "event", event="diverged",
                    **{k: v for k, v in divergence.items() if k != "step"})
        if main:
            log(message)
            atomic_write_text(json.dumps(json_safe({**divergence, "message": message}),
                                         indent=2) + "\n", out / DIVERGED_FILE)
    elif main:
        if cfg.keep_best and (out / BEST).is_file():  # the final report is the best state's
            model.load_state_dict(read_checkpoint(out / BEST, plan.kind, dist.device)["model"])
            log(f"keep_best: the parameters of step {loop['best_step']} (validation loss "
                f"{loop['best_val_loss']:.4f}) are the run's result")
            summary.update(result_step=loop["best_step"], result_val_loss=loop["best_val_loss"])
        elif average is not None:  # the final report is the average's
            model.load_state_dict(result_state())
        report = task.finish(out)
        summary.update(report)
        if "test" in report:
            metrics.log(step, "test", **report["test"])
    metrics.close()
    if main:
        atomic_write_text(json.dumps(json_safe(summary), indent=2) + "\n", out / SUMMARY_FILE)
    # DistributedDataParallel's reducer must go while its process group still exists: freed
    # after the group (when this frame unwinds), it could block a process for good on the
    # rendezvous store that process 0 has already taken down with it
    del module
    gc.collect()
    dist.leave()
    return summary
