"""Fit a flow to a collection of sets: one training loop, checkpoints, resume, evaluation."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from tqdm.auto import tqdm

from ..attention import twice_differentiable
from ..data import SetData, load_dataset
from ..errors import RunError
from ..flows.base import set_dims
from ..flows.builders import SetFlow
from ..runs import (
    DistributedContext,
    MetricsLog,
    atomic_torch_save,
    atomic_write_text,
    prepare_out_dir,
    rng_state,
    set_rng_state,
)
from .config import SetsConfig, build_flow

__all__ = ["fit", "evaluate", "load_flow", "CHECKPOINT"]

CHECKPOINT = "checkpoint.pt"


class _LogProb(nn.Module):
    """log p(x) as a module's forward, so DistributedDataParallel sees the computation."""

    def __init__(self, flow: SetFlow):
        super().__init__()
        self.flow = flow

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        return self.flow.log_prob(x, mask)


def _solver_counts(flow: SetFlow) -> dict:
    """Field evaluations of the latest forward and backward solve (continuous flows only)."""
    solvers = [m for m in flow.modules() if hasattr(m, "nfe_forward")]
    if not solvers:
        return {}
    return {"nfe_forward": sum(int(m.nfe_forward) for m in solvers),
            "nfe_backward": sum(int(m.nfe_backward) for m in solvers)}


def learning_rate(config: SetsConfig, step: int) -> float:
    """Linear warm-up, then cosine decay from ``lr`` to ``min_lr``."""
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    progress = (step - config.warmup) / max(1, config.steps - config.warmup)
    return config.min_lr + 0.5 * (config.lr - config.min_lr) * (1 + math.cos(math.pi * progress))


def _batch(data: SetData, index: Tensor, device) -> tuple[Tensor, Tensor | None]:
    mask = None if data.mask is None else data.mask[index].to(device)
    return data.x[index].to(device), mask


def evaluate(flow: SetFlow, data: SetData, batch_size: int = 256, limit: int | None = None,
             device=None) -> dict:
    """Deterministic NLL of ``data`` under ``flow`` (evaluation mode: exact log-det if feasible).

    Returns NLL in nats per set (``nll``), per degree of freedom (``nll_per_dim``; (n - 1) D per
    set in zero-centre-of-mass mode, the E-NF convention) and the number of sets.
    """
    was_training = flow.training
    flow.eval()
    device = device or next(flow.parameters()).device
    count = len(data) if limit is None else min(limit, len(data))
    total_nll, total_dims = 0.0, 0.0
    for start in range(0, count, batch_size):
        index = torch.arange(start, min(start + batch_size, count))
        x, mask = _batch(data, index, device)
        # no graph: a continuous flow would otherwise keep every solver step of the batch
        with twice_differentiable(), torch.no_grad():
            log_prob = flow.log_prob(x, mask)
        if not torch.isfinite(log_prob).all():
            raise RunError(f"non-finite log-likelihood while evaluating {data.name}")
        total_nll -= log_prob.double().sum().item()
        total_dims += set_dims(x, mask, flow.zero_com).double().sum().item()
    flow.train(was_training)
    return {"nll": total_nll / count, "nll_per_dim": total_nll / total_dims, "num_sets": count}


def _data_spec(train: SetData) -> dict:
    return {"name": train.name, "dim": train.dim, "set_size": train.set_size,
            "zero_com": train.zero_com, "variable_size": train.mask is not None}


def _with_legacy_defaults(settings: dict) -> dict:
    """Settings missing from an older checkpoint take the values its flow was built with."""
    settings = dict(settings)
    if "field" not in settings:  # before the field setting: attention, 2 layers of width 16
        settings["field"] = "attention" if settings.get("flow") == "cnf" else "auto"
        for name, old_default in (("field_layers", 2), ("field_hidden", 16)):
            if settings.get(name) == old_default:
                settings[name] = None  # now "the field's default", which is the same
    return {"location": False, "radial_basis": 32, "radial_range": 6.0, "manybody": False,
            **settings}


def load_flow(checkpoint_dir: str | Path, device: str = "cpu") -> tuple[SetFlow, dict]:
    """The flow saved in ``checkpoint_dir`` (in evaluation mode) and its checkpoint record."""
    path = Path(checkpoint_dir) / CHECKPOINT
    if not path.is_file():
        raise RunError(f"no checkpoint at {path}")
    try:
        record = torch.load(path, map_location=device, weights_only=False)
    except Exception as err:  # truncated or foreign file
        raise RunError(f"cannot read checkpoint {path}: {err}") from None
    spec = record["data"]
    config = SetsConfig(**_with_legacy_defaults(record["config"]))
    flow = build_flow(config, spec["dim"], spec["set_size"], spec["zero_com"]).to(device)
    flow.load_state_dict(record["model"])
    return flow.eval(), record


