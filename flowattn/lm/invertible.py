"""Inverting the residual stack of an invertible language model: hidden states -> embeddings."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..errors import InputError, InverseNotConverged
from ..flows.inverse import residual_inverse
from .model import Block, ChannelAffine, TransformerLM

__all__ = ["invert_block", "invert_hidden_states", "reconstruction_report", "InverseNotConverged"]

METHODS = ("fixed-point", "anderson")


def _invert_norm(norm: nn.Module, y: Tensor) -> Tensor:
    if isinstance(norm, ChannelAffine):
        return norm.inverse(y)
    if isinstance(norm, nn.Identity):
        return y
    raise InputError(f"{type(norm).__name__} is not invertible")


@torch.no_grad()
def invert_block(
    block: Block,
    y: Tensor,
    tol: float = 1e-6,
    max_iter: int = 500,
    method: str = "fixed-point",
) -> Tensor:
    """Invert one invertible block, x -> N1(x) = u -> v = u + g1(u) -> N2(v) = w -> w + g2(w).

    Each residual map is solved per sequence by the Banach iteration x <- y - g(x) (Behrmann et
    al. 2019, Alg. 1) or Anderson acceleration of it, to ||x + g(x) - y||_inf <=
    tol * max(1, ||y||_inf): :func:`flowattn.flows.inverse.residual_inverse`, the solver of the
    flows' invertible residual blocks, with ``method``, ``tol`` and ``max_iter`` the fields of
    :class:`~flowattn.flows.InverseOptions` of the same names. The
    :class:`~flowattn.lm.model.ChannelAffine` layers are inverted exactly.

    Raises:
        InverseNotConverged: when a sequence misses ``tol`` after ``max_iter`` iterations.
    """
    if not block.invertible:
        raise InputError("the block is not invertible (the model was built without invertible)")
    if method not in METHODS:
        raise InputError(f"method must be one of {METHODS}, got {method!r}")

    def solve(branch, target: Tensor) -> Tensor:
        # sequences are unpadded: the branch ignores the solver's (absent) mask
        return residual_inverse(
            lambda x, mask: branch(x), target, None, method=method, tol=tol, max_iter=max_iter
        )

    w = solve(block.ff_branch, y)
    v = _invert_norm(block.norm_ff, w)
    u = solve(block.attention_branch, v)
    return _invert_norm(block.norm_attn, u)


@torch.no_grad()
def invert_hidden_states(
    model: TransformerLM,
    h: Tensor,
    tol: float = 1e-6,
    max_iter: int = 500,
    method: str = "fixed-point",
) -> Tensor:
    """The embeddings whose final hidden states (before the final norm) are ``h`` (B, T, D).

    Inverts the blocks of an invertible :class:`~flowattn.lm.model.TransformerLM` in reverse
    order with :func:`invert_block`. The model should be in evaluation mode, so that dropout
    is deterministic and the spectral normalisation uses exact singular values.

    Examples:
        >>> from flowattn.lm.config import LMConfig
        >>> model = TransformerLM(LMConfig(vocab_size=7, block_size=6, layers=2, dim=8,
        ...                                heads=2, invertible=True)).eval()
        >>> e = model.embed(torch.randint(7, (3, 6)))
        >>> h, _ = model.hidden_states(e)
        >>> bool((invert_hidden_states(model, h) - e).abs().max() < 1e-4)
        True
    """
    if not model.config.invertible:
        raise InputError(
            "this language model is not invertible: train it with --invertible (contractive "
            "blocks, invertible normalisation)"
        )
    if model.training:
        raise InputError("call model.eval() before inverting: training mode is stochastic")
    x = h
    for block in reversed(model.blocks):
        x = invert_block(block, x, tol=tol, max_iter=max_iter, method=method)
    return x


@torch.no_grad()
def reconstruction_report(
    model: TransformerLM,
    idx: Tensor,
    tol: float = 1e-6,
    max_iter: int = 500,
    method: str = "fixed-point",
) -> dict:
    """Embed ``idx`` (B, T), run the stack forward, invert it, and measure the reconstruction.

    Returns a dict with ``max_error`` (max |e - e_rec|), ``mean_error``, ``relative_error``
    (max error / max |e|), ``token_accuracy`` (the share of tokens whose nearest token
    embedding, after removing the position embedding, is the true token), ``tokens`` and the
    largest certified branch constant ``max_branch_bound``.
    """
    e = model.embed(idx)
    h, _ = model.hidden_states(e)
    rec = invert_hidden_states(model, h, tol=tol, max_iter=max_iter, method=method)
    err = (rec - e).abs()
    token_part = rec - model.pos_emb(torch.arange(idx.shape[1], device=idx.device))
    nearest = torch.cdist(token_part.reshape(-1, token_part.shape[-1]), model.tok_emb.weight)
    accuracy = (nearest.argmin(-1) == idx.reshape(-1)).to(torch.float64).mean()
    bounds = [b for pair in model.lipschitz_bounds(idx.shape[1]) for b in pair]
    return {
        "max_error": float(err.max()),
        "mean_error": float(err.mean()),
        "relative_error": float(err.max() / e.abs().max().clamp_min(math.ulp(1.0))),
        "token_accuracy": float(accuracy),
        "tokens": int(idx.numel()),
        "max_branch_bound": max(bounds),
    }
