"""Bounded offsets of the L2 logits: a learnt self-offset and a relative-position bias."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import InputError
from ..lipschitz import check_counts

__all__ = ["LogitOffsets", "MAX_OFFSET"]

# The largest cap of an offset: e^{2 MAX_OFFSET}, a self-offset and a bias together, stays far
# inside float64, in which the certificate's weighted counts are summed (float32 ends at e^88).
MAX_OFFSET = 80.0


class LogitOffsets(nn.Module):
    r"""Offsets b_h(i, j) added to the logits of head h, bounded so that a certificate survives.

    With tied query and key weights the self-logit -||q_i - q_i||^2 = 0 is the largest of its
    row: no token can weight another above itself. Two bounded offsets lift that limit:

    * a **self-offset** beta_h = ``self_offset`` * sigmoid(theta_h) in (0, ``self_offset``),
      subtracted from the diagonal: l_ii = -beta_h;
    * a **relative-position bias** b_h(k) = phi_k - softplus(phi_k - B) < B for the offset
      k = i - j != 0 (clipped to [-K, K], K = ``max_distance``), b_h(0) = 0, with
      B = ``position_bias``: any value below B, unbounded below (a previous-token head raises
      k = 1, a local head lowers the far offsets).

    In both cases b_h(i, j) - b_h(i, i) <= B_h := beta_h + max_{k != 0} b_h(k) for every row,
    which bounds the certificate's constant (:func:`~flowattn.lipschitz.logit_margin_constant`):
    Kim et al.'s W_0((N - 1)/e) becomes at most W_0((N - 1) e^{B_h}/e), about B_h more. The
    certificates use the sharper W_0(S_h/e) with S_h the sum of the ratios e^{b_h(i, j) -
    b_h(i, i)} over a row's other keys (:meth:`weighted_counts`): a bias raised for one
    position costs one term, not N - 1. The
    position bias depends on the order of the elements: use it for sequences, not for sets (the
    self-offset keeps permutation equivariance).

    Arguments:
        heads: number of heads H.
        self_offset: the cap of beta_h (0: no self-offset).
        position_bias: the cap B of the position bias (0: no position bias).
        max_distance: K, the offsets |i - j| beyond which the bias is that of K.

    Examples:
        >>> offsets = LogitOffsets(heads=2, self_offset=2.0)
        >>> offsets(3)[0].detach()  # beta_h = 1 at initialisation, on the diagonal only
        tensor([[-1.,  0.,  0.],
                [ 0., -1.,  0.],
                [ 0.,  0., -1.]])
        >>> offsets.margin().detach()
        tensor([1., 1.])
    """

    def __init__(
        self, heads: int, self_offset: float = 0.0, position_bias: float = 0.0,
        max_distance: int = 64,
    ):
        super().__init__()
        for name, value in (("self_offset", self_offset), ("position_bias", position_bias)):
            if not (math.isfinite(value) and 0 <= value <= MAX_OFFSET):
                raise InputError(f"{name} must be a number from 0 to {MAX_OFFSET:g}, got {value}"
                                 " (an offset B weights a key e^B times; the certificate's "
                                 "constant grows like B + log N)")
        if max_distance < 1:
            raise InputError(f"max_distance must be >= 1, got {max_distance}")
        if self_offset == 0 and position_bias == 0:
            raise InputError("LogitOffsets needs self_offset > 0 or position_bias > 0")
        self.heads, self.max_distance = heads, max_distance
        self.self_offset, self.position_bias = float(self_offset), float(position_bias)
        self.offset_logit = nn.Parameter(torch.zeros(heads)) if self_offset > 0 else None
        if position_bias > 0:
            # phi - softplus(phi - B) = 0 at phi = -log(1 - e^{-B}): no bias at initialisation
            start = -math.log(-math.expm1(-self.position_bias))
            self.position_logit = nn.Parameter(torch.full((heads, 2 * max_distance + 1), start))
        else:
            self.position_logit = None

    def offset(self) -> Tensor | None:
        """beta_h (H,), or None without a self-offset."""
        if self.offset_logit is None:
            return None
        return self.self_offset * torch.sigmoid(self.offset_logit)

    def position_table(self) -> Tensor | None:
        """b_h(k) for k = -K, ..., K (H, 2K + 1), b_h(0) = 0; None without a position bias."""
        if self.position_logit is None:
            return None
        phi = self.position_logit
        table = phi - F.softplus(phi - self.position_bias)
        centre = torch.zeros_like(table[:, :1])
        k = self.max_distance
        return torch.cat([table[:, :k], centre, table[:, k + 1 :]], dim=1)

    def margin(self) -> Tensor:
        """B_h (H,): the most by which a logit may exceed its row's self-logit beyond the
        distance term, beta_h + max_{k != 0} b_h(k)."""
        parts = []
        beta = self.offset()
        if beta is not None:
            parts.append(beta)
        table = self.position_table()
        if table is not None:
            k = self.max_distance
            others = torch.cat([table[:, :k], table[:, k + 1 :]], dim=1)
            parts.append(others.amax(dim=1))
        return parts[0] if len(parts) == 1 else parts[0] + parts[1]

    def weighted_counts(self, n: int | range | Tensor, causal: bool = False) -> Tensor:
        """S_h(n) (..., H), float64: for every row that sees ``n`` keys (itself included), a bound
        on sum_{j != i} e^{b_h(i, j) - b_h(i, i)}, the row's other keys each weighted by the
        ratio of its offset to the self-offset.

        Certificates use c_h = W_0(S_h / e) (:func:`~flowattn.lipschitz.logit_margin_constant`),
        which is at most W_0((n - 1) e^{B_h} / e) and equals it when every offset sits at the
        margin B_h. The keys are the rows of one sequence of length max(``n``): a row sees n - 1
        others at distinct relative positions k = i - j, all past ones (k > 0) if ``causal``,
        so S_h(n) = e^{beta_h} times the sum of the n - 1 largest e^{b_h(k)} among those k
        (exact for a causal row without padding when b_h decreases in k). Differentiable in the
        offsets' parameters.

        Examples:
            >>> offsets = LogitOffsets(heads=1, self_offset=2.0)  # beta = 1: S = (n - 1) e
            >>> offsets.weighted_counts(range(1, 4)).detach().squeeze(-1).float()
            tensor([0.0000, 2.7183, 5.4366])
        """
        n = check_counts(n)
        counts = torch.tensor(list(n)) if isinstance(n, range) else torch.as_tensor(n)
        ref = self.offset_logit if self.offset_logit is not None else self.position_logit
        # the length is read from the counts before they move: no read back from the device
        length = int(counts.max()) if counts.numel() else 1
        counts = counts.to(ref.device)
        k = torch.arange(1, max(length, 1), device=ref.device)
        if not causal:
            k = torch.cat([k, -k])
        # in float64: e^{beta + b} reaches e^160 with the largest caps (float32 ends at e^88)
        table = self.position_table()
        if table is None:
            weights = torch.ones(self.heads, k.numel(), dtype=torch.float64, device=ref.device)
        else:
            k = k.clamp(-self.max_distance, self.max_distance) + self.max_distance
            # stable: equal weights (every bias starts at 0) keep their order, so the gradient
            # lands on the same entries on every device
            weights = table[:, k].double().exp().sort(dim=1, descending=True, stable=True).values
        top = torch.cat([weights.new_zeros(self.heads, 1), weights.cumsum(dim=1)], dim=1)
        sums = top[:, counts - 1].movedim(0, -1)  # (..., H): the n - 1 largest weights
        beta = self.offset()
        return sums if beta is None else sums * beta.double().exp()

    def parts(self) -> tuple[Tensor | None, Tensor | None]:
        """(beta_h, b_h): :meth:`offset` and :meth:`position_table`, all that :meth:`forward`
        reads of the parameters."""
        return self.offset(), self.position_table()

    def forward(self, length: int, device=None, dtype=None, rows: slice | None = None,
                parts: tuple[Tensor | None, Tensor | None] | None = None) -> Tensor:
        """The additive offsets (H, N, N) of the logits of a sequence of ``length`` elements;
        with ``rows``, only those query rows (H, rows, N). ``parts``: :meth:`parts`, computed
        here when None."""
        ref = self.offset_logit if self.offset_logit is not None else self.position_logit
        device = ref.device if device is None else device
        dtype = ref.dtype if dtype is None else dtype
        pos = torch.arange(length, device=device)
        queries = pos if rows is None else pos[rows]
        eye = (queries[:, None] == pos[None, :]).to(dtype)
        beta, table = self.parts() if parts is None else parts
        if table is None:
            out = torch.zeros(self.heads, len(queries), length, device=device, dtype=dtype)
        else:
            k = self.max_distance
            index = (queries[:, None] - pos[None, :]).clamp(-k, k) + k
            out = table.to(device=device, dtype=dtype)[:, index]
        if beta is not None:
            out = out - beta.to(device=device, dtype=dtype)[:, None, None] * eye
        return out