def fit(config: SetsConfig, out: str | Path, resume: bool = False, progress: bool = True,
        plots: bool = True, log=print) -> dict:
    """Train ``config``'s flow, writing checkpoints, metrics and plots under ``out``.

    With ``resume`` the run continues from ``out/checkpoint.pt`` exactly where it stopped: the
    model, optimiser, step and every random state are restored. Returns the final summary
    (also written to ``out/summary.json``).
    """
    ctx = DistributedContext.from_environment(config.device)
    out = prepare_out_dir(out)
    checkpoint_path = out / CHECKPOINT
    if checkpoint_path.exists() and not resume:
        raise RunError(f"{out} already holds a run: pass --resume to continue it, "
                       "or choose another --out")
    sizes = None if config.num_train is None else {"train": config.num_train}
    splits = load_dataset(config.data, sizes, seed=config.seed, progress=progress and ctx.is_main)
    train, val = splits["train"], splits["val"]
    test = splits.get("test", val)
    device = ctx.device(config.device)

    # ---------------------------------------------------------------- model and optimiser
    torch.manual_seed(config.seed)
    flow = build_flow(config, train.dim, train.set_size, train.zero_com).to(device)
    optimizer = torch.optim.Adam(flow.parameters(), lr=config.lr)
    generator = torch.Generator().manual_seed(config.seed)
    metrics = MetricsLog(out, enabled=ctx.is_main)
    start = 0
    if resume and checkpoint_path.exists():
        record = torch.load(checkpoint_path, map_location=device, weights_only=False)
        saved = SetsConfig(**_with_legacy_defaults(record["config"])).to_dict()
        changed = sorted(k for k, v in config.to_dict().items() if saved.get(k) != v)
        if changed:
            raise RunError(f"the settings {changed} differ from the checkpoint's; resume with "
                           "the same ones")
        flow.load_state_dict(record["model"])
        optimizer.load_state_dict(record["optimizer"])
        set_rng_state(generator, record["rng"])
        start = record["step"]
        metrics.truncate_after(start)
        log(f"resuming {out} at step {start}")
    else:
        # Data-dependent initialisation (ActNorm) on a batch every process shares.
        x0, mask0 = _batch(train, torch.arange(min(len(train), config.batch_size)), device)
        with twice_differentiable():
            flow.log_prob(x0, mask0)
    if ctx.is_main:
        atomic_write_text(json.dumps(config.to_dict(), indent=2) + "\n", out / "config.json")
    model: nn.Module = _LogProb(flow)
    if ctx.active:
        model = DistributedDataParallel(model)

    def save(step: int) -> None:
        if ctx.is_main:
            atomic_torch_save({"version": 1, "config": config.to_dict(), "data": _data_spec(train),
                               "model": flow.state_dict(), "optimizer": optimizer.state_dict(),
                               "step": step, "rng": rng_state(generator)}, checkpoint_path)

    # ---------------------------------------------------------------- training loop
    bar = tqdm(range(start, config.steps), initial=start, total=config.steps,
               desc="fit", disable=not (progress and ctx.is_main), dynamic_ncols=True)
    started = time.time()
    for step in bar:
        lr = learning_rate(config, step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        index = torch.randint(len(train), (config.batch_size,), generator=generator)
        x, mask = _batch(train, index[ctx.rank :: ctx.world_size], device)
        flow.train()
        with twice_differentiable():
            log_prob = model(x, mask)
        loss = -log_prob.mean() / set_dims(x, mask, train.zero_com).mean()
        if not torch.isfinite(loss):
            metrics.log(step, "train", diverged=True, loss=float(loss))
            raise RunError(f"training diverged at step {step}: the loss is {loss.item()}")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(flow.parameters(), config.grad_clip)
        optimizer.step()
        done = step + 1
        if done % 10 == 0 or done == config.steps:
            metrics.log(done, "train", loss=loss.item(), nll_per_dim=loss.item(), lr=lr,
                        grad_norm=grad_norm.item(), seconds=time.time() - started,
                        **_solver_counts(flow))
            bar.set_postfix(nll_per_dim=f"{loss.item():.3f}")
        if ctx.is_main and (done % config.eval_every == 0 or done == config.steps):
            result = evaluate(flow, val, limit=config.val_sets)
            metrics.log(done, "val", **result)
            say = bar.write if progress else log
            say(f"step {done}: validation NLL {result['nll']:.4f} nats/set, "
                f"{result['nll_per_dim']:.4f} nats/dim")
        if done % config.checkpoint_every == 0 or done == config.steps:
            save(done)
    bar.close()
    ctx.barrier()

    # ---------------------------------------------------------------- final evaluation
    summary = {"steps": config.steps, "train_seconds": time.time() - started}
    if ctx.is_main:
        result = evaluate(flow, test)
        summary.update(test_nll=result["nll"], test_nll_per_dim=result["nll_per_dim"],
                       test_sets=result["num_sets"], test_split=test.name)
        true_nll = test.mean_true_nll()
        if true_nll is not None:
            dims = set_dims(test.x, test.mask, test.zero_com).double().mean().item()
            summary.update(true_nll=true_nll, true_nll_per_dim=true_nll / dims)
        metrics.log(config.steps, "test", **result)
        if plots:
            from .plots import plot_run

            summary["plots"] = [str(p) for p in plot_run(flow, test, out, config.seed)]
        atomic_write_text(json.dumps(summary, indent=2) + "\n", out / "summary.json")
    metrics.close()
    ctx.close()
    return summary
