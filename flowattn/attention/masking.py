"""Padding and causal masks for attention, and the per-row counts the bounds depend on."""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "attention_mask",
    "keys_per_row",
    "zero_padded",
    "masked_mean",
    "masked_softmax",
    "square_safe_limit",
    "downscale",
]


def attention_mask(mask: Tensor | None, causal: bool, length: int, device,
                   rows: slice | None = None) -> Tensor | None:
    """Boolean (B or 1, 1, N, N) mask, True where query i may attend to key j; with ``rows``,
    only those query rows (B or 1, 1, rows, N).

    Key j is visible to query i when j is present (and j <= i if causal). Every element also
    attends to itself, present or not: Kim et al. (2021, App. G) need (i, i) unmasked for the
    bounds, and it keeps the softmax of a padded query finite (its output is zeroed afterwards).
    Returns ``None`` when nothing is masked.
    """
    if mask is None and not causal:
        return None
    keys = torch.arange(length, device=device)
    queries = keys if rows is None else keys[rows]
    eye = queries[:, None] == keys[None, :]
    if causal:
        allowed = queries[:, None] >= keys[None, :]
    else:
        allowed = torch.ones(len(queries), length, dtype=torch.bool, device=device)
    allowed = allowed[None, None]
    if mask is not None:
        allowed = allowed & mask[:, None, None, :]
    return allowed | eye


def masked_softmax(logits: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
    """Softmax over keys of (B, H, N, N) logits, with the keys :func:`attention_mask` hides
    given probability zero: the attention matrices of a module, rows summing to one."""
    allowed = attention_mask(mask, causal, logits.shape[-1], logits.device)
    if allowed is not None:
        logits = logits.masked_fill(~allowed, -math.inf)
    return torch.softmax(logits, dim=-1)


def keys_per_row(mask: Tensor | None, causal: bool, batch: int, length: int, device) -> Tensor:
    """Number of keys each query row attends to, shape (B, N) (long).

    A padded query attends only to itself (count 1); its output is zero anyway.
    """
    if mask is None:
        mask = torch.ones(batch, length, dtype=torch.bool, device=device)
    if causal:
        counts = mask.long().cumsum(dim=1)
    else:
        counts = mask.long().sum(dim=1, keepdim=True).expand(batch, length)
    return torch.where(mask, counts, torch.ones_like(counts))


def zero_padded(y: Tensor, mask: Tensor | None) -> Tensor:
    """Zero the rows of padded elements of a (B, N, D) tensor."""
    if mask is None:
        return y
    return y * mask.unsqueeze(-1).to(y.dtype)


def masked_mean(x: Tensor, mask: Tensor | None, dim: int) -> Tensor:
    """Mean of ``x`` along the element dimension ``dim`` over present elements (keepdim).

    ``mask`` is (B, N) and is broadcast against ``x`` with the element axis at ``dim``.
    """
    if mask is None:
        return x.mean(dim=dim, keepdim=True)
    shape = [1] * x.dim()
    shape[0], shape[dim] = mask.shape[0], mask.shape[1]
    w = mask.reshape(shape).to(x.dtype)
    return (x * w).sum(dim=dim, keepdim=True) / w.sum(dim=dim, keepdim=True)


def square_safe_limit(dtype: torch.dtype, width: int, spare: float = 1.0) -> float:
    """The largest power of two t such that ``width`` squares of values up to t, times
    ``spare``, sum to at most 1/64 of the largest finite number of ``dtype``.

    float32 and bfloat16 with width 16: 2^58; float64: 2^506.
    """
    max_exponent = math.frexp(torch.finfo(dtype).max)[1]  # max < 2^max_exponent
    return 2.0 ** ((max_exponent - 6 - math.ceil(math.log2(width * spare))) // 2)


def downscale(magnitude: Tensor, limit: float) -> Tensor:
    """A power of two s >= 1 per entry with magnitude / s <= limit: 1 unless ``magnitude``
    exceeds ``limit``. Dividing by it is exact (no rounding) and needs no gradient.

    Examples:
        >>> downscale(torch.tensor([0.0, 3.0, 5.0, 40.0]), 4.0).tolist()
        [1.0, 1.0, 2.0, 16.0]
    """
    return torch.exp2(torch.ceil(torch.log2(magnitude.detach() / limit)).clamp(min=0))
