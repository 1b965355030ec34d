"""The flattened baseline: an nflows spline autoregressive flow on the N D vector of a set.

A set of N elements in R^D, written out in some order, is a vector in R^{N D}; any flow on
vectors is then a density over ordered sets. Exchangeable data (every order equally likely) are
learnt by training on a fresh random order of each set's elements in every batch, so the flow
approximates the order-symmetric density. It is the model to beat for a set flow: no
interaction is built in, the autoregressive splines see every coordinate of the set, and
nothing is shared across elements.

:func:`flattened_flow` builds it (a standardisation, then masked rational-quadratic spline
autoregressive layers of Durkan et al. 2019 with reversed orders between them),
:func:`fit_flattened` trains it for a wall-clock budget and :func:`flattened_nll` scores sets
under its symmetrisation. Sets of several sizes (a padding mask) are refused: a flow on
vectors has one dimension (one would need a flow per size, or padding with the size as a
condition).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from itertools import permutations

import torch
from torch import Tensor

from ..data import SetData, random_signs, reflect_sets, reflection_signs
from ..errors import DataError, InputError, NonFiniteError
from ..flows.layers import feature_moments
from ..training.loop import adamw

__all__ = ["FlattenedSettings", "flattened_flow", "fit_flattened", "flattened_nll",
           "shuffled_batch"]


@dataclass(frozen=True)
class FlattenedSettings:
    """Architecture and optimiser of the flattened baseline.

    Arguments:
        layers: masked autoregressive spline layers.
        hidden: width of each layer's MADE conditioner.
        blocks: residual blocks of each conditioner.
        bins: rational-quadratic spline bins.
        tail_bound: splines act on [-B, B] (standardised units), identity outside.
        batch_size: sets per step.
        lr: peak Adam learning rate (linear warm-up over ``warmup`` steps, then cosine decay
            to ``min_lr`` over the wall-clock budget).
        warmup: warm-up steps.
        min_lr: final learning rate.
        grad_clip: gradient-norm clip.
        reflections: train on sets mirrored through the coordinate axes at random
            (x_i -> x_i S, S = diag(±1)) and score the density averaged over the 2^D mirror
            images as well as the element orders (:func:`flattened_nll`): the treatment of a
            flowattn flow with ``symmetry: reflections``, for data whose density keeps its
            value under these reflections.
    """

    layers: int = 5
    hidden: int = 128
    blocks: int = 2
    bins: int = 8
    tail_bound: float = 5.0
    batch_size: int = 64
    lr: float = 1e-3
    warmup: int = 50
    min_lr: float = 1e-5
    grad_clip: float = 10.0
    reflections: bool = False


def flattened_flow(train: SetData, settings: FlattenedSettings = FlattenedSettings()):
    r"""An nflows ``Flow`` on the flattened sets of ``train``: standardise, then MAF splines.

    The standardisation u = (x - m) / s uses the mean m and spread s of each of the D features
    over all elements (the same for every element, as the data are exchangeable), so log q(x) =
    log q_u(u) - N \sum_d log s_d. Then ``layers`` masked piecewise rational-quadratic
    autoregressive transforms (Durkan et al. 2019, "Neural Spline Flows", §3; a MADE conditioner,
    Germain et al. 2015) alternate with order reversals, over a standard normal base.

    Raises:
        DataError: if the sets have several sizes (a padding mask).

    Examples:
        >>> from flowattn.data import load_dataset
        >>> train = load_dataset("shape-sets", {"train": 64, "val": 8, "test": 8})["train"]
        >>> flow = flattened_flow(train, FlattenedSettings(layers=2, hidden=16))
        >>> log_q = flow.log_prob(train.x[:4].flatten(1))
        >>> log_q.shape, bool(torch.isfinite(log_q).all())
        (torch.Size([4]), True)
    """
    from nflows.distributions import StandardNormal
    from nflows.flows import Flow
    from nflows.transforms import (
        CompositeTransform,
        MaskedPiecewiseRationalQuadraticAutoregressiveTransform,
        PointwiseAffineTransform,
        ReversePermutation,
    )

    _check_fixed_size(train)
    features = train.set_size * train.dim
    mean, std = feature_moments(train.x.double())
    standardise = PointwiseAffineTransform(
        shift=(-mean / std).repeat(train.set_size).to(train.x.dtype),
        scale=(1 / std).repeat(train.set_size).to(train.x.dtype))
    layers: list = [standardise]
    for index in range(settings.layers):
        if index:
            layers.append(ReversePermutation(features))
        layers.append(MaskedPiecewiseRationalQuadraticAutoregressiveTransform(
            features, settings.hidden, num_bins=settings.bins, tails="linear",
            tail_bound=settings.tail_bound, num_blocks=settings.blocks))
    return Flow(CompositeTransform(layers), StandardNormal([features]))


def fit_flattened(
    train: SetData,
    seconds: float,
    settings: FlattenedSettings = FlattenedSettings(),
    seed: int = 0,
    max_steps: int | None = None,
    val: SetData | None = None,
    eval_every: int = 250,
) -> tuple[torch.nn.Module, dict]:
    """Train :func:`flattened_flow` on ``train`` for ``seconds`` of wall-clock time.

    Each step draws ``batch_size`` sets and a fresh random order of the elements of each
    (exchangeable data: the flow should not learn an order), and takes an Adam step on the
    mean NLL per dimension. The learning rate warms up linearly, then decays as a cosine of the
    elapsed fraction of the budget. The budget covers the optimisation and the validations
    (building the flow and the final scoring come on top, as in a flowattn run's
    ``train_seconds``). With ``val``, the flow is scored on it (one random order per set)
    every ``eval_every`` steps and at the end, and the parameters of the best validation
    score are the ones returned: early stopping, a help a flowattn run does not get (it
    keeps its last state), so that overfitting cannot count against the baseline.

    Returns:
        (flow in evaluation mode, info) with ``steps``, ``train_seconds``,
        ``initial_loss`` / ``final_loss`` (mean training NLL per dimension of the first and
        last 10 steps) and, with ``val``, ``history`` (``[step, seconds, val NLL per set]``
        rows) and ``best_step``.

    Raises:
        InputError: for a budget that is not positive, or ``max_steps`` < 1.
        DataError: for sets of several sizes.
        NonFiniteError: if the loss stops being finite.

    Examples:
        >>> from flowattn.data import load_dataset
        >>> train = load_dataset("shape-sets", {"train": 256, "val": 8, "test": 8})["train"]
        >>> small = FlattenedSettings(layers=2, hidden=16, batch_size=32)
        >>> flow, info = fit_flattened(train, seconds=60, settings=small, max_steps=30)
        >>> info["steps"], info["final_loss"] < info["initial_loss"]
        (30, True)
    """
    if not seconds > 0:
        raise InputError(f"seconds must be positive, got {seconds}")
    if max_steps is not None and max_steps < 1:
        raise InputError(f"max_steps must be >= 1, got {max_steps}")
    torch.manual_seed(seed)
    flow = flattened_flow(train, settings)
    flow.train()
    optimiser = adamw(flow, settings.lr)  # Adam (no weight decay), fused where it can be
    generator = torch.Generator().manual_seed(seed)
    size, dim = train.set_size, train.dim
    losses: list[float] = []
    step, start = 0, time.perf_counter()
    history: list[list[float]] = []
    best: tuple[float, int, dict] | None = None
    while True:
        elapsed = time.perf_counter() - start
        done = elapsed >= seconds or (max_steps is not None and step >= max_steps)
        if val is not None and step and (done or step % eval_every == 0):
            score = flattened_nll(flow.eval(), val, seed=step, reflections=settings.reflections)
            flow.train()
            history.append([step, time.perf_counter() - start, score])
            if best is None or score < best[0]:
                best = (score, step, {k: v.clone() for k, v in flow.state_dict().items()})
        if done:
            break
        for group in optimiser.param_groups:
            group["lr"] = _learning_rate(step, elapsed / seconds, settings)
        x = shuffled_batch(train.x, settings.batch_size, generator)
        if settings.reflections:
            x = reflect_sets(x, random_signs(x.shape[0], dim, generator, x.dtype))
        loss = -flow.log_prob(x.reshape(settings.batch_size, size * dim)).mean() / (size * dim)
        if not torch.isfinite(loss):
            raise NonFiniteError(f"flattened baseline: non-finite loss at step {step}")
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(flow.parameters(), settings.grad_clip)
        optimiser.step()
        losses.append(loss.item())
        step += 1
    train_seconds = time.perf_counter() - start
    head, tail = losses[:10], losses[-10:]
    info = {"steps": step, "train_seconds": train_seconds,
            "initial_loss": sum(head) / max(len(head), 1),
            "final_loss": sum(tail) / max(len(tail), 1)}
    if best is not None:
        flow.load_state_dict(best[2])
        info.update(history=history, best_step=best[1])
    return flow.eval(), info


def flattened_nll(flow: torch.nn.Module, data: SetData, orders: int = 1, seed: int = 0,
                  batch_size: int = 256, reflections: bool = False) -> float:
    r"""Mean NLL in nats per set of ``data`` under the symmetrised flattened flow.

    A flow q of ordered sets defines the exchangeable density q_sym(X) = (1/N!) \sum_\pi
    q(\pi X). With ``orders`` >= N! every order is summed and the result is -log q_sym
    exactly; otherwise K = ``orders`` random orders give -log (1/K) \sum_k q(\pi_k X), whose
    mean is an upper bound on -log q_sym (Jensen) and equals the NLL of the flow itself in a
    random order at K = 1. With ``reflections`` the average runs over the 2^D mirror images
    X S (S = diag(±1)) of each ordered set as well: -log (1/(2^D K)) \sum_S \sum_k
    q(\pi_k X S).

    Raises:
        InputError: if ``orders`` < 1.
        DataError: for sets of several sizes.
        NonFiniteError: if a log-density is not finite.

    Examples:
        >>> from flowattn.data import load_dataset
        >>> splits = load_dataset("shape-sets", {"train": 64, "val": 8, "test": 16})
        >>> flow = flattened_flow(splits["train"], FlattenedSettings(layers=1, hidden=8))
        >>> one, many = (flattened_nll(flow, splits["test"], k) for k in (1, 8))
        >>> math.isfinite(one) and math.isfinite(many)
        True
    """
    if orders < 1:
        raise InputError(f"orders must be >= 1, got {orders}")
    _check_fixed_size(data)
    size, dim = data.set_size, data.dim
    generator = torch.Generator().manual_seed(seed)
    if math.factorial(size) <= orders:
        every = torch.tensor(list(permutations(range(size))))
    signs = reflection_signs(dim, data.x.dtype)
    total = torch.zeros((), dtype=torch.float64)
    with torch.no_grad():
        for first in range(0, len(data), batch_size):
            x = data.x[first : first + batch_size]
            count = x.shape[0]
            if math.factorial(size) <= orders:
                order = every[None].expand(count, -1, -1)
            else:
                order = torch.rand(count, orders, size, generator=generator).argsort(2)
            xs = x[torch.arange(count)[:, None, None], order]  # (B, K, N, D)
            if reflections:  # (B, 2^D K, N, D): every order in every mirror image
                xs = (xs[:, None] * signs[None, :, None, None, :]).flatten(1, 2)
            k = xs.shape[1]
            log_q = flow.log_prob(xs.reshape(count * k, size * dim)).reshape(count, k)
            total += (torch.logsumexp(log_q.double(), 1) - math.log(k)).sum()
    nll = -float(total) / len(data)
    if not math.isfinite(nll):
        raise NonFiniteError(f"non-finite log-density of {data.name} under the flattened flow")
    return nll


def shuffled_batch(x: Tensor, batch_size: int, generator: torch.Generator) -> Tensor:
    """``batch_size`` sets drawn from ``x`` (M, N, D) with replacement, the elements of each in
    a fresh uniformly random order, shape (B, N, D).

    Examples:
        >>> x = torch.arange(6.0).reshape(1, 3, 2)
        >>> batch = shuffled_batch(x, 4, torch.Generator().manual_seed(0))
        >>> sorted(map(tuple, batch[0].tolist())) == sorted(map(tuple, x[0].tolist()))
        True
    """
    index = torch.randint(x.shape[0], (batch_size,), generator=generator)
    order = torch.rand(batch_size, x.shape[1], generator=generator).argsort(1)
    return x[index[:, None], order]


def _learning_rate(step: int, progress: float, settings: FlattenedSettings) -> float:
    """Linear warm-up over ``warmup`` steps, then a cosine in the elapsed budget fraction."""
    if step < settings.warmup:
        return settings.lr * (step + 1) / (settings.warmup + 1)
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return settings.min_lr + (settings.lr - settings.min_lr) * cosine


def _check_fixed_size(data: SetData) -> None:
    if data.mask is not None:
        raise DataError(f"{data.name}: sets of several sizes (a padding mask); the flattened "
                        "baseline is a flow on vectors of one length N D and needs sets of one "
                        "size")
