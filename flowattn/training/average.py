"""An exponential moving average of a model's parameters (Polyak averaging).

Training with a learning rate that is still large leaves the parameters wandering around a
minimum; their running average sits closer to it. With decay ``beta`` the average after step t
is

    θ̄_t = β_t θ̄_{t-1} + (1 − β_t) θ_t,    β_t = min(β, (1 + t) / (10 + t)),

starting from θ̄_0 = θ_0. The ramp of β_t lets the average follow the fast early steps instead
of keeping the random initialisation for ~1/(1 − β) steps (the rule of TensorFlow's
``ExponentialMovingAverage`` with ``num_updates``). Residual Flows (Chen et al., 2019) report
their densities with averaged weights.

The average replaces the parameters, not the buffers: buffers (a power iteration's vectors,
ActNorm's "initialised" flags) are the trained model's. Every certificate of the library is a
function of the weights it is evaluated with, so an averaged contractive model is as certified
as the trained one.

Examples:
    >>> from torch import nn
    >>> model = nn.Linear(2, 1)
    >>> average = ParameterAverage(model, decay=0.9)
    >>> with torch.no_grad():
    ...     _ = model.weight.add_(1.0)
    >>> average.update(step=1000)  # beta_t = 0.9: the average moves a tenth of the way
    >>> round(float((average.state()["weight"] - model.weight.detach()).abs().max()), 6)
    0.9
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

__all__ = ["ParameterAverage", "average_decay"]


def average_decay(decay: float, step: int) -> float:
    """β_t = min(β, (1 + t) / (10 + t)): the decay applied at step ``t`` (counted from 1)."""
    return min(decay, (1.0 + step) / (10.0 + step))


class ParameterAverage:
    """The running average θ̄ of ``model``'s floating-point parameters.

    Arguments:
        model: the module being trained (its parameters are read, never replaced).
        decay: β in (0, 1); the average remembers about 1/(1 − β) steps.
    """

    def __init__(self, model: nn.Module, decay: float) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must lie in (0, 1), got {decay}")
        self.decay = decay
        self.names, self.params = [], []
        for name, param in model.named_parameters():
            if param.is_floating_point():
                self.names.append(name)
                self.params.append(param)
        self.averages = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def update(self, step: int) -> None:
        """Fold the parameters after optimiser step ``step`` (1, 2, ...) into the average."""
        torch._foreach_lerp_(self.averages, self.params, 1.0 - average_decay(self.decay, step))

    def state(self) -> dict[str, Tensor]:
        """``parameter name -> averaged value`` (a partial state dict of the model)."""
        return dict(zip(self.names, self.averages, strict=True))

    @torch.no_grad()
    def load(self, state: dict[str, Tensor]) -> None:
        """Restore the average from :meth:`state` (or from a whole state dict holding it)."""
        for name, average in zip(self.names, self.averages, strict=True):
            average.copy_(state[name])

    @contextmanager
    def swapped(self) -> Iterator[None]:
        """Within this context the model's parameters hold the average; after it, exactly the
        values they held before (copied back, so optimiser state and wrappers are untouched)."""
        with torch.no_grad():
            kept = [p.detach().clone() for p in self.params]
            torch._foreach_copy_(self.params, self.averages)
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(self.params, kept)
