"""What a certificate is asked for, checked: the name of a norm, the numbers of keys, the
weights' precision."""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from ..errors import InputError
from ..validation import LOW_PRECISION, check_count

__all__ = ["MIXED_NAMES", "norm_name", "check_counts", "check_certificate_precision"]


_INF_NAMES = ("inf", float("inf"), math.inf)
MIXED_NAMES = ("2,inf",)


def norm_name(p, mixed: bool = False) -> str:
    """Canonical name of a norm: ``"inf"``, ``"2"`` or, where ``mixed`` is allowed, ``"2,inf"``.

    ``"2,inf"`` is the mixed norm of a set X in R^{N x D}, max_i ||x_i||_2: the largest Euclidean
    norm of an element. Only the certificates of tied L2 attention are derived for it, so other
    callers refuse it.
    """
    if mixed and p in MIXED_NAMES:
        return "2,inf"
    if p in _INF_NAMES:
        return "inf"
    if p in (2, "2", 2.0):
        return "2"
    expected = "'inf', 2 or '2,inf'" if mixed else "'inf' or 2"
    raise InputError(f"norm must be {expected}, got {p!r}")


def check_counts(n, what: str = "sequence length"):
    """``n``, the number(s) of keys a certificate is asked for, refused unless it is a positive
    integer, a non-empty range of them or an integer tensor (or list) of them: a count of 2.5
    or NaN certifies no set. A tensor is checked on its device (one read back).

    Examples:
        >>> check_counts(range(1, 4))
        range(1, 4)
        >>> check_counts(2.5)
        Traceback (most recent call last):
        ...
        flowattn.errors.InputError: sequence length must be an integer >= 1 (or a range or ...
    """
    if isinstance(n, bool) or not isinstance(n, (numbers.Integral, range, Tensor, list, tuple)):
        raise InputError(f"{what} must be an integer >= 1 (or a range or an integer tensor of "
                         f"them), got {n!r}")
    if isinstance(n, numbers.Integral):
        return check_count(n, what)
    if isinstance(n, range):
        if len(n) == 0 or min(n[0], n[-1]) < 1:  # a range's least is at one of its ends
            raise InputError(f"{what} must be >= 1, got {n}")
        return n
    counts = torch.as_tensor(n)
    if counts.is_floating_point() or counts.is_complex() or counts.dtype == torch.bool:
        raise InputError(f"{what} counts must be integers, got a tensor of dtype {counts.dtype}")
    if counts.numel() == 0 or (counts < 1).any():
        raise InputError(f"{what} must be >= 1, got {n}")
    return n if isinstance(n, Tensor) else counts


def check_certificate_precision(*weights: Tensor) -> None:
    """Refuse weights in half precision: a certificate is evaluated in its weights' precision,
    and in float16 or bfloat16 neither its rounding nor the CPU's eigensolvers serve (mixed
    precision keeps the weights in float32 under ``torch.autocast``).

    Examples:
        >>> check_certificate_precision(torch.eye(2, dtype=torch.bfloat16))
        Traceback (most recent call last):
        ...
        flowattn.errors.InputError: a certified bound needs float32 or float64 weights, got ...
    """
    for w in weights:
        if w.dtype in LOW_PRECISION:
            raise InputError(
                f"a certified bound needs float32 or float64 weights, got {w.dtype}: keep the "
                "module in float32 and run it under torch.autocast for mixed precision (its "
                "certificate is then evaluated in float32)")
