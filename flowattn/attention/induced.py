"""Induced-point tied L2 attention: a certified Lipschitz interaction of cost O(N M).

Each head pools the set into M summaries by tied L2 attention from M learnt inducing points,
then every element attends to itself and the summaries (the induced set attention of Lee et al.
2019, Set Transformer, in the tied L2 form of Kim et al. 2021). Both stages keep a "self" key at
logit 0, which is what Kim et al.'s Lemma F.2 needs: the map is Lipschitz, with the certificate
of :func:`~flowattn.lipschitz.induced_attention_bound` (derivation in ``docs/attention.md``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..errors import InputError
from ..lipschitz import induced_attention_bound
from ..lipschitz.checks import norm_name
from ..validation import check_heads, check_output, check_sets
from .contractive import ContractiveAttention
from .dot_product import merge_heads, split_heads
from .l2 import square_weight
from .masking import zero_padded
from .projections import Projection

__all__ = ["InducedL2MHA", "ContractiveInducedL2MHA"]

_OVERFLOW_HINT = "squared distances to the inducing points overflowed"


class InducedL2MHA(nn.Module):
    r"""Tied L2 attention through M learnt inducing points per head: O(N M) time and memory.

    Head h projects the elements to q_j = x_j W^{Q,h} (queries = keys, as in tied
    :class:`~flowattn.attention.L2MHA`, d = D / H) and holds inducing points u_1, ..., u_M in
    R^d. With logits -||a - b||^2 / sqrt(d) and a "self" key at logit 0 in both stages,

    .. math::
        s_m = P_{m0} u_m + \sum_j P_{mj} q_j, \quad
        P_{m\cdot} = \mathrm{softmax}(0, -\|u_m - q_1\|^2/\sqrt d, \dots),

        y_i = Q_{i0} q_i + \sum_m Q_{im} s_m, \quad
        Q_{i\cdot} = \mathrm{softmax}(0, -\|q_i - s_1\|^2/\sqrt d, \dots),

    and F(X)_i = sum_h y_i^h (W^{Q,h T} W^{V,h} / sqrt(d)) W^{O,h}: the tied value path of L2MHA
    (a value is q_j times a d x d map), so each head is a parameter-free core between the linear
    maps W^{Q,h} and M_h = W^{Q,h T} W^{V,h} W^{O,h} / sqrt(d). The first stage is the row of
    u_m in tied L2 attention over {u_m} and the set, the second the row of q_i over {q_i} and the
    summaries: both are covered by Kim et al.'s Lemma F.2, so F is Lipschitz in the mixed norm
    max_i ||x_i||_2 with the certificate of :func:`~flowattn.lipschitz.induced_attention_bound`,
    which grows with N only through W_0(N / e) (about log N). Permutation equivariant; sets of
    any size, padding masks; not causal (the summaries pool the whole set).

    Arguments:
        dim: model width D.
        heads: number of heads H (must divide D).
        inducing: inducing points M per head.

    Attributes:
        inducing_points: the (H, M, d) parameter u.
        similarity: ``"l2"``, the kind of logits (shared by every attention module).

    Examples:
        >>> attn = InducedL2MHA(dim=4, heads=2, inducing=8)
        >>> attn(torch.randn(3, 1000, 4)).shape
        torch.Size([3, 1000, 4])
        >>> attn.lipschitz_bound(1000).item() > 0
        True
    """

    similarity = "l2"

    def __init__(self, dim: int, heads: int, inducing: int = 16):
        super().__init__()
        check_heads(dim, heads)
        if not isinstance(inducing, int) or inducing < 1:
            raise InputError(f"inducing must be a positive number of points, got {inducing!r}")
        self.dim, self.heads, self.head_dim, self.inducing = dim, heads, dim // heads, inducing
        self.w_q = square_weight(dim)
        self.w_v = square_weight(dim)
        self.w_o = square_weight(dim)
        # spread like the queries of unit-variance inputs (x W^Q with Glorot W^Q)
        self.inducing_points = nn.Parameter(torch.randn(heads, inducing, self.head_dim))

    def head_weights(self, w: Tensor) -> Tensor:
        """(D, D) -> (H, D, d): the column block of each head."""
        return w.reshape(self.dim, self.heads, self.head_dim).permute(1, 0, 2)

    def forward(self, x: Tensor, mask: Tensor | None = None, causal: bool = False) -> Tensor:
        """Attend within each set of ``x`` (B, N, D); ``mask`` (B, N) marks present elements."""
        mask = self._checked(x, mask, causal)
        q = split_heads(x @ self.w_q, self.heads)  # (B, H, N, d)
        y, _, _ = self._core(q, mask)
        out = merge_heads(y @ self._tied_value_map()) @ self.w_o
        return check_output(zero_padded(out, mask), x, "InducedL2MHA", _OVERFLOW_HINT)

    def _checked(self, x: Tensor, mask: Tensor | None, causal: bool) -> Tensor | None:
        if causal:
            raise InputError(
                "InducedL2MHA pools the whole set into its summaries: it has no causal form "
                "(use L2MHA for sequences)"
            )
        return check_sets(x, mask, self.dim, module=self)

    def _tied_value_map(self) -> Tensor:
        """(H, d, d): W^{Q,h T} W^{V,h} / sqrt(d), so that x A_h W^{V,h} = q_h times it."""
        wq, wv = self.head_weights(self.w_q), self.head_weights(self.w_v)
        return wq.transpose(1, 2) @ wv / math.sqrt(self.head_dim)

    def _core(self, q: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """Both stages on queries q (B, H, N, d): (y (B, H, N, d), P (B, H, M, 1 + N),
        Q (B, H, N, 1 + M)); column 0 of P and Q is the self key."""
        scale = self.head_dim**-0.5
        u = self.inducing_points.to(q.dtype)  # (H, M, d)
        # differences, not the expanded square: no cancellation at any offset of the set
        logits = -(u[None, :, :, None, :] - q[:, :, None, :, :]).pow(2).sum(-1) * scale
        if mask is not None:
            logits = logits.masked_fill(~mask[:, None, None, :], float("-inf"))
        p = _with_self(logits).softmax(-1)  # (B, H, M, 1 + N)
        s = p[..., :1] * u + p[..., 1:] @ q  # (B, H, M, d)
        logits = -(q.unsqueeze(-2) - s.unsqueeze(-3)).pow(2).sum(-1) * scale  # (B, H, N, M)
        w = _with_self(logits).softmax(-1)  # (B, H, N, 1 + M)
        y = w[..., :1] * q + w[..., 1:] @ s
        return y, p, w

    def attention_probabilities(
        self, x: Tensor, mask: Tensor | None = None, causal: bool = False
    ) -> Tensor:
        """The weights (B, H, N, N) with which output i mixes the elements' queries:
        Q_i0 [i = j] + sum_m Q_im P_mj. A row sums to one minus the weight that reaches the
        inducing points themselves (sum_m Q_im P_m0). O(N^2) memory: for inspection.

        Examples:
            >>> attn = InducedL2MHA(dim=2, heads=1, inducing=4)
            >>> p = attn.attention_probabilities(torch.randn(1, 5, 2))
            >>> bool((p.sum(-1) <= 1 + 1e-6).all())
            True
        """
        mask = self._checked(x, mask, causal)
        q = split_heads(x @ self.w_q, self.heads)
        _, p, w = self._core(q, mask)
        eye = torch.eye(q.shape[-2], dtype=q.dtype, device=q.device)
        out = w[..., :1] * eye + w[..., 1:] @ p[..., 1:]
        if mask is not None:
            out = out * mask[:, None, :, None]
        return check_output(out, x, "InducedL2MHA", _OVERFLOW_HINT)

    def projections(self) -> list[Projection]:
        """The (D, D) matrices W^Q (= W^K), W^V and W^O, applied as x W."""
        roles = (("w_q", "query"), ("w_v", "value"), ("w_o", "output"))
        return [Projection(name, role, getattr(self, name), "raw") for name, role in roles]

    def lipschitz_bound(self, n: int | range | Tensor, norm: str | int = "2,inf") -> Tensor:
        """Certified bound on Lip_{2,inf}(F) for sets of ``n`` present elements
        (:func:`~flowattn.lipschitz.induced_attention_bound`); ``n`` an int, a range (a table)
        or a tensor of counts. Differentiable in the weights."""
        if norm_name(norm, mixed=True) != "2,inf":
            raise InputError(
                f"InducedL2MHA is certified in the mixed norm '2,inf' only, got norm={norm!r}"
            )
        wq, wv = self.head_weights(self.w_q), self.head_weights(self.w_v)
        return induced_attention_bound(n, self.inducing, wq, wv, self.w_o)


def _with_self(logits: Tensor) -> Tensor:
    """Prepend the self key's logit 0 to every row."""
    return torch.cat([logits.new_zeros(*logits.shape[:-1], 1), logits], dim=-1)


