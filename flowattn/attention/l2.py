"""L2 multi-head self-attention and its contractive form (Kim et al. 2021, §3.2 and §4)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrizations, parametrize

from ..errors import InputError
from ..lipschitz import l2_attention_bound
from ..lipschitz.attention import CERTIFICATES
from ..lipschitz.norms import spectral_norm_function
from ..passes import per_pass
from ..validation import check_count, check_heads, check_output, check_sets, values_readable
from .contractive import ContractiveAttention
from .dot_product import merge_heads, split_heads
from .kernels import _transformed, attend
from .masking import (
    attention_mask,
    downscale,
    masked_mean,
    square_safe_limit,
    zero_padded,
)
from .offsets import LogitOffsets
from .projections import Projection

__all__ = ["L2MHA", "ContractiveL2MHA"]

PARAMETRIZATIONS = ("raw", "orthogonal")
# On the CPU, the most bytes of a block of P's rows in :meth:`L2MHA.linearise` for a set too
# large to keep P (a (B, H, N, N) matrix above ``flowattn.passes.PAIR_BYTES``): at N = 3000
# blocks of 4 MB took 0.8x the time of 16 MB ones and 0.7x the resident memory (one thread).
BLOCK_BYTES = 2**22
OFFSET_CERTIFICATES = ("weighted", "margin")


def square_weight(dim: int) -> nn.Parameter:
    """A (D, D) parameter with Glorot-uniform initialisation."""
    w = torch.empty(dim, dim)
    nn.init.xavier_uniform_(w)
    return nn.Parameter(w)


class HeadScales(nn.Module):
    """Column scaling of a (D, D) matrix by one positive factor s_h = exp(log_scale_h) per head.

    Chained after :func:`torch.nn.utils.parametrizations.orthogonal` it gives
    W^Q = U diag(s_1 I_d, ..., s_H I_d) with U orthogonal: head h's query map is s_h times an
    isometry, ||W^{Q,h}||_2 = s_h, and its singular values are all equal (to the rounding of
    the orthogonal map, which keeps the matrix it was registered with: a module built in
    float32 and converted to float64 is orthogonal to float32's precision). The certificates
    take the norms of W^Q itself, so they hold either way.
    """

    def __init__(self, heads: int, head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        self.log_scale = nn.Parameter(torch.zeros(heads))

    def forward(self, u: Tensor) -> Tensor:
        return u * torch.exp(self.log_scale).repeat_interleave(self.head_dim).to(u.dtype)


def _cached(module: nn.Module):
    """Evaluate the parametrised weights of ``module`` once inside the block."""
    return parametrize.cached() if parametrize.is_parametrized(module) else nullcontext()


def _first_present(k: Tensor, mask: Tensor | None) -> Tensor:
    """The key of each sequence's first present element, (B, H, 1, d).

    Under a causal mask every row sees it, so centring on it keeps outputs exactly independent
    of later elements (a mean over the whole sequence would not, by rounding).
    """
    if mask is None:
        return k[:, :, :1]
    first = mask.to(torch.int8).argmax(dim=1)  # index of the first True
    index = first.view(-1, 1, 1, 1).expand(k.shape[0], k.shape[1], 1, k.shape[3])
    return k.gather(2, index)


_OVERFLOW_HINT = {
    True: "x W, the values x A W^V (x W^V untied) or the mean key overflow",
    False: "the literal squared distances of the reference path (fused=False) overflow; the "
    "fused path scales them down",
}


def _temperature_cap(head_dim: int) -> float:
    """The largest factor r (a power of two, at most 2 sqrt(d)) by which the scaled-down logits
    of :func:`_centred_and_scaled` may be multiplied back without overflowing."""
    return 2.0 ** math.floor(math.log2(2.0 * math.sqrt(head_dim)))


def _centred_and_scaled(
    q: Tensor, k: Tensor, centre: Tensor, mask: Tensor | None, tied: bool,
    always: bool = False,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """Queries and keys (B, H, N, d) centred on ``centre`` and brought into the range where
    squared distances are finite, with the factor that restores the logits.

    Returns (q', k', r, s). Where every centred coordinate lies within
    :func:`square_safe_limit` (all ordinary inputs: one reduction decides), q' = q - centre,
    k' = k - centre and r = s = None: the plain computation (eager code on the CPU only;
    compiled code and other devices take the general form below, where s = r = 1 gives the same
    values, without a host synchronisation). Otherwise
    q' = (q - centre)/s and k' = (k - centre)/s, with s >= 1 a power of two per set and head
    (1 for the sets within the limit), and r = min(s^2, cap) with ``cap`` from
    :func:`_temperature_cap`.
    -r ||q'_i - k'_j||^2 equals the true -||q_i - k_j||^2 whenever s^2 <= cap (every power of
    two scaling is exact); beyond, the true logits are beyond the dtype's range and their
    softmax is saturated -- one-hot on the nearest key at every difference the dtype
    resolves -- which r = cap reproduces. Padded elements' q' and k' are set to 0: their rows
    are discarded and no present query sees them, so their values must not enter s. s is
    infinite or NaN where the centring itself overflowed (check it: the kernel may hide NaN).

    ``always=True`` skips the test and always returns s and r (both 1 for ordinary inputs, where
    dividing and multiplying by them is exact): the same values without reading anything back
    to the host.
    """
    q = q - centre
    if mask is not None:
        q = torch.where(mask[:, None, :, None], q, 0.0)
    if tied:
        k = q
    else:
        k = k - centre
        if mask is not None:
            k = torch.where(mask[:, None, :, None], k, 0.0)
    head_dim = q.shape[-1]
    cap = _temperature_cap(head_dim)
    # float16's range (6.5e4) is too small for the argument above: it keeps s = 1, the plain
    # computation, and where that overflows the module raises NonFiniteError.
    dtype = torch.float32 if q.dtype == torch.float16 else q.dtype
    limit = square_safe_limit(dtype, head_dim + 1, spare=cap)
    # The test reads a value back: eager code on the CPU only. Compiled code and other devices
    # (where it would be a host synchronisation in every call) take the general form below.
    if not (always or torch.compiler.is_compiling() or q.device.type != "cpu"
            or not values_readable()):
        largest = q.detach().abs().amax()
        if not tied:
            largest = torch.maximum(largest, k.detach().abs().amax())
        if bool(largest <= limit):  # (False for NaN)
            return q, k, None, None
    # Compiled code always comes here (the test above is a host sync, which would split the
    # graph): for the sets within the limit s = r = 1, so it computes the plain values exactly.
    magnitude = q.detach().abs().amax(dim=(-2, -1), keepdim=True)
    if not tied:
        magnitude = torch.maximum(magnitude, k.detach().abs().amax(dim=(-2, -1), keepdim=True))
    s = downscale(magnitude, limit)
    q = q / s
    return q, (q if tied else k / s), torch.clamp(s * s, max=cap), s


def _augmented(q: Tensor, k: Tensor, r: Tensor | None) -> tuple[Tensor, Tensor]:
    r"""Queries and keys (B, H, N, d) with one extra coordinate, r [q_i, 1] and
    [k_j, -||k_j||^2 / 2], whose dot products times 2 / sqrt(d) are the L2 logits less each
    row's constant (App. E):

    .. math::
        \frac{2}{\sqrt{d}}\, r [q_i, 1] \cdot [k_j, -\|k_j\|^2 / 2]
            = r (2 q_i \cdot k_j - \|k_j\|^2) / \sqrt{d}
            = -r \|q_i - k_j\|^2 / \sqrt{d} + r \|q_i\|^2 / \sqrt{d},

    and softmax over the keys does not see the last term. ``r`` (B, H, 1, 1) is the factor of
    :func:`_centred_and_scaled` or None (1)."""
    q_aug = torch.cat([q, torch.ones_like(q[..., :1])], dim=-1)
    if r is not None:
        q_aug = q_aug * r
    k_aug = torch.cat([k, -0.5 * k.pow(2).sum(-1, keepdim=True)], dim=-1)
    return q_aug, k_aug


def _distance_logits(q: Tensor, k: Tensor, r: Tensor | None) -> Tensor:
    """The logits of :func:`_augmented` written out, (B, H, N, N): one matrix product, the
    factor 2 / sqrt(d) taken by the (N, d + 1) queries. The caller may mask and offset them
    in place."""
    q_aug, k_aug = _augmented(q, k, r)
    return (q_aug * (2.0 / math.sqrt(q.shape[-1]))) @ k_aug.transpose(-1, -2)


class L2MHA(nn.Module):
    r"""L2 multi-head self-attention (Kim et al. 2021, eq. (8) and F(X) of §3.2).

    .. math::
        P^h_{ij} \propto \exp\!\big(-\|x_i^\top W^{Q,h} - x_j^\top W^{K,h}\|_2^2 / \sqrt{d}\big),
        \qquad d = D / H.

    With ``tied=True`` (W^{K,h} = W^{Q,h}) each head outputs P^h X A_h W^{V,h} with
    A_h = W^{Q,h} W^{Q,h\top} / \sqrt{d} and F(X) = [heads] W^O: this map is Lipschitz, with a
    certified bound returned by :meth:`lipschitz_bound` (by default the tight certificate of
    :func:`~flowattn.lipschitz.l2_attention_bound`, which bounds norms of the per-head products
    W^{Q,h\top} W^{V,h} W^{O,h}; Theorem 3.2 with ``method="thm3.2"``). ``tied=False`` gives the
    untied variant of §5.3 (separate W^K, values X W^V), which is *not* Lipschitz (Lemma F.1).

    Parametrisations: ``"raw"`` (default) stores W^Q, W^V, W^O as plain (D, D) parameters
    ``w_q``, ``w_v``, ``w_o``. ``"orthogonal"`` (tied only) makes W^Q = U diag(s_h I_d) with U
    orthogonal (:func:`torch.nn.utils.parametrizations.orthogonal`) and one learnt scale s_h > 0
    per head (:class:`HeadScales`): each head's query map is then s_h times an isometry, which is
    where the tight certificate is nearly attained. ``w_v`` and ``w_o`` stay free.

    State dicts written before the tight certificate existed (module version < 2) load into a
    raw module built without an explicit ``certificate``; it then switches to ``"thm3.2"`` with a
    warning, so a saved model (e.g. a field normalised by its bound) computes what it computed.

    Two computations of the same function:

    * ``fused=True`` (default): the logits are rewritten for
      :func:`~torch.nn.functional.scaled_dot_product_attention` (App. E). With keys k_j, the term
      ||q_i||^2 is constant along a softmax row and cancels, leaving
      (2 q_i.k_j - ||k_j||^2)/sqrt(d) = (2/sqrt(d)) [q_i, 1].[k_j, -||k_j||^2/2], an ordinary
      dot product with one extra coordinate. q and k are first centred on the mean key of each
      set and head (on the first element's key under a causal mask, which every row sees);
      distances are unchanged, ||k_j||^2 stays small and float32 and bfloat16 avoid
      cancellation. Where a set's centred coordinates are so large that squared norms would
      overflow (beyond about 1e17 in float32), they are divided by a power of two first and
      the logits' scale is restored up to the dtype's range; beyond it the softmax is
      saturated, which a capped scale reproduces. Outputs and gradients stay correct until x W
      or the values themselves overflow (tested to 1e30 in float32); there
      :class:`~flowattn.errors.NonFiniteError` is raised instead of returning NaN. Tied values
      use X A_h W^{V,h} = q_h (W^{Q,h\top} W^{V,h})/sqrt(d), a d x d product instead of D x D.
    * ``fused=False``: the literal formulas (explicit distance matrix, softmax, A_h). Slow; it is
      the reference the fused path is tested against. Its squared distances overflow first
      (float32 inputs near 1e19): it then raises :class:`~flowattn.errors.NonFiniteError`.

    Logit offsets (``self_offset``, ``position_bias``; :class:`LogitOffsets`): with tied weights
    the self-logit is the row maximum and no token can weight another above itself. A learnt
    self-offset beta_h <= ``self_offset`` lowers the diagonal logit, and a learnt bias of the
    relative position i - j below ``position_bias`` (sequences only: it depends on the order)
    raises or lowers the others; the certificate stays valid with Lemma F.2's constant taken at
    W_0(S_h / e), S_h the sum over a row's other keys of e^{b_h(i, j) - b_h(i, i)}, at most
    (N - 1) e^{B_h} with the margin B_h = beta_h + max_k b_h(k)
    (:func:`~flowattn.lipschitz.logit_margin_constant`).
    With offsets the logits are written out (centred as in the fused path) instead of going
    through the fused kernel.

    Dropout: ``dropout`` acts on the attention weights in training mode. Inverted dropout scales
    kept weights by 1/(1-p), so a row of P no longer sums to one and the certificate does not
    hold while it is active: :meth:`lipschitz_bound` refuses to answer in that state.

    Arguments:
        dim: model width D.
        heads: number of heads H (must divide D).
        tied: tie W^K = W^Q (the Lipschitz form).
        dropout: attention-weight dropout probability (training only).
        fused: use the fused kernel path.
        certificate: the default ``method`` of :meth:`lipschitz_bound`: ``"tight"`` (when not
            given) or ``"thm3.2"``.
        parametrization: ``"raw"`` or ``"orthogonal"`` (see above).
        self_offset: cap of the learnt self-offsets beta_h (0: none).
        position_bias: cap B of the learnt relative-position bias (0: none).
        max_distance: relative offsets |i - j| beyond this share one bias.
        offset_certificate: ``"weighted"`` (default): with offsets, Lemma F.2's constant from
            the weighted count of keys (:meth:`LogitOffsets.weighted_counts`); ``"margin"``:
            from the margin B_h alone, the looser form that language models stored with
            ``defaults_version`` < 3 were trained with.
        spectral_norms: how the certificate takes its spectral norms: ``"eigh"`` (default),
            exact from a symmetric eigensolver; ``"squarings"``, a certified upper bound from
            matrix products alone (:func:`~flowattn.lipschitz.spectral_norm_bound`, about
            10^-6 above), which needs no host synchronisation and is much the faster on a GPU.

    Attributes:
        similarity: ``"l2"``, the kind of logits (shared by every attention module).
        certificate: the certificate :meth:`lipschitz_bound` returns by default.
        offsets: the :class:`LogitOffsets`, or None.

    Examples:
        >>> attn = L2MHA(dim=16, heads=4)
        >>> mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
        >>> y = attn(torch.randn(2, 5, 16), mask=mask)
        >>> attn.lipschitz_bound(5).item() > 0
        True
    """

    similarity = "l2"
    _version = 2  # 2: the tight certificate is the default (state dicts carry this number)

    def __init__(
        self,
        dim: int,
        heads: int,
        tied: bool = True,
        dropout: float = 0.0,
        fused: bool = True,
        certificate: str | None = None,
        parametrization: str = "raw",
        self_offset: float = 0.0,
        position_bias: float = 0.0,
        max_distance: int = 64,
        offset_certificate: str = "weighted",
        spectral_norms: str = "eigh",
    ):
        super().__init__()
        spectral_norm_function(spectral_norms)  # refuses an unknown name, as the certificate would
        self.spectral_norms = spectral_norms
        if offset_certificate not in OFFSET_CERTIFICATES:
            raise InputError(f"offset_certificate must be one of {OFFSET_CERTIFICATES}, got "
                             f"{offset_certificate!r}")
        self.offset_certificate = offset_certificate
        check_heads(dim, heads)
        if not 0.0 <= dropout < 1.0:
            raise InputError(f"dropout must lie in [0, 1), got {dropout}")
        if certificate is not None and certificate not in CERTIFICATES:
            raise InputError(f"certificate must be one of {CERTIFICATES}, got {certificate!r}")
        if parametrization not in PARAMETRIZATIONS:
            raise InputError(
                f"parametrization must be one of {PARAMETRIZATIONS}, got {parametrization!r}"
            )
        if parametrization == "orthogonal" and not tied:
            raise InputError("parametrization='orthogonal' is for tied L2 attention only")
        offsets = self_offset != 0 or position_bias != 0
        if offsets and certificate == "thm3.2":
            raise InputError(
                "Theorem 3.2 assumes the self-logit is the row maximum: with self_offset or "
                "position_bias use certificate='tight'"
            )
        self.dim, self.heads, self.head_dim = dim, heads, dim // heads
        self.tied, self.dropout, self.fused = tied, dropout, fused
        self.certificate = certificate or "tight"
        self._certificate_given = certificate is not None
        self.parametrization = parametrization
        self.w_q = square_weight(dim)
        self.w_k = None if tied else square_weight(dim)
        self.w_v = square_weight(dim)
        self.w_o = square_weight(dim)
        if parametrization == "orthogonal":
            with torch.no_grad():
                nn.init.orthogonal_(self.w_q)
            parametrizations.orthogonal(self, "w_q")
            parametrize.register_parametrization(self, "w_q", HeadScales(heads, self.head_dim))
        self.offsets = (
            LogitOffsets(heads, self_offset, position_bias, max_distance) if offsets else None
        )

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args, **kwargs):
        version = local_metadata.get("version")
        legacy = version is None or version < 2
        if legacy and self.parametrization == "raw" and not self._certificate_given \
                and self.offsets is None:
            if self.certificate != "thm3.2":
                warnings.warn(
                    f"{type(self).__name__} state dict {prefix or '(root)'} predates the tight "
                    "certificate (module version < 2): using certificate='thm3.2', the bound "
                    "it was saved with, so the model computes what it computed; build the "
                    "module with certificate='tight' to use the tighter one",
                    stacklevel=2,
                )
            self.certificate = "thm3.2"
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args, **kwargs)

    # Per-head weights in the paper's row convention: W^{.,h} in R^{D x d}.
    def head_weights(self, w: Tensor) -> Tensor:
        """(D, D) -> (H, D, d): the column block of each head."""
        return w.reshape(self.dim, self.heads, self.head_dim).permute(1, 0, 2)

    def forward(self, x: Tensor, mask: Tensor | None = None, causal: bool = False) -> Tensor:
        """Attend within each set of ``x`` (B, N, D); ``mask`` (B, N) marks present elements."""
        return self._attended(x, mask, causal)

    def _attended(self, x: Tensor, mask: Tensor | None, causal: bool,
                  output_scale: Callable[[int], Tensor] | None = None) -> Tensor:
        """:meth:`forward`, or s F(x) with s = ``output_scale(N)`` (a scalar) taken into W^O:
        s W^O is D x D numbers where s F(x) would be B N D (and as many in the backward)."""
        mask = check_sets(x, mask, self.dim, module=self)
        w_o = self.w_o if output_scale is None else self.w_o * output_scale(x.shape[1])
        q = split_heads(x @ self.w_q, self.heads)
        k = q if self.tied else split_heads(x @ self.w_k, self.heads)
        dropout = self.dropout if self.training else 0.0
        scale = None
        if self.fused and self.offsets is not None:
            y, scale = self._written_out(q, k, x, mask, causal, dropout, w_o)
        elif self.fused:
            y, scale = self._fused(q, k, x, mask, causal, dropout, w_o)
        else:
            y = merge_heads(self._reference(q, k, x, mask, causal, dropout)) @ w_o
        return check_output(zero_padded(y, mask), x, "L2MHA", _OVERFLOW_HINT[self.fused], scale)

    def _tied_value_map(self) -> Tensor:
        """(H, d, d): W^{Q,h T} W^{V,h} / sqrt(d), so that X A_h W^{V,h} = q_h times it."""
        wq, wv = self.head_weights(self.w_q), self.head_weights(self.w_v)
        return wq.transpose(1, 2) @ wv / math.sqrt(self.head_dim)

    def _fused(self, q, k, x, mask, causal, dropout, w_o) -> tuple[Tensor, Tensor]:
        # SDPA's fused CPU kernel wants equal query and value widths (d + 1 here). Rather than
        # padding activations, the value and output weights get a zero column / row per head.
        h, d = self.heads, self.head_dim
        if self.tied:  # X A_h W^{V,h} = q_h (W^{Q,h}^T W^{V,h}) / sqrt(d)
            v = q @ F.pad(self._tied_value_map(), (0, 1))
        else:
            v = x.unsqueeze(1) @ F.pad(self.head_weights(self.w_v), (0, 1))
        w_o = F.pad(w_o.reshape(h, d, self.dim), (0, 0, 0, 1)).reshape(h * (d + 1), -1)
        centre = _first_present(k, mask) if causal else masked_mean(k, mask, dim=2)
        q, k, r, scale = _centred_and_scaled(q, k, centre, mask, self.tied)
        q_aug, k_aug = _augmented(q, k, r)
        if scale is None and k_aug.dtype == torch.float16:
            # float16 keeps the plain computation: a key whose squared norm overflows gets the
            # coordinate -inf, and the kernel would drop it unseen; the output check sees it
            scale = k_aug[..., -1]
        allowed = None if mask is None else attention_mask(mask, causal, x.shape[1], x.device)
        heads = attend(
            q_aug,
            k_aug,
            v,
            attn_mask=allowed,
            dropout_p=dropout,
            is_causal=causal and mask is None,
            scale=2.0 / math.sqrt(d),
        )
        return merge_heads(heads) @ w_o, scale

    def _probabilities(
        self, q, k, mask, causal, on_first: bool
    ) -> tuple[Tensor, Tensor | None]:
        """P (B, H, N, N) from the written-out logits -||q_i - k_j||^2 / sqrt(d) (+ offsets),
        q and k centred on the first present key (``on_first``, as the fused path does under a
        causal mask) or the mean key; and the down-scaling factor (or None)."""
        p, _, _, scale = self._centred_probabilities(q, k, mask, causal, on_first)
        return p, scale

    def _centred_probabilities(self, q, k, mask, causal, on_first: bool, always: bool = False):
        """(P, q', r, s) with q' the centred (and down-scaled) queries of
        :func:`_centred_and_scaled` (``always`` passed on) and the logits
        r (-||q'_i - k'_j||^2) / sqrt(d) (+ offsets).

        The logits are those of :func:`_distance_logits` (one matrix product, without the
        row term -||q'_i||^2, which softmax ignores), and the offsets meet the hidden keys'
        -inf on their own (H, N, N) table before they are added in place: one pass over the
        (B, H, N, N) logits besides the product and the softmax."""
        q, k, r, scale = self._centred(q, k, mask, on_first, always)
        return self._probability_rows(q, k, r, mask, causal), q, r, scale

    def _centred(self, q, k, mask, on_first: bool, always: bool = False):
        """(q', k', r, s) of :func:`_centred_and_scaled`, centred on the first present key
        (``on_first``) or the mean key."""
        centre = _first_present(k, mask) if on_first else masked_mean(k, mask, dim=2)
        return _centred_and_scaled(q, k, centre, mask, self.tied, always)

    def _probability_rows(self, q, k, r, mask, causal, rows: slice | None = None,
                          beta: Tensor | None = None, table: Tensor | None = None) -> Tensor:
        """The rows ``rows`` of P (all of them by default), (B, H, rows, N), from the centred
        queries and keys q', k' and the factor r of :func:`_centred_and_scaled`; ``beta`` and
        ``table``: the offsets' parts (:meth:`_offset_parts`), from their parameters if None."""
        if rows is not None:
            q = q[..., rows, :]
        logits = _distance_logits(q, k, r)
        length = k.shape[2]
        allowed = attention_mask(mask, causal, length, k.device, rows)
        if self.offsets is None:
            if allowed is not None:
                logits.masked_fill_(~allowed, -math.inf)
            return torch.softmax(logits, dim=-1)
        parts = None if beta is None and table is None else (beta, table)
        extra = self.offsets(length, k.device, logits.dtype, rows, parts)
        if allowed is not None:
            extra = extra.masked_fill(~allowed, -math.inf)
        return torch.softmax(logits.add_(extra), dim=-1)

    def _written_out(self, q, k, x, mask, causal, dropout, w_o) -> tuple[Tensor, Tensor | None]:
        if self.tied:  # X A_h W^{V,h} = q_h (W^{Q,h}^T W^{V,h}) / sqrt(d), from uncentred q
            v = q @ self._tied_value_map()
        else:
            v = split_heads(x @ self.w_v, self.heads)
        p, centred, _, scale = self._centred_probabilities(q, k, mask, causal, on_first=causal)
        if scale is None and centred.dtype == torch.float16:  # as in _fused: overflowed norms
            scale = centred.pow(2).sum(-1)
        p = F.dropout(p, dropout, training=dropout > 0)
        return merge_heads(p @ v) @ w_o, scale

    def linearise(
        self, x: Tensor, mask: Tensor | None = None, causal: bool = False
    ) -> tuple[Tensor, Callable[[Tensor], Tensor]]:
        r"""F(x), and w -> w^T J_F(x) in closed form: the products of a log-det estimator.

        Tied attention only. F is computed by the written-out formulas (explicit attention
        matrices P^h, as with offsets or ``fused=False``: the same function as :meth:`forward`,
        to rounding). Per head, with q = x W^{Q,h} (centred), values V = q W^{Q,h T} W^{V,h} /
        sqrt(d), logits L_ij = -||q_i - q_j||^2 / sqrt(d) (+ offsets, constant in x) and
        Y = P V, the product of an output cotangent w (padded rows zeroed) is

            dY = w W^{O,h T},   dV = P^T dY,   dP = dY V^T,
            dL = P * (dP - rowsum(dP * P)),   S = dL + dL^T,
            dq_i = dV_i (W^{Q,h T} W^{V,h})^T / sqrt(d) - (2 / sqrt(d)) sum_j S_ij (q_i - q_j),
            w^T J = [dq_h]_h W^{Q T},

        a handful of (N x N) by (N x d) products per head; masks and the causal mask enter
        through P (its zeros), and down-scaled huge inputs through the factor r / s of
        :func:`_centred_and_scaled`. ``w`` may carry leading dimensions (a batch of vectors).
        The product is made of differentiable operations: differentiating it (w.r.t. ``w``,
        ``x`` and the parameters) gives what a double backward through the module would,
        which is what the Neumann gradient of a log-det needs.

        Raises:
            InputError: for untied attention or active attention dropout.

        Examples:
            >>> attn = L2MHA(dim=4, heads=2).double()
            >>> x = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)
            >>> out, vjp = attn.linearise(x)
            >>> w = torch.randn(2, 5, 4, dtype=torch.float64)
            >>> (auto,) = torch.autograd.grad(out, x, w)
            >>> torch.allclose(vjp(w), auto)
            True
        """
        mask = check_sets(x, mask, self.dim, module=self)
        if not self.tied:
            raise InputError("linearise needs tied L2 attention (tied=True)")
        if self.training and self.dropout > 0:
            raise InputError(
                "linearise does not take attention dropout: call .eval() or use dropout=0"
            )
        with _cached(self):
            w_q = self.w_q
            value_map = self._tied_value_map()  # (H, d, d)
        # X A_h W^{V,h} = q_h M_h for all heads at once: x W^Q blockdiag(M_1, ..., M_H)
        value_weight = w_q @ torch.block_diag(*value_map.unbind(0))
        heads, d = self.heads, self.head_dim
        q = split_heads(x @ w_q, heads)
        v = split_heads(x @ value_weight, heads)
        # The down-scaling factors always (1 for ordinary inputs): no host read to decide.
        centred, _, r, scale = self._centred(q, q, mask, on_first=causal, always=True)
        # On the CPU, once a (B, H, N, N) matrix outgrows PAIR_BYTES, P is not kept: blocks of
        # its query rows within BLOCK_BYTES are computed wherever they are needed
        batch, length = x.shape[:2]
        row_bytes = batch * heads * length * x.element_size()
        keep = per_pass(row_bytes, length, x.device) >= length
        if keep:
            p = self._probability_rows(centred, centred, r, mask, causal)
            attended = _times_narrow(p, v)  # P V, (B, H, N, d)
        else:
            size = per_pass(row_bytes, length, x.device, BLOCK_BYTES)
            blocks = [slice(start, start + size) for start in range(0, length, size)]
            kept: list[Tensor] = []

            def kept_blocks() -> list[Tensor]:
                """P's blocks without a graph, for the calls that record nothing (evaluation,
                the terms of a log-det's power series): computed at the first such call."""
                if not kept:
                    with torch.no_grad():
                        kept.extend(self._probability_rows(centred, centred, r, mask, causal, i)
                                    for i in blocks)
                return kept

            if _graph_free():
                attended = torch.cat([_times_narrow(p, v) for p in kept_blocks()], dim=-2)
            else:
                offset_parts = self._offset_parts()
                attended = torch.cat([_recorded(self._block_attended, centred, r, v, mask,
                                                causal, i, *offset_parts) for i in blocks],
                                     dim=-2)
        y = merge_heads(attended) @ self.w_o
        y = check_output(zero_padded(y, mask), x, "L2MHA", _OVERFLOW_HINT[True], scale)
        # logits r (-||q'_i - q'_j||^2) with q' = (q - centre) / s
        factor = (-2.0 / math.sqrt(d)) * r / scale
        present = None if mask is None else mask.unsqueeze(-1).to(x.dtype)
        w_o_t, w_q_t, value_weight_t = self.w_o.t(), w_q.t(), value_weight.t()
        v_t = v.transpose(-1, -2)
        # [q', 1]^T: one product with it gives S q' and the row sums of S together
        centred_t = torch.cat([centred, torch.ones_like(centred[..., :1])], -1).transpose(-1, -2)

        def vjp(w: Tensor) -> Tensor:
            g = w if present is None else w * present
            dy = split_heads_batched(g @ w_o_t, heads)  # (..., B, H, N, d)
            vectors = math.prod(dy.shape[:-4])
            if keep and per_pass(vectors * row_bytes, length, x.device) >= length:
                own, others, dv = _row_block_products(p, dy, v_t, centred_t, centred_t)
                both = (own + others).transpose(-1, -2)
            else:  # blocks of rows within BLOCK_BYTES for this stack of vectors (dP's size)
                size = per_pass(vectors * row_bytes, length, x.device, BLOCK_BYTES)
                own, others, dv = [], None, None
                if keep:  # P's rows, with its graph where one is recorded
                    pieces = list(p.split(size, dim=-2))
                elif _graph_free():  # the kept blocks, split further
                    pieces = [piece for block in kept_blocks()
                              for piece in block.split(size, dim=-2)]
                else:
                    pieces = [None] * -(-length // size)
                    offset_parts = self._offset_parts()
                start = 0
                for piece in pieces:
                    i = slice(start, start + size if piece is None else start + piece.shape[-2])
                    start = i.stop
                    if piece is None:
                        parts = _recorded(self._block_products, centred, r, dy[..., i, :], v_t,
                                          centred_t, centred_t[..., i], mask, causal, i,
                                          *offset_parts)
                    else:
                        parts = _row_block_products(piece, dy[..., i, :], v_t, centred_t,
                                                    centred_t[..., i])
                    own.append(parts[0])
                    others = parts[1] if others is None else others + parts[1]
                    dv = parts[2] if dv is None else dv + parts[2]
                both = (torch.cat(own, dim=-1) + others).transpose(-1, -2)
            dq = factor * (centred * both[..., d:] - both[..., :d])
            return merge_heads_batched(dv) @ value_weight_t + merge_heads_batched(dq) @ w_q_t

        return y, vjp

    def _offset_parts(self) -> tuple[Tensor | None, Tensor | None]:
        """The logit offsets' :meth:`~LogitOffsets.parts` ((None, None) without offsets): what
        a block of P reads of the parameters, handed to a recomputed block as arguments."""
        return (None, None) if self.offsets is None else self.offsets.parts()

    def _block_attended(self, centred, r, v, mask, causal, rows: slice, beta=None,
                        table=None) -> Tensor:
        """(P V) for the query rows ``rows``, P's block recomputed from the centred queries."""
        return _times_narrow(
            self._probability_rows(centred, centred, r, mask, causal, rows, beta, table), v)

    def _block_products(self, centred, r, dy, v_t, centred_t, centred_rows_t, mask, causal,
                        rows: slice, beta=None, table=None) -> tuple[Tensor, Tensor, Tensor]:
        """:func:`_row_block_products` for the query rows ``rows``, P's block recomputed."""
        p = self._probability_rows(centred, centred, r, mask, causal, rows, beta, table)
        return _row_block_products(p, dy, v_t, centred_t, centred_rows_t)

    def _reference(self, q, k, x, mask, causal, dropout) -> Tensor:
        # eq. (14) of App. E taken literally: ||q_i||^2 - 2 q_i.k_j + ||k_j||^2
        sq_dist = q.pow(2).sum(-1, keepdim=True) - 2 * q @ k.transpose(-1, -2)
        sq_dist = sq_dist + k.pow(2).sum(-1).unsqueeze(-2)
        logits = -sq_dist / math.sqrt(self.head_dim)
        if self.offsets is not None:
            logits = logits + self.offsets(x.shape[1], x.device, logits.dtype)
        allowed = attention_mask(mask, causal, x.shape[1], x.device)
        if allowed is not None:
            logits = logits.masked_fill(~allowed, -math.inf)
        p = F.dropout(torch.softmax(logits, dim=-1), dropout, training=dropout > 0)
        if not self.tied:
            return p @ split_heads(x @ self.w_v, self.heads)
        wq, wv = self.head_weights(self.w_q), self.head_weights(self.w_v)
        a = wq @ wq.transpose(1, 2) / math.sqrt(self.head_dim)  # A_h, (H, D, D)
        return p @ (x.unsqueeze(1) @ a @ wv)  # P^h X A_h W^{V,h}

    def attention_probabilities(
        self, x: Tensor, mask: Tensor | None = None, causal: bool = False
    ) -> Tensor:
        """The attention matrices P (B, H, N, N) that :meth:`forward` applies to ``x`` (B, N, D):
        softmax_j(-||q_i - k_j||^2 / sqrt(d) + b_h(i, j)) over the keys query i sees (before
        attention dropout; b the logit offsets, if any).

        Queries and keys are centred on the mean key of each set and head (present elements),
        which leaves every distance unchanged and
        keeps the rounding small, and scaled down where their squared norms would overflow, as
        in :meth:`forward`; the logits are then one product of the augmented vectors
        [2 q_i / sqrt(d), 1] and [k_j, -||k_j||^2 / sqrt(d)], the fused path's (each row's
        constant -||q_i||^2 / sqrt(d) left out: softmax does not see it).

        Examples:
            >>> attn = L2MHA(dim=8, heads=2)
            >>> p = attn.attention_probabilities(torch.randn(2, 4, 8))
            >>> bool(torch.allclose(p.sum(-1), torch.ones(2, 2, 4)))
            True
        """
        mask = check_sets(x, mask, self.dim, module=self)
        q = split_heads(x @ self.w_q, self.heads)
        k = q if self.tied else split_heads(x @ self.w_k, self.heads)
        p, scale = self._probabilities(q, k, mask, causal, on_first=False)
        return check_output(p, x, "L2MHA", _OVERFLOW_HINT[True], scale)

    def projections(self) -> list[Projection]:
        """The raw (D, D) matrices W^Q, W^K (untied only), W^V and W^O, applied as x W.

        With ``parametrization="orthogonal"`` W^Q is an orthogonal matrix times per-head scales,
        not a plain parameter, and is not listed (initialising or penalising it as a free matrix
        would not mean anything)."""
        roles = (("w_q", "query"), ("w_k", "key"), ("w_v", "value"), ("w_o", "output"))
        return [
            Projection(name, role, getattr(self, name), "raw")
            for name, role in roles
            if getattr(self, name) is not None and name in self._parameters
        ]

    def lipschitz_bound(
        self, n: int | range | Tensor, norm: str | int = "inf", method: str | None = None,
        causal: bool | None = None,
    ) -> Tensor:
        """Certified bound on Lip_p(F) for sets of ``n`` elements.

        ``method``: ``"tight"`` (products of the weights, ``docs/attention.md``) or
        ``"thm3.2"`` (Kim et al. 2021, Thm 3.2); by default the module's ``certificate``.
        ``norm``: "inf", 2, or "2,inf" (max_i ||x_i||_2; tight method only). ``n`` may be a
        range or a tensor of per-row counts (the number of keys each query sees under a mask,
        App. G) in a sequence of length max(n); the result then has its shape. With logit
        offsets the tight certificate is taken at their weighted count of keys
        (:meth:`LogitOffsets.weighted_counts`): ``causal=True`` certifies causal rows only
        (keys in the past), sharper when the bias of future positions, which such rows never
        see, is high. ``causal=False`` certifies full calls only (every element sees the others
        of its set), sharper in the 2-norm for long sets without offsets
        (:func:`~flowattn.lipschitz.l2_core_kernel_constant`). The default, None, holds for
        both. Differentiable in the weights.
        """
        if not self.tied:
            raise InputError(
                "untied L2 attention is not Lipschitz (Kim et al. 2021, Lemma F.1): "
                "use tied=True for a certified bound"
            )
        if self.training and self.dropout > 0:
            raise InputError(
                "attention dropout is active (training mode, dropout > 0): rescaled attention "
                "rows void the certificate; call .eval() or use dropout=0"
            )
        wq, wv = self.head_weights(self.w_q), self.head_weights(self.w_v)
        method = method or self.certificate
        if self.offsets is None or method != "tight":
            margin = None if self.offsets is None else self.offsets.margin()  # thm3.2 refuses it
            return l2_attention_bound(n, wq, wv, self.w_o, norm, method, margin,
                                      spectral_norms=self.spectral_norms, causal=causal)
        counts = None
        if self.offset_certificate == "weighted":  # both directions unless causal rows only
            counts = self.offsets.weighted_counts(n, causal is True)
        return l2_attention_bound(
            n, wq, wv, self.w_o, norm, method, self.offsets.margin(), weighted_counts=counts,
            spectral_norms=self.spectral_norms, causal=causal,
        )


class ContractiveL2MHA(ContractiveAttention):
    r"""Contractive L2 self-attention: f(X) = c F(X) / Lip_p-bound(F) (Kim et al. 2021, §4, §5.3).

    F is tied :class:`L2MHA`; its certified bound (by default the tight certificate of
    :func:`~flowattn.lipschitz.l2_attention_bound`; Theorem 3.2 with ``certificate="thm3.2"``)
    is evaluated for the actual number of elements and gradients flow through the denominator
    (the paper found stopping them slightly worse). With ``norm="inf"`` (the default) or
    ``norm="2,inf"`` (max_i ||x_i||_2) each output row i is divided by the bound for the n_i
    keys it sees (present elements; those up to i if causal): in both norms the operator norm
    of the Jacobian is the largest over block rows, and App. G bounds block row i with
    N = n_i. With ``norm=2`` each set is divided by the bound for its number of present
    elements. Either way Lip_p(f) <= c < 1 for every input, so x + f(x) is invertible: the
    fixed-point inverse converges (Banach, in the norm p) and the log-det power series
    converges (the spectral radius is at most any induced norm of the Jacobian).

    Dropout: attention-weight dropout is refused (it voids the bound). ``output_dropout`` is
    classic dropout on f's output: a binary mask in training (a diagonal 0/1 matrix, norm <= 1)
    and multiplication by 1 - p at evaluation, both contractions, so the certificate holds in
    both modes (Kim et al. 2021, §4).

    Checkpoints: the default parametrisation keeps the state-dict keys ``attention.w_q``,
    ``attention.w_v``, ``attention.w_o``; a state dict saved before the tight certificate
    existed switches the module (when built without an explicit ``certificate``) to
    ``"thm3.2"``, the normaliser it was trained with, with a warning (see :class:`L2MHA`).

    Arguments:
        dim: model width D.
        heads: number of heads H.
        coeff: the contraction coefficient c, in (0, 1).
        norm: "inf", 2 or "2,inf", the norm in which f is certified.
        output_dropout: classic dropout probability on the output.
        fused: use the fused kernel path of :class:`L2MHA`.
        certificate: ``"tight"`` (when not given) or ``"thm3.2"``, the bound F is divided by.
        parametrization: ``"raw"`` (default) or ``"orthogonal"`` (orthogonal query map with
            per-head scales, where the tight certificate is nearly attained; see :class:`L2MHA`).
        self_offset: cap of the learnt self-offsets of F (see :class:`L2MHA`); the division
            is by the certificate at the offsets' current values.
        position_bias: cap of F's learnt relative-position bias.
        max_distance: relative offsets beyond this share one bias.
        offset_certificate: ``"weighted"`` or ``"margin"``, how the offsets enter F's
            certificate (see :class:`L2MHA`).
        spectral_norms: ``"eigh"`` (default) or ``"squarings"``, how F's certificate takes
            its spectral norms (see :class:`L2MHA`; ``"squarings"`` for speed on a GPU).
        causal_length: with ``norm=2``, every causal call is divided by the bound for this
            many elements (calls may be shorter, not longer): a causal map on N elements is
            the leading block of that on more, so the bound holds, and an earlier output does
            not depend on how many elements follow it, as a language model needs. ``None``:
            each call takes the bound for its own length.

    Attributes:
        attention: the tied :class:`L2MHA` F.
        similarity: ``"l2"``, the kind of logits (shared by every attention module).

    Examples:
        >>> f = ContractiveL2MHA(dim=8, heads=2, coeff=0.9)
        >>> round(float(f.lipschitz_bound(10)), 6)
        0.9
    """

    similarity = "l2"

    def __init__(
        self,
        dim: int,
        heads: int,
        coeff: float = 0.9,
        norm: str | int = "inf",
        output_dropout: float = 0.0,
        fused: bool = True,
        dropout: float = 0.0,
        certificate: str | None = None,
        parametrization: str = "raw",
        self_offset: float = 0.0,
        position_bias: float = 0.0,
        max_distance: int = 64,
        offset_certificate: str = "weighted",
        spectral_norms: str = "eigh",
        causal_length: int | None = None,
    ):
        super().__init__()
        if dropout != 0.0:
            raise InputError(
                "ContractiveL2MHA does not take attention dropout: rescaled attention rows void "
                "the certified bound; use output_dropout (classic dropout) instead"
            )
        self._contraction(coeff, norm, output_dropout)
        if self.norm == "2,inf" and certificate == "thm3.2":
            raise InputError("Theorem 3.2 has no '2,inf' bound: use certificate='tight'")
        self.attention = L2MHA(
            dim,
            heads,
            tied=True,
            dropout=0.0,
            fused=fused,
            certificate=certificate,
            parametrization=parametrization,
            self_offset=self_offset,
            position_bias=position_bias,
            max_distance=max_distance,
            offset_certificate=offset_certificate,
            spectral_norms=spectral_norms,
        )
        self.dim, self.heads = dim, heads
        self.causal_length = None if causal_length is None else check_count(causal_length,
                                                                            "causal_length")
        # the 2-norm certificate of offsets reads their largest margin back to the host
        # (its column constant is tabulated there): evaluated alone, not batched by vmap
        self.batchable = not (self.norm == "2" and self.attention.offsets is not None)

    @property
    def certificate(self) -> str:
        """The bound F is divided by: ``"tight"`` or ``"thm3.2"`` (held by :attr:`attention`)."""
        return self.attention.certificate

    def forward(self, x: Tensor, mask: Tensor | None = None, causal: bool = False) -> Tensor:
        """Apply f to ``x`` (B, N, D); ``mask`` (B, N) marks present elements."""
        with _cached(self.attention):  # the parametrised W^Q once for F and its bound
            y = self._divided(x, mask, causal)
        return self._classic_dropout(y)

    def _certificate(self, counts: int | range, causal: bool) -> Tensor:
        return self.attention.lipschitz_bound(counts, self.norm, causal=causal)

    def _divided(self, x: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
        """c F(x) / bound; where one bound holds for the whole call (no mask, and not causal
        outside the 2-norm), c / bound is taken into F's W^O instead of dividing the output."""
        if self._every_count(mask is not None, causal):
            return super()._divided(x, mask, causal)
        y = self.attention._attended(
            x, mask, causal,
            lambda length: self.coeff / self._bound(self._certified_length(length, causal),
                                                    every_count=False, causal=causal))
        # the dtype the division gives: under autocast F's products are of lower precision
        # than the bound, which is in the weights' (a no-op otherwise)
        return y.to(torch.promote_types(y.dtype, self.attention.w_o.dtype))

    def linearise(
        self, x: Tensor, mask: Tensor | None = None, causal: bool = False
    ) -> tuple[Tensor, Callable[[Tensor], Tensor]]:
        r"""f(x), and w -> w^T J_f(x) in closed form (:meth:`L2MHA.linearise`).

        f = m * c F / b with the certified bound b of F (per set or per block row; it depends
        on the weights and the set sizes, not on x) and the output-dropout factor m, so
        w^T J_f = (m * c w / b)^T J_F: F's closed-form product, no autograd backward. An
        invertible residual block uses it for every Jacobian product of its log-det, and the
        Neumann gradient then needs no double backward.

        Examples:
            >>> f = ContractiveL2MHA(dim=4, heads=2, coeff=0.9).double()
            >>> x = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)
            >>> out, vjp = f.linearise(x)
            >>> w = torch.randn(2, 5, 4, dtype=torch.float64)
            >>> (auto,) = torch.autograd.grad(out, x, w)
            >>> torch.allclose(vjp(w), auto)
            True
        """
        with _cached(self.attention):
            y, attention_vjp = self.attention.linearise(x, mask, causal)  # validates the input
            scale = self.coeff / self._denominator(x, mask, causal)
        keep = self._dropout_mask(y)
        if keep is not None:
            scale = scale * keep
        return y * scale, lambda w: attention_vjp(w * scale)


def _row_block_products(p: Tensor, dy: Tensor, v_t: Tensor, centred_t: Tensor,
                        centred_rows_t: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The products of :meth:`L2MHA.linearise`'s vector-Jacobian product from the rows i of
    P (``p``), of the output cotangents (``dy``) and of [q', 1]^T (``centred_rows_t``):
    [q', 1]^T dL^T for the rows i, [q', 1]^T dL for every row, and P^T dY, summed over
    the blocks by the caller (``v_t`` = V^T, ``centred_t`` = [q', 1]^T of every row)."""
    # dL = P * (dP - rowsum(dP * P)), dP = dY V^T
    dp = _each_times(dy, v_t)
    dl = p * (dp - (p * dp).sum(-1, keepdim=True))
    # sum_j S_ij (q_i - q_j) with S = dL + dL^T: [q', 1]^T dL^T gives the rows i, and
    # [q', 1]^T dL (from the rows i of dL) a term of every row
    return (_times_each(centred_t, dl.transpose(-1, -2)), _times_each(centred_rows_t, dl),
            _times_each(p.transpose(-1, -2), dy))  # P^T dY


def _graph_free() -> bool:
    """Whether no derivative is being recorded: gradients off and no ``torch.func`` transform
    (whose derivatives need the operations themselves)."""
    return not torch.is_grad_enabled() and not _transformed()


def _recorded(function: Callable, *args):
    """``function(*args)``; where gradients are recorded, through :class:`_Recomputed`: its
    backward keeps the inputs and computes the rest again (a block of P and the products with
    it), so no (B, H, rows, N) tensor outlives the call. ``function`` must read no tensor
    that requires a gradient besides ``args`` (its derivative would be lost)."""
    if torch.is_grad_enabled() and not _transformed():
        return _Recomputed.apply(function, *args)
    return function(*args)


class _Recomputed(torch.autograd.Function):
    """``function(*args)`` computed without a graph; its backward computes it again from the
    tensors among ``args``, with a graph, and differentiates that (to any order: where a
    higher derivative is taken, the recomputation's graph joins the outer one).

    What ``torch.utils.checkpoint`` does for one call, without recording the forward's
    operations: checkpoint's forward builds a graph node and a placeholder per operation,
    small allocations that lie between the blocks' large temporaries and keep glibc's heap
    from reusing their memory (a training step of the set flow at N = 3000 grew a heap of
    1.0-1.3 GB for about 0.2 GB of live tensors; 0.64-0.82 GB with this function,
    docs/benchmarks.md)."""

    @staticmethod
    def forward(ctx, function: Callable, *args):  # noqa: D102
        ctx.function = function
        ctx.tensors = [i for i, a in enumerate(args) if isinstance(a, Tensor)]
        ctx.args = [None if isinstance(a, Tensor) else a for a in args]  # tensors: saved
        ctx.save_for_backward(*(args[i] for i in ctx.tensors))
        ctx.autocast = _autocast_state(args[ctx.tensors[0]].device.type)
        return function(*args)  # no graph is recorded in here

    @staticmethod
    def backward(ctx, *grads):  # noqa: D102
        wanted = [i for i in ctx.tensors if ctx.needs_input_grad[1 + i]]
        higher = torch.is_grad_enabled()  # a derivative of this backward will be taken
        device, dtype, enabled = ctx.autocast
        with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
            # each argument through an alias of its own: the derivative w.r.t. it is then that
            # of this call alone, not also of the paths through other arguments computed from
            # it (its transpose, rows of another); the aliases keep the outer graph for a
            # higher derivative
            args = list(ctx.args)
            for i, t in zip(ctx.tensors, ctx.saved_tensors, strict=True):
                args[i] = t.view_as(t) if i in wanted else t
            outputs = ctx.function(*args)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        found = torch.autograd.grad(outputs, [args[i] for i in wanted], grads,
                                    allow_unused=True, create_graph=higher)
        result: list[Tensor | None] = [None] * len(args)
        for i, g in zip(wanted, found, strict=True):
            result[i] = g
        return None, *result


def _autocast_state(device: str) -> tuple[str, torch.dtype, bool]:
    """(device, dtype, enabled) of ``torch.autocast`` on a device type, to enter it again."""
    if hasattr(torch, "get_autocast_dtype"):  # torch >= 2.4
        return device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device)
    if device == "cpu":
        return device, torch.get_autocast_cpu_dtype(), torch.is_autocast_cpu_enabled()
    return device, torch.get_autocast_gpu_dtype(), torch.is_autocast_enabled()


def _times_narrow(a: Tensor, b: Tensor) -> Tensor:
    """a @ b for a narrow b (few columns, e.g. (N, N) times (N, d)), computed as (b^T a^T)^T:
    the same products, which CPU batched matrix kernels ran about 3 times faster with the
    narrow operand on the left (B = 64, N = 32, d = 3, float32, one thread)."""
    return (b.transpose(-1, -2) @ a.transpose(-1, -2)).transpose(-1, -2)


def _each_times(w: Tensor, a: Tensor) -> Tensor:
    """w_s @ a for every matrix w_s of a stack w (..., *batch, m, k), the leading dimensions
    being the stack, with a (*batch, k, n) shared by all of them: (..., *batch, m, n).

    A log-det's vector-Jacobian products come as such stacks (its N D basis vectors, all times
    the same attention matrices). Stacked, the products are one batched product of (S m) x k
    matrices, not a batch S times larger of m x k ones, whose per-matrix overhead dominates at
    small sizes: for 16 vectors and 8 x 8 attention matrices on the CPU (one thread) a
    branch's whole product and its backward run about 1.5 times faster
    (``benchmarks/set_step.py``). Without a stack (or a stack of one) it is ``w @ a``."""
    lead = w.dim() - a.dim()
    if lead <= 0 or math.prod(w.shape[:lead]) == 1:
        return w @ a
    stack, (*batch, m, k) = w.shape[:lead], w.shape[lead:]
    rows = w.reshape(-1, *batch, m, k).movedim(0, -3).reshape(*batch, -1, k)  # (*batch, S m, k)
    out = _times_narrow(rows, a).unflatten(-2, (-1, m)).movedim(-3, 0)  # (S, *batch, m, n)
    return out.reshape(*stack, *out.shape[1:])


def _times_each(a: Tensor, w: Tensor) -> Tensor:
    """a @ w_s for every matrix w_s of a stack w (..., *batch, k, n), with a (*batch, m, k)
    shared by all of them: (..., *batch, m, n). The stack is moved into the columns (one
    product of m x (S n) matrices): :func:`_each_times` of the transposes. Without a stack it
    is ``a @ w``, through :func:`_times_narrow` for a narrow w (n < m)."""
    lead = w.dim() - a.dim()
    if lead <= 0 or math.prod(w.shape[:lead]) == 1:
        return _times_narrow(a, w) if w.shape[-1] < a.shape[-2] else a @ w
    # a w_s = (w_s^T a^T)^T: the stack of w_s^T in the rows is a's product with [w_1, ..., w_S]
    return _each_times(w.transpose(-1, -2), a.transpose(-1, -2)).transpose(-1, -2)


def split_heads_batched(x: Tensor, heads: int) -> Tensor:
    """(..., B, N, H d) -> (..., B, H, N, d): :func:`split_heads` with leading dimensions."""
    return x.unflatten(-1, (heads, -1)).transpose(-3, -2)


def merge_heads_batched(x: Tensor) -> Tensor:
    """(..., B, H, N, d) -> (..., B, N, H d): :func:`merge_heads` with leading dimensions."""
    return x.transpose(-3, -2).flatten(-2)
