"""Scaled dot-product multi-head self-attention, the non-Lipschitz baseline."""

from __future__ import annotations

import math

from torch import Tensor, nn

from ..errors import InputError
from ..validation import check_heads, check_output, check_sets
from .kernels import attend
from .masking import attention_mask, masked_softmax, zero_padded
from .projections import Projection

__all__ = ["DotProductMHA", "split_heads", "merge_heads"]


_OVERFLOW_CAUSE = "its logits q.k/sqrt(d) grow with the square of the input's scale"


def split_heads(x: Tensor, heads: int) -> Tensor:
    """(B, N, H d) -> (B, H, N, d)."""
    b, n, _ = x.shape
    return x.reshape(b, n, heads, -1).transpose(1, 2)


def merge_heads(x: Tensor) -> Tensor:
    """(B, H, N, d) -> (B, N, H d)."""
    b, h, n, d = x.shape
    return x.transpose(1, 2).reshape(b, n, h * d)


class DotProductMHA(nn.Module):
    r"""Multi-head self-attention with dot-product logits.

    .. math:: P^h = \mathrm{softmax}(X W^{Q,h} (X W^{K,h})^\top / \sqrt{d}), \quad
              F(X) = [P^1 X W^{V,1}, \dots, P^H X W^{V,H}] W^O

    It is **not** Lipschitz (Kim et al. 2021, Thm 3.1): with x_i = 0 the Jacobian block
    d f_i / d x_i grows with the variance of the other inputs. It is the baseline every
    Lipschitz variant is compared with. Its logits grow with the square of the input's scale:
    where they overflow (float32 inputs near 1e19) it raises
    :class:`~flowattn.errors.NonFiniteError` rather than return NaN. Computed by
    :func:`~flowattn.attention.kernels.attend`: the fused kernels of
    :func:`torch.nn.functional.scaled_dot_product_attention` where available, differentiable to
    any order.

    Arguments:
        dim: model width D.
        heads: number of heads H (must divide D).
        dropout: dropout on the attention weights, in training mode only.
        bias: whether the projections have biases.

    Attributes:
        similarity: ``"dot-product"``, the kind of logits (shared by every attention module).

    Examples:
        >>> attn = DotProductMHA(dim=16, heads=4)
        >>> attn(torch.randn(2, 5, 16)).shape
        torch.Size([2, 5, 16])
    """

    similarity = "dot-product"

    def __init__(self, dim: int, heads: int, dropout: float = 0.0, bias: bool = True):
        super().__init__()
        check_heads(dim, heads)
        if not 0.0 <= dropout < 1.0:
            raise InputError(f"dropout must lie in [0, 1), got {dropout}")
        self.dim, self.heads, self.head_dim, self.dropout = dim, heads, dim // heads, dropout
        self.qkv = nn.Linear(dim, 3 * dim, bias=bias)
        self.out = nn.Linear(dim, dim, bias=bias)

    def forward(self, x: Tensor, mask: Tensor | None = None, causal: bool = False) -> Tensor:
        """Attend within each set of ``x`` (B, N, D); ``mask`` (B, N) marks present elements."""
        mask = check_sets(x, mask, self.dim, module=self)
        q, k, v = (split_heads(t, self.heads) for t in self.qkv(x).chunk(3, dim=-1))
        heads = attend(
            q,
            k,
            v,
            attn_mask=None if mask is None else attention_mask(mask, causal, x.shape[1], x.device),
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=causal and mask is None,
        )
        return check_output(zero_padded(self.out(merge_heads(heads)), mask), x, "DotProductMHA",
                            _OVERFLOW_CAUSE)

    def attention_probabilities(
        self, x: Tensor, mask: Tensor | None = None, causal: bool = False
    ) -> Tensor:
        """The attention matrices P (B, H, N, N) that :meth:`forward` applies to ``x`` (B, N, D):
        softmax_j(q_i.k_j / sqrt(d)) over the keys query i sees (before attention dropout).

        Examples:
            >>> attn = DotProductMHA(dim=8, heads=2)
            >>> p = attn.attention_probabilities(torch.randn(1, 3, 8), causal=True)
            >>> tuple(p.shape), p[0, 0, 0].tolist()
            ((1, 2, 3, 3), [1.0, 0.0, 0.0])
        """
        mask = check_sets(x, mask, self.dim, module=self)
        q, k, _ = (split_heads(t, self.heads) for t in self.qkv(x).chunk(3, dim=-1))
        logits = q @ k.transpose(-1, -2) * (1.0 / math.sqrt(self.head_dim))
        return check_output(masked_softmax(logits, mask, causal), x, "DotProductMHA",
                            _OVERFLOW_CAUSE)

    def projections(self) -> list[Projection]:
        """The fused query-key-value map ``qkv.weight`` (3D, D) and the output map
        ``out.weight`` (D, D), both :class:`~torch.nn.Linear` weights."""
        return [
            Projection("qkv.weight", "qkv", self.qkv.weight, "linear"),
            Projection("out.weight", "output", self.out.weight, "linear"),
        ]