class ContractiveInducedL2MHA(ContractiveAttention):
    r"""Contractive induced-point attention: f(X) = c F(X) / Lip_{2,inf}-bound(F), F an
    :class:`InducedL2MHA`.

    Every output row is divided by the certificate for the number of present elements of its
    set, so Lip_{2,inf}(f) <= c < 1 and x + f(x) is an invertible residual block in the mixed
    norm max_i ||x_i||_2 (any induced norm serves the fixed-point inverse and the log-det
    series; see ``docs/attention.md``). Time and memory O(N M) per head: the interaction of
    residual flows on sets of thousands of elements.

    Arguments:
        dim: model width D.
        heads: number of heads H.
        coeff: the contraction coefficient c, in (0, 1).
        inducing: inducing points M per head.
        output_dropout: classic dropout probability on the output (a contraction).

    Examples:
        >>> f = ContractiveInducedL2MHA(dim=3, heads=1, coeff=0.9, inducing=8)
        >>> f(torch.randn(2, 500, 3)).shape
        torch.Size([2, 500, 3])
        >>> round(float(f.lipschitz_bound(500)), 6)
        0.9
    """

    similarity = "l2"
    only_norm = "2,inf"

    def __init__(
        self,
        dim: int,
        heads: int,
        coeff: float = 0.9,
        inducing: int = 16,
        output_dropout: float = 0.0,
    ):
        super().__init__()
        self._contraction(coeff, "2,inf", output_dropout)
        self.attention = InducedL2MHA(dim, heads, inducing)
        self.dim, self.heads = dim, heads

    def forward(self, x: Tensor, mask: Tensor | None = None, causal: bool = False) -> Tensor:
        """Apply f to ``x`` (B, N, D); ``mask`` (B, N) marks present elements."""
        return self._classic_dropout(self._divided(x, mask, causal))

