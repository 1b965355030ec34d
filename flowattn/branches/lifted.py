"""L2 attention among learnt features of the elements, for narrow elements (points in 2-D, 3-D).

Tied L2 attention on D-dimensional elements compares them by a Mahalanobis distance of their
coordinates and mixes linear maps of them: with D = 2 every head has a 2 x 2 metric. Lifting
each element to W features first, x -> phi(x) = LipSwish(x A + a), lets the logits compare
non-linear features (a point's radius, its side of a line) and the values carry them; a linear
map brings the result back to D. Every factor has a certified Lipschitz constant in the mixed
norm max_i ||x_i||_2, so their product certifies the whole.
"""

from __future__ import annotations

from torch import Tensor, nn

from ..attention import L2MHA, Projection
from ..attention.contractive import ContractiveAttention
from ..errors import InputError
from ..lipschitz import spectral_norm_exact
from ..lipschitz.checks import norm_name
from ..validation import check_count, check_heads, check_sets
from .mlp import LipSwish

__all__ = ["LiftedL2MHA", "ContractiveLiftedL2MHA"]


class LiftedL2MHA(nn.Module):
    r"""Tied L2 attention among W learnt features of the elements, read back to D.

    .. math::
        F(X) = F_W\big(\varphi(X)\big)\, B, \qquad \varphi(x) = \mathrm{LipSwish}(x A + a),

    row by row, with A in R^{D x W}, a in R^W, F_W a tied :class:`L2MHA` of width W with H heads
    and B in R^{W x D}. Padded elements are ignored as keys by F_W and give zero rows.

    Certificate (mixed norm ||X||_{2,inf} = max_i ||x_i||_2, where a map applied to each
    element alone has the Lipschitz constant of that map in the 2-norm):

    .. math::
        \mathrm{Lip}_{2,\infty}(F) \le \|A\|_2 \cdot \mathrm{Lip}(\mathrm{LipSwish}) \cdot
        \mathrm{Lip}_{2,\infty}(F_W) \cdot \|B\|_2,

    with F_W's tight mixed-norm certificate (``docs/attention.md``), exact spectral norms and
    LipSwish's 1.09984 / 1.1.

    Arguments:
        dim: element width D.
        width: feature width W.
        heads: heads of F_W (must divide W).

    Examples:
        >>> attn = LiftedL2MHA(dim=2, width=16, heads=4)
        >>> attn(torch.randn(3, 5, 2)).shape
        torch.Size([3, 5, 2])
        >>> float(attn.lipschitz_bound(5).detach()) > 0
        True
    """

    similarity = "l2"

    def __init__(self, dim: int, width: int = 64, heads: int = 4) -> None:
        super().__init__()
        check_count(dim, "dim")
        check_heads(width, heads, "width")  # the attention acts at the lifted width
        self.dim, self.width, self.heads = dim, width, heads
        self.lift = nn.Linear(dim, width)
        self.activation = LipSwish()
        self.attention = L2MHA(width, heads, tied=True)
        self.read = nn.Linear(width, dim, bias=False)

    @property
    def w_q(self) -> Tensor:
        """F_W's W^Q (where a contractive wrapper reads the weights' dtype and device)."""
        return self.attention.w_q

    def features(self, x: Tensor) -> Tensor:
        """phi(X) (B, N, W): the lifted elements."""
        return self.activation(self.lift(x))

    def forward(self, x: Tensor, mask: Tensor | None = None, causal: bool = False) -> Tensor:
        """F(X) for ``x`` (B, N, D); ``mask`` (B, N) marks present elements."""
        mask = check_sets(x, mask, self.dim, module=self)
        # F_W gives padded rows zeros, and the read-out has no bias: they stay zero
        return self.read(self.attention(self.features(x), mask, causal))

    def attention_probabilities(
        self, x: Tensor, mask: Tensor | None = None, causal: bool = False
    ) -> Tensor:
        """The attention matrices P (B, H, N, N) of F_W on the lifted elements."""
        mask = check_sets(x, mask, self.dim, module=self)
        return self.attention.attention_probabilities(self.features(x), mask, causal)

    def projections(self) -> list[Projection]:
        """The lift A (it feeds queries, keys and values alike: role ``"qkv"``) and the
        read-out B (``nn.Linear`` layout) around F_W's W^Q, W^V, W^O."""
        inner = [Projection(f"attention.{p.name}", p.role, p.weight, p.layout)
                 for p in self.attention.projections() if p.role != "output"]
        return [Projection("lift.weight", "qkv", self.lift.weight, "linear"), *inner,
                Projection("read.weight", "output", self.read.weight, "linear")]

    def lipschitz_bound(self, n: int | range | Tensor, norm: str | int = "2,inf") -> Tensor:
        """Certified bound on Lip_{2,inf}(F) for sets of ``n`` elements (an int, a range: a
        table, or a tensor of counts). Differentiable in the weights."""
        if norm_name(norm, mixed=True) != "2,inf":
            raise InputError(
                f"LiftedL2MHA is certified in the mixed norm '2,inf' only, got norm={norm!r}"
            )
        outer = (spectral_norm_exact(self.lift.weight) * spectral_norm_exact(self.read.weight)
                 * self.activation.lipschitz_bound())
        return outer * self.attention.lipschitz_bound(n, "2,inf")


class ContractiveLiftedL2MHA(ContractiveAttention):
    r"""Contractive lifted attention: f(X) = c F(X) / Lip_{2,inf}-bound(F), F a
    :class:`LiftedL2MHA`.

    Each output row i is divided by the certificate for the number of keys it sees, so
    Lip_{2,inf}(f) <= c < 1 and x + f(x) is an invertible residual block in the mixed norm
    (any induced norm serves the fixed-point inverse and the log-det series). It is the
    interaction of residual flows on sets of narrow elements, where attention on the
    coordinates themselves has only a D x D metric per head (``set_flow(attention_width=W)``,
    ``flowattn sets fit --attention-width W``).

    Arguments:
        dim: element width D.
        heads: heads of the attention among features.
        coeff: the contraction coefficient c, in (0, 1).
        width: feature width W.
        output_dropout: classic dropout probability on the output (a contraction).

    Examples:
        >>> f = ContractiveLiftedL2MHA(dim=2, heads=4, coeff=0.9, width=16)
        >>> f(torch.randn(2, 7, 2)).shape
        torch.Size([2, 7, 2])
        >>> round(float(f.lipschitz_bound(7)), 6)
        0.9
    """

    similarity = "l2"
    only_norm = "2,inf"

    def __init__(
        self,
        dim: int,
        heads: int,
        coeff: float = 0.9,
        width: int = 64,
        output_dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self._contraction(coeff, "2,inf", output_dropout)
        self.attention = LiftedL2MHA(dim, width, heads)
        self.dim, self.heads, self.width = dim, heads, width

