"""How many sets one evaluation pass holds: attention keeps sets x N² weights per probe."""

from __future__ import annotations

__all__ = ["EVAL_PAIRS", "eval_batch_size"]

#: element pairs (sets x N²) scored at once in evaluation: 256 sets up to N = 128
EVAL_PAIRS = 2**22


def eval_batch_size(batch_size: int, set_size: int) -> int:
    """Sets per evaluation batch: ``batch_size``, capped so that sets x N² <= 2^22.

    An estimated log-det multiplies each attention block's (B, H, N, N) matrices by a round of
    probes at once (:func:`~flowattn.flows.logdet.precise_series_logdet`): 256 sets of
    N = 1000 would hold 4 GiB per probe in such a tensor, 4 sets hold 16 MiB. Sets of up to
    128 elements keep 256.

    Examples:
        >>> eval_batch_size(256, 55), eval_batch_size(256, 1000), eval_batch_size(256, 10_000)
        (256, 4, 1)
    """
    return max(1, min(batch_size, EVAL_PAIRS // (set_size * set_size)))
