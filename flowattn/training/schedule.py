"""Learning-rate schedules: constant, cosine and noam, each after a linear warm-up."""

from __future__ import annotations

import math

__all__ = ["learning_rate"]


def learning_rate(step: int, *, lr: float, steps: int, schedule: str = "cosine",
                  warmup: int = 0, min_lr: float = 0.0) -> float:
    r"""The learning rate of optimiser step ``step`` (0-based) of ``steps``.

    * warm-up (``constant`` and ``cosine``): :math:`\eta\,(t + 1)/(w + 1)` for :math:`t < w`,
      a straight line that would reach ``lr`` at :math:`t = w`;
    * ``constant``: ``lr`` after the warm-up;
    * ``cosine`` (nanoGPT's): from ``lr`` at :math:`t = w` down to ``min_lr`` at the last
      step :math:`t = T - 1`,
      :math:`\eta_{min} + \tfrac12(1 + \cos(\pi\,(t - w)/(T - 1 - w)))(\eta - \eta_{min})`;
    * ``noam`` (Vaswani et al. 2017; Kim et al. 2021, App. H): :math:`\eta\min(\sqrt{w/t'},
      t'/w)` with :math:`t' = t + 1`, a linear rise to ``lr`` at :math:`t' = w` and a
      :math:`1/\sqrt{t'}` decay, floored at ``min_lr``. The paper's
      :math:`\gamma/\sqrt{D}\min(t^{-1/2}, t w^{-3/2})` is this with
      :math:`\eta = \gamma/\sqrt{D w}`.

    Examples:
        >>> [round(learning_rate(t, lr=1.0, steps=100, warmup=10, min_lr=0.1), 3)
        ...  for t in (0, 9, 10, 99)]
        [0.091, 0.909, 1.0, 0.1]
    """
    if schedule == "noam":
        t = step + 1
        return max(min_lr, lr * min(math.sqrt(warmup / t), t / warmup))
    if step < warmup:
        return lr * (step + 1) / (warmup + 1)
    if schedule == "constant":
        return lr
    if schedule != "cosine":
        raise ValueError(f"unknown schedule {schedule!r}")
    span = max(steps - 1 - warmup, 1)
    progress = min((step - warmup) / span, 1.0)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)
