"""Scaled cosine similarity attention (LipsFormer, Qi et al. 2023, §3.3 and Theorem 1)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..errors import InputError
from ..lipschitz import (
    check_certificate_precision,
    check_counts,
    matrix_inf_norm,
    spectral_norm_exact,
)
from ..lipschitz.checks import norm_name
from ..validation import check_heads, check_output, check_sets
from .contractive import ContractiveAttention
from .dot_product import merge_heads, split_heads
from .kernels import attend
from .l2 import square_weight
from .masking import attention_mask, downscale, masked_softmax, zero_padded
from .projections import Projection

__all__ = ["ScaledCosineMHA", "ContractiveScaledCosineMHA"]

COSINE_CERTIFICATES = ("tight", "lipsformer")


class ScaledCosineMHA(nn.Module):
    r"""Scaled cosine similarity attention (SCSA) of LipsFormer (Qi et al. 2023, eq. (6)).

    .. math::
        \hat q_i = \frac{x_i^\top W^Q}{\sqrt{\|x_i^\top W^Q\|^2 + \epsilon}}\ (\text{same for }
        \hat k, \hat v), \qquad \mathrm{SCSA}(X) = \nu\, \mathrm{softmax}(\tau \hat Q \hat K^\top)
        \hat V,

    per head, then [heads] W^O. Normalising queries, keys and values makes the map Lipschitz for
    any bounded weights. :meth:`lipschitz_bound` gives by default a certificate that does not
    grow with N in the inf- and mixed norms (``method="tight"``, derived in
    ``docs/attention.md``): per head
    nu eps^{-1/2} sqrt(||W^{V,h}||^2 + tau^2 (||W^{Q,h}||^2 + ||W^{K,h}||^2)) in operator norms
    suited to each norm, combined with W^O. ``method="lipsformer"`` gives Theorem 1 of the paper
    per head (width d), combined over heads as max_h (inf-norm) or sqrt(sum_h) (2-norm) and
    multiplied by the norm of W^O. The theorem writes ||W^K||_inf and ||W^Q||_inf without fixing
    the transposition convention; we take the larger of ||W||_inf and ||W^T||_inf, so the
    certificate holds under either reading. It grows like N^2 / sqrt(epsilon).

    Dropout: ``dropout`` acts on the attention weights in training mode and, as for
    :class:`~flowattn.attention.L2MHA`, voids the certificate while active.

    Arguments:
        dim: model width D.
        heads: number of heads H.
        tau: the fixed temperature tau (10 in the LipsFormer code).
        eps: smoothing epsilon of the normalisation.
        nu: output scale nu.
        dropout: attention-weight dropout probability (training only).

    Attributes:
        similarity: ``"scaled-cosine"``, the kind of logits (shared by every attention module).

    Examples:
        >>> attn = ScaledCosineMHA(dim=16, heads=4)
        >>> attn(torch.randn(2, 5, 16)).shape
        torch.Size([2, 5, 16])
    """

    similarity = "scaled-cosine"

    def __init__(
        self,
        dim: int,
        heads: int,
        tau: float = 10.0,
        eps: float = 1e-6,
        nu: float = 1.0,
        dropout: float = 0.0,
    ):
        super().__init__()
        check_heads(dim, heads)
        for name, value in (("tau", tau), ("eps", eps), ("nu", nu)):
            if not (math.isfinite(value) and value > 0):
                raise InputError(f"{name} must be a finite number > 0, got {value}")
        if not 0.0 <= dropout < 1.0:
            raise InputError(f"dropout must lie in [0, 1), got {dropout}")
        self.dim, self.heads, self.head_dim = dim, heads, dim // heads
        self.tau, self.eps, self.nu, self.dropout = tau, eps, nu, dropout
        self.w_q, self.w_k = square_weight(dim), square_weight(dim)
        self.w_v, self.w_o = square_weight(dim), square_weight(dim)

    def _normalised_heads(self, x: Tensor, w: Tensor) -> Tensor:
        # h / sqrt(||h||^2 + eps), with h and eps first divided by the power of two s >= 1 that
        # brings h's largest coordinate to at most 1. Exact (s is a power of two), and neither
        # ||h||^2 nor the derivative's (||h||^2 + eps)^(-3/2) over- or underflows at any scale.
        h = split_heads(x @ w, self.heads)
        s = downscale(h.abs().amax(-1, keepdim=True), 1.0)
        h = h / s
        return h * torch.rsqrt(h.pow(2).sum(-1, keepdim=True) + self.eps / s / s)

    def forward(self, x: Tensor, mask: Tensor | None = None, causal: bool = False) -> Tensor:
        """Attend within each set of ``x`` (B, N, D); ``mask`` (B, N) marks present elements."""
        mask = check_sets(x, mask, self.dim, module=self)
        q, k, v = (self._normalised_heads(x, w) for w in (self.w_q, self.w_k, self.w_v))
        heads = attend(
            q,
            k,
            v,
            attn_mask=None if mask is None else attention_mask(mask, causal, x.shape[1], x.device),
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=causal and mask is None,
            scale=self.tau,
        )
        y = zero_padded(self.nu * merge_heads(heads) @ self.w_o, mask)
        return check_output(y, x, "ScaledCosineMHA", "x W overflows")

    def attention_probabilities(
        self, x: Tensor, mask: Tensor | None = None, causal: bool = False
    ) -> Tensor:
        """The attention matrices P (B, H, N, N) that :meth:`forward` applies to ``x`` (B, N, D):
        softmax_j(tau q^_i.k^_j) over the keys query i sees (before attention dropout).

        Examples:
            >>> attn = ScaledCosineMHA(dim=8, heads=2)
            >>> p = attn.attention_probabilities(torch.randn(1, 3, 8), causal=True)
            >>> p[0, 1, 0].tolist()
            [1.0, 0.0, 0.0]
        """
        mask = check_sets(x, mask, self.dim, module=self)
        q, k = self._normalised_heads(x, self.w_q), self._normalised_heads(x, self.w_k)
        logits = self.tau * q @ k.transpose(-1, -2)
        return check_output(masked_softmax(logits, mask, causal), x, "ScaledCosineMHA",
                            "x W overflows")

    def projections(self) -> list[Projection]:
        """The raw (D, D) matrices W^Q, W^K, W^V and W^O, applied as x W."""
        roles = (("w_q", "query"), ("w_k", "key"), ("w_v", "value"), ("w_o", "output"))
        return [Projection(name, role, getattr(self, name), "raw") for name, role in roles]

    def head_weights(self, w: Tensor) -> Tensor:
        """(D, D) -> (H, D, d): the column block of each head."""
        return w.reshape(self.dim, self.heads, self.head_dim).permute(1, 0, 2)

    def lipschitz_bound(
        self, n: int | Tensor, norm: str | int = "inf", method: str = "tight"
    ) -> Tensor:
        """Certified bound on Lip_p of the module for sets of ``n`` elements.

        ``method="tight"`` (default): for "inf" and "2,inf" (max_i ||x_i||_2) it does not depend
        on n; the 2-norm one is sqrt(n) times the "2,inf" one. ``method="lipsformer"``: Theorem 1
        of Qi et al. (2023), combined over heads ("inf" and 2 only). ``n`` may be a tensor of
        counts; the result has its shape.
        """
        if self.training and self.dropout > 0:
            raise InputError(
                "attention dropout is active (training mode, dropout > 0): the certificate does "
                "not hold; call .eval() or use dropout=0"
            )
        if method not in COSINE_CERTIFICATES:
            raise InputError(f"method must be one of {COSINE_CERTIFICATES}, got {method!r}")
        n = check_counts(n)
        check_certificate_precision(self.w_q, self.w_k, self.w_v, self.w_o)
        if isinstance(n, range):
            n = torch.tensor(list(n))
        norm = norm_name(norm, mixed=method == "tight")
        wq, wk, wv = (self.head_weights(w) for w in (self.w_q, self.w_k, self.w_v))
        if method == "tight":
            return self._tight_bound(n, norm, wq, wk, wv)
        n = torch.as_tensor(n, dtype=wq.dtype, device=wq.device).unsqueeze(-1)  # per head last
        scale = self.nu * self.eps**-0.5
        if norm == "inf":

            def both(w: Tensor) -> Tensor:
                return torch.maximum(matrix_inf_norm(w), matrix_inf_norm(w.transpose(1, 2)))

            root_d = self.head_dim**0.5
            per_head = (
                n**2 * root_d * self.tau * scale * both(wk)
                + n * root_d * self.tau * scale * both(wq)
                + 2 * n * scale * matrix_inf_norm(wv.transpose(1, 2))
            )
            return per_head.amax(-1) * matrix_inf_norm(self.w_o.t())
        per_head = (
            2 * n * (n - 1) * self.tau * scale * spectral_norm_exact(wk)
            + 2 * (n - 1) * self.tau * scale * spectral_norm_exact(wq)
            + 2 * n * scale * spectral_norm_exact(wv)
        )
        tiny = torch.finfo(per_head.dtype).tiny  # zero weights: sqrt's derivative stays finite
        return per_head.pow(2).sum(-1).clamp_min(tiny).sqrt() * spectral_norm_exact(self.w_o)

    def _tight_bound(self, n, norm: str, wq: Tensor, wk: Tensor, wv: Tensor) -> Tensor:
        n = torch.as_tensor(n, device=wq.device)
        if (n < 1).any():
            raise InputError(f"sequence length must be >= 1, got {n}")
        # a row with a single key has P = 1: the logits, and tau, play no part
        tau = self.tau * (n > 1).to(wq.dtype).unsqueeze(-1)  # (..., 1), heads last
        scale = self.nu * self.eps**-0.5
        o = self.w_o.reshape(self.heads, self.head_dim, self.dim)  # W^{O,h}: rows of head h
        # zero weights (a zeroed W^O or W^V): sqrt's derivative at 0 kept finite, the value
        # moved up by at most sqrt(tiny), still a bound
        tiny = torch.finfo(wq.dtype).tiny
        if norm == "inf":

            def omega(w: Tensor) -> Tensor:  # >= ||W||_{2->1} per head
                return torch.minimum(self.dim**0.5 * spectral_norm_exact(w), w.norm(dim=2).sum(1))

            per_head = (omega(wv) ** 2 + tau**2 * (omega(wq) ** 2 + omega(wk) ** 2)).clamp_min(
                tiny).sqrt()
            # (..., H) x (H, D) -> max over output coordinates r of sum_h
            return scale * (per_head @ o.norm(dim=1)).amax(dim=-1)
        per_head = (
            spectral_norm_exact(wv) ** 2
            + tau**2 * (spectral_norm_exact(wq) ** 2 + spectral_norm_exact(wk) ** 2)
        ).clamp_min(tiny).sqrt()  # (..., H)
        gamma = spectral_norm_exact(o.unsqueeze(1) @ o.unsqueeze(0).transpose(-1, -2))
        bound = scale * torch.minimum(
            ((per_head @ gamma) * per_head).sum(-1).clamp_min(tiny).sqrt(),
            spectral_norm_exact(self.w_o) * per_head.norm(dim=-1),
        )
        return bound * torch.sqrt(n.to(bound.dtype)) if norm == "2" else bound


class ContractiveScaledCosineMHA(ContractiveAttention):
    r"""Contractive scaled cosine attention: f(X) = c F(X) / bound_p(F) (F: scaled cosine MHA).

    F is divided by its tight certificate (``docs/attention.md``), with gradients through the
    denominator. In the inf- and mixed norms ("inf", "2,inf") the certificate does not depend
    on the number of elements (except that a row seeing a single key has no attention term), so
    each block row is divided by the bound for its own key count; in the 2-norm each set is
    divided by the bound for its number of present elements (a factor sqrt(n)). Either way
    Lip_p(f) <= c < 1, so x + f(x) is invertible.

    The certificate is nu eps^{-1/2} times weight norms: eps^{-1/2} is the slope of the
    normalisation x / sqrt(||x||^2 + eps) at 0, which inputs near the origin do reach, so a
    larger ``eps`` than :class:`ScaledCosineMHA`'s default (1 here) gives a more useful
    contraction. Output dropout is classic dropout (a contraction), as in
    :class:`~flowattn.attention.ContractiveL2MHA`.

    Arguments:
        dim: model width D.
        heads: number of heads H.
        coeff: the contraction coefficient c, in (0, 1).
        norm: "inf", 2 or "2,inf", the norm in which f is certified.
        tau: the temperature of the cosine logits.
        eps: smoothing epsilon of the normalisation.
        output_dropout: classic dropout probability on the output.

    Attributes:
        attention: the :class:`ScaledCosineMHA` F.
        similarity: ``"scaled-cosine"``.

    Examples:
        >>> f = ContractiveScaledCosineMHA(dim=8, heads=2, coeff=0.9)
        >>> f(torch.randn(2, 5, 8)).shape
        torch.Size([2, 5, 8])
        >>> round(float(f.lipschitz_bound(5)), 6)
        0.9
    """

    similarity = "scaled-cosine"

    def __init__(
        self,
        dim: int,
        heads: int,
        coeff: float = 0.9,
        norm: str | int = "inf",
        tau: float = 10.0,
        eps: float = 1.0,
        output_dropout: float = 0.0,
    ):
        super().__init__()
        self._contraction(coeff, norm, output_dropout)
        self.attention = ScaledCosineMHA(dim, heads, tau=tau, eps=eps)
        self.dim, self.heads = dim, heads
