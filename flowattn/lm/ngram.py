"""Count-based character n-gram models: the floor every language model should clear.

A character n-gram model predicts a character from the n − 1 before it, with add-α (Lidstone)
smoothing of the counts of the training text:

    p(c | u) = (count(u c) + α) / (count(u) + α V),

V the vocabulary size. A unigram ignores all context, a bigram sees one character; a neural LM
whose validation loss is no better than a bigram's uses no context beyond the current
character. ``α`` is chosen on the last tenth of the training split (fitted on the rest), then
the model is refitted on the whole training split and scored on the validation split — the
same split and the same characters the neural models are scored on (every validation character
after the first; the first ``n − 1`` see the shorter context they have).

Counting is vectorised: every context and its next character become one integer key, counted
with ``torch.unique``, looked up with ``torch.searchsorted``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..errors import InputError

__all__ = ["CharNGram", "ngram_baselines", "ALPHAS"]

ALPHAS = (1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)  # the add-alpha grid searched on held-out text


def _keys(ids: Tensor, order: int, vocab: int) -> tuple[Tensor, Tensor]:
    """Integer keys of (context, next) and of the context alone, for every position that has
    ``order - 1`` characters before it."""
    ids = ids.long()
    n = len(ids) - (order - 1)
    context = torch.zeros(n, dtype=torch.long)
    for k in range(order - 1):  # the oldest character is the most significant digit
        context = context * vocab + ids[k : k + n]
    nxt = ids[order - 1 :]
    return context * vocab + nxt, context


def _lookup(table: Tensor, counts: Tensor, keys: Tensor) -> Tensor:
    """``counts`` of ``keys`` in the sorted ``table`` (0 where a key is absent)."""
    if len(table) == 0:
        return torch.zeros_like(keys)
    where = torch.searchsorted(table, keys).clamp(max=len(table) - 1)
    return torch.where(table[where] == keys, counts[where], torch.zeros_like(keys))


class CharNGram:
    """An add-α smoothed character n-gram model of ``order`` (1: unigram, 2: bigram, ...).

    Arguments:
        train: training ids (a 1-D tensor).
        order: n, the number of characters in a gram (context n − 1).
        vocab_size: V.
        alpha: the additive smoothing constant α > 0.

    Examples:
        >>> ids = torch.tensor([0, 1, 0, 1, 0, 1, 0, 1])
        >>> bigram = CharNGram(ids, order=2, vocab_size=2, alpha=0.01)
        >>> round(bigram.nll(torch.tensor([0, 1, 0, 1])), 3)  # nats per predicted character
        0.003
        >>> round(CharNGram(ids, order=1, vocab_size=2, alpha=0.01).nll(ids), 3)  # log 2
        0.693
    """

    def __init__(self, train: Tensor, order: int, vocab_size: int, alpha: float) -> None:
        if order < 1:
            raise InputError(f"order must be >= 1, got {order}")
        if not alpha > 0:
            raise InputError(f"alpha must be positive, got {alpha}")
        if vocab_size ** order >= 2 ** 62:
            raise InputError(f"order {order} over {vocab_size} symbols overflows 64-bit keys")
        if len(train) < order:
            raise InputError(f"{len(train)} training characters hold no {order}-gram")
        self.order, self.vocab_size, self.alpha = order, vocab_size, alpha
        # one table per context length 0..order-1, so early positions use what they have
        self.tables = []
        for k in range(1, order + 1):
            full, context = _keys(train, k, vocab_size)
            full_keys, full_counts = torch.unique(full, return_counts=True)
            ctx_keys, ctx_counts = torch.unique(context, return_counts=True)
            self.tables.append((full_keys, full_counts, ctx_keys, ctx_counts))

    def counts(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """Training counts of (context, next) and of the context, for every character of
        ``ids`` after the first (the counts do not depend on α)."""
        ids = ids.long()
        joint, ctx = [], []
        for t in range(1, min(self.order - 1, len(ids))):  # positions with a shorter context
            j, c = self._counts(ids[: t + 1], t + 1)
            joint.append(j[-1:])
            ctx.append(c[-1:])
        if len(ids) >= self.order:
            first = 1 if self.order == 1 else 0
            j, c = self._counts(ids[first:], self.order)
            joint.append(j)
            ctx.append(c)
        return torch.cat(joint).double(), torch.cat(ctx).double()

    def _counts(self, ids: Tensor, order: int) -> tuple[Tensor, Tensor]:
        full_keys, full_counts, ctx_keys, ctx_counts = self.tables[order - 1]
        full, context = _keys(ids, order, self.vocab_size)
        return _lookup(full_keys, full_counts, full), _lookup(ctx_keys, ctx_counts, context)

    def log_probs(self, ids: Tensor, alpha: float | None = None) -> Tensor:
        """log p(ids[t] | up to n − 1 characters before it), for t = 1 .. len − 1."""
        alpha = self.alpha if alpha is None else alpha
        joint, ctx = self.counts(ids)
        return torch.log((joint + alpha) / (ctx + alpha * self.vocab_size))

    def nll(self, ids: Tensor, alpha: float | None = None) -> float:
        """Mean negative log-likelihood in nats per predicted character (with ``alpha``, or
        the model's own α)."""
        if len(ids) < 2:
            raise InputError("scoring needs at least two characters")
        return float(-self.log_probs(ids, alpha).mean())


def ngram_baselines(train: Tensor, val: Tensor, vocab_size: int,
                    orders: tuple[int, ...] = (1, 2, 3, 4, 5)) -> list[dict]:
    """Validation loss of add-α n-gram models of each order, α chosen on held-out training text.

    Returns one record per order: ``order``, ``alpha``, ``val_loss`` (nats/char), ``val_bpc``.

    Examples:
        >>> text = torch.tensor([0, 1, 2] * 200)
        >>> [round(r["val_loss"], 2) for r in ngram_baselines(text[:500], text[500:], 3, (1, 2))]
        [1.1, 0.0]
    """
    split = int(0.9 * len(train))
    if split < max(orders) or len(train) - split < 2:
        raise InputError(f"{len(train)} training characters are too few to choose alpha")
    fit, held = train[:split], train[split:]
    records = []
    for order in orders:
        joint, ctx = CharNGram(fit, order, vocab_size, 1.0).counts(held)
        alpha = min(ALPHAS, key=lambda a: -float(torch.log(
            (joint + a) / (ctx + a * vocab_size)).mean()))
        loss = max(0.0, CharNGram(train, order, vocab_size, alpha).nll(val))  # never -0.0
        records.append({"order": order, "alpha": alpha, "val_loss": loss,
                        "val_bpc": loss / math.log(2)})
    return records
