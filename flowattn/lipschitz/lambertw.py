"""The principal branch of the Lambert W function, W_0, and Kim et al.'s phi^{-1}(N - 1) =
W_0((N - 1) / e), the constant of a softmax row over N keys (Lemma F.2)."""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from ..errors import InputError

__all__ = ["lambertw0", "phi_inverse", "phi_inverse_of_count"]


def lambertw0(x: Tensor | float, iterations: int = 3, check: bool = True) -> Tensor:
    """Principal branch W_0 of the Lambert W function, w e^w = x, for x >= 0.

    Winitzki's approximation W(x) ~ L (1 - log(1 + L) / (2 + L)), L = log(1 + x) (relative error
    below 2% on [0, inf)) is refined by Halley's method, which converges cubically:

        w <- w - f / (e^w (w + 1) - (w + 2) f / (2 w + 2)),   f = w e^w - x.

    From that start two iterations are within 2e-15 relative of W_0 in float64 over
    [1e-300, 1e300], and three (the default) reach its rounding error there (the tests check the
    whole range). The derivative is the closed form W'(x) = 1 / (e^W (1 + W)) (differentiating
    w e^w = x), not that of the iterations: one operation in the backward pass instead of the
    iterations' graph, and differentiable again (second derivatives, ``torch.func``).

    Arguments:
        x: non-negative values (tensor or float).
        iterations: number of Halley steps.
        check: refuse negative and NaN entries (reads the values back from their device; the
            certificates, whose arguments are sums of exponentials, pass ``False``).

    Examples:
        >>> float(lambertw0(math.e))
        1.0
        >>> x = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
        >>> w = lambertw0(x)
        >>> bool(torch.isclose(torch.autograd.grad(w, x)[0], 1 / (w.exp() * (1 + w))))
        True
    """
    x = torch.as_tensor(x, dtype=torch.get_default_dtype() if not torch.is_tensor(x) else None)
    if not x.is_floating_point():
        x = x.to(torch.get_default_dtype())
    if check and ((x < 0).any() or torch.isnan(x).any()):
        raise InputError("lambertw0 is implemented for x >= 0 only")
    return _LambertW0.apply(x, iterations)


class _LambertW0(torch.autograd.Function):
    """W_0 by Halley's method, with the closed-form derivative (see :func:`lambertw0`)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, iterations: int) -> Tensor:
        log1p = torch.log1p(x)
        w = log1p * (1 - torch.log1p(log1p) / (2 + log1p))
        for _ in range(iterations):
            ew = torch.exp(w)
            f = w * ew - x
            w = w - f / (ew * (w + 1) - (w + 2) * f / (2 * w + 2))
        # W_0(0) = 0 and W_0(inf) = inf (the iterations would give NaN there)
        return torch.where(x == 0, torch.zeros_like(w), torch.where(torch.isinf(x), x, w))

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(output)  # the output: a second derivative goes through W again

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        (w,) = ctx.saved_tensors
        return grad / (torch.exp(w) * (1 + w)), None


@torch.compiler.disable  # a host-side constant: not traced
@functools.lru_cache(maxsize=4096)
def phi_inverse_of_count(n: int) -> float:
    """phi^{-1}(n - 1) for one count n >= 1, as a float (cached: the bounds of attention on sets
    of one size reuse it on every call)."""
    return float(phi_inverse(float(n - 1)))


def phi_inverse(n_minus_one: Tensor | float, check: bool = True) -> Tensor:
    """phi^{-1}(N - 1) = W_0((N - 1) / e), where phi(x) = x exp(x + 1) (Kim et al. 2021, Thm 3.2).

    Solving x e^{x + 1} = N - 1 gives x e^x = (N - 1) / e; the paper prints W_0(N / e), which is
    larger and so also a valid, looser bound. ``check``: as in :func:`lambertw0`.
    """
    return lambertw0(torch.as_tensor(n_minus_one, dtype=torch.float64) / math.e, check=check)
